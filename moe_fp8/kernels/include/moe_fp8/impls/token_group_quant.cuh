// Per-token-group FP8 quantisation of 16-bit activations on sm_90: x [R, K] (K a multiple of 128, R = G·M rows of
// a [G, M, K] input) -> e4m3 codes [R, K] and one FP32 scale per (row, 128 columns) in the column-major, TMA-padded
// layout the GEMMs read (scale of row m, group k of leading group g at g·KG·m_pad + k·m_pad + m).
// Bit-identical to the Triton kernel and to moe_fp8.reference.per_token_group_quant: scale = max(amax, eps) / 448
// correctly rounded (UE8M0: the next power of two), NaN in the group -> NaN scale, a non-finite scale -> every code
// NaN (0x7F), codes = e4m3(clamp(x / scale, ±448)) with x / scale correctly rounded (below).
//
// A stream: 2 bytes read and 1 written an element. The Triton kernel read as fast on the H200 as on the H100
// (2.5 TB/s), as each program loads its tile, waits for it, then reduces and stores, with nothing in flight meanwhile.
// Here every warp is persistent and keeps its next unit of 32 / kLanesPerGroup groups loading while it quantises
// the current one (H200, 16384 x 7168: 98.5 us, 0.89 of a copy of the same bytes, against the Triton kernel's
// 116.5 with its widest tiles; docs/kernels/datapath.md, session 56).
#pragma once

#include "../common/types.cuh"
#include "../epilogue/act_quant.cuh"  // epi::round_up_pow2, pack_e4m3x2, exp2_approx, rcp_approx, kFp8Max
#include "../ptx/misc.cuh"

