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
#include "../mma/mma_sync_bf16.cuh"
#include "../mma/mma_sync_fp8.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::router_gemm {

constexpr uint32_t kChunk = 8;       // elements a lane loads at once (16 bytes of bf16)
constexpr uint32_t kMaxSplits = 8;   // CTAs a cluster, at most (the portable cluster size)

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

// The cluster's splits add their CTAs' totals [kRows tokens][kCols experts from expert0] in rank order (all loads
// issued, then added: the same bits whichever CTA stores); split s stores outputs s, s + num_splits, ... of them.
// Both cluster barriers are here: every split's totals written before the first read (release / acquire at cluster
// scope), and no CTA leaving while another reads its shared memory.
template <uint32_t kRows, uint32_t kCols, uint32_t kThreads>
__device__ __forceinline__ void add_splits_and_store(const float (&totals)[kRows][kCols], float* logits,
                                                     uint32_t num_tokens, uint32_t num_experts, uint32_t expert0) {
    const uint32_t split = ptx::cluster_cta_rank(), num_splits = gridDim.x;
    ptx::cluster_sync();
    for (uint32_t o = split * kThreads + threadIdx.x; o < kRows * kCols; o += num_splits * kThreads) {
        const uint32_t t = o / kCols, e = o % kCols;
        float parts[kMaxSplits];
#pragma unroll
        for (uint32_t s = 0; s < kMaxSplits; ++s)
            parts[s] = s < num_splits ? ptx::ld_shared_cluster_f32(ptx::map_shared_to_cta(&totals[t][e], s)) : 0.f;
        float total = parts[0];
#pragma unroll
        for (uint32_t s = 1; s < kMaxSplits; ++s) total += parts[s];
        if (t < num_tokens && expert0 + e < num_experts)
            logits[static_cast<size_t>(t) * num_experts + expert0 + e] = total;
    }
    ptx::cluster_sync();
}

// The CUDA-core form (float32 weights, or bf16 ones where the MMA form is not built): a lane's FMAs per expert
// and token.
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
    const uint32_t split = ptx::cluster_cta_rank();
    const uint32_t expert0 = blockIdx.y * kExpertsPerCta + warp * kExpertsPerWarp;
    const uint32_t num_chunks = hidden / kChunk;

    // the CTA's weight rows into L2 while the previous kernel ends (nothing but L2 is touched before the wait: a
    // kernel just before this one may have written the weights)
    const uint32_t k0 = split * kChunksPerCta * kChunk, k_len = min(kChunksPerCta * kChunk, hidden - k0);
    if (lane < kExpertsPerWarp && expert0 + lane < num_experts)
        ptx::bulk_prefetch_l2(w + static_cast<size_t>(expert0 + lane) * w_stride + k0, k_len * sizeof(WeightT));
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
            if (chunk < num_chunks && t < num_tokens) xq = mma::ld_shared_by_sm_v4(x + static_cast<size_t>(t) * x_stride + chunk * kChunk);
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
    add_splits_and_store<kTokens, kExpertsPerCta, kWarps * 32>(totals, logits, num_tokens, num_experts,
                                                               blockIdx.y * kExpertsPerCta);
}

