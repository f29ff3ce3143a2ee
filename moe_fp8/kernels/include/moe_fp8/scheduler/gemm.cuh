// Persistent tile schedulers. Each CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ...; a
// scheduler turns that linear index into a tile and says where its rows live. One scheduler per
// layout (normal, M-grouped contiguous, M-grouped masked) so each stays small.
#pragma once

#include "../common/types.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::sched {

struct Tile {
    uint32_t m_block;   // block index inside the group's rows
    uint32_t n_block;
    uint32_t group;     // expert id (0 for the normal GEMM)
    uint32_t row0;      // first row of the tile in the flattened [rows, K] / [rows, N] views
    uint32_t row_end;   // rows >= row_end are neither valid inputs nor written
    uint32_t a_rows;    // the tile's rows that may hold data, from row0 (a multiple of kRowProbe in the contiguous
                        //   layout: see ContiguousScheduler); the producer loads the A boxes they touch
    uint32_t scale_m0;  // x_scale box origin: column (token) and first row (k-block) of the
    uint32_t scale_k0;  //   [groups * Kb, M] view the tile reads
    bool k_reverse;     // walk K from the last block down (see kSerpentineK)
    uint32_t k_block0;  // the tile's K range in 128-blocks: all of K, or one split's / piece's share
    uint32_t num_k_blocks;
    uint32_t wave0;      // two-wave tiles with TailSplit: the 96 / 128-column waves to run,
    uint32_t num_waves;  //   [wave0, wave0 + num_waves) (both, or one half of a split tail tile)
    uint32_t piece;       // K pieces: this piece's index and the tile's piece count (see TailSplit); the
    uint32_t num_pieces;  //   pieces run on CTAs blockIdx.x - piece .. + num_pieces - 1

    __device__ __forceinline__ bool runs_wave(uint32_t w) const { return w >= wave0 && w < wave0 + num_waves; }
};

// NOTE: a persistent grid whose last wave holds few tiles idles most SMs for a whole tile (a masked
// 1206-row group at 4096x7168: 160 tiles of 128x256 on 132 SMs, the last 28 alone for a whole tile; a
// decode step touching one local expert: 16 tiles of 64x256, one wave on 16 SMs).
// Two ways out, for two-wave (192 / 256-wide) tiles; units 0 .. full-1 are whole tiles either way:
// - halves: when the last wave holds at most half as many tiles as there are CTAs, its tiles are handed
//   out as halves, one 96 / 128-column wave each, to twice as many CTAs: unit full + h is the half h % 2
//   of tile full + h / 2. Bit-identical to whole tiles.
// - K pieces (the kernel got a K-split workspace, and K holds two pieces of kMinPieceBlocks): each of the
//   last wave's halves is split into parts = min(kMaxPieces, K blocks / kMinPieceBlocks, CTAs / halves) equal
//   K ranges on consecutive CTAs where that is 2 or more (unit full + j is piece j % parts of half
//   (j / parts) % 2 of tile full + j / parts / 2); else each tile, into parts = min(..., CTAs / tiles) pieces
//   where that is kMinParts or more (unit full + j is piece j % parts of tile full + j / parts); else halves.
//   The pieces reduce-scatter their FP32 partials: each sums one band of the rows, in piece order
//   (deterministic), and stores it (epilogue/k_split.cuh). The pieces of different tiles run the same K
//   range at the same time, so CTAs on one n-block still share B in L2.
//   NOTE: pieces of halves first: on as many CTAs or more they run the same math with half the partial
//   traffic per piece (session 27, 1206 x 4096 x 7168, 28 tail tiles: as 4 whole-width pieces, ~10 us to
//   publish, copy and add 10.7 MB through L2 after ~12 us of math; as 2 pieces of each half, ~4.5 us after
//   ~14 us: kernel 69.8 -> 66.6 us).
// The split is recomputed from the tile count at every tile rather than held: the math warpgroups of
// 256-wide tiles and the store warps (two schedulers in 40 registers) have no registers to spare.
// kKPieces: K pieces compiled in (the masked scheduler only: in the normal and contiguous kernels, which
// never get a workspace, the code alone cost 128x256 tiles 4-8% at long K, session 11 A/B).
// kHalves: halves allowed (not under the fused SiLU·mul + quant epilogue, which needs a tile's gate and up
// waves together: there the last wave runs as K pieces of whole tiles or not split at all).
// kMinParts: fewer K pieces per tile than this run as halves, or whole. Without halves (the fused epilogue) 4:
// at decode two pieces per tile ran 2% slower than whole tiles (48-64 tiles of 64x256 on 132 SMs), four
// 10-26% faster (16-32 tiles).
template <bool kEnabled, uint32_t kNumKBlocks, bool kKPieces_ = false, bool kHalves_ = true, uint32_t kMinParts = 2>
struct TailSplit {
    static constexpr bool kHalves = kHalves_;
    // (heuristics.py: K_SPLIT_MAX_PIECES, K_SPLIT_MIN_PIECE_BLOCKS)
    // more pieces would add partial-tile traffic for little (at decode, 8 pieces of 7 blocks ran 14% slower than 4)
    static constexpr uint32_t kMaxPieces = 4;
    static constexpr uint32_t kMinPieceBlocks = 12;  // shorter pieces lost to halves (K = 2048: 8 blocks)
    // only where K holds two pieces: with fewer blocks the code could never run
    static constexpr bool kKPieces = kEnabled && kKPieces_ && kNumKBlocks >= 2 * kMinPieceBlocks;

