// Block-scaled FP8 GEMM for sm_90a: out[M, N] (bf16) = (x_fp8 · x_scale) @ (w_fp8 · w_scale)ᵀ.
//
// Roles (warp specialisation): warpgroups 0 .. kNumMathWGs-1 run wgmma on 64-row slices of the
// tile and promote each 128-K partial sum on CUDA cores (x_scale[row] · w_scale[n-block]); the last
// warpgroup is the producer: one thread issues the TMA loads of A, B and A's scales into a
// kNumStages ring (full / empty mbarriers), and its warps 1-3 stage each tile's weight scales in
// shared memory one tile ahead and copy each finished bf16 tile from shared memory to global memory
// while the math warpgroups start the next tile. The grid is persistent; `Scheduler` decides the tile
// order and which rows each tile may read and write (normal, contiguous-grouped, masked-grouped).
#pragma once

#include "../common/types.cuh"
#include "../epilogue/act_quant.cuh"
#include "../epilogue/split_k.cuh"
#include "../epilogue/store.cuh"
#include "../epilogue/k_split.cuh"
#include "../mma/wgmma.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"
#include "../ptx/tma.cuh"
#include "../scheduler/gemm.cuh"

namespace moe_fp8 {

constexpr uint32_t kBlockK = 128;  // == scale granularity: one promotion per K block
constexpr uint32_t kWgmmaK = 32;   // K of one fp8 wgmma
// Named barriers (0 is __syncthreads) between each math warpgroup and the store warps, one per
// warpgroup so the two never wait for each other at a tile's ends: its 64 rows of the staging tile
// are full (math -> store warps) / have been copied out (store warps -> math) ...
constexpr uint32_t kBarStagingFull = 1;   // + warpgroup
constexpr uint32_t kBarStagingEmpty = 3;  // + warpgroup
// ... and the store warps have staged a tile's weight scales (store warps -> math), per buffer.
constexpr uint32_t kBarScalesFull = 5;  // + 2 * buffer + warpgroup
// The math warpgroups' partial tile is published (a K piece): every math thread has written it.
constexpr uint32_t kBarPartial = 9;
constexpr uint32_t kNumStoreThreads = 96;  // warps 1-3 of the producer warpgroup

// Shared-memory layout of one kernel variant; the host passes the total it computed as
// kSmemBytes and the kernel checks it covers this layout (one formula, checked on both sides).
template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t kNumStages, uint32_t SHAPE_K>
struct GemmSmem {
    static constexpr uint32_t kABytes = BLOCK_M * kBlockK;  // fp8, 128-byte rows
    static constexpr uint32_t kBBytes = BLOCK_N * kBlockK;
    static constexpr uint32_t kSABytes = BLOCK_M * sizeof(float);
    // a tile's weight scales: two 128-column blocks x every K block, double-buffered across tiles
    static constexpr uint32_t kSBPitch = align_up(ceil_div(SHAPE_K, kBlockK), 4u);  // floats per row
    static constexpr uint32_t kSBBytes = 2 * 2 * kSBPitch * sizeof(float);
    static constexpr uint32_t kA = 0;
    static constexpr uint32_t kB = kA + kNumStages * kABytes;
    static constexpr uint32_t kSA = kB + kNumStages * kBBytes;
    static constexpr uint32_t kD = kSA + kNumStages * kSABytes;
    static constexpr uint32_t kSB = kD + epi::StagingTile<BLOCK_N>::template bytes<BLOCK_M>();
    static constexpr uint32_t kBar = kSB + kSBBytes;
    static constexpr uint32_t kTotal = kBar + (2 * kNumStages + 1) * sizeof(uint64_t);  // + split-K's
    static constexpr uint32_t kTxBytes = kABytes + kBBytes + kSABytes;
    static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0, "sw128 tiles must stay 1024-byte aligned");
    static_assert(kSABytes % 128 == 0, "TMA destinations must be 128-byte aligned");
};

// Scales of one 128-K block for this thread's two fragment rows and (up to) two B-scale blocks.
struct BlockScales {
    float a_top, a_bot, b_lo, b_hi;
};

// NOTE: the math warpgroups read two weight scales per 128-K block. Read from global memory (DRAM
// latency, ~0.5 us, as a scale is first touched) they stalled every block at small M even when
// loaded one block ahead: a 64-row tile's block of math is far shorter than that latency. So the
// store warps, idle during the mainloop, copy a tile's scales into shared memory one tile ahead.
// `dst` gets the scales of 128-row weight block sb0 (every K block) in row 0 and of block sb1 in row
// 1, kPitch floats apart.
template <uint32_t kNumKBlocks, uint32_t kNumNScales, uint32_t kPitch, uint32_t kNumThreads>
__device__ __forceinline__ void stage_w_scales(float* dst, const float* w_scale, uint32_t group, uint32_t sb0,
                                               uint32_t sb1, uint32_t thread_idx) {
    const float* lo = w_scale + (group * kNumNScales + sb0) * kNumKBlocks;
    const float* hi = w_scale + (group * kNumNScales + sb1) * kNumKBlocks;
    constexpr uint32_t kUnroll = 4;  // loads in flight per thread before their stores
#pragma unroll 1
    for (uint32_t base = thread_idx; base < 2 * kNumKBlocks; base += kUnroll * kNumThreads) {
        float v[kUnroll];
#pragma unroll
        for (uint32_t u = 0; u < kUnroll; ++u) {
            const uint32_t i = base + u * kNumThreads;
            if (i < 2 * kNumKBlocks) v[u] = ptx::ldg_f32(i < kNumKBlocks ? lo + i : hi + (i - kNumKBlocks));
        }
#pragma unroll
        for (uint32_t u = 0; u < kUnroll; ++u) {
            const uint32_t i = base + u * kNumThreads;
            if (i < 2 * kNumKBlocks) dst[i < kNumKBlocks ? i : kPitch + (i - kNumKBlocks)] = v[u];
        }
    }
}

