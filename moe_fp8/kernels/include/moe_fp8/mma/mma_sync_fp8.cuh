// Warp-level FP8 MMA (mma.sync, sm_89+) and the loads that feed it from global memory, for the few-rows
// GEMM (impls/fp8_gemm_few_rows.cuh). Kept apart from the wgmma headers: the tuned tables are keyed by the
// wgmma GEMM's sources only (kernels/tuning.py).
#pragma once

#include "../common/types.cuh"

namespace moe_fp8::mma {

// D[16x8] = A[16x32] · B[32x8] + C, e4m3 in, FP32 out. Fragments (lane = 4 * g + t): a0 / a2 hold row g,
// a1 / a3 row g + 8, each four K values: a0 / a1 at k = 4t..4t+3, a2 / a3 at 16 + 4t..; b0 / b1 hold
// column g at the same k. d0 / d1: row g, columns 2t / 2t + 1; d2 / d3: row g + 8.
// A thread's k positions are the same in A and B, so any bijection of K onto (t, slot) used by both
// gives the same product: the callers load whole 16-byte pieces per thread and never shuffle.
__device__ __forceinline__ void mma_m16n8k32_e4m3(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                                  uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// 16 bytes read once (weights): not kept in L1. Not volatile, so the compiler may batch the loads.
__device__ __forceinline__ uint4 ld_stream_v4(const void* ptr) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

// 16 bytes read by many warps of an SM (activation rows): through L1.
__device__ __forceinline__ uint4 ld_shared_by_sm_v4(const void* ptr) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

}  // namespace moe_fp8::mma
