// Shared device code for every cukern kernel family: storage types, numeric conversion,
// vector packs, Load/Store functors, warp/block reductions and small math helpers.
// Compiled through NVRTC with no CUDA headers: half and bfloat16 are plain 16-bit storage
// types converted with PTX instructions, so the compile check needs nothing but NVRTC itself.
#pragma once

namespace cukern {

typedef long long i64;

// ---------------------------------------------------------------------------------------------
// Storage types and conversion to/from the compute type.
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

template <typename T> struct Num;

template <> struct Num<float> {
  typedef float compute;
  static __device__ __forceinline__ float to(float v) { return v; }
  static __device__ __forceinline__ float from(float v) { return v; }
};

template <> struct Num<double> {
  typedef double compute;
  static __device__ __forceinline__ double to(double v) { return v; }
  static __device__ __forceinline__ double from(double v) { return v; }
};

template <> struct Num<f16> {
  typedef float compute;
  static __device__ __forceinline__ float to(f16 v) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
  }
  static __device__ __forceinline__ f16 from(float v) {
    f16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));
    return h;
  }
};

template <> struct Num<bf16> {
  typedef float compute;
  static __device__ __forceinline__ float to(bf16 v) {
    return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
  }
  static __device__ __forceinline__ bf16 from(float v) {
    bf16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));  // sm_80 and newer
    return h;
  }
};

// ---------------------------------------------------------------------------------------------
// Math in the compute type (float or double).
template <typename C> struct Math;

template <> struct Math<float> {
  static __device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
  static __device__ __forceinline__ float exp(float v) { return expf(v); }
  static __device__ __forceinline__ float log(float v) { return logf(v); }
  static __device__ __forceinline__ float rsqrt(float v) { return rsqrtf(v); }
  static __device__ __forceinline__ float div(float a, float b) { return a / b; }
};

template <> struct Math<double> {
  static __device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000LL); }
  static __device__ __forceinline__ double exp(double v) { return ::exp(v); }
  static __device__ __forceinline__ double log(double v) { return ::log(v); }
  static __device__ __forceinline__ double rsqrt(double v) { return ::rsqrt(v); }
  static __device__ __forceinline__ double div(double a, double b) { return a / b; }
};

// A max that keeps NaN, so a NaN anywhere in a row reaches every output of that row.
template <typename C> __device__ __forceinline__ C max_nan(C a, C b) {
  return (a > b || a != a) ? a : b;
}

// ---------------------------------------------------------------------------------------------
// Vector packs: N elements of T moved by one load or store instruction.
template <int BYTES> struct Word;
template <> struct Word<2> { typedef unsigned short type; };
template <> struct Word<4> { typedef unsigned int type; };
template <> struct Word<8> { typedef uint2 type; };
template <> struct Word<16> { typedef uint4 type; };

template <typename T, int N> union Pack {
  typedef typename Word<sizeof(T) * N>::type word_t;
  word_t word;
  T elem[N];
};

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

// Reads N consecutive columns of one row and converts them to the compute type.
template <typename T, typename C, bool STRIDED> struct Load {
  const T* ptr;
  Layout<STRIDED> at;
  template <int N> __device__ __forceinline__ void load(C* dst, i64 row, int col) const {
    if (STRIDED) {
#pragma unroll
      for (int i = 0; i < N; ++i) dst[i] = Num<T>::to(ptr[at.offset(row, col + i)]);
    } else {
      Pack<T, N> pack;
      pack.word = *reinterpret_cast<const typename Pack<T, N>::word_t*>(ptr + at.offset(row, col));
#pragma unroll
      for (int i = 0; i < N; ++i) dst[i] = Num<T>::to(pack.elem[i]);
    }
  }
};

// Converts N compute values to T and writes them to N consecutive columns of one row.
template <typename C, typename T, bool STRIDED> struct Store {
  T* ptr;
  Layout<STRIDED> at;
  template <int N> __device__ __forceinline__ void store(const C* src, i64 row, int col) const {
    if (STRIDED) {
#pragma unroll
      for (int i = 0; i < N; ++i) ptr[at.offset(row, col + i)] = Num<T>::from(src[i]);
    } else {
      Pack<T, N> pack;
#pragma unroll
      for (int i = 0; i < N; ++i) pack.elem[i] = Num<T>::from(src[i]);
      *reinterpret_cast<typename Pack<T, N>::word_t*>(ptr + at.offset(row, col)) = pack.word;
    }
  }
};

// A row cached on chip in the storage type: packs of N elements in shared memory.
template <typename T, typename C, int N> struct SmemRow {
  T* base;
  __device__ __forceinline__ void put(int pack_id, const C* v) const {
    Pack<T, N> pack;
#pragma unroll
    for (int i = 0; i < N; ++i) pack.elem[i] = Num<T>::from(v[i]);
    reinterpret_cast<typename Pack<T, N>::word_t*>(base)[pack_id] = pack.word;
  }
  __device__ __forceinline__ void get(int pack_id, C* v) const {
    Pack<T, N> pack;
    pack.word = reinterpret_cast<const typename Pack<T, N>::word_t*>(base)[pack_id];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = Num<T>::to(pack.elem[i]);
  }
};

