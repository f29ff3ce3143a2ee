// Basic types shared by every kernel. No CUDA toolkit headers: the same source must compile under
// NVRTC (which ships no <cuda.h>, <cstdint> or <cuda_bf16.h>) and nvcc.
#pragma once

#ifdef __CUDACC_RTC__
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long long uint64_t;
typedef int int32_t;
typedef long long int64_t;
#else
#include <cstdint>
#endif

namespace moe_fp8 {

// Opaque 128-byte TMA descriptor (CUtensorMap), encoded on the host and passed by value as a
// `const __grid_constant__` kernel parameter so the copy engine can read it from parameter space.
struct alignas(64) TmaDesc {
    uint64_t opaque[16];
};

template <typename T>
__host__ __device__ constexpr T ceil_div(T a, T b) {
    return (a + b - 1) / b;
}

template <typename T>
__host__ __device__ constexpr T align_up(T a, T b) {
    return ceil_div(a, b) * b;
}

template <typename T>
__host__ __device__ constexpr T constexpr_min(T a, T b) {
    return a < b ? a : b;
}

template <typename T>
__host__ __device__ constexpr T constexpr_gcd(T a, T b) {
    return b == 0 ? a : constexpr_gcd(b, a % b);
}

constexpr uint32_t kFullMask = 0xffffffffu;  // every lane of a warp (shuffles, votes, reductions)

// A compile-time count passed to a generic lambda (C++17 has no templated lambdas).
template <uint32_t kValue>
struct Count {
    static constexpr uint32_t value = kValue;
};

}  // namespace moe_fp8
