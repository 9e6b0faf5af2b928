// The softmax family's device helpers (kernels/softmax.cuh has the kernels): the per-value
// formulas, the warp kernel's group width, the cached kernels' register caps and widths, the
// kernels' views of their arrays and the addressing of a cached row's packs.
#pragma once
#include "cluster.cuh"

namespace cukern {

enum { kSoftmax = 0, kLogSoftmax = 1 };

// The per-row constant of the output, from the row sum s of exp(x - max): 1 / s for softmax,
// log(s) for log-softmax.
template <int ALGO, typename C> __device__ __forceinline__ C row_constant(C s) {
  return ALGO == kSoftmax ? C(1) / s : Math<C>::log(s);
}

// y for one value, given the row max m and row_constant r.
template <int ALGO, typename T, typename C> __device__ __forceinline__ C softmax_out(C x, C m, C r) {
  if (ALGO == kSoftmax) return Num<T>::exp(x - m) * r;
  return (x - m) - r;
}

// The per-row term summed by the backward: softmax sums dy * y, log-softmax sums dy.
template <int ALGO, typename C> __device__ __forceinline__ C grad_term(C y, C dy) {
  return ALGO == kSoftmax ? dy * y : dy;
}

// dx for one value, given the row sum s of grad_term.
template <int ALGO, typename T, typename C> __device__ __forceinline__ C grad_out(C y, C dy, C s) {
  if (ALGO == kSoftmax) return (dy - s) * y;
  return dy - Num<T>::exp(y) * s;
}

// allreduce_group over a warp kernel's row group of `width` lanes, with the width made a constant
// (one branch a call, not one a shuffle level).
template <typename S> __device__ __forceinline__ S allreduce_row(S v, int width) {
  switch (width) {
    case 32: return allreduce_group(v, 32);
    case 16: return allreduce_group(v, 16);
    case 8: return allreduce_group(v, 8);
    case 4: return allreduce_group(v, 4);
    case 2: return allreduce_group(v, 2);
    default: return v;  // one lane
  }
}

// Runs `body(width)` with a warp kernel's group width: the constant 32 for a full warp (every
// row of more than one pack a lane, and rows of 17..32 packs), else blockDim.x. A run-time 32
// took allreduce_row's switch and each lane's column arithmetic: bfloat16 log-softmax at 256
// columns compiled to 472 instructions against 320 with the constant.
// `body` must be inlined (always_inline) for the constant to reach it.
template <int NP, typename Body> __device__ __forceinline__ void with_group_width(Body body) {
  if (NP > 1 || blockDim.x == 32) {
    body(32);
  } else {
    body(static_cast<int>(blockDim.x));
  }
}

// Registers a thread of the forward cached kernels may use. With the block size unknown, ptxas
// takes up to 64; these are what the kernels took with it known (16-bit types: 40 for 16-byte
// packs, 32 for smaller; float: 48 and 40), which keep three blocks of 512 threads (two for float
// with 16-byte packs) to an SM. Clusters of 16-bit types with 16-byte packs take 48: at 40 the
// log-softmax spills (docs/notes/kernels.md, "Softmax"); so do shifted rows (SHIFT: each view's
// row window) at 40, which take 48.
template <typename T, int PACK, bool CLUSTER, bool SHIFT = false> struct CachedRegs {
  static constexpr bool kWide = PACK * sizeof(T) == 16;
  static constexpr int value = sizeof(T) == 8   ? 64
                               : sizeof(T) == 4 ? (kWide ? 48 : 40)
                                                : (kWide ? (CLUSTER || SHIFT ? 48 : 40) : 32);
  static constexpr bool kHold = value >= 48 && sizeof(T) < 8;  // held row pointers (below)
};

// A cached block kernel's width: WIDTH compiled in (OpPolicy.fixed_widths), or 0: the
// launch's blockDim.x. With it compiled in, a thread's packs are constant strides apart and the
// register cap is what that width allows (__launch_bounds__(WIDTH)'s budget).
template <int WIDTH> __device__ __forceinline__ int block_width() {
  return WIDTH ? WIDTH : static_cast<int>(blockDim.x);
}
template <int WIDTH, int REGS> struct WidthRegs {
  static constexpr int value = WIDTH == 0 ? REGS : (65536 / WIDTH > 255 ? 255 : 65536 / WIDTH);
};

// A kernel's views of its arrays. SHIFT (rows off the 16-byte grid: memory.cuh's RowWindow) has
// the other rows' elements of a row's end packs read as `fill`: -inf in the forward (the max's
// and the sum's identity), 0 in the backward (its sum's).
template <typename T, typename C, bool STRIDED, bool SHIFT>
__device__ __forceinline__ Load<T, C, STRIDED, SHIFT> view_in(const T* p, Layout<STRIDED> at,
                                                              int cols, C fill) {
  if constexpr (SHIFT) {
    return {p, at, {0, cols, 0, Num<T>::from(fill)}};
  } else {
    return {p, at};
  }
}
template <typename C, typename T, bool STRIDED, bool SHIFT>
__device__ __forceinline__ Store<C, T, STRIDED, SHIFT> view_out(T* p, Layout<STRIDED> at,
                                                                int cols) {
  if constexpr (SHIFT) {
    return {p, at, {0, cols, 0, T{}}};
  } else {
    return {p, at};
  }
}

// ---------------------------------------------------------------------------------------------
// Addressing in the cached kernels' loops over a row's packs. With the block size a run-time
// value, each pack's address is its own, and ptxas folded the row's 64-bit offset into every one
// of them, recomputing it (and reloading the base pointer) for each access: 5-10 instructions a
// pack (sm_90 SASS, NVRTC 13), where the block size as a template argument had one address and
// immediate offsets. With HOLD, `held` computes a view's row pointer once and keeps it (opaque
// to that reassociation; still a global pointer: LDG/STG, not generic accesses), and pack_at /
// store_pack address pack q off it with one 32-bit index (IMAD.WIDE): 1 instruction a pack, two
// registers a pointer. Kernels under a 40-register cap take HOLD = false (held pointers spill
// 12-20 bytes there; CachedRegs::kHold), and so does double (more spills at 64).
template <typename T> constexpr bool kGradHold = sizeof(T) < 8;  // the backward (64 registers)
template <bool HOLD, typename V> __device__ __forceinline__ V held(V v) {
  if constexpr (HOLD) {
    asm("mov.b64 %0, %0;" : "+l"(v.ptr));
    __builtin_assume(__isGlobal(v.ptr));
  }
  return v;
}
// SHIFT: the pack as read (a pack past the row's last: the last), the other rows' elements left
// to the caller's win.mask; stores of the row's end packs element by element (Store).
// (Held pointers for shifted rows cost the float backward 3-6 points of copy at 2025-16361
// columns, H200.)
template <int PACK, bool HOLD, typename T, typename C, bool STRIDED, bool SHIFT>
__device__ __forceinline__ Pack<T, PACK> pack_at(const Load<T, C, STRIDED, SHIFT>& lr, int q) {
  if constexpr (STRIDED || SHIFT || !HOLD) {
    return lr.template raw<PACK, false>(0, q * PACK);
  } else {
    Pack<T, PACK> v;
    v.word = reinterpret_cast<const typename Pack<T, PACK>::word_t*>(lr.ptr)[q];
    return v;
  }
}
template <int PACK, bool HOLD, typename C, typename T, bool STRIDED, bool SHIFT>
__device__ __forceinline__ void store_pack(const Store<C, T, STRIDED, SHIFT>& sr, int q,
                                           const C* v) {
  if constexpr (STRIDED || SHIFT || !HOLD) {
    sr.template store<PACK>(v, 0, q * PACK);
  } else {
    T e[PACK];
#pragma unroll
    for (int i = 0; i < PACK; ++i) e[i] = Num<T>::from(v[i]);
    store_global(reinterpret_cast<typename Pack<T, PACK>::word_t*>(sr.ptr) + q,
                 WordOf<T, PACK>::make(e));
  }
}

}  // namespace cukern
