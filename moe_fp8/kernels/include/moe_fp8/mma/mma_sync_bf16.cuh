// Warp-level bf16 MMA (mma.sync, sm_80+) with float32 accumulation, for the router GEMM (impls/router_gemm.cuh).
#pragma once

#include "../common/types.cuh"

namespace moe_fp8::mma {

// D[16x8] += A[16x16] · B[16x8], bf16 in, FP32 out. Fragments (lane = 4 * g + t): a0 / a2 hold row g, a1 / a3 row
// g + 8, each two K values: a0 / a1 at k = 2t, 2t + 1, a2 / a3 at 2t + 8, 2t + 9; b0 / b1 hold column g at the same
// k. d0 / d1: row g, columns 2t / 2t + 1; d2 / d3: row g + 8.
__device__ __forceinline__ void mma_m16n8k16_bf16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

}  // namespace moe_fp8::mma