    // unit (= blockIdx.x + iter * gridDim.x) of `num_tiles` -> tile index, waves and K range; false past
    // this CTA's last unit.
    __device__ __forceinline__ static bool map(uint32_t num_tiles, bool k_split, uint32_t unit, uint32_t& tile_idx,
                                               Tile& t) {
        t.wave0 = 0, t.num_waves = 2, t.k_block0 = 0, t.num_k_blocks = kNumKBlocks;
        const uint32_t num_ctas = gridDim.x, last = num_tiles % num_ctas;
        const uint32_t most = kKPieces && k_split ? min(kMaxPieces, kNumKBlocks / kMinPieceBlocks) : 0;
        // K pieces of halves where two or more per half fit, else of whole tiles where kMinParts fit
        const uint32_t half_parts = kHalves ? min(most, num_ctas / max(2 * last, 1u)) : 0;
        const bool of_halves = half_parts >= 2;
        const uint32_t k_parts = of_halves ? half_parts : min(most, num_ctas / max(last, 1u));
        const bool pieces = of_halves || k_parts >= kMinParts;  // else halves, where they apply
        const bool halves = kHalves && (of_halves || !pieces);
        const uint32_t parts = pieces ? k_parts : 1;  // per half (tile)
        const uint32_t splits = halves ? 2 : 1;       // halves (or the tile) per tile
        const bool split = kEnabled && last > 0 && (pieces || (kHalves && 2 * last <= num_ctas));
        const uint32_t full = split ? num_tiles - last : num_tiles;
        if (unit < full) {
            tile_idx = unit;
            return true;
        }
        if (!split || unit - full >= splits * parts * last) return false;
        const uint32_t j = unit - full;
        tile_idx = full + j / (splits * parts);
        if (halves) t.wave0 = j / parts % 2, t.num_waves = 1;
        if (pieces) {
            const uint32_t piece = j % parts;
            t.k_block0 = piece * kNumKBlocks / parts;
            t.num_k_blocks = (piece + 1) * kNumKBlocks / parts - t.k_block0;
            t.piece = piece, t.num_pieces = parts;
        }
        return true;
    }
    // one K piece of a half or tile (the others run on the neighbouring CTAs)
    __device__ __forceinline__ static bool is_piece(const Tile& t) {
        return kKPieces && t.num_k_blocks < kNumKBlocks;
    }
};

