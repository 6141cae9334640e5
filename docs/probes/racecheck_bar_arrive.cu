// Does compute-sanitizer's racecheck honour the ordering that bar.arrive gives? The PTX ISA's
// own producer/consumer example: a producer warp stores into shared memory and bar.arrive-s,
// a consumer warp bar.sync-s and reads; the roles reverse on a second barrier before the
// buffer is reused. Mode 0 is that pattern; mode 1 has bar.sync on both sides. Both compute
// the same sums. On an H100 with CUDA 13.0's compute-sanitizer (2026-12-07), racecheck reports
// 7 hazards in mode 0 and none in mode 1 (docs/testing.md: why racecheck of the rotating
// producer's bulk append is not clean).
//
//   nvcc -O2 -arch=sm_90a -o racecheck_bar_arrive docs/probes/racecheck_bar_arrive.cu
//   compute-sanitizer --tool racecheck ./racecheck_bar_arrive 0   # the ISA's pattern
//   compute-sanitizer --tool racecheck ./racecheck_bar_arrive 1   # bar.sync on both sides
#include <cstdio>
#include <cstdlib>

__global__ void handoff(int* out, int mode) {
  __shared__ int buf[32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int sum = 0;
  for (int round = 0; round < 8; ++round) {
    if (warp == 0) {  // producer
      if (round > 0) asm volatile("bar.sync 2, 64;" ::: "memory");  // the consumer has read the last value
      buf[lane] = lane + round;
      if (mode == 0) {
        asm volatile("bar.arrive 1, 64;" ::: "memory");
      } else {
        asm volatile("bar.sync 1, 64;" ::: "memory");
      }
    } else {  // consumer
      asm volatile("bar.sync 1, 64;" ::: "memory");  // the value is stored
      sum += buf[(lane + 1) % 32];
      if (round < 7) {
        if (mode == 0) {
          asm volatile("bar.arrive 2, 64;" ::: "memory");
        } else {
          asm volatile("bar.sync 2, 64;" ::: "memory");
        }
      }
    }
  }
  if (warp == 1) out[lane] = sum;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? std::atoi(argv[1]) : 0;
  int* out = nullptr;
  if (cudaMalloc(&out, 32 * sizeof(int)) != cudaSuccess) return 1;
  handoff<<<1, 64>>>(out, mode);
  int host[32];
  const cudaError_t e = cudaMemcpy(host, out, sizeof host, cudaMemcpyDeviceToHost);
  int expected = 0;
  for (int round = 0; round < 8; ++round) expected += 1 + round;  // lane 0 reads lane 1's values
  std::printf("mode %d: lane 0 sum %d (expected %d), %s\n", mode, host[0], expected, cudaGetErrorString(e));
  return e == cudaSuccess && host[0] == expected ? 0 : 1;
}
