// Expert routing (select_experts) with sigmoid scores: DeepSeek-V3's grouped top-k, or plain top-k.
// One warp per token at a time; lane l holds experts l*V .. l*V+V-1 (E = 32·V), and a group of experts is LPG
// whole lanes (LPG = 0: no groups). Same results as the Triton kernel and the reference
// (kernels/triton/routing.py): float64 scores rounded once to float32, picks ordered by
// (sort_key(value), lower expert first) with NaN above everything.
//
// Two paths compute the picks (the weights are always the float64 scores of the picked experts):
// - certified (pick_certified): float32 scores from the fast exp2 / reciprocal, within 2^-23 of the
//   float64-rounded ones, so every choice is known to within a few units u (see make_window). Picks are made on
//   those estimates, then kept only if every decision that sets them had a margin wider than the estimates'
//   error: the last kept group against the first dropped one, the last pick against the next expert. A token
//   that fails (near-ties at a cut, NaN, a choice outside the window) takes the exact path; random logits fail
//   ~0.01% of the time. Picks closer to each other than the margin are a certain set in an uncertain order:
//   the weights' pass, which computes their float64 scores anyway, sorts them on those (order_picks).
// - exact (pick_exact): float64 scores of every expert, then the selection on them, by the token's warp.
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

__device__ __forceinline__ float load_f32(const float* p) { return *p; }
__device__ __forceinline__ float load_f32(const uint16_t* p) {  // bf16 bits: exact in float32
    return __uint_as_float(static_cast<uint32_t>(*p) << 16);
}

// 1/d within an ulp, for d and 1/d normal doubles: Newton steps from the approximate reciprocal, as __drcp_rn
// takes them, without its out-of-range branch (a call, whose ABI register saves spilled this kernel)
__device__ __forceinline__ double reciprocal_rn(double d) {
    double r;
    asm("rcp.approx.ftz.f64 %0, %1;" : "=d"(r) : "d"(d));
    double e = fma(-d, r, 1.0);
    r = fma(r, e, r);
    e = fma(-d, r, 1.0);
    r = fma(r, e, r);
    e = fma(-d, r, 1.0);
    return fma(r, e, r);
}

// the float64 sigmoid rounded once to float32, as the reference computes it; beyond 2^150 it rounds to 0
// (tests/test_routing_hopper.py checks every float input against 1.0 / (1.0 + exp(-x)))
__device__ __forceinline__ float sigmoid_f32(double x) {
    const double d = 1.0 + exp(-x);
    return d > 0x1p150 ? 0.0f : static_cast<float>(reciprocal_rn(d));  // NaN stays NaN
}

// sigmoid from the fast exp2 and reciprocal: |result - sigmoid_f32(x)| ≤ 2^-23 for every float x but NaN
// (checked over all 2^32 inputs by tests/test_routing_hopper.py)
__device__ __forceinline__ float sigmoid_estimate(float x) {
    float e, s;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(e) : "f"(x * -1.4426950408889634f));
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(s) : "f"(1.0f + e));
    return s;
}

// A lane's V logits (or bias) as loaded, unconverted: 16-byte vectors where V fills them (rows are contiguous
// and 16-byte aligned: the wrapper makes them so), bf16 two a register there. A row in flight so holds half the
// registers of its floats (as floats, the DeepSeek-V3 kernel on bf16 logits spilled under nvcc); row_floats
// converts it when its pick starts. kOnce: a token's logits, read once, evict-first in L2 (logits that miss evict
// each other, not dirty lines such as the rest of logits larger than the L2; docs/kernels/datapath.md).
template <typename T, uint32_t V>
constexpr uint32_t kRowWords = V % (16 / sizeof(T)) == 0 ? V * sizeof(T) / 4 : V;

template <uint32_t V, bool kOnce = false, typename T>
__device__ __forceinline__ void load_row_bits(const T* row, uint32_t (&w)[kRowWords<T, V>]) {
    if constexpr (V % (16 / sizeof(T)) == 0) {
#pragma unroll
        for (uint32_t j = 0; j < kRowWords<T, V>; j += 4) {
            const uint4* p = reinterpret_cast<const uint4*>(row) + j / 4;
            const uint4 v = kOnce ? ptx::ld_global_evict_first_v4(p) : *p;
            w[j] = v.x, w[j + 1] = v.y, w[j + 2] = v.z, w[j + 3] = v.w;
        }
    } else {
#pragma unroll
        for (uint32_t j = 0; j < V; ++j) w[j] = __float_as_uint(load_f32(row + j));
    }
}

