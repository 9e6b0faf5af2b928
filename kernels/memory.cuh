// Global and shared memory: Layout, the Load and Store functors, shared-memory row caches,
// asynchronous copies (async_copy.cuh), L2 prefetch and the dynamic shared memory.
#pragma once
#include "async_copy.cuh"
#include "types.cuh"

namespace cukern {

// One store instruction of a whole word to global memory.
__device__ __forceinline__ void store_global(unsigned short* p, unsigned short w) { *p = w; }
__device__ __forceinline__ void store_global(unsigned* p, unsigned w) {
  asm volatile("st.global.u32 [%0], %1;" ::"l"(p), "r"(w) : "memory");
}
__device__ __forceinline__ void store_global(uint2* p, uint2 w) {
  asm volatile("st.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(w.x), "r"(w.y) : "memory");
}
__device__ __forceinline__ void store_global(uint4* p, uint4 w) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(w.x), "r"(w.y),
               "r"(w.z), "r"(w.w)
               : "memory");
}

// ---------------------------------------------------------------------------------------------
// Where row `row`, column `col` of a (rows, cols) view lives. The host collapses any array to
// rows = outer * inner: element (o, c, i) sits at o * s_outer + c * s_col + i * s_inner.
// Contiguous rows (STRIDED == false) need inner == 1 and s_col == 1, and allow vector packs.
template <bool STRIDED> struct Layout {
  i64 s_outer, s_inner, s_col, inner;
  __device__ __forceinline__ i64 offset(i64 row, int col) const {
    if (STRIDED) {
      return (row / inner) * s_outer + (row % inner) * s_inner + static_cast<i64>(col) * s_col;
    }
    return row * s_outer + col;
  }
};

// Rows off the 16-byte grid (SHIFT: contiguous rows whose length or start is not a multiple of
// 16 bytes, every array's rows starting at the same offset within their 16-byte words): a row
// is read and written in whole 16-byte packs of memory, its own elements at [lo, hi) of them
// (lo: its first element's place in its word). The packs' other elements belong to the
// neighbouring rows: loads put `fill` (the reduction's identity) in their place, or leave them
// to the kernel's mask() of the values (after all of its loads: a masking branch between loads
// made them wait for each other), and stores leave them alone. A 16-byte-aligned word holding
// one element of an array lies in the same memory page, so reading it whole is safe; a pack
// wholly past the row is read as its last one (`last`: that pack's first column).
template <typename T, bool SHIFT> struct RowWindow {
  static constexpr bool kActive = false;
  template <int N, typename C> __device__ __forceinline__ void mask(C*, int, C) const {}
};
template <typename T> struct RowWindow<T, true> {
  static constexpr bool kActive = true;
  int lo, hi, last;
  T fill;
  // a pack at column `col` holds elements of other rows (the row's first or last pack)
  __device__ __forceinline__ bool partial(int col, int n) const { return col < lo || col + n > hi; }
  __device__ __forceinline__ bool has(int col) const { return col >= lo && col < hi; }
  // the N values of the pack at column col, the other rows' replaced by `fill`
  template <int N, typename C> __device__ __forceinline__ void mask(C* v, int col, C f) const {
    if (partial(col, N)) {
#pragma unroll
      for (int i = 0; i < N; ++i) v[i] = has(col + i) ? v[i] : f;
    }
  }
  // the window of the row that begins at p (a row of hi - lo elements, packs of N), and p moved
  // back to the start of its 16-byte word
  template <int N, typename P> __device__ __forceinline__ RowWindow at_row(P*& p) const {
    const int off = static_cast<int>(reinterpret_cast<unsigned long long>(p) & 15) /
                    static_cast<int>(sizeof(T));
    p -= off;
    const int end = off + hi - lo;
    return RowWindow{off, end, (end - 1) & -N, fill};
  }
};

// The packs a row takes: cols / N, or with SHIFT the most a row of cols elements covers on the
// 16-byte grid (its first one at any offset).
template <int N, bool SHIFT> __host__ __device__ constexpr int row_packs(int cols) {
  return SHIFT ? (cols + 2 * N - 2) / N : cols / N;
}