// total += acc · x_scale[row] · w_scale[n-block], on the D-fragment layout of WgmmaFp8<BLOCK_N>;
// tile columns below `split` take the first weight-scale block, the rest the next one.
template <uint32_t BLOCK_N>
__device__ __forceinline__ void promote_split(float* total, const float* acc, const BlockScales& sc, uint32_t split) {
    const float top_lo = sc.a_top * sc.b_lo, bot_lo = sc.a_bot * sc.b_lo;
    const float top_hi = sc.a_top * sc.b_hi, bot_hi = sc.a_bot * sc.b_hi;
#pragma unroll
    for (uint32_t j = 0; j < BLOCK_N / 8; ++j) {
        const bool hi = j * 8 >= split;
        const float top = hi ? top_hi : top_lo, bot = hi ? bot_hi : bot_lo;
        total[4 * j + 0] = fmaf(acc[4 * j + 0], top, total[4 * j + 0]);
        total[4 * j + 1] = fmaf(acc[4 * j + 1], top, total[4 * j + 1]);
        total[4 * j + 2] = fmaf(acc[4 * j + 2], bot, total[4 * j + 2]);
        total[4 * j + 3] = fmaf(acc[4 * j + 3], bot, total[4 * j + 3]);
    }
}

// NOTE: with a run-time split every block paid a compare + select per 8 columns and a multiply per
// pair (~80 extra instructions at BLOCK_N = 160, as many as the FMAs: 1050 vs 1290 TF without
// promotion). The split is 128 - n0 % 128, a multiple of g = gcd(BLOCK_N, 128), so it takes only
// 128 / g values: the tile picks a copy with the split folded in (warp-uniform branch, once per
// block). Above 8 copies the code would grow too much; those fall back to the run-time split.
template <uint32_t BLOCK_N, uint32_t kCase = 0>
__device__ __forceinline__ void promote(float* total, const float* acc, const BlockScales& sc, uint32_t n0) {
    constexpr uint32_t kGranule = constexpr_gcd(BLOCK_N, 128u);
    constexpr uint32_t kNumCases = 128 % BLOCK_N == 0 ? 1 : 128 / kGranule;
    if constexpr (kNumCases == 1) {
        promote_split<BLOCK_N>(total, acc, sc, BLOCK_N);
    } else if constexpr (kNumCases > 8) {
        promote_split<BLOCK_N>(total, acc, sc, 128 - n0 % 128);
    } else if constexpr (kCase + 1 == kNumCases) {
        promote_split<BLOCK_N>(total, acc, sc, 128 - kCase * kGranule);
    } else {
        if ((n0 % 128) / kGranule == kCase)
            promote_split<BLOCK_N>(total, acc, sc, 128 - kCase * kGranule);
        else
            promote<BLOCK_N, kCase + 1>(total, acc, sc, n0);
    }
}

#ifndef MOE_FP8_ACC_OVERLAP
#define MOE_FP8_ACC_OVERLAP 1  // -DMOE_FP8_ACC_OVERLAP=0: one accumulator set at BLOCK_M = 64 too (for measurements)
#endif

// K blocks per unrolled chunk of the overlapped mainloop (one math warpgroup, see there): the largest divisor
// of num_kb from most / 2 to most, or else most (the blocks past the last chunk run without overlap).
__host__ __device__ constexpr uint32_t overlap_chunk(uint32_t num_kb, uint32_t most) {
    for (uint32_t c = most; c >= most / 2; --c)
        if (num_kb % c == 0) return c;
    return num_kb < most ? num_kb : most;
}

// kActQuant: 0 = bf16 out[M, N]; 1 / 2 = the fused SiLU·mul + quantisation epilogue (FP32 / UE8M0
// scales, epilogue/act_quant.cuh): `w` holds [gate; up] halves of N rows each per group, tile j
// multiplies gate rows j*128.. and up rows N/2 + j*128.., and `out` gets FP8 act[M, N/2] with its
// scales in `out_scale` (column-major, `out_scale_stride` rows per 128-column block).
template <uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t kNumStages,
          uint32_t kSmemBytes, uint32_t kActQuant, uint32_t kABoxRows, class Scheduler>
