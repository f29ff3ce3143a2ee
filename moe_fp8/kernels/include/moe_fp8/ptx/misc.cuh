// Register reallocation, proxy fences and small conversions.
#pragma once

#include "../common/types.cuh"

namespace moe_fp8::ptx {

// Warpgroup-wide register reallocation; needs a register cap at entry (__launch_bounds__(n, 1)).
template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}

template <uint32_t kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// Programmatic dependent launch: the next kernel on the stream, if launched with the PDL attribute, may
// start now; it still waits (griddepcontrol.wait) for this grid to complete before touching its outputs.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
// ... and this grid, if launched so, waits here until the previous one has completed and its writes are
// visible (a no-op otherwise): nothing before it may read what that kernel writes.
__device__ __forceinline__ void wait_prerequisites() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// *ptr + 1 on shared memory by the calling thread alone (wrapping to 0 past `wrap`), returning the old value.
// `atom.inc`, not `atom.add`: ptxas turns an add (even an inline-asm one, even under `if (lane == 0)`) into a
// warp-aggregated sequence of ~15 instructions (vote, find-leader, popc, shuffle), not an inc.
__device__ __forceinline__ uint32_t atomic_inc_shared(uint32_t* ptr, uint32_t wrap) {
    uint32_t old;
    asm volatile("atom.shared.inc.u32 %0, [%1], %2;"
                 : "=r"(old) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "r"(wrap) : "memory");
    return old;
}

// atomicAdd on global memory by the calling thread alone, relaxed, returning the old value
__device__ __forceinline__ uint32_t atomic_add_gpu_u32(uint32_t* ptr, uint32_t v) {
    uint32_t old;
    asm volatile("atom.relaxed.gpu.global.add.u32 %0, [%1], %2;" : "=r"(old) : "l"(ptr), "r"(v) : "memory");
    return old;
}

// Adds v with release semantics (the caller's earlier writes become visible first); no value back.
__device__ __forceinline__ void red_release_gpu_add_u32(uint32_t* ptr, uint32_t v) {
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(ptr), "r"(v) : "memory");
}

// 16 bytes of read-only global memory, their L2 line allocated evict-first: a stream read once then evicts its
// own lines before other data's (after a flush, before dirty lines that would have to be written back). Not
// volatile: the policy is a pure value the compiler may hoist, and the load may move past other reads.
__device__ __forceinline__ uint4 ld_global_evict_first_v4(const void* ptr) {
    uint64_t policy;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    uint4 v;
    asm("ld.global.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr), "l"(policy));
    return v;
}

// 16 bytes global -> shared without registers (through L2 only); complete after cp_async_wait_all.
__device__ __forceinline__ void cp_async_cg_16(void* smem_dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;"
                 ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst))), "l"(src) : "memory");
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Orders generic-proxy shared-memory accesses before later async-proxy (TMA, wgmma) ones.
__device__ __forceinline__ void fence_proxy_async_shared() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Round-to-nearest pack of two floats into bf16x2 (low half = lo).
__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
    uint32_t out;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(out) : "f"(hi), "f"(lo));
    return out;
}

__device__ __forceinline__ float ld_shared_f32(const float* ptr) {
    float v;
    asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))));
    return v;
}

__device__ __forceinline__ void st_shared_u32(void* ptr, uint32_t v) {
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "r"(v));
}

// Four 8x8 b16 matrices to shared memory: lane i gives row i % 8 of matrix i / 8; register j holds
// this lane's two elements (row lane / 4, columns 2 * (lane % 4) ..+1) of matrix j.
__device__ __forceinline__ void stmatrix_x4(void* ptr, uint32_t r0, uint32_t r1, uint32_t r2, uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "r"(r0), "r"(r1), "r"(r2), "r"(r3));
}

// The shared::cluster address of `ptr`'s counterpart in CTA `cta_id` of the cluster (DSMEM).
__device__ __forceinline__ uint32_t map_shared_to_cta(const void* ptr, uint32_t cta_id) {
    uint32_t remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;"
                 : "=r"(remote)
                 : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "r"(cta_id));
    return remote;
}

__device__ __forceinline__ float ld_shared_cluster_f32(uint32_t cluster_addr) {
    float v;
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(cluster_addr));
    return v;
}

__device__ __forceinline__ void st_shared_f32(float* ptr, float v) {
    asm volatile("st.shared.f32 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "f"(v));
}

__device__ __forceinline__ void st_shared_u16(void* ptr, uint16_t v) {
    asm volatile("st.shared.u16 [%0], %1;" ::"r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))), "h"(v));
}

__device__ __forceinline__ uint4 ld_shared_v4(const void* ptr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(static_cast<uint32_t>(__cvta_generic_to_shared(ptr))));
    return v;
}

__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// L2-only 16-byte accesses (.cg): data another SM wrote (or will read) in this launch; L1 is not coherent.
__device__ __forceinline__ void st_global_cg_v4(float* ptr, float x, float y, float z, float w) {
    asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
}

__device__ __forceinline__ void fence_acq_rel_gpu() {
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
}

__device__ __forceinline__ uint32_t ld_acquire_gpu_u32(const uint32_t* ptr) {
    uint32_t v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(ptr) : "memory");
    return v;
}

__device__ __forceinline__ float ldg_f32(const float* ptr) {
    float v;
    asm volatile("ld.global.nc.f32 %0, [%1];" : "=f"(v) : "l"(ptr));  // volatile: issue where written
    return v;
}

__device__ __forceinline__ int32_t ldg_s32(const int32_t* ptr) {
    int32_t v;
    asm volatile("ld.global.nc.s32 %0, [%1];" : "=r"(v) : "l"(ptr));
    return v;
}

}  // namespace moe_fp8::ptx
