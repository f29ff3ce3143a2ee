// Router logits at decode sizes: logits[T, E] (float32) = x[T, H] (bf16) . w[E, H]^T (bf16 or float32), every
// product and sum in float32 (a bf16 x bf16 product is exact in float32), as F.linear(x.float(), w.float()).
//
// A few tokens make this a read of the whole weight (DeepSeek-V3: 256 x 7168 bf16, 3.7 MB). As CUDA-graph replays
// after an L2 flush (H200, 1-8 tokens): cuBLAS's float32 gemv / sgemm on upcast operands 14.8-30.4 us, its bf16 GEMM
// with float32 output 10.5-10.8, this kernel 7.6-9.2.
//
// The grid is one cluster of kSplits CTAs per kExpertsPerCta experts. CTA s of a cluster takes K chunks
// [s * kChunksPerCta, (s+1) * kChunksPerCta) of 8 elements, warp w of it kExpertsPerWarp experts, lane l the chunks
// l, l + 32, ... of the CTA's range. Each lane holds a partial sum per (token, expert); a warp folds them so each
// lane keeps a few totals, and the CTAs of a cluster add theirs through distributed shared memory, in rank order
// (the same bits on every run: no atomics).
//
// A PDL-launched CTA prefetches its weight rows into L2 before it waits for the previous kernel (griddepcontrol.wait),
// then loads them and x.
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::router_gemm {

constexpr uint32_t kChunk = 8;       // elements a lane loads at once (16 bytes of bf16)
constexpr uint32_t kMaxSplits = 8;   // CTAs a cluster, at most (the portable cluster size)

// `bytes` (a multiple of 16, 16-byte aligned) of global memory into L2, by one thread. Safe before a PDL wait on data
// the previous kernel may still write: L2 is where its writes land, so nothing stale can be read from there.
// (Here, not in ptx/misc.cuh: the tuned tables hash the wgmma GEMM's include closure, which holds that header.)
__device__ __forceinline__ void bulk_prefetch_l2(const void* ptr, uint32_t bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(ptr), "r"(bytes) : "memory");
}

__device__ __forceinline__ float bf16_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf16_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// One chunk of 8 weights as floats (bf16: one 16-byte load; float32: two).
template <typename WeightT>
struct WeightChunk;

template <>
struct WeightChunk<uint16_t> {
    uint4 raw;
    __device__ __forceinline__ void load(const uint16_t* row, uint32_t chunk) {
        raw = ptx::ld_global_evict_first_v4(row + chunk * kChunk);
    }
    __device__ __forceinline__ float operator[](uint32_t i) const {
        const uint32_t word = i / 2 == 0 ? raw.x : i / 2 == 1 ? raw.y : i / 2 == 2 ? raw.z : raw.w;
        return i % 2 ? bf16_hi(word) : bf16_lo(word);
    }
};

template <>
struct WeightChunk<float> {
    uint4 raw[2];
    __device__ __forceinline__ void load(const float* row, uint32_t chunk) {
        raw[0] = ptx::ld_global_evict_first_v4(row + chunk * kChunk);
        raw[1] = ptx::ld_global_evict_first_v4(row + chunk * kChunk + 4);
    }
    __device__ __forceinline__ float operator[](uint32_t i) const {
        const uint4& q = raw[i / 4];
        return __uint_as_float(i % 4 == 0 ? q.x : i % 4 == 1 ? q.y : i % 4 == 2 ? q.z : q.w);
    }
};

// x's 16 bytes through the read-only path (every expert CTA of a split reads the same x chunks: L2 / L1 hits).
__device__ __forceinline__ uint4 ld_x_v4(const uint16_t* ptr) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

constexpr uint32_t log2_floor(uint32_t n) { return n > 1 ? 1 + log2_floor(n / 2) : 0; }

// Folds kN partial sums (a power of two) across the warp. Each of the first min(log2 kN, 5) exchange steps halves
// the list: the lanes with the step's bit set keep its upper half and send the lower, the others the reverse;
// later steps add whole values. Afterwards lane l holds the warp's totals of list entries index(l, i),
// i < kKept (lanes that differ only in bits below the halving steps hold the same totals).
template <uint32_t kN>
struct WarpFold {
    static constexpr uint32_t kSteps = log2_floor(kN) < 5 ? log2_floor(kN) : 5;
    static constexpr uint32_t kKept = kN >> kSteps;

    __device__ __forceinline__ static void run(float (&v)[kN], uint32_t lane) { step<0>(v, lane); }

    template <uint32_t kStep>
    __device__ __forceinline__ static void step(float (&v)[kN], uint32_t lane) {
        if constexpr (kStep < 5) {
            constexpr uint32_t kOffset = 16u >> kStep;
            if constexpr (kStep < kSteps) {
                constexpr uint32_t kHalf = (kN >> kStep) / 2;
                const bool upper = lane & kOffset;
#pragma unroll
                for (uint32_t i = 0; i < kHalf; ++i) {
                    const float send = upper ? v[i] : v[i + kHalf];
                    v[i] = (upper ? v[i + kHalf] : v[i]) + __shfl_xor_sync(kFullMask, send, kOffset);
                }
            } else {
#pragma unroll
                for (uint32_t i = 0; i < kKept; ++i) v[i] += __shfl_xor_sync(kFullMask, v[i], kOffset);
            }
            step<kStep + 1>(v, lane);
        }
    }

    // step j chose index bit (log2 kN - 1 - j) from lane bit (4 - j): the lane's top kSteps bits, then i
    __device__ __forceinline__ static uint32_t index(uint32_t lane, uint32_t i) {
        return (lane >> (5 - kSteps)) * kKept + i;
    }