// NOTE: consecutive waves of a persistent GEMM share operands (the same band of A rows, say), but a
// wave streams its whole K range through L2, so by the time the next wave starts at k = 0 that data
// is gone (L2 hit rate 73% at 4096x7168x16384). Alternating the K direction per wave makes each wave
// begin on the K slice the previous one just used.
#ifndef MOE_FP8_SERPENTINE_K
#define MOE_FP8_SERPENTINE_K 1  // -DMOE_FP8_SERPENTINE_K=0 restores plain order (for measurements)
#endif
constexpr bool kSerpentineK = MOE_FP8_SERPENTINE_K;

// Linear tile index -> (m_block, n_block) in groups of kGroupM m-blocks walked M-fastest, so the
// CTAs in flight at once share a few B (weight) columns and a band of A rows in L2.
template <uint32_t kGroupM>
__device__ __forceinline__ void swizzle_tile(uint32_t idx, uint32_t num_m_blocks, uint32_t num_n_blocks,
                                             uint32_t& m_block, uint32_t& n_block) {
    const uint32_t per_group = kGroupM * num_n_blocks;
    const uint32_t first_m = (idx / per_group) * kGroupM;
    const uint32_t group_m = min(kGroupM, num_m_blocks - first_m);
    const uint32_t in_group = idx % per_group;
    m_block = first_m + in_group % group_m;
    n_block = in_group / group_m;
}

// Normal GEMM: rows [0, shape_m). With kMulticast == 2 the two CTAs of a cluster take the two
// halves of one "cluster tile": m-blocks 2p, 2p+1 of one n-block (they share B) or, on A, n-blocks
// 2q, 2q+1 of one m-block. A half past the matrix still runs (its peer needs its half of the shared
// operand) but stores nothing. With kSplitK > 1 the kSplitK CTAs of a cluster share one tile, each
// over its own share of K, and the grid has one cluster per tile (no persistent loop: the partial
// sums are reduced once, through DSMEM, see epilogue/split_k.cuh).
template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t kGroupM,
          bool kTailSplit_ = false, uint32_t kMulticast_ = 1, bool kMulticastOnA_ = false, uint32_t kSplitK_ = 1>
struct NormalScheduler {
    static constexpr bool kTailSplit = kTailSplit_;
    static constexpr uint32_t kMulticast = kMulticast_;
    static constexpr bool kMulticastOnA = kMulticastOnA_;
    static constexpr uint32_t kSplitK = kSplitK_;
    static_assert(kSplitK == 1 || kMulticast == 1, "a cluster either splits K or shares an operand");
    static_assert(!kTailSplit || ((BLOCK_N == 256 || BLOCK_N == 192) && kMulticast == 1 && kSplitK == 1),
                  "tail halves: two-wave (192 / 256-wide) tiles of single CTAs");
    static constexpr bool kGroupedScales = false;  // an output scale layout per group (masked)
    static constexpr uint32_t kNumNBlocks = ceil_div(SHAPE_N, BLOCK_N);
    static constexpr uint32_t kNumKBlocks = ceil_div(SHAPE_K, 128u);
    static_assert(kNumKBlocks >= kSplitK, "every split needs at least one K block");
    using Tail = TailSplit<kTailSplit, kNumKBlocks>;
    uint32_t shape_m, num_m_blocks, num_units_m, num_units_n, num_units;
    int32_t iter = -1;

    __device__ __forceinline__ NormalScheduler(uint32_t shape_m_, const int32_t* /*layout*/, uint32_t /*groups*/,
                                               const int32_t* /*m_rows*/, bool /*k_split*/)
        : shape_m(shape_m_), num_m_blocks(ceil_div(shape_m_, BLOCK_M)) {
        num_units_m = kMulticastOnA ? num_m_blocks : ceil_div(num_m_blocks, kMulticast);
        num_units_n = kMulticastOnA ? ceil_div(kNumNBlocks, kMulticast) : kNumNBlocks;
        num_units = num_units_m * num_units_n;
    }