template <uint32_t V, typename T>
__device__ __forceinline__ void row_floats(const uint32_t (&w)[kRowWords<T, V>], float (&x)[V]) {
    if constexpr (sizeof(T) == 2 && V % 8 == 0) {  // bf16 pairs: element 2i in the low half
#pragma unroll
        for (uint32_t i = 0; i < V / 2; ++i) {
            x[2 * i] = __uint_as_float(w[i] << 16), x[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
        }
    } else {
#pragma unroll
        for (uint32_t j = 0; j < V; ++j) x[j] = __uint_as_float(w[j]);
    }
}

// the lane's V logits (or bias), as floats
template <uint32_t V, typename T>
__device__ __forceinline__ void load_row(const T* row, float (&x)[V]) {
    uint32_t w[kRowWords<T, V>];
    load_row_bits<V>(row, w);
    row_floats<V, T>(w, x);
}

// Batcher's odd-even merge sort of V registers, descending (19 compare-exchanges for V = 8)
template <uint32_t V, typename T>
__device__ __forceinline__ void sort_descending(T (&key)[V]) {
#pragma unroll
    for (uint32_t p = 1; p < V; p <<= 1) {
#pragma unroll
        for (uint32_t k = p; k >= 1; k >>= 1) {
#pragma unroll
            for (uint32_t j = k % p; j + k < V; j += 2 * k) {
#pragma unroll
                for (uint32_t i = 0; i < k && i + j + k < V; ++i) {
                    if ((i + j) / (2 * p) == (i + j + k) / (2 * p)) {
                        const T hi = max(key[i + j], key[i + j + k]), lo = min(key[i + j], key[i + j + k]);
                        key[i + j] = hi, key[i + j + k] = lo;
                    }
                }
            }
        }
    }
}

// The certified path works on t = estimated choice + offset, which lies in one binade [2^q, 2^(q+1)) for every
// choice (the warp's window: 2^q above the choices' span and magnitude, from the bias's range; q ≥ 1). There a
// float's resolution is u = 2^(q-23), and a float's bits order as its value. Errors, in u (|estimate - score| ≤
// 2^-23 ≤ u/2): t - offset is within 1.75 u of the exact choice (estimate u/2, offset and sum roundings u/2 each,
// the exact choice's own rounding u/4, as |choice| < 2^q), so picks kPickMargin = 4 units apart are ordered the
// same by the exact choices (4 u > 2 · 1.75 u); a group score (the sum of two, rounded to 2 u) is within 5 u of the
// exact one (2 · 1.75 u, its rounding u, the exact sum's u/2), so groups more than kGroupMargin = 10 u apart are.
// make_window: each lane's V offsets (bias + offset), and the bits every t in the window has above its mantissa
// (0 where no window exists: infinite biases, or a span past 2^126; every token then fails).
__device__ __forceinline__ int32_t ordered_bits(float v) {  // signed order of non-NaN floats
    const int32_t bits = __float_as_int(v);
    return bits >= 0 ? bits : bits ^ 0x7fffffff;
}

template <uint32_t V, bool kHasBias, typename TBias>
__device__ __forceinline__ uint32_t make_window(const TBias* bias, uint32_t expert0, float (&biased_offset)[V]) {
    float low = 0.0f, high = 0.0f;  // the bias's range: choices lie in [low, high + 1] (NaN biases are skipped:
                                    // their t is NaN, out of the window)
    if constexpr (kHasBias) {
        load_row(bias + expert0, biased_offset);
        low = __int_as_float(0x7f800000), high = -low;
#pragma unroll
        for (uint32_t j = 0; j < V; ++j) low = fminf(low, biased_offset[j]), high = fmaxf(high, biased_offset[j]);
        low = key_value(__reduce_min_sync(kFullMask, ordered_bits(low)));
        high = key_value(__reduce_max_sync(kFullMask, ordered_bits(high)));
    }
    // q: the least with 2^q above the span and every |choice| (both ≥ 1 when finite), bounds rounded up
    const float top = __fadd_ru(high, 1.0f);
    const float reach = fmaxf(__fsub_ru(top, low), fmaxf(-low, top));
    const uint32_t q = (__float_as_uint(reach) >> 23) - 126;
    // offset ≥ 2^q - low (rounded up): every finite t = estimate + (bias + offset) is ≥ 2^q. Only NaN and a t
    // rounded up to 2^(q+1) leave the window, and both set exponent bits the window's lacks.
    const float offset = __fsub_ru(__uint_as_float(min(127 + q, 253u) << 23), low);
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) biased_offset[j] = kHasBias ? biased_offset[j] + offset : offset;
    return q <= 126 ? (127 + q) << 23 : 0u;
}