namespace moe_fp8::quant {

constexpr uint32_t kGroupSize = 128;

// NaN-propagating maxima of packed 16-bit floats' magnitudes (the sign of the result is the xor of the inputs':
// mask it off at the end), and of floats
template <bool kBf16>
__device__ __forceinline__ uint32_t max_abs_nan_x2(uint32_t a, uint32_t b) {
    uint32_t d;
    if constexpr (kBf16) {
        asm("max.NaN.xorsign.abs.bf16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    } else {
        asm("max.NaN.xorsign.abs.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    }
    return d;
}
__device__ __forceinline__ float max_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}

// the two 16-bit floats of a word as floats (exact), low half first
template <bool kBf16>
__device__ __forceinline__ void unpack_x2(uint32_t w, float& lo, float& hi) {
    if constexpr (kBf16) {
        lo = __uint_as_float(w << 16), hi = __uint_as_float(w & 0xffff0000u);
    } else {
        asm("{.reg .f16 l, h;\n\tmov.b32 {l, h}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, h;}"
            : "=f"(lo), "=f"(hi) : "r"(w));
    }
}

// |x| / s correctly rounded without a division per element (an IEEE division is ~10 instructions): inv = RN(1 / s)
// once a group, q0 = RN(|x| · inv) is within an ulp of the quotient, and one correction with the exact residual
// |x| − q0·s rounds it correctly (Markstein's theorem; as quantize_exact in kernels/triton/common.py). Needs scales
// of at least 2^-93 (the wrapper's MIN_EPS): the residual of every quotient that reaches an FP8 code (≥ 2^-10) is
// then a normal float, so exact. Magnitudes, because the correction turns a zero quotient into +0 whatever x's sign:
// the codes take the signs of x afterwards.
__device__ __forceinline__ float divide_abs_rn(float x, float s, float inv) {
    const float q0 = fabsf(x) * inv;
    return fmaf(fmaf(-q0, s, fabsf(x)), inv, q0);
}

// Codes of the 8 16-bit floats in `w` against one scale: two words, or all NaN (0x7F) when the scale is not
// finite. (x / scale is symmetric in the sign, and satfinite rounds ±448-clamped magnitudes alike.)
template <bool kBf16>
__device__ __forceinline__ uint2 codes_x8(const uint4& w, float s, float inv, bool finite) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    uint32_t out[2];
#pragma unroll
    for (uint32_t h = 0; h < 2; ++h) {
        float x[4];
        unpack_x2<kBf16>(words[2 * h], x[0], x[1]);
        unpack_x2<kBf16>(words[2 * h + 1], x[2], x[3]);
        const uint32_t lo = epi::pack_e4m3x2(divide_abs_rn(x[0], s, inv), divide_abs_rn(x[1], s, inv));
        const uint32_t hi = epi::pack_e4m3x2(divide_abs_rn(x[2], s, inv), divide_abs_rn(x[3], s, inv));
        // the sign bits of the four inputs (bit 7 of bytes 1 and 3 of each word) into bit 7 of each code byte
        const uint32_t signs = __byte_perm(words[2 * h], words[2 * h + 1], 0x7531);
        out[h] = finite ? ((lo | (hi << 16)) & 0x7f7f7f7fu) | (signs & 0x80808080u) : 0x7f7f7f7fu;
    }
    return make_uint2(out[0], out[1]);
}

// One warp's unit: 32 / kLanesPerGroup consecutive groups of the flat [R·KG] list of output groups, kLanesPerGroup
// lanes each, a lane kVecs 16-byte vectors of its group's input: vector v of lane q covers the group's bytes
// [v·16·L + q·16, +16), so each load instruction reads 16·L contiguous bytes of every group. kSilu: the input rows
// are [gate | up], 2·KG groups wide, and a lane loads its group's gate vectors, then its up vectors.
template <uint32_t kLanesPerGroup, bool kSilu = false>
struct Unit {
    static constexpr uint32_t kGroups = 32 / kLanesPerGroup;
    static constexpr uint32_t kVecs = kGroupSize * 2 / 16 / kLanesPerGroup;
    static constexpr uint32_t kBufVecs = kVecs * (kSilu ? 2 : 1);
};

// Plain loads: with an evict-first L2 policy on them (as routing's) 16384 x 7168 took 107 against 98.5 us on the
// H200 (docs/kernels/datapath.md, session 56).
template <uint32_t kLanesPerGroup, bool kSilu>
__device__ __forceinline__ void load_unit(const uint8_t* x, uint64_t group, uint64_t num_groups, uint32_t kg,
                                          uint4 (&buf)[Unit<kLanesPerGroup, kSilu>::kBufVecs]) {
    using U = Unit<kLanesPerGroup, kSilu>;
    const uint32_t lane = threadIdx.x % 32;
    if (group >= num_groups) return;
    // the input group: the same one, or (SiLU) the gate block of row r's group k, r·2KG + k (groups < 2^31)
    const uint64_t in_group = kSilu ? group + static_cast<uint32_t>(group) / kg * kg : group;
    const uint8_t* src = x + in_group * (kGroupSize * 2) + (lane % kLanesPerGroup) * 16;
#pragma unroll
    for (uint32_t v = 0; v < U::kVecs; ++v) buf[v] = *reinterpret_cast<const uint4*>(src + v * 16 * kLanesPerGroup);
    if constexpr (kSilu) {
        const uint8_t* up = src + static_cast<uint64_t>(kg) * (kGroupSize * 2);
#pragma unroll
        for (uint32_t v = 0; v < U::kVecs; ++v) {
            buf[U::kVecs + v] = *reinterpret_cast<const uint4*>(up + v * 16 * kLanesPerGroup);
        }
    }
}

// act = silu(gate) · up of 16-bit inputs, from the MUFU exp2 / reciprocal as the fused GEMM epilogue computes it
// (epilogue/act_quant.cuh; within a few FP32 ulps of the reference's float64 value, as the Triton kernel's)
template <bool kBf16>
__device__ __forceinline__ void silu_mul_x8(const uint4& gate, const uint4& up, float (&act)[8]) {
    const uint32_t g[4] = {gate.x, gate.y, gate.z, gate.w}, u[4] = {up.x, up.y, up.z, up.w};
#pragma unroll
    for (uint32_t i = 0; i < 4; ++i) {
        float g0, g1, u0, u1;
        unpack_x2<kBf16>(g[i], g0, g1);
        unpack_x2<kBf16>(u[i], u0, u1);
        act[2 * i] = g0 * epi::rcp_approx(1.0f + epi::exp2_approx(-g0 * epi::kLog2e)) * u0;
        act[2 * i + 1] = g1 * epi::rcp_approx(1.0f + epi::exp2_approx(-g1 * epi::kLog2e)) * u1;
    }
}

// The group's scale from the lane's amax (the group's lanes reduce it): max(amax, eps) / 448 correctly rounded,
// UE8M0 rounded up, NaN where the group holds one.
template <bool kUe8m0, uint32_t kLanesPerGroup>
__device__ __forceinline__ float group_scale(float amax, float eps) {
#pragma unroll
    for (uint32_t mask = 1; mask < kLanesPerGroup; mask <<= 1) {
        amax = max_nan(amax, __shfl_xor_sync(kFullMask, amax, mask));
    }
    float s = __fdiv_rn(amax != amax ? amax : fmaxf(amax, eps), epi::kFp8Max);
    if constexpr (kUe8m0) s = epi::round_up_pow2(s);
    return s;
}

// `group`: this lane's group in the flat list; rows of `rows_per_lead` (M) each lead to the scale layout.
template <bool kBf16, bool kUe8m0, uint32_t kLanesPerGroup, bool kSilu>
__device__ __forceinline__ void quantize_unit(const uint4 (&buf)[Unit<kLanesPerGroup, kSilu>::kBufVecs],
                                              uint64_t group, uint64_t num_groups, uint8_t* out, float* out_scale,
                                              uint32_t kg, uint32_t rows_per_lead, uint32_t m_pad, float eps) {
    constexpr uint32_t kVecs = Unit<kLanesPerGroup, kSilu>::kVecs;
    const uint32_t q = threadIdx.x % 32 % kLanesPerGroup;
    uint8_t* dst = out + group * kGroupSize + q * 8;
    float s;
    if constexpr (kSilu) {
        float act[kVecs][8];
        float amax = 0.0f;
#pragma unroll
        for (uint32_t v = 0; v < kVecs; ++v) {
            silu_mul_x8<kBf16>(buf[v], buf[kVecs + v], act[v]);
#pragma unroll
            for (uint32_t i = 0; i < 8; ++i) amax = max_nan(amax, fabsf(act[v][i]));
        }
        s = group_scale<kUe8m0, kLanesPerGroup>(amax, eps);
        const bool finite = fabsf(s) < __uint_as_float(0x7f800000u);
        const float inv = __frcp_rn(s);
        if (group >= num_groups) return;
#pragma unroll
        for (uint32_t v = 0; v < kVecs; ++v) {
            uint32_t w[2];
#pragma unroll
            for (uint32_t h = 0; h < 2; ++h) {
                const float* a = act[v] + 4 * h;  // (the codes take act's signs: -0 stays 0x80)
                const uint32_t lo = epi::pack_e4m3x2(copysignf(divide_abs_rn(a[0], s, inv), a[0]),
                                                     copysignf(divide_abs_rn(a[1], s, inv), a[1]));
                const uint32_t hi = epi::pack_e4m3x2(copysignf(divide_abs_rn(a[2], s, inv), a[2]),
                                                     copysignf(divide_abs_rn(a[3], s, inv), a[3]));
                w[h] = finite ? lo | (hi << 16) : 0x7f7f7f7fu;
            }
            *reinterpret_cast<uint2*>(dst + v * 8 * kLanesPerGroup) = make_uint2(w[0], w[1]);
        }
    } else {
        // amax of |x| on the packed halves (exact: a maximum is one of the inputs)
        uint32_t m2 = 0;
#pragma unroll
        for (uint32_t v = 0; v < kVecs; ++v) {
            m2 = max_abs_nan_x2<kBf16>(m2, buf[v].x);
            m2 = max_abs_nan_x2<kBf16>(m2, buf[v].y);
            m2 = max_abs_nan_x2<kBf16>(m2, buf[v].z);
            m2 = max_abs_nan_x2<kBf16>(m2, buf[v].w);
        }
        float lo, hi;
        unpack_x2<kBf16>(m2 & 0x7fff7fffu, lo, hi);
        s = group_scale<kUe8m0, kLanesPerGroup>(max_nan(lo, hi), eps);
        const bool finite = fabsf(s) < __uint_as_float(0x7f800000u);
        const float inv = __frcp_rn(s);
        if (group >= num_groups) return;
#pragma unroll
        for (uint32_t v = 0; v < kVecs; ++v) {
            *reinterpret_cast<uint2*>(dst + v * 8 * kLanesPerGroup) = codes_x8<kBf16>(buf[v], s, inv, finite);
        }
    }
    if (q == 0) {
        const uint32_t row = static_cast<uint32_t>(group / kg), k = static_cast<uint32_t>(group % kg);
        const uint32_t lead = row / rows_per_lead, m = row % rows_per_lead;
        out_scale[(static_cast<uint64_t>(lead) * kg + k) * m_pad + m] = s;
    }
}

// Persistent: warp w of the grid quantises units w, w + W, w + 2W, ... (W warps in all), each unit's loads issued
// before the previous unit is quantised. Launched as a programmatic dependent: it waits for the kernel before it
// (which may still write x, or read the outputs) before any access. kSilu: x holds [gate | up] rows of 2·KG groups,
// and the codes are those of silu(gate) · up.
template <bool kBf16, bool kUe8m0, uint32_t kLanesPerGroup, uint32_t kThreads, bool kSilu = false>
__global__ void __launch_bounds__(kThreads) per_token_group_quant_kernel(
    const uint8_t* __restrict__ x, uint8_t* __restrict__ out, float* __restrict__ out_scale, uint64_t num_groups,
    uint32_t kg, uint32_t rows_per_lead, uint32_t m_pad, float eps) {
    static_assert(kLanesPerGroup == 4 || kLanesPerGroup == 8 || kLanesPerGroup == 16,
                  "a group's 256 bytes in 16-byte lanes");
    using U = Unit<kLanesPerGroup, kSilu>;
    ptx::wait_prerequisites();
    ptx::launch_dependents();
    const uint64_t num_units = ceil_div<uint64_t>(num_groups, U::kGroups);
    const uint64_t stride = static_cast<uint64_t>(gridDim.x) * (blockDim.x / 32);
    const uint64_t lane_group = threadIdx.x % 32 / kLanesPerGroup;
    uint64_t unit = static_cast<uint64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
    uint4 buf[2][U::kBufVecs];
    load_unit<kLanesPerGroup, kSilu>(x, unit * U::kGroups + lane_group, num_groups, kg, buf[0]);
    const auto step = [&](const uint4 (&cur)[U::kBufVecs], uint4 (&upcoming)[U::kBufVecs]) {
        const uint64_t next = unit + stride;
        if (next < num_units) {
            load_unit<kLanesPerGroup, kSilu>(x, next * U::kGroups + lane_group, num_groups, kg, upcoming);
        }
        quantize_unit<kBf16, kUe8m0, kLanesPerGroup, kSilu>(cur, unit * U::kGroups + lane_group, num_groups, out,
                                                            out_scale, kg, rows_per_lead, m_pad, eps);
        unit = next;
    };
    while (unit < num_units) {
        step(buf[0], buf[1]);
        if (unit >= num_units) break;
        step(buf[1], buf[0]);
    }
}

}  // namespace moe_fp8::quant
