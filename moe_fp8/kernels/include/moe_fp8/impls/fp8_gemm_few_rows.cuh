// Block-scaled FP8 GEMM for groups of few rows (decode): out[g, r, n] for r < rows(g), rows(g) = masked_m[g]
// (masked layout, [G, max_m, K]) or max_m (normal layout: one group, masked_m null). A warp's MMAs take 8 *
// kTokenTiles rows; groups of more (any count up to max_m) are walked in chunks of that many.
//
// NOTE: why not the wgmma kernel. At decode a step touches few experts, and a masked GEMM's tiles are
// (group, 64-row block, n-block): one touched expert of 4096 x 7168 gives 16-64 tiles, each a serial chain
// of 56 K blocks, and the expert's 29 MB are read at ~1.1 TB/s (docs/kernels/gemm.md, session 50). Here the
// weights are the MMA's M side (swap AB): a warp computes 16 weight rows x 8 tokens with mma.sync, and the
// K range of each 16-row tile is split over kSplitK warps, so one expert spreads over the whole GPU and
// every warp keeps several K blocks of loads in flight. No shared-memory staging: each thread loads the
// 32 bytes of its rows that its MMA fragments hold (any K order serves: see mma/mma_sync_fp8.cuh).
//
// Numerics as the wgmma kernel's: each 128-K block's product starts from zero and is added in FP32 with
// its two scales; the kSplitK partial sums are added in split order (deterministic).
#pragma once

#include "../common/types.cuh"
#include "../mma/mma_sync_fp8.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::few_rows {

constexpr uint32_t kWarps = 8, kThreads = 32 * kWarps;
constexpr uint32_t kTileN = 16;         // weight rows of one warp tile (the MMA's M)
constexpr uint32_t kMaxGroups = 1024;   // compacted in shared memory (kernels/few_rows.py: MAX_GROUPS)
// K blocks of loads a warp issues before their MMAs (one token tile / two), and CTAs an SM holds (the register
// cap): -D switches for measurements only.
#ifndef MOE_FP8_FEW_ROWS_UNROLL
#define MOE_FP8_FEW_ROWS_UNROLL 2
#endif
#ifndef MOE_FP8_FEW_ROWS_UNROLL_2T
#define MOE_FP8_FEW_ROWS_UNROLL_2T 1
#endif
#ifndef MOE_FP8_FEW_ROWS_MIN_CTAS
#define MOE_FP8_FEW_ROWS_MIN_CTAS 2
#endif

__device__ __forceinline__ uint32_t word(const uint4 (&v)[2], uint32_t i) {
    const uint4& h = v[i / 4];
    const uint32_t j = i % 4;
    return j == 0 ? h.x : j == 1 ? h.y : j == 2 ? h.z : h.w;
}

__device__ __forceinline__ uint16_t to_bf16(float v) {
    uint16_t r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(v));
    return r;
}