    // k_split: the kernel has a K-split workspace (the last wave runs as K pieces, not halves)
    __device__ __forceinline__ bool next(Tile& t, bool k_split) {
        if constexpr (kSplitK > 1) {
            if (++iter > 0 || blockIdx.x / kSplitK >= num_units) return false;
            swizzle_tile<kGroupM>(blockIdx.x / kSplitK, num_units_m, num_units_n, t.m_block, t.n_block);
            const uint32_t split = blockIdx.x % kSplitK;
            t.group = 0;
            t.row0 = t.m_block * BLOCK_M;
            t.row_end = shape_m;
            t.a_rows = BLOCK_M;
            t.scale_m0 = t.row0;
            t.scale_k0 = 0;
            t.k_reverse = false;
            t.k_block0 = split * kNumKBlocks / kSplitK;
            t.num_k_blocks = (split + 1) * kNumKBlocks / kSplitK - t.k_block0;
            return true;
        }
        uint32_t unit = blockIdx.x / kMulticast + static_cast<uint32_t>(++iter) * (gridDim.x / kMulticast);
        if (!Tail::map(num_units, k_split, unit, unit, t)) return false;
        uint32_t um, un;
        swizzle_tile<kGroupM>(unit, num_units_m, num_units_n, um, un);
        const uint32_t rank = blockIdx.x % kMulticast;
        t.m_block = kMulticastOnA ? um : um * kMulticast + rank;
        t.n_block = kMulticastOnA ? un * kMulticast + rank : un;
        t.group = 0;
        t.row0 = t.m_block * BLOCK_M;
        t.row_end = t.n_block < kNumNBlocks ? shape_m : 0;  // no rows to store past N
        t.a_rows = BLOCK_M;  // (rows past M: zero-filled by the TMA unit)
        t.scale_m0 = t.row0;
        t.scale_k0 = 0;
        t.k_reverse = kSerpentineK && (iter & 1);
        return true;
    }

    // the end of the rows the store warps write (see ContiguousScheduler)
    __device__ __forceinline__ uint32_t stored_row_end(const Tile& t) const { return t.row_end; }
};

// M-grouped contiguous: rows [0, shape_m) hold each group's segment, padded to a multiple of 128
// (>= BLOCK_M, so no tile spans two groups). m_indices[row] is the group, -1 on padding rows, which
// come at the end of a segment: a tile whose first row is padding is all padding and is skipped
// (no loads, no math, no stores). m_rows (optional, on the device): the rows from *m_rows on are all
// padding. A sync-free dispatch sizes its layout by an upper bound (several times M_total under expert
// parallelism); reading the real count at the start keeps those rows out of the tile count, so no CTA
// walks them and the tail split sees the real last wave. (The kernel is not launched as a programmatic
// dependent, so the producer of *m_rows has finished.)
template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t kGroupM,
          bool kTailSplit_ = false>
struct ContiguousScheduler {
    static constexpr bool kTailSplit = kTailSplit_;
    static constexpr uint32_t kMulticast = 1;
    static constexpr bool kMulticastOnA = false;
    static constexpr uint32_t kSplitK = 1;
    static constexpr bool kGroupedScales = false;
    static constexpr uint32_t kNumNBlocks = ceil_div(SHAPE_N, BLOCK_N);
    static constexpr uint32_t kNumKBlocks = ceil_div(SHAPE_K, 128u);
    static_assert(128 % BLOCK_M == 0, "tiles must not straddle 128-aligned group segments");
    // A tile's rows that may hold data, in steps of kRowProbe (Tile::a_rows): a segment's padding rows come last and
    // their results are never stored, so with A boxes smaller than the tile (GemmConfig.a_box_rows) the producer loads
    // only those before them (at 16 rows an expert, 32 of a tile's 128) and the math runs the rest on stale rows.
    static constexpr uint32_t kRowProbe = 32;
    static_assert(!kTailSplit || BLOCK_N == 256 || BLOCK_N == 192, "tail halves: two-wave (192 / 256-wide) tiles");
    const int32_t* m_indices;
    uint32_t shape_m, num_m_blocks;
    using Tail = TailSplit<kTailSplit, kNumKBlocks>;  // over every tile below m_rows (padding ones are few)
    int32_t iter = -1;

