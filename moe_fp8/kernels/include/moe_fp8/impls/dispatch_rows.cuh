// FP8 rows of the chunked dispatches on sm_90 (contiguous; masked beyond the fused kernel's size): every
// token's row and scales copied to the rows the Triton routing kernels (kernels/triton/dispatch.py:
// `_count_kernel`, `_scan_kernel`) assign its local (token, slot) pairs, plus `row_map` and (contiguous)
// `m_indices`. One warp and one token per CTA: lane 0 brings the row into shared memory with one bulk
// copy, each local slot's lane stores it with one bulk store, and the warp writes the token's scales to
// each destination meanwhile.
//
// NOTE: scales stored a token at a time land 4 bytes at a time in 32-byte sectors of the column-major
// [groups, M] layout, which tokens much later complete: up to ~32K pairs they go straight there, marked
// evict-last while the rows stream through L2 evict-first (else a row evicts a part-written sector);
// beyond that (~7 MB of scales) the warp hands them to a pass over the output rows (kScalesApart).
#pragma once

#include "../common/types.cuh"
#include "../ptx/barrier.cuh"
#include "../ptx/misc.cuh"
#include "../ptx/tma.cuh"

namespace moe_fp8::dispatch {

// The expert whose segment holds row `r`, -1 for a padding row: the last segment starting at or below `r`
// (an empty segment shares its start with the next), if `r` lies within its count.
__device__ __forceinline__ int32_t row_expert(const int64_t* seg_start, const int64_t* count, uint32_t num_experts,
                                              int64_t r) {
    uint32_t lo = 0, hi = num_experts;  // first e with seg_start[e] > r
    while (lo < hi) {
        const uint32_t mid = (lo + hi) / 2;
        if (seg_start[mid] <= r) lo = mid + 1; else hi = mid;
    }
    return lo > 0 && r - seg_start[lo - 1] < count[lo - 1] ? static_cast<int32_t>(lo - 1) : -1;
}

// kMasked: the masked layout [E, max_m, K] (scales [E, groups, m_pad]): a pair's row is its expert's
// block + its position, dropped past max_m; no m_indices. kRowsOnDevice (contiguous): the layout of the
// M_total rows in `status` (scale columns padded to kScaleAlignM rows: utils.SCALE_M_ALIGN). kScalesApart:
// instead of the scales, each destination row's token (`src_rows`, indexed by the row: E * max_m of them
// when masked) and the token's scales token-major (`token_scales` [T, groups]); a pass over the output rows
// then stores whole sectors (the Triton `_scale_rows_kernel`). Otherwise the scales go straight to every
// destination, kept in L2.
template <uint32_t kTopK, bool kMasked, bool kRowsOnDevice, bool kScalesApart, uint32_t kScaleAlignM>
__global__ void __launch_bounds__(32) dispatch_rows_kernel(
    const uint8_t* __restrict__ x, const float* __restrict__ x_scale, uint64_t xs_stride_t, uint64_t xs_stride_g,
    const int32_t* __restrict__ local, const int32_t* __restrict__ rank, const int32_t* __restrict__ base,
    const int64_t* __restrict__ seg_start, const int64_t* __restrict__ count, const int64_t* __restrict__ status,
    uint8_t* __restrict__ out, float* __restrict__ out_scale, int64_t* __restrict__ row_map,
    int32_t* __restrict__ m_indices, int32_t* __restrict__ src_rows, float* __restrict__ token_scales,
    uint32_t num_tokens, uint32_t row_bytes, uint32_t num_groups, uint32_t chunk, uint32_t num_experts,
    uint32_t m_rows, uint32_t m_pad, uint32_t max_m) {
    static_assert(kTopK >= 1 && kTopK <= 32, "one lane per slot");
    static_assert(!kMasked || !kRowsOnDevice, "the masked layout has its shape on the host");
    extern __shared__ __align__(128) uint8_t row[];
    __shared__ uint64_t bar;
    // (launched plainly after the routing kernels; the scale pass after it may become resident now)
    ptx::launch_dependents();
    if constexpr (kRowsOnDevice) {  // launched before the host knows M_total: the layout of M_total rows
        m_rows = static_cast<uint32_t>(status[0]);
        m_pad = align_up(m_rows, kScaleAlignM);
    }
    const uint32_t lane = threadIdx.x;
    const uint32_t t = blockIdx.x;
    // rows are read and written once; inline scales must outlive them in L2 (see the NOTE above)
    const uint64_t row_policy = kScalesApart ? ptx::policy_evict_normal() : ptx::policy_evict_first();

    const uint64_t p = static_cast<uint64_t>(t) * kTopK + lane;
    const int32_t e = t < num_tokens && lane < kTopK ? local[p] : -1;
    const bool any_local = __any_sync(kFullMask, e >= 0);  // (under expert parallelism some tokens have none)
    if (any_local && lane == 0) {
        ptx::mbar_init(&bar, 1);
        ptx::fence_barrier_init();
        ptx::mbar_arrive_expect_tx(&bar, row_bytes);
        ptx::bulk_load(row, x + static_cast<uint64_t>(t) * row_bytes, row_bytes, &bar, row_policy);
    }
    // each local pair's destination row: its count in earlier chunks + its rank, in its expert's segment
    // (contiguous) or block of max_m rows (masked); and where its scales go (the row in its group's column)
    int64_t dest = -1, scale_dest = -1;
    if (e >= 0) {
        const int64_t pos = base[(p / chunk) * num_experts + e] + rank[p];
        if constexpr (kMasked) {
            if (pos < max_m) {
                dest = static_cast<int64_t>(e) * max_m + pos;
                scale_dest = static_cast<int64_t>(e) * num_groups * m_pad + pos;
            }
        } else {
            dest = scale_dest = seg_start[e] + pos;
        }
    }
    if (t < num_tokens && lane < kTopK) row_map[p] = dest;
    // 32 rows of m_indices per CTA while the row arrives (the grid covers max(T, M / 32) CTAs)
    if constexpr (!kMasked) {
        const int64_t r = static_cast<int64_t>(t) * 32 + lane;
        if (r < m_rows) m_indices[r] = row_expert(seg_start, count, num_experts, r);
    }
    if (!any_local) return;

    if constexpr (kScalesApart) {
        if (dest >= 0) src_rows[dest] = static_cast<int32_t>(t);
        for (uint32_t g = lane; g < num_groups; g += 32)
            token_scales[static_cast<uint64_t>(t) * num_groups + g] = x_scale[t * xs_stride_t + g * xs_stride_g];
    } else {
        const uint64_t scale_policy = ptx::policy_evict_last();
        int64_t dests[kTopK];
#pragma unroll
        for (uint32_t k = 0; k < kTopK; ++k) dests[k] = __shfl_sync(kFullMask, scale_dest, k);
        for (uint32_t g = lane; g < num_groups; g += 32) {
            const float v = x_scale[t * xs_stride_t + g * xs_stride_g];
            float* column = out_scale + static_cast<uint64_t>(g) * m_pad;
#pragma unroll
            for (uint32_t k = 0; k < kTopK; ++k)
                if (dests[k] >= 0) ptx::st_global_hint_f32(column + dests[k], v, scale_policy);
        }
    }
    __syncwarp();
    ptx::mbar_wait(&bar, 0);
    if (dest >= 0) {
        ptx::bulk_store(out + static_cast<uint64_t>(dest) * row_bytes, row, row_bytes, row_policy);
        ptx::bulk_commit();
        ptx::bulk_wait_read();  // shared memory stays valid until the store has read it
    }
}

}  // namespace moe_fp8::dispatch
