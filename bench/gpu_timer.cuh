// Event timing with a cold L2 for Google Benchmark's manual-time mode, and the measured
// device-to-device copy bandwidth that every GPU benchmark reports itself against.
#pragma once

#include <benchmark/benchmark.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>

namespace oscar::bench {

inline void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

// Writes 512 MB (over 8x the H200's 60 MB L2) between timed runs so each run starts cold.
class L2Scrubber {
 public:
  static constexpr size_t kBytes = size_t{512} << 20;
  L2Scrubber() { check(cudaMalloc(&buffer_, kBytes), "cudaMalloc scrub"); }
  ~L2Scrubber() { cudaFree(buffer_); }
  void scrub(cudaStream_t stream) { check(cudaMemsetAsync(buffer_, 0x5a, kBytes, stream), "scrub"); }

 private:
  void* buffer_ = nullptr;
};

// Times `work` once per benchmark iteration with CUDA events, cold L2, and reports the
// achieved bandwidth over `bytes` and its share of the copy bandwidth measured in this run.
template <class Work>
void time_kernel(benchmark::State& state, double bytes, Work&& work) {
  static L2Scrubber scrubber;
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "event");
  check(cudaEventCreate(&stop), "event");
  work();  // warm-up: module load, first-touch
  check(cudaDeviceSynchronize(), "warm-up");
  for (auto _ : state) {
    scrubber.scrub(nullptr);
    check(cudaEventRecord(start), "record");
    work();
    check(cudaEventRecord(stop), "record");
    check(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    state.SetIterationTime(ms / 1e3);
  }
  check(cudaGetLastError(), "kernel");
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  state.counters["bytes"] = bytes;
  state.counters["GB/s"] = benchmark::Counter(bytes * double(state.iterations()) / 1e9, benchmark::Counter::kIsRate);
}

// Set by the copy benchmark, which runs first; read by the others' reports.
inline double& copy_gbps() {
  static double value = 0;
  return value;
}

}  // namespace oscar::bench
