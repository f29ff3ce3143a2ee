// Fused SiLU·mul + FP8 quantisation epilogue of an expert's first GEMM. The 256-wide tile holds the
// gate block (wave 0: the fragment's floats [0, 64)) and the up block (wave 1: [64, 128)) of the same
// 128 output columns, so act = silu(gate) · up is exactly one 128-wide quantisation group per row:
// its amax is reduced over the quad of lanes that shares the row, the FP8 codes are staged for the
// store warps (128 bytes a row, pitch of a 64-column bf16 tile) and the row's scale is written here.
// Numerics as moe_fp8.reference.per_token_group_quant: scale = max(amax, eps) / 448 correctly
// rounded (UE8M0: the next power of two), NaN in the group -> NaN scale, a non-finite scale -> every
// code NaN (0x7F), codes = e4m3(clamp(act · (1 / scale), +-448)) rounded to nearest even.
// Fast math on purpose: silu uses the MUFU exp2 / reciprocal, and the codes multiply by the rounded
// reciprocal of the scale (exact for UE8M0; otherwise within 1.5 ulp of act / scale, so a code moves
// one step only when act lies that close to a rounding boundary). The accumulators already differ
// from the reference's by the tensor cores' ~1e-4, so IEEE divisions and expf bought nothing here; they
// made the epilogue ~2k instructions per thread per tile, on the math warpgroups' critical path.
#pragma once

#include "../common/types.cuh"
#include "../ptx/misc.cuh"
#include "store.cuh"

namespace moe_fp8::epi {

constexpr float kFp8Max = 448.0f;
constexpr float kActQuantEps = 1e-10f;  // moe_fp8.reference.DEFAULT_EPS
constexpr float kLog2e = 1.4426950408889634f;

// MUFU approximations (~2 ulp): 2^x and 1 / x (1 / +-Inf = +-0).
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
    float y;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Smallest power of two >= s for a positive normal s (the scales here are >= 1e-10 / 448); +Inf stays.
__device__ __forceinline__ float round_up_pow2(float s) {
    const uint32_t bits = __float_as_uint(s);
    const uint32_t exponent = (bits >> 23) & 0xFF;
    return exponent == 0xFF ? s : __uint_as_float((exponent + ((bits & 0x7FFFFF) != 0)) << 23);
}

// Two e4m3 codes (lo in the low byte), saturating to +-448 and keeping NaN.
__device__ __forceinline__ uint16_t pack_e4m3x2(float lo, float hi) {
    uint16_t out;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(out) : "f"(hi), "f"(lo));
    return out;
}

// `total`: this thread's D fragment of the 256-wide tile (gate then up). Rows of the tile at or past
// `num_rows` get codes in smem (never stored) but no scale. `row_scale`: where the scale of the tile's
// row 0 goes (the next rows follow contiguously: the column-major, TMA-padded scale layout).
template <bool kUe8m0>
__device__ __forceinline__ void silu_mul_quant_to_smem(uint8_t* smem_d, float* total, uint32_t wg_row0,
                                                       float* row_scale, uint32_t num_rows) {
    constexpr uint32_t kPitch = StagingTile<64>::kPitchBytes;  // 128 FP8 bytes + 16
    const uint32_t lane = threadIdx.x % 32, quad_lane = lane % 4;
    const uint32_t row = wg_row0 + ((threadIdx.x / 32) % 4) * 16 + lane / 4;  // and row + 8

    // act in place of the gate values; floats 4c + {0, 1} are on `row`, 4c + {2, 3} on row + 8
    float amax[2] = {0.0f, 0.0f};
    uint32_t has_nan[2] = {0u, 0u};
#pragma unroll
    for (uint32_t i = 0; i < 64; ++i) {
        const float gate = total[i], up = total[64 + i];
        // silu(g) = g / (1 + e^-g); for g < -88 e^-g is +Inf and the reciprocal 0: act = -0 (reference: ~0)
        const float act = gate * rcp_approx(1.0f + exp2_approx(-gate * kLog2e)) * up;
        total[i] = act;
        amax[(i / 2) % 2] = fmaxf(amax[(i / 2) % 2], fabsf(act));
        has_nan[(i / 2) % 2] |= act != act;
    }
    float scale[2], inv_scale[2];
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
#pragma unroll
        for (uint32_t mask = 1; mask < 4; mask <<= 1) {
            amax[h] = fmaxf(amax[h], __shfl_xor_sync(0xffffffffu, amax[h], mask));
            has_nan[h] |= __shfl_xor_sync(0xffffffffu, has_nan[h], mask);
        }
        scale[h] = __fdiv_rn(fmaxf(amax[h], kActQuantEps), kFp8Max);
        if constexpr (kUe8m0) scale[h] = round_up_pow2(scale[h]);
        if (has_nan[h]) scale[h] = __uint_as_float(0x7FC00000u);
        inv_scale[h] = __frcp_rn(scale[h]);
    }

    uint8_t* base = smem_d + row * kPitch + quad_lane * 2;
#pragma unroll
    for (uint32_t c = 0; c < 16; ++c) {
#pragma unroll
        for (uint32_t h = 0; h < 2; ++h) {
            uint16_t codes = 0x7F7F;  // a non-finite scale: every code NaN
            if (fabsf(scale[h]) < __uint_as_float(0x7F800000u)) {
                // (cvt .satfinite clamps to +-448 itself)
                codes = pack_e4m3x2(total[4 * c + 2 * h] * inv_scale[h], total[4 * c + 2 * h + 1] * inv_scale[h]);
            }
            ptx::st_shared_u16(base + h * 8 * kPitch + c * 8, codes);
        }
    }
    if (quad_lane == 0) {
        if (row < num_rows) row_scale[row] = scale[0];
        if (row + 8 < num_rows) row_scale[row + 8] = scale[1];
    }
}

}  // namespace moe_fp8::epi