    // one lane of each set holding the same totals
    __device__ __forceinline__ static bool writer(uint32_t lane) { return lane % (32u >> kSteps) == 0; }
};

template <typename WeightT, uint32_t kTokens, uint32_t kExpertsPerWarp, uint32_t kWarps, uint32_t kChunksPerLane>
__global__ void __launch_bounds__(kWarps * 32, 1)
    router_gemm_kernel(const uint16_t* __restrict__ x, const WeightT* __restrict__ w, float* __restrict__ logits,
                       uint32_t num_tokens, uint32_t hidden, uint32_t num_experts, uint32_t x_stride,
                       uint32_t w_stride) {
    constexpr uint32_t kExpertsPerCta = kWarps * kExpertsPerWarp, kChunksPerCta = 32 * kChunksPerLane;
    constexpr uint32_t kSums = kTokens * kExpertsPerWarp;  // partials a lane: [token][expert]
    static_assert((kSums & (kSums - 1)) == 0, "a power of two of partial sums a lane");
    __shared__ float totals[kTokens][kExpertsPerCta];

    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t split = ptx::cluster_cta_rank(), num_splits = gridDim.x;
    const uint32_t expert0 = blockIdx.y * kExpertsPerCta + warp * kExpertsPerWarp;
    const uint32_t num_chunks = hidden / kChunk;

    // the CTA's weight rows into L2 while the previous kernel ends (nothing but L2 is touched before the wait: a
    // kernel just before this one may have written the weights)
    const uint32_t k0 = split * kChunksPerCta * kChunk, k_len = min(kChunksPerCta * kChunk, hidden - k0);
    if (lane < kExpertsPerWarp && expert0 + lane < num_experts)
        bulk_prefetch_l2(w + static_cast<size_t>(expert0 + lane) * w_stride + k0, k_len * sizeof(WeightT));
    ptx::wait_prerequisites();
    ptx::launch_dependents();  // routing, next, waits for this grid's end before reading the logits

    // this lane's weight chunks; the chunks past the row (the last split's) and the experts past E are zeros, so
    // the math below needs no branch
    WeightChunk<WeightT> wc[kChunksPerLane][kExpertsPerWarp];
#pragma unroll
    for (uint32_t c = 0; c < kChunksPerLane; ++c) {
        const uint32_t chunk = split * kChunksPerCta + c * 32 + lane;
#pragma unroll
        for (uint32_t e = 0; e < kExpertsPerWarp; ++e) {
            wc[c][e] = WeightChunk<WeightT>{};
            if (chunk < num_chunks && expert0 + e < num_experts)
                wc[c][e].load(w + static_cast<size_t>(expert0 + e) * w_stride, chunk);
        }
    }

    float sums[kSums];
#pragma unroll
    for (uint32_t i = 0; i < kSums; ++i) sums[i] = 0.f;
#pragma unroll
    for (uint32_t c = 0; c < kChunksPerLane; ++c) {
        const uint32_t chunk = split * kChunksPerCta + c * 32 + lane;
#pragma unroll
        for (uint32_t t = 0; t < kTokens; ++t) {  // (tokens past num_tokens, up to the tile: zeros)
            uint4 xq = make_uint4(0, 0, 0, 0);
            if (chunk < num_chunks && t < num_tokens) xq = ld_x_v4(x + static_cast<size_t>(t) * x_stride + chunk * kChunk);
            const uint32_t words[4] = {xq.x, xq.y, xq.z, xq.w};
#pragma unroll
            for (uint32_t i = 0; i < kChunk; ++i) {
                const float xv = i % 2 ? bf16_hi(words[i / 2]) : bf16_lo(words[i / 2]);
#pragma unroll
                for (uint32_t e = 0; e < kExpertsPerWarp; ++e)
                    sums[t * kExpertsPerWarp + e] = fmaf(xv, wc[c][e][i], sums[t * kExpertsPerWarp + e]);
            }
        }
    }

    using Fold = WarpFold<kSums>;
    Fold::run(sums, lane);
    if (Fold::writer(lane)) {
#pragma unroll
        for (uint32_t i = 0; i < Fold::kKept; ++i) {
            const uint32_t index = Fold::index(lane, i);
            totals[index / kExpertsPerWarp][warp * kExpertsPerWarp + index % kExpertsPerWarp] = sums[i];
        }
    }
    ptx::cluster_sync();  // every split's totals written (release / acquire at cluster scope)

    // the cluster's splits add their totals in rank order; split s stores outputs s, s + num_splits, ...
    for (uint32_t o = split * kWarps * 32 + threadIdx.x; o < kTokens * kExpertsPerCta; o += num_splits * kWarps * 32) {
        const uint32_t t = o / kExpertsPerCta, e = o % kExpertsPerCta;
        float parts[kMaxSplits];
#pragma unroll
        for (uint32_t s = 0; s < kMaxSplits; ++s)  // (all loads issued, then added in rank order)
            parts[s] = s < num_splits ? ptx::ld_shared_cluster_f32(ptx::map_shared_to_cta(&totals[t][e], s)) : 0.f;
        float total = parts[0];
#pragma unroll
        for (uint32_t s = 1; s < kMaxSplits; ++s) total += parts[s];
        const uint32_t expert = blockIdx.y * kExpertsPerCta + e;
        if (t < num_tokens && expert < num_experts) logits[static_cast<size_t>(t) * num_experts + expert] = total;
    }
    ptx::cluster_sync();  // no CTA leaves while another reads its shared memory
}

}  // namespace moe_fp8::router_gemm