__global__ void __launch_bounds__((BLOCK_M / 64 + 1) * 128, 1)
    fp8_gemm_kernel(const __grid_constant__ TmaDesc tmap_a,   // x_fp8 as [rows, K] fp8, box [kABoxRows, 128]
                    const __grid_constant__ TmaDesc tmap_b,   // w as [groups * N, K] fp8, box [BLOCK_N, 128]
                    const __grid_constant__ TmaDesc tmap_sa,  // x_scale as [groups * Kb, M] fp32, box [BLOCK_M, 1]
                    const float* __restrict__ w_scale,        // [groups, ceil(N/128), Kb]
                    uint16_t* __restrict__ out,               // bf16 [rows, N]
                    const int32_t* __restrict__ grouped_layout,  // m_indices / masked_m / unused
                    const int32_t* __restrict__ m_rows,        // contiguous: rows holding data (device), or null
                    uint32_t shape_m,                          // rows of A (per group when masked)
                    uint32_t num_groups,
                    float* __restrict__ out_scale,  // kActQuant only
                    uint32_t out_scale_stride,
                    uint32_t* __restrict__ k_split_flags,  // tail split: K pieces, not halves (or null) ...
                    float* __restrict__ k_split_slots,     // ... and their partials (epilogue/k_split.cuh)
                    uint32_t warm_k_blocks,  // the weights' first K blocks to prefetch into L2 first (gemm.py)
                    uint32_t async_stores) {  // every tile but a CTA's last leaves by bulk copies (gemm.py)
    constexpr uint32_t kNumMathWGs = BLOCK_M / 64;
    constexpr uint32_t kNumMathThreads = kNumMathWGs * 128;
    constexpr uint32_t kNumKBlocks = ceil_div(SHAPE_K, kBlockK);
    constexpr uint32_t kNumNScales = ceil_div(SHAPE_N, 128u);
    // BLOCK_N = 256 (192) runs as two 128 (96)-column waves over one smem stage: each wave is a
    // wgmma -> wait -> promote round on one accumulator set, so a 128x256 tile holds 128 running
    // totals + 64 accumulators per thread and loads 25% fewer bytes per FLOP than 128x128.
    constexpr uint32_t kWaveN = BLOCK_N == 256 ? 128 : BLOCK_N == 192 ? 96 : BLOCK_N;
    constexpr uint32_t kNumWaves = BLOCK_N / kWaveN;
    constexpr uint32_t kNumAccum = BLOCK_N / 2;      // running totals (the whole tile's D fragment)
    constexpr uint32_t kWaveAccum = kWaveN / 2;      // wgmma accumulators of one wave
    constexpr uint32_t kMulticast = Scheduler::kMulticast;  // CTAs per cluster sharing one operand
    constexpr bool kMulticastOnA = Scheduler::kMulticastOnA;
    constexpr uint32_t kSplitK = Scheduler::kSplitK;  // CTAs per cluster splitting one tile's K
    constexpr bool kCluster = kMulticast > 1 || kSplitK > 1;
    // two-wave tiles (192 / 256 wide) of single CTAs load B as two 96 / 128-row boxes, one per wave:
    // the gate and up blocks (kActQuant), or only the wave a split tail half runs (scheduler's TailSplit)
    constexpr bool kTwoBoxB = kNumWaves == 2 && !kCluster;
    constexpr uint32_t kBBoxRows = kTwoBoxB ? kWaveN : BLOCK_N;  // (no cluster where the warm-up runs)
    constexpr bool kTailSplit = Scheduler::kTailSplit;
    using Tail = typename Scheduler::Tail;
    constexpr bool kKPieces = Tail::kKPieces;  // the last wave may run as K pieces (masked layout)
    static_assert(kMulticast == 1 || kMulticast == 2, "clusters of one or two CTAs");
    static_assert(kMulticast == 1 || (kMulticastOnA ? BLOCK_M : BLOCK_N) % 16 == 0,
                  "each multicast half must stay 1024-byte aligned");
    // A arrives as boxes of kABoxRows (gemm.py: a_box_rows): a multicast half, or the boxes of a tile's rows that may
    // hold data (Tile::a_rows; the others keep stale rows, whose results are never stored)
    constexpr uint32_t kABoxes = kMulticastOnA ? 1 : BLOCK_M / kABoxRows;
    static_assert(kMulticastOnA ? kABoxRows * kMulticast == BLOCK_M : BLOCK_M % kABoxRows == 0 && kABoxRows % 8 == 0,
                  "A boxes: a multicast half, or whole 1024-byte swizzle atoms of the tile");
    // NOTE: ptxas allocates the math warpgroups' code within the setmaxnreg value (232; the SASS of
    // the two-warpgroup kernels uses up to R229), not the launch-bounds cap of 65536 / threads. A
    // second accumulator set (overlapping wgmma with promotion inside one warpgroup) costs
    // 3 x BLOCK_N/2 live floats: measured to spill at 128x128, so it is the one-math-warpgroup
    // (BLOCK_M = 64, small-M) path; with two math warpgroups one promotes while the other's wgmmas run.
    // The 80 left for addresses, scales and loop state is measured too: at 72, 64x104 spilled one.
    constexpr bool kOverlap =
        MOE_FP8_ACC_OVERLAP && kNumMathWGs == 1 && kNumWaves == 1 && 3 * kNumAccum + 80 <= 232;
    constexpr uint32_t kOverlapChunk = overlap_chunk(kNumKBlocks, 8);
    // The producer warpgroup's registers after setmaxnreg. With two math warpgroups at 232, 40 (48 would
    // fill the SM's 65536 exactly: measured to hang in setmaxnreg.inc); with one, 96 (its store warps
    // walk two schedulers, one a tile ahead, which spilled at 40 with the tail-split state).
    constexpr uint32_t kProducerRegs = kNumMathWGs == 2 ? 40 : 96;
    using Smem = GemmSmem<BLOCK_M, BLOCK_N, kNumStages, SHAPE_K>;
    static_assert(BLOCK_M == 64 || BLOCK_M == 128, "one or two math warpgroups");
    static_assert(BLOCK_N % 8 == 0 && BLOCK_N <= 256, "wgmma N is a multiple of 8, tiles up to 256");
    static_assert(BLOCK_N <= 128 + constexpr_gcd(BLOCK_N, 128u), "a tile may touch at most two B-scale blocks");
    static_assert(SHAPE_N % 8 == 0 && SHAPE_K % 16 == 0, "16-byte rows for TMA and stores");
    static_assert(kSmemBytes >= Smem::kTotal, "host shared-memory size disagrees with the kernel layout");
    static_assert(kSplitK == 1 || (kNumStages * (Smem::kABytes + Smem::kBBytes) >= BLOCK_M * BLOCK_N * sizeof(float) &&
                                   BLOCK_N % (8 * kSplitK) == 0),
                  "split-K: the drained stages hold the FP32 partial tile; each CTA stores whole 8-column chunks");
    static_assert(kActQuant == 0 || (BLOCK_N == 256 && SHAPE_N % 256 == 0 && !kCluster),
                  "SiLU·mul + quant: 256-wide tiles (a gate and an up block) on [gate; up] weights, no cluster");
    static_assert(!kTailSplit || (kTwoBoxB && (kActQuant == 0 || (kKPieces && !Tail::kHalves))),
                  "tail halves: plain two-wave tiles; under the fused epilogue, K pieces only");
    static_assert(!kKPieces || epi::piece_buffer_bytes<kNumAccum, kNumMathThreads, Tail::kMaxPieces>() <=
                                   kNumStages * (Smem::kABytes + Smem::kBBytes),
                  "K pieces reduce through the drained stage buffers");

    extern __shared__ __align__(1024) uint8_t smem[];
    uint8_t* smem_a = smem + Smem::kA;
    uint8_t* smem_b = smem + Smem::kB;
    float* smem_sa = reinterpret_cast<float*>(smem + Smem::kSA);
    float* smem_sb = reinterpret_cast<float*>(smem + Smem::kSB);  // [2 buffers][2 scale blocks][kSBPitch]
    uint8_t* smem_d = smem + Smem::kD;
    uint64_t* full_bar = reinterpret_cast<uint64_t*>(smem + Smem::kBar);
    uint64_t* empty_bar = full_bar + kNumStages;
    uint64_t* reduce_bar = empty_bar + kNumStages;  // split-K: every partial of the cluster is published

    const uint32_t warpgroup = threadIdx.x / 128;
    if (threadIdx.x == 0) {
        for (uint32_t s = 0; s < kNumStages; ++s) {
            ptx::mbar_init(&full_bar[s], 1);
            // with multicast a slot is refilled for both CTAs, so both CTAs' consumers release it
            ptx::mbar_init(&empty_bar[s], kNumMathThreads / 32 * kMulticast);
        }
        ptx::mbar_init(reduce_bar, kSplitK * kNumMathThreads);
        ptx::fence_barrier_init();
    }
    // the peer's barriers must be initialised before its multicasts or arrivals reach them
    if constexpr (kCluster) ptx::cluster_sync(); else __syncthreads();
    // A masked GEMM issues its first loads only once it has read the groups' counts. For those of one or two groups
    // (gemm.py decides) one thread a CTA first prefetches a share of the weights' first K blocks into L2
    // (not the previous kernel's outputs: before the wait), so the DRAM latency of the first loads overlaps the
    // counts' (and, under PDL, the previous kernel's end).
    if (warm_k_blocks > 0 && threadIdx.x == kNumMathThreads + 32) {
        constexpr uint32_t kBoxes = ceil_div(SHAPE_N, kBBoxRows);
        const uint32_t boxes = num_groups * kBoxes, blocks = min(warm_k_blocks, kNumKBlocks);
        for (uint32_t i = blockIdx.x; i < boxes * blocks; i += gridDim.x)
            ptx::tma_prefetch_l2_2d(&tmap_b, static_cast<int32_t>(i / boxes * kBlockK),
                                    static_cast<int32_t>(i % boxes / kBoxes * SHAPE_N + i % kBoxes * kBBoxRows));
    }
    // Launched as a programmatic dependent (gemm.py), the CTAs got here while the previous kernel still ran;
    // from here on they read its outputs (the scheduler reads the grouped layout). The next kernel may
    // become resident on the SMs this grid leaves idle (at decode most of them) and wait there.
    ptx::wait_prerequisites();
    ptx::launch_dependents();

    const bool k_split = k_split_flags != nullptr;
    Scheduler scheduler(shape_m, grouped_layout, num_groups, m_rows, k_split);
    sched::Tile tile;

    // NOTE: the epilogue is split: math warpgroups write the bf16 tile into shared memory and go on
    // to the next tile's mainloop; warps 1-3 of the producer warpgroup (idle otherwise) copy it out
    // with the bounded stores, so global-store time leaves the tensor cores' critical path.
    // Each math warpgroup hands its own 64 rows over (kBarStagingFull / Empty + warpgroup) and waits only
    // for its own scales, so neither waits for the other at a tile's start or end (the store warps take
    // both halves before storing the tile, which keeps their code, and registers, as for one handshake).
    constexpr uint32_t kNumStagingThreads = 128 + kNumStoreThreads;
    if (warpgroup == kNumMathWGs) {
        ptx::setmaxnreg_dec<kProducerRegs>();
        if (threadIdx.x % 128 >= 32) {
            // ---- store warps: copy each staged tile out (same tile sequence as the math warpgroups) ----
            const uint32_t store_idx = threadIdx.x % 128 - 32;
            // a second scheduler walks one tile ahead: the weight scales of tile t + 1 are staged
            // while the math warpgroups run tile t (buffer (t + 1) % 2, free since tile t - 1 ended)
            Scheduler ahead = scheduler;
            sched::Tile next_tile;
            uint32_t scale_buf = 0;
            // a handshake with every math warpgroup: barrier `bar` + warpgroup
            auto arrive_each = [&](uint32_t bar) {
#pragma unroll
                for (uint32_t g = 0; g < kNumMathWGs; ++g) ptx::named_barrier_arrive(bar + g, kNumStagingThreads);
            };
            auto stage_next_scales = [&]() -> bool {  // false: no next tile
                if (!ahead.next(next_tile, k_split)) return false;
                // the tile's two weight-scale blocks: its gate and up blocks (kActQuant), or its first
                // and next, both clamped to the last (a multicast partner tile past N, or the second
                // wave of N's last tile, reads it for columns that are never stored)
                const uint32_t j = next_tile.n_block;
                const uint32_t sb0 = kActQuant ? j : min(j * BLOCK_N / 128, kNumNScales - 1);
                const uint32_t sb1 = kActQuant ? kNumNScales / 2 + j : min(sb0 + 1, kNumNScales - 1);
                stage_w_scales<kNumKBlocks, kNumNScales, Smem::kSBPitch, kNumStoreThreads>(
                    smem_sb + scale_buf * 2 * Smem::kSBPitch, w_scale, next_tile.group, sb0, sb1, store_idx);
                arrive_each(kBarScalesFull + 2 * scale_buf);
                scale_buf ^= 1;
                return true;
            };
            stage_next_scales();
            arrive_each(kBarStagingEmpty);  // the staging tile starts empty
            while (scheduler.next(tile, k_split)) {
                tile.row_end = scheduler.stored_row_end(tile);  // (in place: a value more spills, as below)
                // NOTE: a CTA's last tile keeps the direct stores: bulk-copied, its rows' writes end the kernel
                // later (805 x 7168 x 2048 masked rows, three tiles a CTA: 4% slower with every tile bulk-copied).
                // Not held across tiles: one more live register spills the store warps' 40.
                const bool has_next = stage_next_scales();
#pragma unroll
                for (uint32_t g = 0; g < kNumMathWGs; ++g)
                    ptx::named_barrier_sync(kBarStagingFull + g, kNumStagingThreads);
                // a K piece stores the band of rows it summed (epilogue/k_split.cuh), any other tile all its rows
                uint32_t band0 = 0, band_end = BLOCK_M;
                if (Tail::is_piece(tile)) {
                    constexpr uint32_t kMathWarps = kNumMathThreads / 32;
                    band0 = epi::piece_band_row0<kMathWarps>(tile.piece, tile.num_pieces);
                    band_end = epi::piece_band_row0<kMathWarps>(tile.piece + 1, tile.num_pieces);
                }
                const uint32_t row0 = tile.row0 + band0, row_end = min(tile.row_end, tile.row0 + band_end);
                const bool bulk = async_stores && has_next;
                if constexpr (kActQuant) {  // 128 FP8 bytes a row: stored as a 64-column bf16 tile
                    epi::store_tile<BLOCK_M, 64, SHAPE_N / 4, kNumStoreThreads>(
                        smem_d + band0 * epi::StagingTile<64>::kPitchBytes, out, row0, row_end, tile.n_block * 64,
                        store_idx, 0, bulk);
                } else if (kTailSplit && tile.num_waves == 1) {  // a tail half (or a K piece of one): its columns
                    epi::store_tile<BLOCK_M, BLOCK_N, SHAPE_N, kNumStoreThreads, BLOCK_N / 16>(
                        smem_d + band0 * epi::StagingTile<BLOCK_N>::kPitchBytes, out, row0, row_end,
                        tile.n_block * BLOCK_N, store_idx, tile.wave0 * BLOCK_N / 16, bulk);
                } else {
                    // a split-K CTA stores the share of the tile it summed (epi::reduce_split_k)
                    constexpr uint32_t kChunks = BLOCK_N / 8 / kSplitK;
                    const uint32_t chunk0 = kSplitK > 1 ? ptx::cluster_cta_rank() * kChunks : 0;
                    epi::store_tile<BLOCK_M, BLOCK_N, SHAPE_N, kNumStoreThreads, kChunks>(
                        smem_d + band0 * epi::StagingTile<BLOCK_N>::kPitchBytes, out, row0, row_end,
                        tile.n_block * BLOCK_N, store_idx, chunk0, bulk);
                }
                arrive_each(kBarStagingEmpty);
            }
            if (async_stores) ptx::bulk_wait();  // the earlier tiles' bulk copies have written their rows
        } else if (threadIdx.x % 128 == 0) {
            // ---- producer: one thread issues every TMA load ----
            ptx::tma_prefetch_desc(&tmap_a);
            ptx::tma_prefetch_desc(&tmap_b);
            ptx::tma_prefetch_desc(&tmap_sa);
            // multicast: this CTA fetches its half (by cluster rank) of the shared operand for both
            const uint32_t rank = kMulticast > 1 ? ptx::cluster_cta_rank() : 0;
            uint32_t stage = 0, phase = 0;
            while (scheduler.next(tile, k_split)) {
                const int32_t a_row = static_cast<int32_t>(tile.row0);
                const int32_t b_row = static_cast<int32_t>(tile.group * SHAPE_N + tile.n_block * BLOCK_N);
                // constants unless K is split (split-K, or the K pieces of a tail-split kernel)
                const uint32_t kb0 = kSplitK > 1 || kKPieces ? tile.k_block0 : 0;
                const uint32_t num_kb = kSplitK > 1 || kKPieces ? tile.num_k_blocks : kNumKBlocks;
                const uint32_t a_boxes = kABoxes > 1 ? ceil_div(tile.a_rows, kABoxRows) : 1;
                // not unrolled: one thread issuing TMA gains nothing from it, and at 40 registers an
                // unrolled loop spills (ptxas unrolls it by the stage count)
#pragma unroll 1
                for (uint32_t kb_iter = 0; kb_iter < num_kb; ++kb_iter) {
                    const uint32_t kb = kb0 + (tile.k_reverse ? num_kb - 1 - kb_iter : kb_iter);
                    // wait for the consumers (of both CTAs, with multicast) to release the slot
                    ptx::mbar_wait(&empty_bar[stage], phase ^ 1);
                    ptx::mbar_arrive_expect_tx(&full_bar[stage],
                                               Smem::kTxBytes - (kABoxes - a_boxes) * kABoxRows * kBlockK -
                                                   (kTailSplit && tile.num_waves == 1 ? Smem::kBBytes / 2 : 0));
                    const int32_t k0 = static_cast<int32_t>(kb * kBlockK);
                    uint8_t* a_dst = smem_a + stage * Smem::kABytes;
                    uint8_t* b_dst = smem_b + stage * Smem::kBBytes;
                    if constexpr (kMulticast > 1 && kMulticastOnA) {
                        ptx::tma_load_2d_multicast(a_dst + rank * Smem::kABytes / 2, &tmap_a, &full_bar[stage], k0,
                                                   a_row + rank * BLOCK_M / 2, 0b11);
                    } else {
                        for (uint32_t j = 0; j < a_boxes; ++j)
                            ptx::tma_load_2d(a_dst + j * kABoxRows * kBlockK, &tmap_a, &full_bar[stage], k0,
                                             a_row + static_cast<int32_t>(j * kABoxRows));
                    }
                    if constexpr (kMulticast > 1 && !kMulticastOnA) {
                        ptx::tma_load_2d_multicast(b_dst + rank * Smem::kBBytes / 2, &tmap_b, &full_bar[stage], k0,
                                                   b_row + rank * BLOCK_N / 2, 0b11);
                    } else if constexpr (kTwoBoxB) {
                        // wave w's rows: the tile's columns w * kWaveN.., or gate / up block n_block
                        const int32_t row0 = kActQuant ? static_cast<int32_t>(tile.group * SHAPE_N + tile.n_block * 128)
                                                       : b_row;
                        const int32_t wave_rows = kActQuant ? static_cast<int32_t>(SHAPE_N / 2) : kWaveN;
#pragma unroll
                        for (uint32_t w = 0; w < 2; ++w) {
                            if (kTailSplit && !tile.runs_wave(w)) continue;
                            ptx::tma_load_2d(b_dst + w * Smem::kBBytes / 2, &tmap_b, &full_bar[stage], k0,
                                             row0 + static_cast<int32_t>(w) * wave_rows);
                        }
                    } else {
                        ptx::tma_load_2d(b_dst, &tmap_b, &full_bar[stage], k0, b_row);
                    }
                    ptx::tma_load_2d(smem_sa + stage * BLOCK_M, &tmap_sa, &full_bar[stage], tile.scale_m0,
                                     tile.scale_k0 + kb);
                    if (++stage == kNumStages) stage = 0, phase ^= 1;
                }
            }
        }
    } else {
    // ---- math warpgroups ----
    ptx::setmaxnreg_inc<232>();
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t frag_row = warpgroup * 64 + ((threadIdx.x / 32) % 4) * 16 + lane / 4;  // and +8
    float total[kNumAccum];
    uint32_t stage = 0, phase = 0;  // next slot to issue from (continues across tiles)
    uint32_t release_stage = 0;     // next slot to hand back (retired in issue order)
    uint32_t scale_buf = 0;         // the store warps' weight-scale buffer of this tile
    // stage 0's descriptors; a stage's are these plus its byte offset / 16 (keeps the loop short)
    const uint64_t desc_a0 = mma::make_desc_k_major_sw128(smem_a + warpgroup * 64 * kBlockK);
    const uint64_t desc_b0 = mma::make_desc_k_major_sw128(smem_b);

    while (scheduler.next(tile, k_split)) {
        const uint32_t n0 = tile.n_block * BLOCK_N;
#pragma unroll
        for (uint32_t i = 0; i < kNumAccum; ++i) total[i] = 0.0f;

        // The tile's weight scales, staged by the store warps: row 0 holds its first scale block,
        // row 1 the next (a straddling wave's upper columns or the second wave's).
        const float* tile_w_scale = smem_sb + scale_buf * 2 * Smem::kSBPitch;
        ptx::named_barrier_sync(kBarScalesFull + 2 * scale_buf + warpgroup, kNumStagingThreads);
        scale_buf ^= 1;
        // the tile's K blocks (a split's share with split-K; a K piece's has its own mainloop below);
        // the i-th issue's block, as the producer walks them
        const uint32_t kb0 = kSplitK > 1 ? tile.k_block0 : 0;
        const uint32_t num_kb = kSplitK > 1 ? tile.num_k_blocks : kNumKBlocks;
        auto k_block = [&](uint32_t i, uint32_t first, uint32_t count) {
            return first + (tile.k_reverse ? count - 1 - i : i);
        };

        // Wait for the next slot, holding K block kb, and read its scales; the slot stays ours until released.
        auto acquire = [&](uint32_t kb, BlockScales& sc) {
            sc.b_lo = ptx::ld_shared_f32(tile_w_scale + kb);
            sc.b_hi = ptx::ld_shared_f32(tile_w_scale + Smem::kSBPitch + kb);
            ptx::mbar_wait(&full_bar[stage], phase);
            sc.a_top = ptx::ld_shared_f32(smem_sa + stage * BLOCK_M + frag_row);
            sc.a_bot = ptx::ld_shared_f32(smem_sa + stage * BLOCK_M + frag_row + 8);
        };
        // Issue wave w's four K=32 wgmmas on the acquired slot into `acc`.
        auto mma_wave = [&](uint32_t w, float* acc) {
            const uint64_t desc_a = mma::advance_desc(desc_a0, stage * Smem::kABytes);
            const uint64_t desc_b = mma::advance_desc(desc_b0, stage * Smem::kBBytes + w * kWaveN * kBlockK);
#pragma unroll
            for (uint32_t i = 0; i < kWaveAccum; ++i) mma::fence_operand(acc[i]);
            mma::wgmma_fence();
#pragma unroll
            for (uint32_t k = 0; k < kBlockK / kWgmmaK; ++k)
                WgmmaFp8<kWaveN>::mma(mma::advance_desc(desc_a, k * kWgmmaK), mma::advance_desc(desc_b, k * kWgmmaK),
                                      acc, k > 0);
            mma::wgmma_commit();
        };
        auto next_stage = [&]() {
            if (++stage == kNumStages) stage = 0, phase ^= 1;
        };
        // The oldest acquired slot's wgmmas are complete: hand it back (in acquire order).
        auto release = [&]() {
            __syncwarp();
            if (lane == 0) {
                if constexpr (kMulticast > 1) {
                    ptx::mbar_arrive_cluster(&empty_bar[release_stage], 0);
                    ptx::mbar_arrive_cluster(&empty_bar[release_stage], 1);
                } else {
                    ptx::mbar_arrive(&empty_bar[release_stage]);
                }
            }
            if (++release_stage == kNumStages) release_stage = 0;
        };
        // total[wave w's columns] += acc · x_scale · w_scale. Waves of 128 lie in one scale block each
        // (the second wave in the next). A 192-wide tile starts on a multiple of 64: its two 96-column
        // waves split at 96|- and 32|64 columns (tile on a block boundary) or 64|32 and -|96 (off it),
        // each a compile-time split of promote_split.
        auto promote_wave = [&](uint32_t w, const float* acc, const BlockScales& sc) {
            if constexpr (kNumWaves == 1 && kOverlap) {
                // the split at run time: the compile-time copies of promote() take so many registers in
                // the overlapped chunks that ptxas serialises their wgmmas (ptxas C7511)
                promote_split<BLOCK_N>(total, acc, sc, 128 % BLOCK_N == 0 ? BLOCK_N : 128 - n0 % 128);
            } else if constexpr (kNumWaves == 1) {
                promote<BLOCK_N>(total, acc, sc, n0);
            } else if constexpr (kWaveN == 128) {
                const float b = w == 0 ? sc.b_lo : sc.b_hi;
                promote_split<128>(total + w * kWaveAccum, acc, BlockScales{sc.a_top, sc.a_bot, b, b}, 128);
            } else {
                static_assert(BLOCK_N == 192, "two-wave tiles are 192 or 256 wide");
                const bool on_boundary = n0 % 128 == 0;
                if (w == 0) {
                    if (on_boundary) promote_split<96>(total, acc, sc, 96);
                    else promote_split<96>(total, acc, sc, 64);
                } else {
                    if (on_boundary) promote_split<96>(total + kWaveAccum, acc, sc, 32);
                    else promote_split<96>(total + kWaveAccum, acc, sc, 0);
                }
            }
        };
        if constexpr (kOverlap) {
            // Two accumulator sets: block kb+1's wgmmas run on the tensor cores while block kb is
            // promoted on the CUDA cores (wait_group 1 = everything but the newest group is done).
            float acc0[kWaveAccum], acc1[kWaveAccum];
            BlockScales sc0, sc1;
            auto issue = [&](uint32_t i, float* acc, BlockScales& sc) {
                acquire(k_block(i, kb0, num_kb), sc);
                mma_wave(0, acc);
                next_stage();
            };
            auto retire = [&](float* acc, const BlockScales& sc) {
#pragma unroll
                for (uint32_t i = 0; i < kWaveAccum; ++i) mma::fence_operand(acc[i]);
                release();
                promote_wave(0, acc, sc);
            };
            // NOTE: ptxas serialises every wgmma (a wait after each one: ptxas C7514 / C7515) when a
            // group is still in flight across a loop's back edge, as in a plain loop over K blocks: the
            // accumulator reads of the promotion after `wait_group 1` are then not provably safe. So the
            // pipeline runs in fully unrolled chunks of kOverlapChunk blocks and drains at each chunk's end
            // (one promotion in kOverlapChunk left exposed); blocks past the last whole chunk run without
            // overlap. Unrolling the whole K loop instead is too much code at long K (11k instructions
            // and a 40 s compile at K = 16384).
            auto chunk = [&](uint32_t first) {
                issue(first, acc0, sc0);
#pragma unroll
                for (uint32_t i = 1; i < kOverlapChunk; ++i) {
                    if (i % 2) {
                        issue(first + i, acc1, sc1);
                        mma::wgmma_wait<1>();
                        retire(acc0, sc0);
                    } else {
                        issue(first + i, acc0, sc0);
                        mma::wgmma_wait<1>();
                        retire(acc1, sc1);
                    }
                }
                mma::wgmma_wait<0>();
                if (kOverlapChunk % 2) retire(acc0, sc0); else retire(acc1, sc1);
            };
            uint32_t kb = 0;
            for (; kb + kOverlapChunk <= num_kb; kb += kOverlapChunk) chunk(kb);
            for (; kb < num_kb; ++kb) {
                issue(kb, acc0, sc0);
                mma::wgmma_wait<0>();
                retire(acc0, sc0);
            }
        } else {
            float acc[kWaveAccum];
            BlockScales sc;
            // waves [kFirst, kFirst + kRun) of K blocks [k0, k0 + nk); the last wave releases the slot. The
            // waves are compile-time: a run-time wave would index `total` dynamically (local memory).
            auto mainloop = [&](auto first, auto run, uint32_t k0, uint32_t nk) {
                constexpr uint32_t kFirst = decltype(first)::value, kRun = decltype(run)::value;
                for (uint32_t i = 0; i < nk; ++i) {
                    acquire(k_block(i, k0, nk), sc);
#pragma unroll
                    for (uint32_t r = 0; r < kRun; ++r) {
                        const uint32_t w = kFirst + r;
                        mma_wave(w, acc);
                        mma::wgmma_wait<0>();
#pragma unroll
                        for (uint32_t j = 0; j < kWaveAccum; ++j) mma::fence_operand(acc[j]);
                        if (r + 1 == kRun) release();
                        promote_wave(w, acc, sc);
                    }
                    next_stage();
                }
            };
            // NOTE: each split tail half, and a K piece, gets its own copy of the loop. Testing the wave inside
            // one shared loop cost whole tiles 6-10% at 4096x7168 (session 8 sweep), even on grids that never
            // split; a run-time K range in the whole tiles' loop cost 4-13% at long K (session 11 record).
            if (kTailSplit && Tail::kHalves && tile.num_waves == 1) {  // a half, or a K piece of one
                const uint32_t k0 = kKPieces ? tile.k_block0 : kb0, nk = kKPieces ? tile.num_k_blocks : num_kb;
                if (tile.wave0 == 0) mainloop(Count<0>{}, Count<1>{}, k0, nk);
                else mainloop(Count<1>{}, Count<1>{}, k0, nk);
            } else if (kKPieces && tile.num_k_blocks != kNumKBlocks) {
                mainloop(Count<0>{}, Count<kNumWaves>{}, tile.k_block0, tile.num_k_blocks);
            } else {
                mainloop(Count<0>{}, Count<kNumWaves>{}, kb0, num_kb);
            }
        }

        // K pieces of a split tail (epilogue/k_split.cuh): the pieces' CTAs sum and store a band of rows each,
        // using the drained stage buffers. Pieces of halves reduce their wave's totals (moved to the front:
        // the wave is known at run time only, and an indexed `total` would live in local memory).
        bool stores = true;  // this warp's rows are stored by this CTA
        if (Tail::is_piece(tile)) {
            const uint32_t num_rows = min(BLOCK_M, tile.row_end - tile.row0);  // (a tile has rows)
            if (Tail::kHalves && tile.num_waves == 1) {  // a piece of a half: its wave's totals, at the front
                const bool moved = tile.wave0 == 1;
#pragma unroll
                for (uint32_t i = 0; i < kWaveAccum; ++i)
                    if (moved) total[i] = total[kWaveAccum + i];
                stores = epi::reduce_scatter_pieces<kWaveAccum, kNumMathThreads, Tail::kMaxPieces>(
                    k_split_flags, k_split_slots, total, tile.piece, tile.num_pieces, num_rows, smem_a, kBarPartial);
#pragma unroll
                for (uint32_t i = 0; i < kWaveAccum; ++i)
                    if (moved) total[kWaveAccum + i] = total[i];
            } else {
                stores = epi::reduce_scatter_pieces<kNumAccum, kNumMathThreads, Tail::kMaxPieces>(
                    k_split_flags, k_split_slots, total, tile.piece, tile.num_pieces, num_rows, smem_a, kBarPartial);
            }
        }
        // ---- epilogue: stage bf16 in smem once the store warps have copied the previous tile out ----
        ptx::named_barrier_sync(kBarStagingEmpty + warpgroup, kNumStagingThreads);
        if (!stores) {  // another piece's rows; the handshake keeps the store warps in step
        } else if constexpr (kSplitK > 1) {
            // one tile per CTA: its stage buffers are drained and hold the partial sums
            epi::reduce_split_k<BLOCK_N, kNumMathThreads, kSplitK>(reinterpret_cast<float*>(smem), reduce_bar, total,
                                                                  smem_d, warpgroup * 64);
        } else if constexpr (kActQuant) {
            // scales of the tile's rows: group g's block j column of the [(G *) N/256, stride] layout
            const uint32_t scale_group = Scheduler::kGroupedScales ? tile.group : 0;
            float* row_scale = out_scale + static_cast<uint64_t>(scale_group * (SHAPE_N / 256) + tile.n_block) *
                                               out_scale_stride + tile.scale_m0;
            // a row's scale only where the store warps store its codes: never from the stale rows of A boxes left
            // unloaded (GemmConfig.a_box_rows), and the same bits every run
            const uint32_t row_end = scheduler.stored_row_end(tile);
            const uint32_t num_rows = row_end > tile.row0 ? min(BLOCK_M, row_end - tile.row0) : 0;
            epi::silu_mul_quant_to_smem<kActQuant == 2>(smem_d, total, warpgroup * 64, row_scale, num_rows);
        } else {
            epi::write_fragment_to_smem<BLOCK_N>(smem_d, total, warpgroup * 64);
        }
        // the store warps' bulk copies read the tile through the async proxy: order these writes before them
        if (async_stores) ptx::fence_proxy_async_shared();
        ptx::named_barrier_arrive(kBarStagingFull + warpgroup, kNumStagingThreads);
    }
    }
    // no CTA may exit while its peer can still multicast into it, arrive on its barriers or (split-K)
    // read its partial sums
    if constexpr (kCluster) ptx::cluster_sync();
}

}  // namespace moe_fp8