constexpr uint32_t kPickMargin = 4;   // units u between consecutive picks (> 2 · 1.75)
constexpr uint32_t kGroupMargin = 10;  // units u the last kept group must clear the first dropped by (2 · 5)
constexpr uint32_t kCodeBits = 9;    // the expert in a certified key: 511 - e (lower expert first)

// kRounds picks from unique keys, sorted descending in each lane: each the warp's largest head, popped from its
// lane's first kDepth keys (no keys left: zeros). Lane k < kTopK keeps pick k in `my_key`; returns the last pick.
template <uint32_t kDepth, uint32_t kRounds, uint32_t kTopK, uint32_t V>
__device__ __forceinline__ uint32_t pop_picks(uint32_t (&key)[V], uint32_t lane, uint32_t& my_key) {
    uint32_t best = 0;
#pragma unroll
    for (uint32_t k = 0; k < kRounds; ++k) {
        best = __reduce_max_sync(kFullMask, key[0]);
        if (key[0] == best) {
#pragma unroll
            for (uint32_t j = 0; j + 1 < kDepth; ++j) key[j] = key[j + 1];
            key[kDepth - 1] = 0;
        }
        if (k < kTopK && lane == k) my_key = best;
    }
    return best;
}

// kSplit: the kept groups hold half the lanes and a lane 8 experts (DeepSeek-V3: 4 of 8 groups of 4 lanes). A lane
// sorts its keys as two halves of 4 (10 compare-exchanges, not 19); after the group stage each kept lane hands its
// second half to a dropped lane (through `exchange`: the warp's 32 16-byte slots in shared memory), so the picks pop
// from 32 lists of 4 keys, each list a lane's whole share (none runs out), and shift 4 registers, not 5.
template <uint32_t V, uint32_t LPG, uint32_t kTopKGroup>
constexpr bool kSplit = LPG > 0 && kTopKGroup * LPG * 2 == 32 && V == 8;

