// Expert routing (select_experts) with sigmoid scores: DeepSeek-V3's grouped top-k, or plain top-k.
// One warp per token; lane l holds experts l*V .. l*V+V-1 (E = 32·V), and a group of experts is LPG
// whole lanes (LPG = 0: no groups). Same results as the Triton kernel and the reference
// (kernels/triton/routing.py): float64 scores rounded once to float32, picks ordered by
// (sort_key(value), lower expert first) with NaN above everything.
//
// NOTE: the Triton kernel spends ~85% of its time in its 8 picks: each is an int64 max over a
// [tokens, groups, experts] tile that Triton lays over two warps (shared memory) and shuffles as
// 2 x 32-bit per butterfly level. Here each lane sorts its V keys once, and a pick is two 32-bit
// redux.sync over the lanes' heads (value key, then the lowest expert among equal values).
#pragma once

#include "../common/types.cuh"
#include "../ptx/misc.cuh"

namespace moe_fp8::routing {

constexpr int64_t kRemoved = -0x7fffffffffffffffLL - 1;  // below every (key, expert) rank
constexpr int32_t kNegInfKey = static_cast<int32_t>(0xff800000u ^ 0x7fffffffu);  // sort_key(-inf)

// int32 whose signed order is torch.sort's order of float32 v: -0.0 == +0.0, every NaN above +Inf
__device__ __forceinline__ int32_t sort_key(float v) {
    const int32_t bits = __float_as_int(v == 0.0f ? 0.0f : v);
    return v != v ? 0x7fffffff : bits >= 0 ? bits : bits ^ 0x7fffffff;
}

// the float a key came from (up to the sign of zero and the NaN payload, neither of which orders)
__device__ __forceinline__ float key_value(int32_t key) {
    return __int_as_float(key >= 0 ? key : key ^ 0x7fffffff);
}

// (key, code) as one int64: larger key first, then larger code (codes are E-1-expert: lower expert first)
__device__ __forceinline__ int64_t rank(int32_t key, uint32_t code) {
    return static_cast<int64_t>((static_cast<uint64_t>(static_cast<uint32_t>(key)) << 32) | code);
}

__device__ __forceinline__ double load_f64(const float* p) { return static_cast<double>(*p); }
__device__ __forceinline__ double load_f64(const uint16_t* p) {  // bf16 bits
    return static_cast<double>(__uint_as_float(static_cast<uint32_t>(*p) << 16));
}

__device__ __forceinline__ float sigmoid_f32(double x) { return static_cast<float>(1.0 / (1.0 + exp(-x))); }

template <typename TLogit, typename TBias, uint32_t V, uint32_t LPG, bool kHasBias>
__global__ void __launch_bounds__(256) select_experts_kernel(
    const TLogit* __restrict__ logits, const TBias* __restrict__ bias, float* __restrict__ weights,
    int32_t* __restrict__ ids, uint32_t num_tokens, uint64_t stride_t, uint64_t stride_e, uint64_t stride_bias,
    uint32_t topk_group, uint32_t top_k, uint32_t renormalize, float routed_scaling_factor) {
    static_assert(V >= 1 && V <= 16, "32 to 512 experts");
    static_assert(LPG == 0 || (LPG <= 32 && (LPG & (LPG - 1)) == 0), "a group is a power-of-two of lanes");
    constexpr uint32_t kNumExperts = 32 * V;
    constexpr uint32_t kNumGroups = LPG ? 32 / LPG : 1;
    // the data-path kernel after routing (PDL-launched) may become resident and prefetch its rows now
    ptx::launch_dependents();
    // one token per warp (the grid has a warp for every token)
    const uint32_t t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t >= num_tokens) return;
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t expert0 = lane * V;
    const TLogit* row = logits + t * stride_t;
    // the lane's (choice, expert) ranks, sorted descending once: a pick then reads only the head
    int64_t key[V];
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) {
        const float score = sigmoid_f32(load_f64(row + (expert0 + j) * stride_e));
        const float choice = kHasBias ? score + static_cast<float>(load_f64(bias + (expert0 + j) * stride_bias)) : score;
        key[j] = rank(sort_key(choice), kNumExperts - 1 - (expert0 + j));
    }
#pragma unroll
    for (uint32_t round = 0; round < V; ++round) {  // odd-even transposition sort
#pragma unroll
        for (uint32_t j = round % 2; j + 1 < V; j += 2) {
            const int64_t hi = max(key[j], key[j + 1]), lo = min(key[j], key[j + 1]);
            key[j] = hi, key[j + 1] = lo;
        }
    }

    if constexpr (LPG > 0) {
        // group score: the sum of the group's two best choices (one with a single expert per group)
        int64_t first = key[0], second = kRemoved;
        if constexpr (V > 1) second = key[1];
#pragma unroll
        for (uint32_t m = 1; m < LPG; m <<= 1) {
            const int64_t o1 = __shfl_xor_sync(kFullMask, first, m), o2 = __shfl_xor_sync(kFullMask, second, m);
            if (first > o1) {
                second = max(second, o1);
            } else {
                second = max(first, o2);
                first = o1;
            }
        }
        float group_score = key_value(static_cast<int32_t>(first >> 32));
        if (LPG * V >= 2) group_score += key_value(static_cast<int32_t>(second >> 32));
        const int64_t group_rank = rank(sort_key(group_score), kNumGroups - 1 - lane / LPG);
        uint32_t better = 0;  // groups ranked above this lane's
#pragma unroll
        for (uint32_t g = 0; g < kNumGroups; ++g) better += __shfl_sync(kFullMask, group_rank, g * LPG) > group_rank;
        if (better >= topk_group) {  // not kept: every choice -inf, so sorted by expert alone
#pragma unroll
            for (uint32_t j = 0; j < V; ++j) key[j] = rank(kNegInfKey, kNumExperts - 1 - (expert0 + j));
        }
    }

    // top-k: each pick is the warp's largest head; lane k keeps pick k
    int32_t my_id = 0;
    for (uint32_t k = 0; k < top_k; ++k) {
        const int32_t head_key = static_cast<int32_t>(key[0] >> 32);
        const int32_t best_key = __reduce_max_sync(kFullMask, head_key);
        const uint32_t code = __reduce_max_sync(kFullMask, head_key == best_key ? static_cast<uint32_t>(key[0]) : 0u);
        if (head_key == best_key && static_cast<uint32_t>(key[0]) == code) {  // this lane's head won: pop it
#pragma unroll
            for (uint32_t j = 0; j + 1 < V; ++j) key[j] = key[j + 1];
            key[V - 1] = kRemoved;
        }
        if (lane == k) my_id = static_cast<int32_t>(kNumExperts - 1 - code);
    }
    // weights: the picked experts' scores, recomputed from their logits (one per lane)
    float my_weight = lane < top_k ? sigmoid_f32(load_f64(row + static_cast<uint64_t>(my_id) * stride_e)) : 0.0f;
    if (renormalize) {
        float sum = my_weight;  // lanes past top_k hold 0
#pragma unroll
        for (uint32_t m = 1; m < 32; m <<= 1) sum += __shfl_xor_sync(kFullMask, sum, m);
        my_weight = __fdiv_rn(my_weight, sum);
    }
    if (lane < top_k) {
        weights[static_cast<uint64_t>(t) * top_k + lane] = my_weight * routed_scaling_factor;
        ids[static_cast<uint64_t>(t) * top_k + lane] = my_id;
    }
}

}  // namespace moe_fp8::routing