    __device__ __forceinline__ ContiguousScheduler(uint32_t shape_m_, const int32_t* m_indices_, uint32_t /*groups*/,
                                                   const int32_t* m_rows, bool /*k_split*/)
        : m_indices(m_indices_),
          shape_m(m_rows == nullptr ? shape_m_ : min(shape_m_, static_cast<uint32_t>(max(ptx::ldg_s32(m_rows), 0)))),
          num_m_blocks(ceil_div(shape_m, BLOCK_M)) {}

    __device__ __forceinline__ bool next(Tile& t, bool k_split) {
        while (true) {
            uint32_t idx = blockIdx.x + static_cast<uint32_t>(++iter) * gridDim.x;
            if (!Tail::map(num_m_blocks * kNumNBlocks, k_split, idx, idx, t)) return false;
            swizzle_tile<kGroupM>(idx, num_m_blocks, kNumNBlocks, t.m_block, t.n_block);
            t.row0 = t.m_block * BLOCK_M;
            const int32_t group = ptx::ldg_s32(m_indices + t.row0);
            // a_rows: to the end of the last kRowProbe rows whose first row is real. Plain loads, issued with the
            // group's, and dropped where a_rows is never read (other roles; whole-tile A boxes). In bounds: M_total is
            // a multiple of 128. NOTE: still not free (heuristics.py: PARTIAL_A_MIN_K).
            t.a_rows = kRowProbe;
#pragma unroll
            for (uint32_t r = kRowProbe; r < BLOCK_M; r += kRowProbe)
                t.a_rows += m_indices[t.row0 + r] >= 0 && t.row0 + r < shape_m ? kRowProbe : 0;
            if (group < 0) continue;
            t.group = static_cast<uint32_t>(group);
            t.row_end = shape_m;
            t.scale_m0 = t.row0;
            t.scale_k0 = 0;
            t.k_reverse = kSerpentineK && (iter & 1);
            return true;
        }
    }

    // The end of the rows the store warps write: past the tile's real rows, to a multiple of BLOCK_M / 32. A
    // segment's padding rows (output unspecified) come at its end, as the tile skip above assumes, so a short
    // group's tile is mostly padding: storing it all cost the down projection of a 512-token prefill ~50 MB of
    // writes at 32 experts (session 35). Called by whole warps: lane l reads the first row of the l-th
    // BLOCK_M / 32 rows (in bounds: M_total is a multiple of 128).
    __device__ __forceinline__ uint32_t stored_row_end(const Tile& t) const {
        constexpr uint32_t kPerLane = BLOCK_M / 32;
        const uint32_t first = threadIdx.x % 32 * kPerLane;
        const uint32_t end = ptx::ldg_s32(m_indices + t.row0 + first) >= 0 ? first + kPerLane : 0;
        return min(t.row_end, t.row0 + __reduce_max_sync(kFullMask, end));
    }
};

// M-grouped masked: group g owns rows [g * max_m, g * max_m + masked_m[g]) of a [G, max_m] buffer;
// masked_m lives on the device (no host sync, CUDA-graph safe). Tiles are numbered group by group,
// each group contributing ceil(masked_m[g] / BLOCK_M) m-blocks; rows past masked_m[g] are never
// written. kTailHalves: see TailSplit::kHalves.
template <uint32_t BLOCK_M, uint32_t BLOCK_N, uint32_t SHAPE_N, uint32_t SHAPE_K, uint32_t kGroupM,
          bool kTailSplit_ = false, bool kTailHalves = true>