// Certified picks (see the file comment): true, and lane k < kTopK holds pick k in `my_id`, when every
// decision that sets them had its margin; false (warp-uniform) when the token must take the exact path. A pick
// that lacked the margin to the next one has its id's sign bit set (kUnordered): order_picks settles the order.
constexpr int32_t kUnordered = -0x7fffffff - 1;
template <uint32_t V, uint32_t LPG, uint32_t kTopK, uint32_t kTopKGroup>
__device__ __forceinline__ bool pick_certified(const float (&logit)[V], const float (&biased_offset)[V],
                                               uint32_t in_range, uint32_t lane, int32_t& my_id,
                                               uint32_t exchange) {
    constexpr bool kHalves = kSplit<V, LPG, kTopKGroup>;
    constexpr uint32_t H = V / 2;  // with kHalves: 4 keys, one 16-byte slot
    constexpr uint32_t kDepth = kHalves ? H : kTopK <= 8 && V > 5 ? 5 : V;  // the keys a lane lists for the picks
    const uint32_t expert0 = lane * V;
    uint32_t key[V], any_bits = 0;  // in range iff no t has exponent bits beyond the window's (make_window)
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) {
        const uint32_t bits = __float_as_uint(sigmoid_estimate(logit[j]) + biased_offset[j]);  // t
        any_bits |= bits;
        key[j] = (bits << kCodeBits) | (511 - (expert0 + j));  // t's mantissa, then the expert
    }
    bool ok = (any_bits & 0xff800000u) == in_range;
    uint32_t first, second;
    if constexpr (kHalves) {
        uint32_t lo[H], hi[H];
#pragma unroll
        for (uint32_t j = 0; j < H; ++j) lo[j] = key[j], hi[j] = key[H + j];
        sort_descending(lo);
        sort_descending(hi);
        first = max(lo[0], hi[0]), second = max(min(lo[0], hi[0]), max(lo[1], hi[1]));
#pragma unroll
        for (uint32_t j = 0; j < H; ++j) key[j] = lo[j], key[H + j] = hi[j];
    } else {
        sort_descending(key);
        first = key[0], second = V > 1 ? key[1] : 0;
    }

    if constexpr (LPG > 0) {
        // group score: the sum of the group's two best t (from the sorted keys: their mantissas)
#pragma unroll
        for (uint32_t m = 1; m < LPG; m <<= 1) {
            const uint32_t o1 = __shfl_xor_sync(kFullMask, first, m), o2 = __shfl_xor_sync(kFullMask, second, m);
            second = max(min(first, o1), max(second, o2)), first = max(first, o1);
        }
        const float best_t = __uint_as_float(in_range | (first >> kCodeBits));
        const float score = LPG * V >= 2 ? best_t + __uint_as_float(in_range | (second >> kCodeBits)) : best_t;
        // A score lies in one binade (twice t's), of resolution 2 u: its key is its mantissa, then the group (unique:
        // one group kept a round). A group is kept in the round its key is the best left.
        uint32_t left = (__float_as_uint(score) << kCodeBits) | (31 - lane / LPG), worst_kept = 0;
        bool kept = false;
#pragma unroll
        for (uint32_t r = 0; r < kTopKGroup; ++r) {
            worst_kept = __reduce_max_sync(kFullMask, left);
            if (left == worst_kept) kept = true, left = 0;
        }
        const uint32_t best_dropped = __reduce_max_sync(kFullMask, left);
        ok &= best_dropped == 0 || (worst_kept >> kCodeBits) > (best_dropped >> kCodeBits) + kGroupMargin / 2;
        if constexpr (kHalves) {
            // slot: the lane's place among the lanes of its kind (kept or dropped); kept lane s hands its second
            // half to dropped lane s
            const uint32_t kept_lanes = __ballot_sync(kFullMask, kept);
            const uint32_t slot = __popc((kept ? kept_lanes : ~kept_lanes) & ((1u << lane) - 1));
            const uint32_t mine = exchange + slot * 16;
            __syncwarp();  // the previous token's reads are done
            if (kept) {
                asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(mine), "r"(key[H]), "r"(key[H + 1]),
                             "r"(key[H + 2]), "r"(key[H + 3]) : "memory");
            }
            __syncwarp();
            if (!kept) {
                asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                             : "=r"(key[0]), "=r"(key[1]), "=r"(key[2]), "=r"(key[3]) : "r"(mine) : "memory");
            }
        } else if (!kept) {
#pragma unroll
            for (uint32_t j = 0; j < kDepth; ++j) key[j] = 0;
        }
    }

    // top-k: each pick is the warp's largest head (keys are unique), popped from its lane's list of kDepth; then
    // one more, to certify the last pick. Without kSplit, a lane that gives its whole list fails the token (its next
    // key was not in it): with 8 experts a lane, 5 of the 9 picks from one lane's 8 is rare (~1e-5 of random tokens).
    [[maybe_unused]] const bool listed = key[0] != 0;
    uint32_t my_key = 0;
    const uint32_t best = pop_picks<kDepth, kTopK + 1, kTopK>(key, lane, my_key);
    if constexpr (kDepth < V && !kHalves) ok &= !listed || key[0] != 0;
    const uint32_t below = __shfl_down_sync(kFullMask, my_key, 1);  // every lane: a full-mask shuffle
    const uint32_t next = lane + 1 == kTopK ? best : below;
    // the last pick against the next key sets the picks; each earlier pair only their order
    const bool apart = lane >= kTopK || (my_key >> kCodeBits) >= (next >> kCodeBits) + kPickMargin;
    ok &= apart || lane != kTopK - 1;
    my_id = static_cast<int32_t>((my_key & 511) ^ (apart ? 511u : 511u | kUnordered));  // 511 - code, flagged
    return __all_sync(kFullMask, ok);
}

