// Routing of the chunked dispatches on sm_90, in one launch: what the Triton `_count_kernel` then
// `_scan_kernel` (kernels/triton/dispatch.py) compute, with the same outputs, so either scatter (Triton, or
// the row mover of dispatch_rows.cuh) places the pairs from them.
//
// The flat (token, slot) pairs fall in chunks of kRouteChunk; a pair's destination is its rank among its
// chunk's earlier pairs of the same local expert (`rank`) + that expert's pairs in the earlier chunks
// (`base` [chunks, E]) (+ the expert's segment start, contiguous layout). A CTA takes kRouteChunksPerCta
// chunks: each warp ranks two chunks' pairs by `match.any` against shared-memory counters, the CTA turns its
// chunk histograms into per-CTA prefixes, and the CTAs chain their per-expert sums by a decoupled look-back
// (each publishes its sum, then its inclusive prefix once it has read its predecessors'). The last CTA then
// holds every expert's total: it writes `count`, and `masked_m` or the aligned segment starts and `status`.
//
// NOTE: the look-back waits only for CTAs of lower index, which the hardware schedules first (as CUB's
// single-pass scan relies on), so it cannot wait for a CTA that is not resident.
#pragma once

#include "../common/types.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::dispatch {

constexpr uint32_t kRouteChunk = 128;  // pairs a chunk: configs.DispatchConfig.chunk (the scatter's `p / chunk`)
constexpr uint32_t kRouteChunksPerCta = 16;
constexpr uint32_t kRouteThreads = 256;  // 8 warps of two chunks each
constexpr uint32_t kRoutePairsPerCta = kRouteChunk * kRouteChunksPerCta;
constexpr uint32_t kRoutePairsPerLane = kRoutePairsPerCta / kRouteThreads;
constexpr uint32_t kRouteLookBack = 16;  // predecessors' flags read at once
// a look-back word: the state in the top two bits, the count below
constexpr uint64_t kFlagSum = 1ull << 62, kFlagPrefix = 2ull << 62, kFlagValue = kFlagSum - 1;
// the Triton kernels' sentinels for the id range of no pairs (status of an empty call, bit for bit)
constexpr int64_t kNoLow = 1ll << 62, kNoHigh = -(1ll << 62);

// Relaxed, not acquire: an acquire load orders every later load after it, which would serialize a batch of
// look-back reads (one L2 round trip each); the reader fences once after its look-back instead.
__device__ __forceinline__ uint64_t ld_relaxed_gpu_u64(const uint64_t* ptr) {
    uint64_t v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ void fence_acq_rel_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }

__device__ __forceinline__ void st_release_gpu_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

template <typename T, typename Op>
__device__ __forceinline__ T warp_reduce(T v, Op op) {
#pragma unroll
    for (uint32_t d = 16; d > 0; d /= 2) v = op(v, __shfl_xor_sync(kFullMask, v, d));
    return v;
}

// The pairs of the CTAs before CTA `cta` for one expert (its column `flags[·, e]`, stride `num_experts`):
// sums back to the first published prefix, re-reading a flag not yet published.
__device__ __forceinline__ uint64_t look_back(const uint64_t* flags, uint32_t num_experts, int32_t cta) {
    uint64_t before = 0;
    int32_t j = cta - 1;
    while (j >= 0) {
        uint64_t w[kRouteLookBack];
#pragma unroll
        for (uint32_t i = 0; i < kRouteLookBack; ++i)  // past CTA 0: a prefix of nothing
            w[i] = j - static_cast<int32_t>(i) >= 0
                       ? ld_relaxed_gpu_u64(flags + static_cast<uint64_t>(j - i) * num_experts) : kFlagPrefix;
        int32_t used = 0;
#pragma unroll
        for (uint32_t i = 0; i < kRouteLookBack; ++i) {
            const uint64_t state = w[i] & ~kFlagValue;
            if (state == 0) break;  // not published yet: read it again
            before += w[i] & kFlagValue;
            if (state == kFlagPrefix) return before;
            ++used;
        }
        j -= used;
    }
    return before;
}

