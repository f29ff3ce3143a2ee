// Epilogue: FP32 accumulators -> bf16 tile in shared memory -> 16-byte coalesced global stores
// with row/column bounds, so ragged M / N and masked rows are never written.
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"
#include "../ptx/tma.cuh"

namespace moe_fp8::epi {

// Row pitch of the staging tile: +16 bytes shifts each row by 4 banks so the 8 rows a warp's
// D-fragment touches in one store land in distinct banks.
template <uint32_t BLOCK_N>
struct StagingTile {
    static constexpr uint32_t kPitchBytes = BLOCK_N * 2 + 16;
    template <uint32_t BLOCK_M>
    static constexpr uint32_t bytes() { return BLOCK_M * kPitchBytes; }
};

// Thread-local part of the staging tile: where this thread's D-fragment rows start (8-column
// chunk j lies j * 16 bytes further; the fragment's second row pair is 8 rows below).
template <uint32_t BLOCK_N>
__device__ __forceinline__ uint8_t* fragment_smem_base(uint8_t* smem_d, uint32_t wg_row0) {
    const uint32_t lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x / 32) % 4;
    const uint32_t row = wg_row0 + warp_in_wg * 16 + lane / 4;
    return smem_d + row * StagingTile<BLOCK_N>::kPitchBytes + (lane % 4) * 4;
}

// Chunk j of a D fragment: (v0, v1) on the thread's row, (v2, v3) eight rows below.
template <uint32_t BLOCK_N>
__device__ __forceinline__ void write_chunk_to_smem(uint8_t* base, uint32_t j, float v0, float v1, float v2,
                                                    float v3) {
    constexpr uint32_t kPitch = StagingTile<BLOCK_N>::kPitchBytes;
    ptx::st_shared_u32(base + j * 16, ptx::pack_bf16x2(v0, v1));
    ptx::st_shared_u32(base + 8 * kPitch + j * 16, ptx::pack_bf16x2(v2, v3));
}

// `acc` is one warpgroup's m64nBLOCK_N D-fragment (BLOCK_N / 2 floats), rows `wg_row0`..+63 of the tile.
// Two 8-column chunks per stmatrix (a quarter of the store instructions of 4-byte stores): matrices
// 0 / 1 are chunk j's upper / lower 8 rows, 2 / 3 chunk j + 1's; lane i addresses row i % 8 of matrix i / 8.
template <uint32_t BLOCK_N>
__device__ __forceinline__ void write_fragment_to_smem(uint8_t* smem_d, const float* acc, uint32_t wg_row0) {
    constexpr uint32_t kPitch = StagingTile<BLOCK_N>::kPitchBytes;
    constexpr uint32_t kChunks = BLOCK_N / 8;
    const uint32_t lane = threadIdx.x % 32, warp_in_wg = (threadIdx.x / 32) % 4;
    uint8_t* base = smem_d + (wg_row0 + warp_in_wg * 16 + lane % 8 + (lane / 8) % 2 * 8) * kPitch + lane / 16 * 16;
#pragma unroll
    for (uint32_t j = 0; j + 1 < kChunks; j += 2)
        ptx::stmatrix_x4(base + j * 16, ptx::pack_bf16x2(acc[4 * j], acc[4 * j + 1]),
                         ptx::pack_bf16x2(acc[4 * j + 2], acc[4 * j + 3]),
                         ptx::pack_bf16x2(acc[4 * j + 4], acc[4 * j + 5]),
                         ptx::pack_bf16x2(acc[4 * j + 6], acc[4 * j + 7]));
    if constexpr (kChunks % 2) {
        constexpr uint32_t j = kChunks - 1;
        write_chunk_to_smem<BLOCK_N>(fragment_smem_base<BLOCK_N>(smem_d, wg_row0), j, acc[4 * j], acc[4 * j + 1],
                                     acc[4 * j + 2], acc[4 * j + 3]);
    }
}

// All `kNumThreads` epilogue threads copy the staged tile out; row r of the tile goes to global row
// row0 + r when row0 + r < row_end, columns n0.. only below SHAPE_N (a multiple of 8). Only the
// kNumChunks 8-column chunks from `chunk0` are copied (a split-K CTA stores its share of the tile).
// `bulk`: each row leaves as one asynchronous bulk copy (the TMA unit moves it) instead of 16-byte loads and
// stores by these threads, which then issue a few instructions a tile rather than ~40 each (gemm.py decides
// when). Either way the staging tile is free again on return; the bulk copies' writes land later (the store
// warps wait for them before the CTA exits).
template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t SHAPE_N, uint32_t kNumThreads, uint32_t kNumChunks = BLOCK_N / 8>
__device__ __forceinline__ void store_tile(const uint8_t* smem_d, uint16_t* out, uint32_t row0, uint32_t row_end,
                                           uint32_t n0, uint32_t thread_idx, uint32_t chunk0, bool bulk) {
    constexpr uint32_t kPitch = StagingTile<BLOCK_N>::kPitchBytes;
    const uint32_t num_rows = min(BLOCK_M, row_end > row0 ? row_end - row0 : 0u);
    if (bulk) {
        const uint32_t col0 = n0 + chunk0 * 8;
        const uint32_t cols = SHAPE_N % BLOCK_N == 0 ? kNumChunks * 8
                              : col0 < SHAPE_N      ? min(kNumChunks * 8, SHAPE_N - col0)
                                                    : 0u;
        if (cols > 0) {
            for (uint32_t r = thread_idx; r < num_rows; r += kNumThreads)
                ptx::bulk_store(out + static_cast<uint64_t>(row0 + r) * SHAPE_N + col0, smem_d + r * kPitch + chunk0 * 16,
                                cols * 2);
        }
        ptx::bulk_commit();
        ptx::bulk_wait_read();
        return;
    }
    for (uint32_t idx = thread_idx; idx < num_rows * kNumChunks; idx += kNumThreads) {
        const uint32_t r = idx / kNumChunks, c = chunk0 + idx % kNumChunks;
        const uint32_t col = n0 + c * 8;
        if (SHAPE_N % BLOCK_N == 0 || col < SHAPE_N) {
            const uint4 v = ptx::ld_shared_v4(smem_d + r * kPitch + c * 16);
            ptx::st_global_v4(out + static_cast<uint64_t>(row0 + r) * SHAPE_N + col, v);
        }
    }
}

}  // namespace moe_fp8::epi