// The exact (float64) rank of expert e of score `score`: its choice's sort key, then E-1-e (lower expert first)
template <uint32_t kNumExperts, bool kHasBias, typename TBias>
__device__ __forceinline__ int64_t exact_rank(float score, const TBias* bias, uint32_t e) {
    return rank(sort_key(kHasBias ? score + load_f32(bias + e) : score), kNumExperts - 1 - e);
}

// Exact picks from the lane's V ranks, sorted descending: the group stage on them, then each pick two
// 32-bit redux.sync over the lanes' heads (value key, then the lowest expert among equal values).
template <uint32_t V, uint32_t LPG>
__device__ __forceinline__ int32_t select_exact(int64_t (&key)[V], uint32_t lane, uint32_t topk_group, uint32_t top_k) {
    constexpr uint32_t kNumExperts = 32 * V;
    constexpr uint32_t kNumGroups = LPG ? 32 / LPG : 1;
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
            for (uint32_t j = 0; j < V; ++j) key[j] = rank(kNegInfKey, kNumExperts - 1 - (lane * V + j));
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
    return my_id;
}

// Puts each token's picks in the order of their exact choices (score + bias; ties: lower expert first), for the
// tokens whose certified picks came without it. Lanes [lane0, lane0 + kTopK) hold one token's picks, lane0 + j
// pick j: its expert `id` and float64 score `score`, which move to the lane of their place. Tokens already in
// order stay so (their exact order is the certified one).
template <uint32_t kNumExperts, uint32_t kTopK, bool kHasBias, typename TBias>
__device__ __forceinline__ void order_picks(float& score, int32_t& id, const TBias* bias, uint32_t lane0) {
    const uint32_t lane = threadIdx.x % 32;
    const int64_t my_rank = exact_rank<kNumExperts, kHasBias>(score, bias, static_cast<uint32_t>(id));
    uint32_t place = 0;  // picks of the token ranked above this one (ranks are unique: one per expert)
#pragma unroll
    for (uint32_t j = 0; j < kTopK; ++j) place += __shfl_sync(kFullMask, my_rank, (lane0 + j) % 32) > my_rank;
    uint32_t from = lane;  // the lane whose pick takes this lane's place
#pragma unroll
    for (uint32_t j = 0; j < kTopK; ++j) {
        const uint32_t holders = __ballot_sync(kFullMask, place == j) >> lane0;  // this token's lowest bits first
        if (lane == lane0 + j && holders != 0) from = lane0 + __ffs(holders) - 1;
    }
    score = __shfl_sync(kFullMask, score, from);
    id = __shfl_sync(kFullMask, id, from);
}

// Weights of picks whose scores sum below 2^-126 (logits under about -87): the rounded scores lose their
// precision there and are 0 / 0 once they underflow, while sigmoid(x) = e^x (1 - O(e^x)) makes the exact weights
// the softmax of the picks' logits (`logit`; all -inf: equal weights). Lanes of the warp's other tokens come along.
template <uint32_t kTopK>
__device__ __noinline__ float tiny_sum_weight(float logit, uint32_t lane0) {
    double x_max = logit;
#pragma unroll
    for (uint32_t k = 0; k < kTopK; ++k) {
        x_max = fmax(x_max, static_cast<double>(__shfl_sync(kFullMask, logit, lane0 + k)));
    }
    const double e = exp(logit == x_max ? 0.0 : logit - x_max);
    double sum = 0.0;
#pragma unroll
    for (uint32_t k = 0; k < kTopK; ++k) sum += __shfl_sync(kFullMask, e, lane0 + k);
    return static_cast<float>(e / sum);
}

// The weight of a pick of float64 score `score` held by the lanes [lane0, lane0 + kTopK) of a token (0 in
// lanes without one, `mine` false): the score, divided by the sum of the token's in pick order when
// `renormalize` (tiny_sum_weight below 2^-126; `logit` reads the pick's logit, only then).
template <uint32_t kTopK, typename LoadLogit>
__device__ __forceinline__ float pick_weight(float weight, uint32_t lane0, uint32_t renormalize, bool mine,
                                             const LoadLogit& logit) {
    if (renormalize) {
        float sum = 0.0f;
#pragma unroll
        for (uint32_t k = 0; k < kTopK; ++k) sum += __shfl_sync(kFullMask, weight, lane0 + k);
        const bool tiny = mine && sum < 0x1p-126f;  // (a NaN sum is not: NaN stays NaN)
        if (__any_sync(kFullMask, tiny)) {
            const float w = tiny_sum_weight<kTopK>(mine ? logit() : 0.0f, lane0);
            if (tiny) return w;
        }
        // = __fdiv_rn(weight, sum) without its call: the float64 quotient is within 2^-51 and a quotient of two
        // floats is a float rounding midpoint or 2^-50 away from one
        weight = static_cast<float>(static_cast<double>(weight) * reciprocal_rn(sum));
    }
    return weight;
}