// The tensor-core form, bf16 weights: a CTA takes kNTiles x 8 experts, its warps consecutive K ranges of kIters x 32
// elements; lane (g, t) = (lane / 4, lane % 4) loads 16 bytes at k + 8 t of expert g of each 8 and of tokens g and
// g + 8 of each 16, and feeds them to two m16n8k16 MMAs (its first 4 elements as the fragments' k = 2t, 2t + 1,
// 2t + 8, 2t + 9 of one, the last 4 of the other: the same bijection of K in A and B, so the same product).
template <uint32_t kMTiles, uint32_t kNTiles, uint32_t kWarps, uint32_t kIters>
__global__ void __launch_bounds__(kWarps * 32, 1)
    router_gemm_mma_kernel(const uint16_t* __restrict__ x, const uint16_t* __restrict__ w, float* __restrict__ logits,
                           uint32_t num_tokens, uint32_t hidden, uint32_t num_experts, uint32_t x_stride,
                           uint32_t w_stride) {
    constexpr uint32_t kRows = 16 * kMTiles, kCols = 8 * kNTiles, kKPerCta = kWarps * kIters * 32;
    __shared__ float warp_sums[kWarps][kRows][kCols];
    __shared__ float totals[kRows][kCols];

    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    const uint32_t expert0 = blockIdx.y * kCols, k_cta = ptx::cluster_cta_rank() * kKPerCta;

    // the CTA's weight rows into L2 while the previous kernel ends (as the CUDA-core form)
    if (threadIdx.x < kCols && expert0 + threadIdx.x < num_experts)
        ptx::bulk_prefetch_l2(w + static_cast<size_t>(expert0 + threadIdx.x) * w_stride + k_cta,
                              min(kKPerCta, hidden - k_cta) * 2);
    ptx::wait_prerequisites();
    ptx::launch_dependents();  // routing, next, waits for this grid's end before reading the logits

    float d[kMTiles][kNTiles][4] = {};
#pragma unroll
    for (uint32_t i = 0; i < kIters; ++i) {
        const uint32_t k = k_cta + (warp * kIters + i) * 32 + t * kChunk;
        const bool k_ok = k < hidden;  // (hidden % 8 == 0: a chunk is in the row or past it)
        uint4 wv[kNTiles];
#pragma unroll
        for (uint32_t nt = 0; nt < kNTiles; ++nt) {
            const uint32_t e = expert0 + nt * 8 + g;
            wv[nt] = k_ok && e < num_experts ? ptx::ld_global_evict_first_v4(w + static_cast<size_t>(e) * w_stride + k)
                                             : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (uint32_t mt = 0; mt < kMTiles; ++mt) {
            const uint32_t r = mt * 16 + g;
            const uint4 xa = k_ok && r < num_tokens ? mma::ld_shared_by_sm_v4(x + static_cast<size_t>(r) * x_stride + k)
                                                    : make_uint4(0, 0, 0, 0);
            const uint4 xb = k_ok && r + 8 < num_tokens
                                 ? mma::ld_shared_by_sm_v4(x + static_cast<size_t>(r + 8) * x_stride + k)
                                 : make_uint4(0, 0, 0, 0);
#pragma unroll
            for (uint32_t nt = 0; nt < kNTiles; ++nt) {
                mma::mma_m16n8k16_bf16(d[mt][nt], xa.x, xb.x, xa.y, xb.y, wv[nt].x, wv[nt].y);
                mma::mma_m16n8k16_bf16(d[mt][nt], xa.z, xb.z, xa.w, xb.w, wv[nt].z, wv[nt].w);
            }
        }
    }

    // d: rows g / g + 8 of each token tile, columns 2t, 2t + 1 of each expert tile; the warps' sums in warp order
#pragma unroll
    for (uint32_t mt = 0; mt < kMTiles; ++mt) {
#pragma unroll
        for (uint32_t nt = 0; nt < kNTiles; ++nt) {
            float* row = &warp_sums[warp][mt * 16 + g][nt * 8 + 2 * t];
            row[0] = d[mt][nt][0], row[1] = d[mt][nt][1];
            row[8 * kCols] = d[mt][nt][2], row[8 * kCols + 1] = d[mt][nt][3];
        }
    }
    __syncthreads();
    for (uint32_t o = threadIdx.x; o < kRows * kCols; o += kWarps * 32) {
        float total = warp_sums[0][o / kCols][o % kCols];
#pragma unroll
        for (uint32_t v = 1; v < kWarps; ++v) total += warp_sums[v][o / kCols][o % kCols];
        totals[o / kCols][o % kCols] = total;
    }
    add_splits_and_store<kRows, kCols, kWarps * 32>(totals, logits, num_tokens, num_experts, expert0);
}

}  // namespace moe_fp8::router_gemm