struct MaskedScheduler {
    static constexpr bool kTailSplit = kTailSplit_;
    static constexpr uint32_t kMulticast = 1;
    static constexpr bool kMulticastOnA = false;
    static constexpr uint32_t kSplitK = 1;
    static constexpr bool kGroupedScales = true;
    static constexpr uint32_t kNumNBlocks = ceil_div(SHAPE_N, BLOCK_N);
    static constexpr uint32_t kNumKBlocks = ceil_div(SHAPE_K, 128u);
    static_assert(!kTailSplit || BLOCK_N == 256 || BLOCK_N == 192, "tail halves: two-wave (192 / 256-wide) tiles");
    const int32_t* masked_m;
    uint32_t max_m, num_groups;
    // the current group's tiles are [group_first_tile, group_end_tile); its row count is re-read when
    // needed rather than held (the store warps run two schedulers in 40 registers)
    uint32_t group = 0, group_first_tile = 0, group_end_tile = 0;
    using Tail = TailSplit<kTailSplit, kNumKBlocks, /*kKPieces=*/true, kTailHalves, kTailHalves ? 2 : 4>;
    // The tile count: the tail split needs it, and past it a CTA is done without walking the remaining groups
    // (at decode most of them are empty; with the 4-group walk below, a 64x128 decode GEMM at 7168x2048 with
    // one touched expert of 32 went from 16.9 to 14.6 us). 128-row tiles count up to 8 groups (the large-row shapes whose tail matters): their store warps run two
    // schedulers in 40 registers, where counting any number spilled one (ptxas, session 21). 64-row tiles
    // (96 registers there; the decode tiles) count any number.
    static constexpr uint32_t kMaxCountedGroups = BLOCK_M == 64 ? 0xffffffffu : 8;
    static constexpr uint32_t kUncounted = 0xffffffffu;  // (a unit index never reaches it)
    uint32_t num_tiles = kUncounted;
    int32_t iter = -1;

    // Every thread of the CTA constructs it (converged warps): each warp counts the tiles, a group per lane, and
    // where it counted them (and there are kSeekGroups or more) starts at the group of the CTA's first tile.
    // NOTE: walking there in next() took the decode GEMMs ~1.5 us at the start (31 empty groups of 32, 4 counts
    // a round: each round an L2 round trip, in the one producer thread as in every other warp); the seek took
    // them 1.1-1.3 us less (7168x2048, one or two of 32 experts touched: 13.4 -> 12.2 and 19.0 -> 17.7 us) but
    // a 1-group GEMM ~0.9 us more (session 27, same process).
    static constexpr uint32_t kSeekGroups = 4;
    __device__ __forceinline__ MaskedScheduler(uint32_t max_m_, const int32_t* masked_m_, uint32_t num_groups_,
                                               const int32_t* /*m_rows*/, bool k_split)
        : masked_m(masked_m_), max_m(max_m_), num_groups(num_groups_) {
        if (num_groups <= kMaxCountedGroups) {
            const uint32_t lane = threadIdx.x % 32;
            uint32_t tiles = 0, lane_tiles = 0;  // (lane_tiles: of group `lane`, when there are at most 32)
            for (uint32_t g = lane; g < num_groups; g += 32) {
                lane_tiles = ceil_div(rows_of(g), BLOCK_M) * kNumNBlocks;
                tiles += lane_tiles;
            }
            num_tiles = __reduce_add_sync(kFullMask, tiles);
            Tile unused;
            uint32_t first = blockIdx.x;
            if (num_groups >= kSeekGroups && (!kTailSplit || Tail::map(num_tiles, k_split, blockIdx.x, first, unused)))
                seek(first, lane, lane_tiles);
        }
        load_group();
    }

