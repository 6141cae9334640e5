// Compiler portability macros and the library version. Every other header includes this one.
#pragma once

// Functors marked OSCAR_HOST_DEVICE run on the CPU (the reference cache, fitting, tests) and
// inside CUDA kernels. Outside nvcc the macro is plain `inline`, which is why every .hpp of
// the library compiles with a host C++20 compiler alone.
#if defined(__CUDACC__)
#define OSCAR_HOST_DEVICE __host__ __device__ __forceinline__
#define OSCAR_DEVICE __device__ __forceinline__
#else
#define OSCAR_HOST_DEVICE inline
#endif

// Full unrolling of a loop with a constant trip count in device code (register arrays must
// stay in registers); host compilers decide for themselves.
#if defined(__CUDA_ARCH__)
#define OSCAR_UNROLL _Pragma("unroll")
#else
#define OSCAR_UNROLL
#endif

// True while compiling device code (nvcc's device pass); used to pick intrinsics.
#if defined(__CUDA_ARCH__)
#define OSCAR_DEVICE_CODE 1
#else
#define OSCAR_DEVICE_CODE 0
#endif

namespace oscar {

inline constexpr int kVersionMajor = 0;
inline constexpr int kVersionMinor = 1;
inline constexpr int kVersionPatch = 0;

}  // namespace oscar