// ---------------------------------------------------------------------------------------------
// Reductions.
struct SumOp {
  template <typename C> static __device__ __forceinline__ C apply(C a, C b) { return a + b; }
  template <typename C> static __device__ __forceinline__ C identity() { return C(0); }
};
struct MaxOp {
  template <typename C> static __device__ __forceinline__ C apply(C a, C b) { return max_nan(a, b); }
  template <typename C> static __device__ __forceinline__ C identity() { return -Math<C>::inf(); }
};

// Butterfly all-reduce inside groups of WIDTH consecutive lanes (WIDTH a power of two <= 32).
// Every lane of the warp must call it.
template <typename Op, int WIDTH, typename C> __device__ __forceinline__ C group_allreduce(C v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) {
    v = Op::apply(v, __shfl_xor_sync(0xffffffffu, v, mask, WIDTH));
  }
  return v;
}

// All-reduce over a block of BLOCK threads (a multiple of 32). Every thread must call it;
// it ends with a barrier, so calls may follow each other.
template <typename Op, int BLOCK, typename C> __device__ __forceinline__ C block_allreduce(C v) {
  constexpr int WARPS = BLOCK / 32;
  __shared__ C partial[WARPS];
  __shared__ C result;
  v = group_allreduce<Op, 32>(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    C w = lane < WARPS ? partial[lane] : Op::template identity<C>();
    w = group_allreduce<Op, 32>(w);
    if (lane == 0) result = w;
  }
  __syncthreads();
  v = result;
  __syncthreads();
  return v;
}

// ---------------------------------------------------------------------------------------------
// Online softmax state: the running max m and the sum d of exp(x - m) seen so far.
template <typename C> struct MaxSum {
  C m, d;
  static __device__ __forceinline__ MaxSum empty() { return MaxSum{-Math<C>::inf(), C(0)}; }
  // Rescale a partial sum to a new max; an empty part (m == -inf) contributes nothing.
  __device__ __forceinline__ C sum_at(C new_m) const {
    return m == -Math<C>::inf() ? C(0) : d * Math<C>::exp(m - new_m);
  }
  static __device__ __forceinline__ MaxSum merge(const MaxSum& a, const MaxSum& b) {
    const C m = max_nan(a.m, b.m);
    return MaxSum{m, a.sum_at(m) + b.sum_at(m)};
  }
  // Folds N values into the state with one rescale.
  template <int N> __device__ __forceinline__ void add(const C* v) {
    C pm = m;
#pragma unroll
    for (int i = 0; i < N; ++i) pm = max_nan(pm, v[i]);
    C s = sum_at(pm);
#pragma unroll
    for (int i = 0; i < N; ++i) s += Math<C>::exp(v[i] - pm);
    m = pm;
    d = s;
  }
};

template <int WIDTH, typename C> __device__ __forceinline__ MaxSum<C> group_allreduce(MaxSum<C> v) {
#pragma unroll
  for (int mask = WIDTH / 2; mask > 0; mask /= 2) {
    MaxSum<C> o{__shfl_xor_sync(0xffffffffu, v.m, mask, WIDTH),
                __shfl_xor_sync(0xffffffffu, v.d, mask, WIDTH)};
    v = MaxSum<C>::merge(v, o);
  }
  return v;
}

template <int BLOCK, typename C> __device__ __forceinline__ MaxSum<C> block_allreduce(MaxSum<C> v) {
  constexpr int WARPS = BLOCK / 32;
  __shared__ C pm[WARPS], pd[WARPS];
  __shared__ C rm, rd;
  v = group_allreduce<32>(v);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) { pm[warp] = v.m; pd[warp] = v.d; }
  __syncthreads();
  if (warp == 0) {
    MaxSum<C> w = lane < WARPS ? MaxSum<C>{pm[lane], pd[lane]} : MaxSum<C>::empty();
    w = group_allreduce<32>(w);
    if (lane == 0) { rm = w.m; rd = w.d; }
  }
  __syncthreads();
  v = MaxSum<C>{rm, rd};
  __syncthreads();
  return v;
}

// ---------------------------------------------------------------------------------------------
// Thread-block clusters (sm_90): barriers and reads of another block's shared memory.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}
__device__ __forceinline__ unsigned cluster_rank() {
  unsigned r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
  return r;
}
// The shared-memory address of `p` in the block of cluster rank `rank`.
__device__ __forceinline__ unsigned cluster_map(const void* p, unsigned rank) {
  unsigned local, remote;
  asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }"
               : "=r"(local) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}
__device__ __forceinline__ float cluster_load(unsigned addr, float) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(addr) : "memory");
  return v;
}
__device__ __forceinline__ double cluster_load(unsigned addr, double) {
  double v;
  asm volatile("ld.shared::cluster.f64 %0, [%1];" : "=d"(v) : "r"(addr) : "memory");
  return v;
}

}  // namespace cukern