// Exact picks from every expert's float64 score, by 64-bit ranks: any input (NaN, infinities, choices far
// apart). `lane_logits`: the lane's V logits (reloaded: L1 hits).
template <uint32_t V, uint32_t LPG, bool kHasBias, typename TLogit, typename TBias>
__device__ __noinline__ int32_t pick_exact_wide(const TLogit* lane_logits, const TBias* bias, uint32_t lane,
                                                uint32_t topk_group, uint32_t top_k) {
    float logit[V];
    load_row(lane_logits, logit);
    int64_t key[V];
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) key[j] = exact_rank<32 * V, kHasBias>(sigmoid_f32(logit[j]), bias, lane * V + j);
    sort_descending(key);
    return select_exact<V, LPG>(key, lane, topk_group, top_k);
}

// Exact picks of a token the certified path leaves, by its own warp: the float64 scores of every expert, then
// the selection of pick_certified on exact values, in 32-bit keys again. A key holds a choice as its distance
// below the warp's best (in sort_key steps, up to 2^23 - 2), then the expert; tokens with a non-finite choice,
// or a pick farther down, take pick_exact_wide. Out of line: a call keeps its registers off the common path, and
// the block's other warps take over this warp's later tokens while it runs.
template <uint32_t V, uint32_t LPG, uint32_t kTopK, bool kHasBias, typename TLogit, typename TBias>
__device__ __noinline__ int32_t pick_exact(const TLogit* lane_logits, const TBias* bias, uint32_t lane,
                                           uint32_t topk_group) {
    float choice[V], offset[V];
    load_row(lane_logits, choice);
    if constexpr (kHasBias) load_row(bias + lane * V, offset);
    bool finite = true;
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) {
        choice[j] = kHasBias ? sigmoid_f32(choice[j]) + offset[j] : sigmoid_f32(choice[j]);
        finite &= isfinite(choice[j]);
    }
    if (!__all_sync(kFullMask, finite)) return pick_exact_wide<V, LPG, kHasBias>(lane_logits, bias, lane, topk_group, kTopK);

    bool kept = true;
    if constexpr (LPG > 0) {
        // group score: the sum of the group's two best choices; kept when fewer than topk_group groups rank above
        // (a larger score, or an equal one of a lower group)
        constexpr uint32_t kNumGroups = 32 / LPG;
        float first = -__int_as_float(0x7f800000), second = first;
#pragma unroll
        for (uint32_t j = 0; j < V; ++j) second = fmaxf(second, fminf(first, choice[j])), first = fmaxf(first, choice[j]);
#pragma unroll
        for (uint32_t m = 1; m < LPG; m <<= 1) {
            const float o1 = __shfl_xor_sync(kFullMask, first, m), o2 = __shfl_xor_sync(kFullMask, second, m);
            second = fmaxf(fminf(first, o1), fmaxf(second, o2)), first = fmaxf(first, o1);
        }
        const float score = LPG * V >= 2 ? first + second : first;
        const uint32_t group = lane / LPG;
        uint32_t above = 0;
#pragma unroll
        for (uint32_t g = 0; g < kNumGroups; ++g) {
            const float other = __shfl_sync(kFullMask, score, g * LPG);
            above += other > score || (other == score && g < group);
        }
        kept = above < topk_group;
    }

    // keys: distance below the best kept choice, from 2^23 - 1 down (0: dropped, or too far down to order)
    uint32_t key[V], top = 0;
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) {
        key[j] = static_cast<uint32_t>(sort_key(choice[j])) ^ 0x80000000u;  // unsigned, in sort_key's order
        top = kept ? max(top, key[j]) : top;
    }
    top = __reduce_max_sync(kFullMask, top);