// A CTA-wide exclusive scan of one value a thread (in thread order): the thread's prefix; the sum in `total`.
__device__ __forceinline__ int64_t block_exclusive_scan(int64_t sum, int64_t* warp_sums, int64_t& total) {
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    int64_t incl = sum;
#pragma unroll
    for (uint32_t d = 1; d < 32; d *= 2) {
        const int64_t v = __shfl_up_sync(kFullMask, incl, d);
        if (lane >= d) incl += v;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    int64_t before = 0;
    total = 0;
#pragma unroll
    for (uint32_t w = 0; w < kRouteThreads / 32; ++w) {
        if (w < warp) before += warp_sums[w];
        total += warp_sums[w];
    }
    return before + incl - sum;
}

__device__ __forceinline__ void red_max_gpu_u64(uint64_t* ptr, uint64_t v) {
    asm volatile("red.relaxed.gpu.global.max.u64 [%0], %1;" ::"l"(ptr), "l"(v) : "memory");
}

// The id range of a CTA's pairs (min id, max id, max mapped id) as three maxima of non-negative words (zero: no
// pairs), so the CTAs combine theirs by `red.max` in the zero-filled workspace.
__device__ __forceinline__ void publish_range(uint64_t* words, int64_t lo, int64_t hi, int64_t top) {
    red_max_gpu_u64(words, static_cast<uint64_t>(kNoLow) - static_cast<uint64_t>(lo));
    red_max_gpu_u64(words + 1, static_cast<uint64_t>(hi) - static_cast<uint64_t>(kNoHigh));
    red_max_gpu_u64(words + 2, static_cast<uint64_t>(top + 1));
}

__device__ __forceinline__ void read_range(const uint64_t* words, int64_t& lo, int64_t& hi, int64_t& top) {
    lo = static_cast<int64_t>(static_cast<uint64_t>(kNoLow) - ld_relaxed_gpu_u64(words));
    hi = static_cast<int64_t>(ld_relaxed_gpu_u64(words + 1) + static_cast<uint64_t>(kNoHigh));
    top = static_cast<int64_t>(ld_relaxed_gpu_u64(words + 2)) - 1;
}

// kV: experts a thread (1 or 2), E <= 256·kV. With more than one CTA, `flags` ([CTAs, E]) and `stat_words` (3) must
// start at zero. kMasked: `masked_m = min(count, max_m)`; else `seg_start` (each count rounded up to align_m,
// exclusive prefix) and `status = [M_total, min id, max id, max mapped id]`. Ids outside [0, num_global) (or,
// without a map, [0, E)) and experts mapped outside [0, E) are not local (`local` -1, rank 0). `map_entries`:
// the map's entries staged in shared memory (0: it is read from global memory).
//
// Only the flags order the CTAs, and nothing is stored before them but the id range (by the thread that also
// publishes expert 0's flag): a release then waits for no earlier stores, and the last CTA sees every CTA's id
// range through its own look-back for expert 0. A single CTA publishes nothing.
template <typename IdT, typename MapT, bool kHasMap, bool kMasked, uint32_t kV>
__global__ void __launch_bounds__(kRouteThreads) route_pairs_kernel(
    const IdT* __restrict__ ids, const MapT* __restrict__ expert_map, int32_t* __restrict__ local,
    int32_t* __restrict__ rank, int32_t* __restrict__ base, int64_t* __restrict__ count,
    int64_t* __restrict__ seg_start, int64_t* __restrict__ status, int32_t* __restrict__ masked_m,
    uint64_t* flags, uint64_t* stat_words, uint64_t num_pairs, uint32_t num_experts, int64_t num_global,
    uint32_t map_entries, uint32_t max_m, uint32_t align_m) {
    extern __shared__ __align__(16) uint8_t smem[];
    MapT* smem_map = reinterpret_cast<MapT*>(smem);
    // [kRouteChunksPerCta, E]: counters, then the CTA's prefixes
    int32_t* hist = reinterpret_cast<int32_t*>(smem + align_up<uint32_t>(map_entries * sizeof(MapT), 16));
    __shared__ int64_t warp_stats[kRouteThreads / 32][3];
    __shared__ int64_t warp_sums[kRouteThreads / 32];
    const uint32_t tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const uint32_t cta = blockIdx.x;  // (the look-back waits only for lower indices, scheduled first)
    const bool alone = gridDim.x == 1;
    const uint64_t num_chunks = (num_pairs + kRouteChunk - 1) / kRouteChunk;
    ptx::wait_prerequisites();  // the ids come from the kernel before (routing)
    ptx::launch_dependents();   // the scatter may become resident: it waits for this grid to complete

    // 1. the warp's pairs (two chunks, 32 a round): local ids, ranks, the chunks' histograms, the id range
    const uint64_t first = static_cast<uint64_t>(cta) * kRoutePairsPerCta + warp * 32 * kRoutePairsPerLane + lane;
    int64_t id[kRoutePairsPerLane];
#pragma unroll
    for (uint32_t r = 0; r < kRoutePairsPerLane; ++r)  // in flight while the map is staged
        id[r] = first + r * 32 < num_pairs ? static_cast<int64_t>(ids[first + r * 32]) : 0;
    if constexpr (kHasMap)
        for (uint32_t i = tid; i < map_entries; i += kRouteThreads) smem_map[i] = expert_map[i];
    for (uint32_t i = tid; i < kRouteChunksPerCta * num_experts; i += kRouteThreads) hist[i] = 0;
    __syncthreads();
    const MapT* map = map_entries > 0 ? smem_map : expert_map;
    int32_t e[kRoutePairsPerLane];
    int64_t lo = kNoLow, hi = kNoHigh, top = -1;
#pragma unroll
    for (uint32_t r = 0; r < kRoutePairsPerLane; ++r) {
        int64_t mapped = -1;
        if (first + r * 32 < num_pairs) {
            if constexpr (kHasMap) {
                if (id[r] >= 0 && id[r] < num_global) mapped = static_cast<int64_t>(map[id[r]]);
            } else if (id[r] >= 0 && id[r] < num_experts) {
                mapped = id[r];
            }
            lo = min(lo, id[r]);
            hi = max(hi, id[r]);
            top = max(top, mapped);
        }
        e[r] = mapped >= 0 && mapped < num_experts ? static_cast<int32_t>(mapped) : -1;
    }
    const uint32_t lanes_below = (1u << lane) - 1;
    int32_t rk[kRoutePairsPerLane];
#pragma unroll
    for (uint32_t r = 0; r < kRoutePairsPerLane; ++r) {
        int32_t* counters = hist + (warp * 2 + r / (kRoutePairsPerLane / 2)) * num_experts;
        const uint32_t peers = __match_any_sync(kFullMask, e[r]);
        const uint32_t below = __popc(peers & lanes_below);
        rk[r] = e[r] >= 0 ? counters[e[r]] + static_cast<int32_t>(below) : 0;
        __syncwarp();
        if (e[r] >= 0 && below == 0) counters[e[r]] += __popc(peers);
        __syncwarp();
    }
    lo = warp_reduce(lo, [](int64_t a, int64_t b) { return min(a, b); });
    hi = warp_reduce(hi, [](int64_t a, int64_t b) { return max(a, b); });
    top = warp_reduce(top, [](int64_t a, int64_t b) { return max(a, b); });
    if (lane == 0) {
        warp_stats[warp][0] = lo;
        warp_stats[warp][1] = hi;
        warp_stats[warp][2] = top;
    }
    __syncthreads();
    if (tid == 0) {  // the CTA's range, in thread 0's lo / hi / top
#pragma unroll
        for (uint32_t w = 1; w < kRouteThreads / 32; ++w) {
            lo = min(lo, warp_stats[w][0]);
            hi = max(hi, warp_stats[w][1]);
            top = max(top, warp_stats[w][2]);
        }
        if (!alone) publish_range(stat_words, lo, hi, top);
    }

    // 2. per expert: the CTA's chunk prefixes (in place) and sum; the CTAs before it by look-back
    int64_t sum[kV], before[kV];
#pragma unroll
    for (uint32_t v = 0; v < kV; ++v) {
        const uint32_t ex = tid + v * kRouteThreads;
        sum[v] = before[v] = 0;
        if (ex >= num_experts) continue;
#pragma unroll
        for (uint32_t c = 0; c < kRouteChunksPerCta; ++c) {
            const int32_t h = hist[c * num_experts + ex];
            hist[c * num_experts + ex] = static_cast<int32_t>(sum[v]);
            sum[v] += h;
        }
        if (!alone)
            st_release_gpu_u64(flags + static_cast<uint64_t>(cta) * num_experts + ex,
                               (cta == 0 ? kFlagPrefix : kFlagSum) | static_cast<uint64_t>(sum[v]));
    }
#pragma unroll
    for (uint32_t v = 0; v < kV; ++v) {
        const uint32_t ex = tid + v * kRouteThreads;
        if (ex >= num_experts || cta == 0) continue;
        before[v] = static_cast<int64_t>(look_back(flags + ex, num_experts, static_cast<int32_t>(cta)));
        st_release_gpu_u64(flags + static_cast<uint64_t>(cta) * num_experts + ex,
                           kFlagPrefix | static_cast<uint64_t>(before[v] + sum[v]));
    }

    // 3. the pairs' local ids and ranks, the CTA's chunks' bases
#pragma unroll
    for (uint32_t r = 0; r < kRoutePairsPerLane; ++r) {
        const uint64_t p = first + r * 32;
        if (p < num_pairs) {
            local[p] = e[r];
            rank[p] = rk[r];
        }
    }
#pragma unroll
    for (uint32_t v = 0; v < kV; ++v) {
        const uint32_t ex = tid + v * kRouteThreads;
        if (ex >= num_experts) continue;
        for (uint32_t c = 0; c < kRouteChunksPerCta; ++c) {
            const uint64_t chunk = static_cast<uint64_t>(cta) * kRouteChunksPerCta + c;
            if (chunk < num_chunks)
                base[chunk * num_experts + ex] = static_cast<int32_t>(before[v]) + hist[c * num_experts + ex];
        }
    }
    if (cta != gridDim.x - 1) return;

    // 4. the last CTA: every expert's total, then masked_m, or the segment starts and status
#pragma unroll
    for (uint32_t v = 0; v < kV; ++v) {
        const uint32_t ex = tid + v * kRouteThreads;
        if (ex >= num_experts) continue;
        const int64_t total = before[v] + sum[v];
        count[ex] = total;
        if constexpr (kMasked) masked_m[ex] = static_cast<int32_t>(min(total, static_cast<int64_t>(max_m)));
    }
    if constexpr (!kMasked) {
        // the scan wants a thread's experts adjacent: through shared memory (hist is no longer read)
        int64_t* seg = reinterpret_cast<int64_t*>(hist);
        __syncthreads();
#pragma unroll
        for (uint32_t v = 0; v < kV; ++v) {
            const uint32_t ex = tid + v * kRouteThreads;
            if (ex < num_experts) seg[ex] = (before[v] + sum[v] + align_m - 1) / align_m * align_m;
        }
        __syncthreads();
        int64_t mine = 0;
#pragma unroll
        for (uint32_t v = 0; v < kV; ++v) {
            const uint32_t ex = tid * kV + v;
            if (ex < num_experts) mine += seg[ex];
        }
        int64_t m_total;
        int64_t start = block_exclusive_scan(mine, warp_sums, m_total);
#pragma unroll
        for (uint32_t v = 0; v < kV; ++v) {
            const uint32_t ex = tid * kV + v;
            if (ex < num_experts) {
                seg_start[ex] = start;
                start += seg[ex];
            }
        }
        if (tid == 0) {
            // every CTA's range, its own included (thread 0's look-back for expert 0 saw them published)
            if (!alone) {
                fence_acq_rel_gpu();  // (with the flags read before: an acquire of each CTA's range)
                read_range(stat_words, lo, hi, top);
            }
            status[0] = m_total;
            status[1] = lo;
            status[2] = hi;
            status[3] = top;
        }
    }
}

}  // namespace moe_fp8::dispatch