// Reads N consecutive columns of one row and converts them to the compute type; `raw` reads
// them in the storage type. SHIFT: columns count from the row's 16-byte word (win), and the
// view must come from from_row.
template <typename T, typename C, bool STRIDED, bool SHIFT = false> struct Load {
  const T* ptr;
  Layout<STRIDED> at;
  RowWindow<T, SHIFT> win;
  // MASK false (SHIFT): the other rows' elements left as read, for the kernel's win.mask
  template <int N, bool MASK = true>
  __device__ __forceinline__ Pack<T, N> raw(i64 row, int col) const {
    Pack<T, N> pack;
    if (STRIDED) {
#pragma unroll
      for (int i = 0; i < N; ++i) pack.elem[i] = ptr[at.offset(row, col + i)];
    } else if constexpr (SHIFT) {
      pack.word = *reinterpret_cast<const typename Pack<T, N>::word_t*>(
          ptr + at.offset(row, col < win.last ? col : win.last));
      if (MASK && win.partial(col, N)) {
#pragma unroll
        for (int i = 0; i < N; ++i) {
          if (!win.has(col + i)) pack.elem[i] = win.fill;
        }
      }
    } else {
      pack.word = *reinterpret_cast<const typename Pack<T, N>::word_t*>(ptr + at.offset(row, col));
    }
    return pack;
  }
  template <int N, bool MASK = true>
  __device__ __forceinline__ void load(C* dst, i64 row, int col) const {
    const Pack<T, N> pack = raw<N, MASK>(row, col);
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = pack_value(pack, i);
  }
  // The view from row `row` on (its row 0), for a loop over one row's columns: the row's offset
  // (a 64-bit division when STRIDED) computed once, not under each pack's guard.
  __device__ __forceinline__ Load from_row(i64 row) const {
    const T* p = ptr + at.offset(row, 0);
    if constexpr (SHIFT) {
      const RowWindow<T, SHIFT> w = win.template at_row<16 / sizeof(T)>(p);
      return Load{p, at, w};
    } else {
      return Load{p, at};
    }
  }
};

// Converts N compute values to T and writes them to N consecutive columns of one row (SHIFT:
// as Load).
template <typename C, typename T, bool STRIDED, bool SHIFT = false> struct Store {
  T* ptr;
  Layout<STRIDED> at;
  RowWindow<T, SHIFT> win;
  template <int N> __device__ __forceinline__ void store(const C* src, i64 row, int col) const {
    if (STRIDED) {
#pragma unroll
      for (int i = 0; i < N; ++i) ptr[at.offset(row, col + i)] = Num<T>::from(src[i]);
    } else {
      if constexpr (SHIFT) {
        if (win.partial(col, N)) {
#pragma unroll
          for (int i = 0; i < N; ++i) {
            if (win.has(col + i)) ptr[at.offset(row, col + i)] = Num<T>::from(src[i]);
          }
          return;
        }
      }
      T e[N];
#pragma unroll
      for (int i = 0; i < N; ++i) e[i] = Num<T>::from(src[i]);
      store_global(reinterpret_cast<typename Pack<T, N>::word_t*>(ptr + at.offset(row, col)),
                   WordOf<T, N>::make(e));
    }
  }
  // As Load::from_row.
  __device__ __forceinline__ Store from_row(i64 row) const {
    T* p = ptr + at.offset(row, 0);
    if constexpr (SHIFT) {
      const RowWindow<T, SHIFT> w = win.template at_row<16 / sizeof(T)>(p);
      return Store{p, at, w};
    } else {
      return Store{p, at};
    }
  }
};

// A row cached on chip in the storage type: packs of N elements in shared memory.
template <typename T, typename C, int N> struct SmemRow {
  T* base;
  __device__ __forceinline__ void put(int pack_id, const C* v) const {
    T e[N];
#pragma unroll
    for (int i = 0; i < N; ++i) e[i] = Num<T>::from(v[i]);
    reinterpret_cast<typename Pack<T, N>::word_t*>(base)[pack_id] = WordOf<T, N>::make(e);
  }
  __device__ __forceinline__ void get(int pack_id, C* v) const {
    Pack<T, N> pack;
    pack.word = reinterpret_cast<const typename Pack<T, N>::word_t*>(base)[pack_id];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = pack_value(pack, i);
  }
};