#pragma unroll
    for (uint32_t j = 0; j < V; ++j) {
        const uint32_t below = top - key[j];
        key[j] = kept && below < (1u << (32 - kCodeBits)) - 1 ? (((1u << (32 - kCodeBits)) - 1 - below) << kCodeBits) | (511 - (lane * V + j)) : 0;
    }
    sort_descending(key);
    uint32_t my_key = 0;
    pop_picks<V, kTopK, kTopK>(key, lane, my_key);
    if (!__all_sync(kFullMask, lane >= kTopK || (my_key >> kCodeBits) != 0)) {
        return pick_exact_wide<V, LPG, kHasBias>(lane_logits, bias, lane, topk_group, kTopK);
    }
    return static_cast<int32_t>(511 - (my_key & 511));
}

// One block per SM, of 32 warps at most (16 above V = 8, for their 128 registers; the wrapper launches one a
// token where a block has fewer). Block b routes tokens [b·T / B, (b+1)·T / B), its warps taking them one at a
// time (after the first) from a shared counter (the next one's logits load while a warp picks), so the warps
// the scheduler favours do more of them and the block ends with its last token, not its slowest warp's share.
// A token's weights are computed later, with those of 32 / kTopK tokens the warp picked, one pick a lane.
// `exact_only`: every token takes the exact path (a measurement switch, MOE_FP8_ROUTING_EXACT=1). `bias`:
// contiguous, 16-byte aligned.
template <uint32_t V>
constexpr uint32_t kThreads = V <= 8 ? 1024 : 512;
// Whether the PDL-launched kernel after routing (the dispatch) may launch at this kernel's start, or only as its
// blocks exit. NOTE: measured, not understood (H100, decode graphs with the router GEMM before routing; session 52,
// docs/kernels/datapath.md): after the V > 8 variants (Kimi-K2's 384 experts) an early launch made the
// dispatch end ~9.5 us after routing instead of ~3.3 in nearly every replay (Kimi-K2's decode step at 1-4 tokens
// 5-23% slower), whatever the routing's length, registers, shared memory or its own PDL wait; the V <= 8 ones rarely
// showed it, and for them the early launch saves ~1 us (the dispatch's launch and first loads hidden under routing).
// (MOE_FP8_ROUTING_EARLY_DEPENDENTS=0/1 overrides it: a measurement switch, scripts/ab_routing_dependents.py.)
#ifndef MOE_FP8_ROUTING_EARLY_DEPENDENTS
template <uint32_t V>
constexpr bool kEarlyDependents = V <= 8;
#else
template <uint32_t V>
constexpr bool kEarlyDependents = MOE_FP8_ROUTING_EARLY_DEPENDENTS;
#endif

template <typename TLogit, typename TBias, uint32_t V, uint32_t LPG, uint32_t kTopK, uint32_t kTopKGroup,
          bool kHasBias>
