// Programmatic dependent launch (Hopper): a kernel launched as the programmatic dependent of
// the one before it in the stream may start once every block of that one has called
// allow_dependent_launch or exited (our prerequisites call it first thing), so its prologue
// and launch latency overlap the tail of its prerequisite; it must call wait_for_prerequisite_grid before it reads anything that grid
// writes. Everything older in the stream than the prerequisite is complete when a dependent
// starts, provided the prerequisite itself was launched the ordinary way (then it started only
// after all of it), so a dependent may read those inputs before the wait.
//
// launch_maybe_programmatic sets the launch attribute only where both sides exist: a device of
// compute capability 9.0 or newer running a kernel compiled for one (a kernel of an sm_80
// build, or of compute_80 PTX JIT-compiled on a Hopper, holds no griddepcontrol instructions,
// and without the wait an early start would be a race). Elsewhere it is an ordinary launch.
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "oscar/core/config.hpp"

// Set to 0 to launch every kernel the ordinary way (an A/B of the overlap, or a tool that does
// not follow programmatic launches).
#ifndef OSCAR_PROGRAMMATIC_LAUNCH
#define OSCAR_PROGRAMMATIC_LAUNCH 1
#endif

namespace oscar {
namespace ptx {

// Blocks until every prerequisite grid has completed and its memory operations are visible.
// Without a programmatic launch it returns at once (the stream already serialised the grids).
OSCAR_DEVICE void wait_for_prerequisite_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// Lets this grid's programmatic dependent start before this block exits (it starts once every
// block has called this or exited). Says nothing about memory: the dependent's wait does.
OSCAR_DEVICE void allow_dependent_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" :::);
#endif
}

}  // namespace ptx

// Whether `kernel` launches as a programmatic dependent on the current device: this build
// allows it (OSCAR_PROGRAMMATIC_LAUNCH), the device is compute capability 9.0 or newer, and the
// kernel's code was compiled for one (what launch_maybe_programmatic checks; benchmarks report it).
template <typename... KernelArgs>
cudaError_t programmatic_launch_available(void (*kernel)(KernelArgs...), bool& available) {
  available = false;
  if (!OSCAR_PROGRAMMATIC_LAUNCH) return cudaSuccess;
  int device = 0, major = 0;
  cudaFuncAttributes fa{};
  cudaError_t e = cudaGetDevice(&device);
  if (e == cudaSuccess) e = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (e == cudaSuccess) e = cudaFuncGetAttributes(&fa, kernel);
  available = e == cudaSuccess && major >= 9 && fa.ptxVersion >= 90;
  return e;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...), as the programmatic dependent of the
// stream's previous kernel when `programmatic` is set and programmatic_launch_available.
template <typename... KernelArgs, typename... Args>
cudaError_t launch_maybe_programmatic(bool programmatic, void (*kernel)(KernelArgs...), dim3 grid, dim3 block,
                                      size_t smem, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  if (programmatic) {
    bool available = false;
    if (const cudaError_t e = programmatic_launch_available(kernel, available); e != cudaSuccess) return e;
    if (available) {
      attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
      attribute.val.programmaticStreamSerializationAllowed = 1;
      config.attrs = &attribute;
      config.numAttrs = 1;
    }
  }
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace oscar