// Asks L2 to fetch `bytes` (a multiple of 16) of global memory from `src` (16-byte aligned) in
// the background: one instruction for a whole span, no registers, nothing to wait for (sm_90;
// elsewhere a no-op).
__device__ __forceinline__ void prefetch_l2(const void* src, unsigned bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(src), "r"(bytes) : "memory");
#endif
}
// Stores a row that a warp kernel's lane holds: lane `lane` of a group of `width` holds packs
// p = 0 .. NP - 1 of the row, at columns (p * width + lane) * PACK (those from `cols` on are
// padding); element i of pack p is value(p * PACK + i) (a constant index once unrolled).
template <int NP, int PACK, typename C, typename St, typename F>
__device__ __forceinline__ void store_lane_packs(const St& st, i64 row, int width, int lane,
                                                 int cols, const F& value) {
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    const int col = (p * width + lane) * PACK;
    if (col >= cols) continue;
    C out[PACK];
#pragma unroll
    for (int i = 0; i < PACK; ++i) out[i] = value(p * PACK + i);
    st.template store<PACK>(out, row, col);
  }
}

// Puts `fill` in place of the other rows' elements in the packs a warp kernel's lane holds
// (laid out as for store_lane_packs): a shifted row's end packs (RowWindow).
template <int NP, int PACK, typename W, typename C>
__device__ __forceinline__ void mask_lane_packs(const W& win, int width, int lane, C fill,
                                                C* v) {
#pragma unroll
  for (int p = 0; p < NP; ++p) {
    win.template mask<PACK>(v + p * PACK, (p * width + lane) * PACK, fill);
  }
}

// The dynamic shared memory this launch was given.
__device__ __forceinline__ unsigned dynamic_smem_bytes() {
  unsigned n;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(n));
  return n;
}

// The dynamic shared memory. It begins where the kernel's static shared memory (reduction
// buffers) ends, which ptxas aligns to 16 bytes only; asynchronous copies into a row cache off a
// 128-byte boundary are slower (docs/notes/kernels.md, "Shared memory"). A plan that asks for
// kSmemAlign bytes more (the planner's smem_align) may take it from its first kSmemAlign-byte
// boundary (aligned_dynamic_smem: the norms' backward clusters, whose static buffers end
// anywhere); block kernels whose only static buffers are allreduce_block's 64 states (a multiple
// of 256 bytes) and cluster kernels with none (merge_tail) start on one already and take it as
// it is (dynamic_smem).
constexpr unsigned kSmemAlign = 128;
template <typename T> __device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ uint4 smem_words[];
  return reinterpret_cast<T*>(smem_words);
}
template <typename T> __device__ __forceinline__ T* aligned_dynamic_smem() {
  extern __shared__ uint4 smem_words[];
  const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(smem_words));
  return reinterpret_cast<T*>(reinterpret_cast<char*>(smem_words) +
                              (kSmemAlign - at % kSmemAlign) % kSmemAlign);
}

// A block's reduction buffers at the end of the dynamic shared memory, where the planner adds
// them (plan.rowwise.tail_scratch): in a cluster the merge's four slots of MERGE bytes last
// (merge_tail; MERGE 0 in a block kernel), and before them the block all-reduce's BUFFERS (two,
// or one: reduce.cuh) states a warp (tail_scratch; reduce.cuh's allreduce_block_in). Static
// shared memory counts in whole 128-byte units beside the dynamic and moves where the dynamic
// begins, so static buffers can cost three 64 KiB blocks the 196 KiB carveout step, and the SM
// the L1 that holds its loads in flight (docs/notes/softmax.md, "The carveout"); with none, a
// cached slice at the start is 128-byte aligned for asynchronous copies.
template <int MERGE> __device__ __forceinline__ char* merge_tail() {
  extern __shared__ uint4 smem_words[];
  return reinterpret_cast<char*>(smem_words) + dynamic_smem_bytes() - 4 * MERGE;
}
template <typename S, int MERGE, int BUFFERS = 2> __device__ __forceinline__ S* tail_scratch() {
  const unsigned nwarps = (blockDim.x * blockDim.y + 31) / 32;
  return reinterpret_cast<S*>(merge_tail<MERGE>() - BUFFERS * nwarps * sizeof(S));
}

}  // namespace cukern
