// Asynchronous copies from global to shared memory (cp.async), on their own: the permute
// kernels, which need none of types.cuh, take them too.
#pragma once
#include "fallbacks.cuh"

namespace cukern {

// Asynchronous copies from global to shared memory (sm_80+): a thread can have every pack it
// owns in flight at once, whatever the compiler's register budget, and waits once. Before
// sm_80 (CUKERN_FALLBACKS), plain copies.
__device__ __forceinline__ unsigned shared_address(const void* p) {
  unsigned a;
  asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  return a;
}
// dst: a shared-memory address (shared_address), which a loop can compute once.
template <int BYTES> __device__ __forceinline__ void cp_async_to(unsigned dst, const void* src) {
  static_assert(BYTES == 4 || BYTES == 8 || BYTES == 16, "cp.async moves 4, 8 or 16 bytes");
#ifdef CUKERN_FALLBACKS
  // Before sm_80: one load and one store, done when the thread goes on. Every use reads back
  // only the packs the same thread copied, so the waits below have nothing left to wait for.
  if (BYTES == 16) {
    const uint4 w = *static_cast<const uint4*>(src);
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(w.x), "r"(w.y),
                 "r"(w.z), "r"(w.w)
                 : "memory");
  } else if (BYTES == 8) {
    const uint2 w = *static_cast<const uint2*>(src);
    asm volatile("st.shared.v2.u32 [%0], {%1, %2};" ::"r"(dst), "r"(w.x), "r"(w.y) : "memory");
  } else {
    const unsigned w = *static_cast<const unsigned*>(src);
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(dst), "r"(w) : "memory");
  }
#else
  if (BYTES == 16) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
  } else {
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2;" ::"r"(dst), "l"(src), "n"(BYTES)
                 : "memory");
  }
#endif
}
template <int BYTES> __device__ __forceinline__ void cp_async(void* dst, const void* src) {
  cp_async_to<BYTES>(shared_address(dst), src);
}
// The waits. With the fallback's synchronous copies they only keep the compiler from moving
// shared-memory accesses across them (the "memory" clobber), as the instructions do.
__device__ __forceinline__ void cp_async_wait_all() {
#ifdef CUKERN_FALLBACKS
  asm volatile("" ::: "memory");
#else
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
// Closes the group of copies issued since the last commit; wait_group<N> waits until at most
// the N most recent groups are still in flight.
__device__ __forceinline__ void cp_async_commit() {
#ifdef CUKERN_FALLBACKS
  asm volatile("" ::: "memory");
#else
  asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
template <int N> __device__ __forceinline__ void cp_async_wait_group() {
#ifdef CUKERN_FALLBACKS
  asm volatile("" ::: "memory");
#else
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

}  // namespace cukern