__global__ void __launch_bounds__(kThreads<V>, 1) select_experts_kernel(
    const TLogit* __restrict__ logits, const TBias* __restrict__ bias, float* __restrict__ weights,
    int32_t* __restrict__ ids, uint32_t num_tokens, uint64_t stride_t, uint32_t renormalize, float routed_scaling_factor,
    uint32_t exact_only) {
    static_assert(V >= 1 && V <= 16 && kTopK >= 1 && kTopK <= 32, "32 to 512 experts, top-1 to top-32");
    static_assert(LPG == 0 || (LPG <= 32 && (LPG & (LPG - 1)) == 0), "a group is a power-of-two of lanes");
    __shared__ uint32_t taken;  // tokens of the block handed out
    // kSplit's slots for the second halves of the kept lanes' keys, 32 a warp (pick_certified): dynamic shared
    // memory, 512 bytes a warp (the wrapper's split_smem_bytes)
    extern __shared__ __align__(16) uint4 exchanges[];
    const uint32_t exchange = static_cast<uint32_t>(__cvta_generic_to_shared(exchanges + threadIdx.x / 32 * 32));
    // the data-path kernel after routing (PDL-launched) may become resident and prefetch its rows now
    if constexpr (kEarlyDependents<V>) ptx::launch_dependents();
    // launched as a PDL dependent (of the router GEMM): resident early, reading nothing before that kernel ends
    ptx::wait_prerequisites();
    const uint32_t lane = threadIdx.x % 32;
    const uint32_t per_block = num_tokens / gridDim.x, rest = num_tokens % gridDim.x;
    const uint32_t first = blockIdx.x * per_block + min(blockIdx.x, rest);
    const uint32_t count = per_block + (blockIdx.x < rest ? 1 : 0);
    const auto take = [&]() {  // the next token of the block (≥ count: none left)
        uint32_t i = 0;
        if (lane == 0) i = ptx::atomic_inc_shared(&taken, 0x7fffffffu);  // (a block's tokens never wrap)
        return __shfl_sync(kFullMask, i, 0);
    };

    // the lane's logits of the block's i-th token (from the parameter each time: two registers fewer held)
    const auto lane_logits = [&](uint32_t i) { return logits + (first + i) * stride_t + lane * V; };
    // A warp's first token is its index: its row is requested at once, beside the bias, with no branch or atomic
    // before it (ptxas put the window's math, which waits for the bias, ahead of those: two round trips). A warp past
    // the block's tokens loads the last row, unused. The index goes through a shuffle: as a plain expression the
    // compiler peeled the loop for it and spilled.
    uint32_t next = __shfl_sync(kFullMask, threadIdx.x / 32, 0);
    uint32_t logit[2][kRowWords<TLogit, V>];  // the rows of the token being picked and the next one, alternately
    load_row_bits<V, true>(lane_logits(min(next, count - 1)), logit[0]);
    float biased_offset[V];
    const uint32_t in_range = make_window<V, kHasBias>(bias, lane * V, biased_offset);
    if (threadIdx.x == 0) taken = blockDim.x / 32;  // the counter hands out the rest
    __syncthreads();
    // a pass computes the weights of 32 / kTopK tokens: lane j those of pick j % kTopK of token j / kTopK
    constexpr uint32_t kPerPass = 32 / kTopK;
    const uint32_t lane_token = lane / kTopK, lane_pick = lane % kTopK;
    while (next < count) {
        uint32_t pass_token = 0, picked = 0;
        int32_t pass_id = 0;
        const auto pick = [&](const uint32_t (&cur_bits)[kRowWords<TLogit, V>],
                              uint32_t (&upcoming)[kRowWords<TLogit, V>]) {
            const uint32_t token = next;
            next = take();
            if (next < count) load_row_bits<V, true>(lane_logits(next), upcoming);
            float cur[V];
            row_floats<V, TLogit>(cur_bits, cur);
            int32_t my_id = 0;
            if (exact_only ||
                !pick_certified<V, LPG, kTopK, kTopKGroup>(cur, biased_offset, in_range, lane, my_id, exchange)) {
                my_id = pick_exact<V, LPG, kTopK, kHasBias>(lane_logits(token), bias, lane, kTopKGroup);
            }
            const int32_t id = __shfl_sync(kFullMask, my_id, lane_pick);
            if (lane_token == picked) pass_id = id, pass_token = first + token;
            ++picked;
        };
        while (picked < kPerPass && next < count) {
            pick(logit[0], logit[1]);
            if (picked == kPerPass || next >= count) {  // (an odd pass: its next token starts the next one)
#pragma unroll
                for (uint32_t j = 0; j < kRowWords<TLogit, V>; ++j) logit[0][j] = logit[1][j];
                break;
            }
            pick(logit[1], logit[0]);
        }
        const bool mine = lane_token < picked, unordered = __any_sync(kFullMask, pass_id < 0);
        pass_id &= ~kUnordered;
        const auto pick_logit = [&]() { return load_f32(logits + pass_token * stride_t + pass_id); };
        float score = mine ? sigmoid_f32(pick_logit()) : 0.0f;
        if (unordered) order_picks<32 * V, kTopK, kHasBias>(score, pass_id, bias, lane - lane_pick);
        const float weight = pick_weight<kTopK>(score, lane - lane_pick, renormalize, mine, pick_logit);
        if (mine) {
            weights[static_cast<uint64_t>(pass_token) * kTopK + lane_pick] = weight * routed_scaling_factor;
            ids[static_cast<uint64_t>(pass_token) * kTopK + lane_pick] = pass_id;
        }
    }
}

}  // namespace moe_fp8::routing