    // To the group holding tile `first` (if any): 32 groups a round, by a prefix sum over the lanes.
    __device__ __forceinline__ void seek(uint32_t first, uint32_t lane, uint32_t lane_tiles) {
        uint32_t before = 0;  // tiles of the groups before this round's
        for (uint32_t g0 = 0; g0 < num_groups; g0 += 32) {
            uint32_t tiles = num_groups <= 32 ? lane_tiles
                                              : (g0 + lane < num_groups ? ceil_div(rows_of(g0 + lane), BLOCK_M) : 0) * kNumNBlocks;
            uint32_t end = tiles;
#pragma unroll
            for (uint32_t d = 1; d < 32; d <<= 1) {
                const uint32_t o = __shfl_up_sync(kFullMask, end, d);
                end += lane >= d ? o : 0;
            }
            end += before;
            const uint32_t past = __ballot_sync(kFullMask, g0 + lane < num_groups && end > first);
            if (past) {
                const uint32_t l = __ffs(past) - 1;
                group = g0 + l, group_first_tile = __shfl_sync(kFullMask, end - tiles, l);
                return;
            }
            before = __shfl_sync(kFullMask, end, 31);
        }
    }

    // clamp: an out-of-range count must not write past the group's rows
    __device__ __forceinline__ uint32_t rows_of(uint32_t g) const {
        return min(static_cast<uint32_t>(max(ptx::ldg_s32(masked_m + g), 0)), max_m);
    }
    __device__ __forceinline__ void load_group() {
        group_end_tile = group_first_tile + ceil_div(rows_of(group), BLOCK_M) * kNumNBlocks;
    }

    __device__ __forceinline__ bool next(Tile& t, bool k_split) {
        uint32_t idx = blockIdx.x + static_cast<uint32_t>(++iter) * gridDim.x;
        if (kTailSplit && num_tiles != kUncounted) {
            if (!Tail::map(num_tiles, k_split, idx, idx, t)) return false;
        } else {  // whole tiles only
            if (idx >= num_tiles) return false;
            t.wave0 = 0, t.num_waves = 2, t.k_block0 = 0, t.num_k_blocks = kNumKBlocks;
        }
        // to the tile's group, reading kWalk groups' counts at once (independent loads: one round trip); one
        // at a time with 128-row tiles (more spilled in their 40-register store warps)
        constexpr uint32_t kWalk = BLOCK_M == 64 ? 4 : 1;
        while (idx >= group_end_tile) {
            uint32_t rows[kWalk];
#pragma unroll
            for (uint32_t j = 0; j < kWalk; ++j) rows[j] = group + 1 + j < num_groups ? rows_of(group + 1 + j) : 0;
#pragma unroll
            for (uint32_t j = 0; j < kWalk; ++j) {
                if (idx < group_end_tile) break;
                if (++group >= num_groups) return false;
                group_first_tile = group_end_tile;
                group_end_tile += ceil_div(rows[j], BLOCK_M) * kNumNBlocks;
            }
        }
        const uint32_t group_rows = rows_of(group);
        swizzle_tile<kGroupM>(idx - group_first_tile, ceil_div(group_rows, BLOCK_M), kNumNBlocks, t.m_block,
                              t.n_block);
        t.group = group;
        t.row0 = group * max_m + t.m_block * BLOCK_M;
        t.row_end = group * max_m + group_rows;
        t.a_rows = min(group_rows - t.m_block * BLOCK_M, BLOCK_M);
        t.scale_m0 = t.m_block * BLOCK_M;
        t.scale_k0 = group * kNumKBlocks;
        t.k_reverse = kSerpentineK && (iter & 1);
        return true;
    }

    // the end of the rows the store warps write: row_end stops at masked_m already
    __device__ __forceinline__ uint32_t stored_row_end(const Tile& t) const { return t.row_end; }
};

}  // namespace moe_fp8::sched