// Items: (chunk, kWarps / kSplitK consecutive 16-row tiles), walked by a persistent grid; a chunk is the rows of
// a group with rows, or with kChunked (max_m past 8 * kTokenTiles) up to kChunkRows = 8 * kTokenTiles of them: a
// group of more rows (a hot expert of a batched layout) is several chunks. In an item, warp w takes tile w / kSplitK
// and K blocks [s * Kb / kSplitK, (s + 1) * Kb / kSplitK) with s = w % kSplitK.
template <uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t kTokenTiles, uint32_t kSplitK, bool kOutF32, bool kChunked>
__global__ void __launch_bounds__(kThreads, MOE_FP8_FEW_ROWS_MIN_CTAS) fp8_gemm_few_rows_kernel(
    const uint8_t* __restrict__ x, const float* __restrict__ x_scale, const uint8_t* __restrict__ w,
    const float* __restrict__ w_scale, void* __restrict__ out, const int32_t* __restrict__ masked_m,
    uint32_t num_groups, uint32_t max_m, uint32_t xs_group_stride, uint32_t xs_k_stride) {
    static_assert(kWarps % kSplitK == 0 && SHAPE_N % 8 == 0 && SHAPE_K % 16 == 0, "see kernels/few_rows.py");
    static_assert(kTokenTiles >= 1 && kTokenTiles <= 2, "rows of 8 or 16 a chunk");
    constexpr uint32_t kNumKBlocks = ceil_div(SHAPE_K, 128u), kNumNBlocks = ceil_div(SHAPE_N, 128u);
    constexpr uint32_t kTilesPerItem = kWarps / kSplitK, kChunkRows = 8 * kTokenTiles;
    constexpr uint32_t kItemsPerChunk = ceil_div(SHAPE_N, kTileN * kTilesPerItem);
    constexpr uint32_t kUnroll = kTokenTiles == 1 ? MOE_FP8_FEW_ROWS_UNROLL : MOE_FP8_FEW_ROWS_UNROLL_2T;
    constexpr bool kRaggedN = SHAPE_N % kTileN != 0, kRaggedK = SHAPE_K % 128 != 0;
    constexpr uint32_t kChunkSlots = kChunked ? kMaxGroups : 1;
    // each group with rows, in group order: group << 16 | rows (kChunked: the group, its rows and the chunks up to
    // and including its own apart)
    __shared__ uint32_t touched[kMaxGroups], touched_rows[kChunkSlots], chunks_end[kChunkSlots];
    __shared__ uint32_t warp_count[kWarps], warp_chunks[kChunked ? kWarps : 1];
    __shared__ float partial[kSplitK > 1 ? kWarps : 1][kTokenTiles][4][32];
    const uint32_t warp = threadIdx.x / 32, lane = threadIdx.x % 32;

    ptx::wait_prerequisites();  // masked_m and x come from the previous kernel
    ptx::launch_dependents();

    // the groups with rows (and their chunks), compacted (every CTA alike: no host sync, CUDA-graph safe)
    uint32_t num_touched = 0, num_chunks = 0;
    for (uint32_t g0 = 0; g0 < num_groups; g0 += kThreads) {
        const uint32_t g = g0 + threadIdx.x;
        uint32_t rows = 0;
        if (g < num_groups)  // clamped: an out-of-range count must not read or write past the group
            rows = masked_m == nullptr ? max_m : min(static_cast<uint32_t>(max(ptx::ldg_s32(masked_m + g), 0)), max_m);
        uint32_t chunks = 0;  // kChunked: an inclusive scan over the warp's lanes
        if constexpr (kChunked) {
            chunks = ceil_div(rows, kChunkRows);
#pragma unroll
            for (uint32_t o = 1; o < 32; o <<= 1) {
                const uint32_t below = __shfl_up_sync(kFullMask, chunks, o);
                chunks += lane >= o ? below : 0;
            }
            if (lane == 31) warp_chunks[warp] = chunks;
        }
        const uint32_t ballot = __ballot_sync(kFullMask, rows > 0);
        if (lane == 0) warp_count[warp] = __popc(ballot);
        __syncthreads();
        uint32_t before = num_touched, chunks_before = num_chunks;
#pragma unroll
        for (uint32_t i = 0; i < kWarps; ++i) {
            before += i < warp ? warp_count[i] : 0;
            num_touched += warp_count[i];
            if constexpr (kChunked) {
                chunks_before += i < warp ? warp_chunks[i] : 0;
                num_chunks += warp_chunks[i];
            }
        }
        if (rows > 0) {
            const uint32_t at = before + __popc(ballot & ((1u << lane) - 1));
            if constexpr (kChunked)
                touched[at] = g, touched_rows[at] = rows, chunks_end[at] = chunks_before + chunks;
            else
                touched[at] = g << 16 | rows;
        }
        __syncthreads();  // the counts are rewritten next round
    }
    if constexpr (!kChunked) num_chunks = num_touched;

    const uint32_t t = lane % 4, gq = lane / 4;  // fragment coordinates (mma/mma_sync_fp8.cuh)
    const uint32_t split = warp % kSplitK;
    const uint32_t kb_begin = split * kNumKBlocks / kSplitK, kb_end = (split + 1) * kNumKBlocks / kSplitK;
    for (uint32_t item = blockIdx.x; item < num_chunks * kItemsPerChunk; item += gridDim.x) {
        const uint32_t chunk = item / kItemsPerChunk;
        uint32_t group, rows, r0 = 0;  // the chunk's rows start at row r0 of the group
        if constexpr (kChunked) {
            uint32_t lo = 0, hi = num_touched - 1;  // the first group whose chunks end past this one
            while (lo < hi) {
                const uint32_t mid = (lo + hi) / 2;
                if (chunks_end[mid] > chunk) hi = mid; else lo = mid + 1;
            }
            group = touched[lo];
            r0 = (chunk - (lo ? chunks_end[lo - 1] : 0)) * kChunkRows;
            rows = min(touched_rows[lo] - r0, kChunkRows);
        } else {
            group = touched[chunk] >> 16, rows = touched[chunk] & 0xffffu;
        }
        const uint32_t n0 = ((item % kItemsPerChunk) * kTilesPerItem + warp / kSplitK) * kTileN;
        const bool second_row = !kRaggedN || n0 + gq + 8 < SHAPE_N;
        float acc[kTokenTiles][4] = {};
        if (n0 < SHAPE_N) {
            // this thread's 32 bytes of each 128-K block, [16t, 16t + 16) and [64 + 16t, ...): weight rows n0 + gq
            // (+ 8), token gq (+ 8j). A warp's load covers the first or last 64 bytes of 8 rows, whole 32-byte
            // sectors: each sector is requested once (with [32t, 32t + 32) each was requested twice, half each time)
            const uint8_t* w_row = w + (static_cast<uint64_t>(group) * SHAPE_N + n0 + gq) * SHAPE_K + 16 * t;
            const uint8_t* x_row = x + (static_cast<uint64_t>(group) * max_m + r0 + gq) * SHAPE_K + 16 * t;
            const float* ws = w_scale + (static_cast<uint64_t>(group) * kNumNBlocks + n0 / 128) * kNumKBlocks;
            const float* xs = x_scale + static_cast<uint64_t>(group) * xs_group_stride + r0 + 2 * t;
            for (uint32_t kb0 = kb_begin; kb0 < kb_end; kb0 += kUnroll) {
                uint4 wv[kUnroll][2][2] = {}, xv[kUnroll][kTokenTiles][2] = {};
#pragma unroll
                for (uint32_t u = 0; u < kUnroll; ++u) {
                    const uint32_t kb = kb0 + u;
                    if (kb >= kb_end) break;
#pragma unroll
                    for (uint32_t h = 0; h < 2; ++h) {
                        const uint32_t k = kb * 128 + 64 * h;  // (+ 16t: in the row pointers)
                        if (kRaggedK && k + 16 * t + 16 > SHAPE_K) continue;
                        wv[u][0][h] = mma::ld_stream_v4(w_row + k);
                        if (second_row) wv[u][1][h] = mma::ld_stream_v4(w_row + 8 * SHAPE_K + k);
#pragma unroll
                        for (uint32_t j = 0; j < kTokenTiles; ++j)
                            if (8 * j + gq < rows) xv[u][j][h] = mma::ld_shared_by_sm_v4(x_row + 8 * j * SHAPE_K + k);
                    }
                }
#pragma unroll
                for (uint32_t u = 0; u < kUnroll; ++u) {
                    const uint32_t kb = kb0 + u;
                    if (kb >= kb_end) break;
                    const float sw = ptx::ldg_f32(ws + kb);
#pragma unroll
                    for (uint32_t j = 0; j < kTokenTiles; ++j) {
                        if (8 * j >= rows) break;
                        float d[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                        for (uint32_t i = 0; i < 4; ++i)
                            mma::mma_m16n8k32_e4m3(d, word(wv[u][0], 2 * i), word(wv[u][1], 2 * i),
                                                   word(wv[u][0], 2 * i + 1), word(wv[u][1], 2 * i + 1),
                                                   word(xv[u][j], 2 * i), word(xv[u][j], 2 * i + 1));
                        const uint32_t r = 8 * j + 2 * t;  // d0 / d2: token r, d1 / d3: token r + 1
                        const float s0 = r < rows ? sw * ptx::ldg_f32(xs + 8 * j + kb * xs_k_stride) : 0.f;
                        const float s1 = r + 1 < rows ? sw * ptx::ldg_f32(xs + 8 * j + 1 + kb * xs_k_stride) : 0.f;
                        acc[j][0] += d[0] * s0, acc[j][1] += d[1] * s1, acc[j][2] += d[2] * s0, acc[j][3] += d[3] * s1;
                    }
                }
            }
        }
        if constexpr (kSplitK > 1) {  // the tile's other splits hand their sums to its first warp
#pragma unroll
            for (uint32_t j = 0; j < kTokenTiles; ++j)
#pragma unroll
                for (uint32_t i = 0; i < 4; ++i) partial[warp][j][i][lane] = acc[j][i];
            __syncthreads();
            if (split == 0) {
#pragma unroll
                for (uint32_t s = 1; s < kSplitK; ++s)
#pragma unroll
                    for (uint32_t j = 0; j < kTokenTiles; ++j)
#pragma unroll
                        for (uint32_t i = 0; i < 4; ++i) acc[j][i] += partial[warp + s][j][i][lane];
            }
        }
        if (split == 0 && n0 < SHAPE_N) {
#pragma unroll
            for (uint32_t j = 0; j < kTokenTiles; ++j)
#pragma unroll
                for (uint32_t i = 0; i < 4; ++i) {
                    const uint32_t r = 8 * j + 2 * t + i % 2, n = n0 + gq + 8 * (i / 2);
                    if (r >= rows || (i >= 2 && !second_row)) continue;
                    const uint64_t at = (static_cast<uint64_t>(group) * max_m + r0 + r) * SHAPE_N + n;
                    if constexpr (kOutF32)
                        static_cast<float*>(out)[at] = acc[j][i];
                    else
                        static_cast<uint16_t*>(out)[at] = to_bf16(acc[j][i]);
                }
        }
        if constexpr (kSplitK > 1) __syncthreads();  // `partial` is rewritten by the next item
    }
}

}  // namespace moe_fp8::few_rows
