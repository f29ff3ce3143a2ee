// K-split last wave (scheduler/gemm.cuh, TailSplit): the p K pieces of a tile (or of a tile half) run at
// the same time on consecutive CTAs c0 .. c0 + p - 1 and reduce-scatter their FP32 partials. Math warp w
// (16 rows of the tile) belongs to piece w * p / W (W math warps), so each piece owns one band of rows: it
// publishes its other warps' fragments, waits for the other pieces to publish theirs, adds the band's p
// partials in piece order (the same order, and bits, whichever piece finishes first) and stores the band.
// Warps whose rows are all past the tile's stored rows take no part (decode: most of a 64-row tile).
// NOTE: the traffic through L2, not any one SM, bounds this step: at 1206 x 4096 x 7168 (28 tail tiles of
// 128x256 as 4 whole-width pieces, 10.7 MB of partials) piece 0 gathering everything and every piece
// adding its band both took ~9-10 us after the math (session 27 timelines); pieces of tile halves, half the
// traffic per piece, ~4.5 us.
// Workspace, two buffers: `flags`, kKSplitFlagWords words, word c0 for the tile whose first piece runs on CTA c0
// (arrived pieces in the low half, live math warps done waiting in the high half: the last of them zeroes it for
// the next launch), zero before the first launch; `slots`, one slot of BLOCK_M x BLOCK_N floats per CTA, never
// zeroed (apart, so that a CUDA-graph capture can take flags zeroed before it and slots from the graph's pool:
// gemm.py). Waiting is safe: a piece is its CTA's last unit, every CTA runs as many whole tiles before it, and
// the persistent grid (at most one CTA per SM) is resident at once.
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::epi {

constexpr uint32_t kKSplitFlagWords = 1024;  // the grid's CTAs, at most (the host checks)

// CTA `cta`'s slot, fragment-major: floats 4q..4q+3 of math thread t at float4 q * kNumMathThreads + t,
// so each warp access covers 512 contiguous bytes.
template <uint32_t kNumAccum, uint32_t kNumMathThreads>
__device__ __forceinline__ float* k_split_slot(float* slots, uint32_t cta) {
    return slots + cta * kNumAccum * kNumMathThreads;
}

// First row of piece `piece`'s band of the tile (piece `num_pieces`: the band's end): the rows of math
// warps ceil(piece * W / num_pieces) ..
template <uint32_t kNumMathWarps>
__device__ __forceinline__ uint32_t piece_band_row0(uint32_t piece, uint32_t num_pieces) {
    return (piece * kNumMathWarps + num_pieces - 1) / num_pieces * 16;
}

// Bytes of shared memory reduce_scatter_pieces needs: the other pieces' fragments of the largest band.
template <uint32_t kNumAccum, uint32_t kNumMathThreads, uint32_t kMaxPieces>
constexpr uint32_t piece_buffer_bytes() {
    constexpr uint32_t kWarps = kNumMathThreads / 32;
    uint32_t most = 0;
    for (uint32_t p = 2; p <= kMaxPieces; ++p) {
        const uint32_t bytes = (p - 1) * ceil_div(kWarps, p) * 32 * kNumAccum * 4;
        most = bytes > most ? bytes : most;
    }
    return most;
}

// `total`: this math thread's partial D fragment (kNumAccum floats) of piece `piece` of `num_pieces`, in a
// tile whose first `num_rows` rows (>= 1) are stored. Returns whether this thread's warp belongs to the piece's
// band and holds stored rows; if so, `total` is now the sum of every piece's partial. A warp with no stored
// rows (decode: most of a 64-row tile) neither publishes nor adds. `buffer`: piece_buffer_bytes() of shared
// memory that no one else uses from here on (the drained pipeline stages); `bar_id`: a named barrier of the
// math threads.
template <uint32_t kNumAccum, uint32_t kNumMathThreads, uint32_t kMaxPieces>
__device__ __forceinline__ bool reduce_scatter_pieces(uint32_t* flags, float* slots, float* total, uint32_t piece,
                                                      uint32_t num_pieces, uint32_t num_rows, uint8_t* buffer,
                                                      uint32_t bar_id) {
    static_assert(kNumAccum % 4 == 0, "whole float4s per thread");
    constexpr uint32_t kWarps = kNumMathThreads / 32, kQuads = kNumAccum / 4;
    const uint32_t warp = threadIdx.x / 32, cta0 = blockIdx.x - piece;
    const bool in_band = warp * num_pieces / kWarps == piece, live = warp * 16 < num_rows;
    if (!in_band && live) {  // publish for the piece that owns these rows
        float* slot = k_split_slot<kNumAccum, kNumMathThreads>(slots, blockIdx.x) + 4 * threadIdx.x;
#pragma unroll
        for (uint32_t q = 0; q < kQuads; ++q)
            ptx::st_global_cg_v4(slot + 4 * q * kNumMathThreads, total[4 * q], total[4 * q + 1], total[4 * q + 2],
                                 total[4 * q + 3]);
        ptx::fence_acq_rel_gpu();  // each thread's stores before the count, raised after every thread's fence
    }
    // (also: every math warp is past its mainloop, so the stage buffers are free)
    ptx::named_barrier_sync(bar_id, kNumMathThreads);
    if (threadIdx.x == 0) ptx::red_release_gpu_add_u32(flags + cta0, 1);
    if (!in_band || !live) return false;

    while ((ptx::ld_acquire_gpu_u32(flags + cta0) & 0xFFFFu) < num_pieces) __nanosleep(32);
    __syncwarp();
    // every live math warp of the tile's CTAs has seen the count (each is in one band): the last zeroes it
    const uint32_t live_warps = min(kWarps, ceil_div(num_rows, 16u));
    if (threadIdx.x % 32 == 0 && ptx::atomic_add_gpu_u32(flags + cta0, 1u << 16) >> 16 == live_warps - 1)
        flags[cta0] = 0;

    // the other pieces' fragments of this thread, j-th other piece's quad q at float4
    // (j * kQuads + q) * band_threads + band index
    const uint32_t band_warp0 = piece_band_row0<kWarps>(piece, num_pieces) / 16;
    const uint32_t band_threads = piece_band_row0<kWarps>(piece + 1, num_pieces) * 2 - band_warp0 * 32;
    float4* mine = reinterpret_cast<float4*>(buffer) + (threadIdx.x - band_warp0 * 32);
    auto other = [&](uint32_t j, uint32_t q) -> float4& { return mine[(j * kQuads + q) * band_threads]; };
    // NOTE: this runs once per CTA from a cold instruction cache: the loops over pieces stay loops (ptxas
    // unrolling them into the 32 quads made 19k instructions, which took ~10 us to fetch)
#pragma unroll 1
    for (uint32_t j = 0; j < num_pieces; ++j) {
        if (j == piece) continue;
        const float* slot = k_split_slot<kNumAccum, kNumMathThreads>(slots, cta0 + j) + 4 * threadIdx.x;
#pragma unroll
        for (uint32_t q = 0; q < kQuads; ++q)
            ptx::cp_async_cg_16(&other(j - (j > piece), q), slot + 4 * q * kNumMathThreads);
    }
    ptx::cp_async_wait_all();  // (each thread reads back only what it copied)

    // in piece order: the partials before this piece's summed in the last of their places, then added to this
    // piece's, then each later one (float adds commute, so each step's bits are the single gatherer's)
    auto add = [](float4& acc, const float4& v) { acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w; };
#pragma unroll 1
    for (uint32_t j = 1; j < piece; ++j) {
#pragma unroll 8
        for (uint32_t q = 0; q < kQuads; ++q) add(other(j, q), other(j - 1, q));
    }
#pragma unroll 1
    for (uint32_t j = piece > 0 ? piece - 1 : 0; j + 1 < num_pieces; ++j) {
#pragma unroll
        for (uint32_t q = 0; q < kQuads; ++q) {
            const float4 v = other(j, q);
            total[4 * q] += v.x, total[4 * q + 1] += v.y, total[4 * q + 2] += v.z, total[4 * q + 3] += v.w;
        }
    }
    return true;
}

}  // namespace moe_fp8::epi
