// The permute kernels' (permute.cuh) parts: perm:: word types, FastDiv and batch offsets; the
// argument structs (mirrors of numpy dtypes in cukern/families/permute.py, passed by value);
// the tile kernel's phase 2 in registers (store_regs, store_flat, store_skew).
#pragma once

namespace cukern {

namespace perm {

constexpr int kMaxDims = 8;    // batch dims a kernel decomposes
constexpr int kThreads = 256;  // the most threads a block (__launch_bounds__)

template <int BYTES> struct Bytes;
template <> struct Bytes<1> { typedef unsigned char type; };
template <> struct Bytes<2> { typedef unsigned short type; };
template <> struct Bytes<4> { typedef unsigned int type; };
template <> struct Bytes<8> { typedef unsigned long long type; };
template <> struct Bytes<16> { typedef uint4 type; };
template <int BYTES> using Word = typename Bytes<BYTES>::type;

// Bytes a shared-memory store of a loaded word moves (row tiles): the tile's row pitch is
// 4 (mod 8) elements against bank conflicts, which aligns rows to 4, 8 and 16 bytes for 1-, 2-
// and 4-or-more-byte elements.
__host__ __device__ constexpr int smem_unit(int elem, int vec) {
  return vec * elem < (elem == 1 ? 4 : elem == 2 ? 8 : 16) ? vec * elem
                                                          : (elem == 1 ? 4 : elem == 2 ? 8 : 16);
}

// N elements of T as one word, as elements, and as shared-memory units of SU bytes.
template <typename T, int N, int SU> union Vec {
  static_assert(sizeof(T) * N <= 16 && (sizeof(T) * N) % SU == 0, "a word is 1..16 bytes");
  Word<sizeof(T) * N> w;
  T e[N];
  Word<SU> u[sizeof(T) * N / SU];
};

// Quotient of 0 <= n < 2^31 by a run-time divisor d: (umulhi(n, m) + n) >> s, with
// s = ceil(log2 d) and m = floor(2^32 (2^s - d) / d) + 1 from the host (m = 0, s = 31 for
// d >= 2^31, where every such quotient is 0).
__device__ __forceinline__ unsigned fdiv(unsigned n, unsigned m, unsigned s) {
  return (__umulhi(n, m) + n) >> s;
}

// Dims beside the ones a kernel walks itself, innermost first: sizes, strides (elements) on
// each side, the FastDiv constants of each size.
struct Batch {
  long long size[kMaxDims];
  long long in[kMaxDims];
  long long out[kMaxDims];
  unsigned m[kMaxDims];
  unsigned s[kMaxDims];
  int n;
  int pad_;
};

// Adds the input and output offsets of batch index idx to in and out.
template <typename IDX>
__device__ __forceinline__ void batch_offsets(const Batch& b, IDX idx, IDX& in, IDX& out) {
#pragma unroll
  for (int k = 0; k < kMaxDims; ++k) {
    if (k < b.n) {
      IDX q;
      if (sizeof(IDX) > 4 && idx > IDX(0x7fffffff)) {
        q = idx / IDX(b.size[k]);
      } else {
        q = IDX(fdiv(unsigned(idx), b.m[k], b.s[k]));
      }
      const IDX r = idx - q * IDX(b.size[k]);
      in += r * IDX(b.in[k]);
      out += r * IDX(b.out[k]);
      idx = q;
    }
  }
}

// i / d for a tile or row-tile index i (64-bit kernels: natively past 2^31).
template <typename IDX>
__device__ __forceinline__ IDX div_index(IDX i, long long d, unsigned m, unsigned s) {
  if (sizeof(IDX) > 4 && i > IDX(0x7fffffff)) return i / IDX(d);
  return IDX(fdiv(unsigned(i), m, s));
}

// Words a rows-kernel thread keeps in flight: 4 of 16 bytes, 8 narrower ones.
__host__ __device__ constexpr int rows_unroll(int bytes) { return bytes >= 16 ? 4 : 8; }

// Words a tile-kernel thread loads (or gathers) before it stores them.
constexpr int kTileUnroll = 4;

}  // namespace perm

// permute_rows: y[out_base + batch_out + c * out_step] = x[in_base + batch_in + c * in_step] for
// every row (a batch index) and 0 <= c < len, in words W.
struct PermuteRowsArgs {
  perm::Batch batch;            // the rows: every dim but the walked one
  long long in_base, out_base;  // offsets (words) of the first element visited
  long long len;                // words a row
  long long in_step, out_step;  // the walked dim's strides, in words
  long long rows;               // batch indices (product of the batch sizes)
  long long tiles;              // row tiles (TY rows) x segments (TX * U words)
  long long segs;               // segments a row, and its FastDiv constants
  unsigned seg_m, seg_s;
  int tail;                     // bytes after len words still to copy (one-row copies)
  int pad_;
};

// permute_tile: for every batch index and (i, o) < (si, so),
// y[out_base + batch_out + i * i_out + o] = x[in_base + batch_in + o * o_in + i].
// A tile is ti x to; shared memory holds it in input order, row o_l at o_l * pitch (pitch = si
// for a flat input run). Phase 1 loads words of VI elements along i (or along the flat run) and
// stores them to shared memory; phase 2 gathers VO elements along o for one i into a word and
// stores it along the output row (or the flat output run). Phase 2 lanes take 2^group adjacent
// o-words of one row (32 bytes: whole sectors), then the next rows. REGS: phase 2 reads whole
// 32-bit words of shared memory instead (perm::store_regs); FO, 16-byte row chunks of a flat
// output run of FO-element blocks (perm::store_flat); SK, skewed 32-bit columns of a flat output
// run of channels (perm::store_skew).
struct PermuteTileArgs {
  perm::Batch batch;            // every dim but i and o
  long long in_base, out_base;  // element offsets of the first element visited
  long long si, so;             // sizes of i and o
  long long o_in, i_out;        // input stride of o, output stride of i
  long long tiles;              // batch x tiles along o x tiles along i
  int ti, to;                   // tile extents along i and o
  int pitch;                    // shared-memory elements between tile rows
  int nti, nto;                 // tiles along i a panel and along o, their FastDiv constants
  unsigned nti_m, nti_s, nto_m, nto_s;
  int flat_in;                  // ti == si and o_in == si: a tile's input is one run
  int flat_out;                 // to == so and i_out == so: a tile's output is one run
  int in_words;                 // VI-words a tile row (row input), and its FastDiv constants
  unsigned in_words_m, in_words_s;
  int out_words;                // VO-words an output tile row (row output)
  int group;                    // log2 of the o-words adjacent lanes take (row output)
  unsigned ti_m, ti_s;          // FastDiv constants of ti
  unsigned so_m, so_s;          // FastDiv constants of so (flat output)
  int npi;                      // panels along i (nti tiles each), and its FastDiv constants
  unsigned npi_m, npi_s;
  int pad_;
};

namespace perm {

// Output row r of an R x VO block held as VO 32-bit words along o, word j holding R = 4 / E
// elements along i: the r-th element of each word, packed (__byte_perm: a 4 x 4 byte or 2 x 2
// half-word transpose a group of R words).
template <typename T, int VO>
__device__ __forceinline__ void regs_row(const unsigned (&w)[VO], int r, Vec<T, VO, 4>& out) {
  constexpr int R = 4 / int(sizeof(T));
#pragma unroll
  for (int m = 0; m < VO / R; ++m) {
    const unsigned* q = w + m * R;
    if constexpr (R == 4) {
      // pairs of rows first: lo = (q0.b0, q1.b0, q0.b1, q1.b1), hi = the same of q2, q3
      const unsigned lo = __byte_perm(q[0], q[1], r < 2 ? 0x5140 : 0x7362);
      const unsigned hi = __byte_perm(q[2], q[3], r < 2 ? 0x5140 : 0x7362);
      out.u[m] = __byte_perm(lo, hi, (r & 1) ? 0x7632 : 0x5410);
    } else {
      out.u[m] = __byte_perm(q[0], q[1], r ? 0x7632 : 0x5410);
    }
  }
}

// Phase 2 of permute_tile<..., REGS = true> (1- and 2-byte elements, output rows, a pitch of
// 4 (mod 8) elements: row tiles, or a flat input run of such a length; VO * E >= 4): an item
// is R = 4 / E adjacent i by VO adjacent o; its thread reads VO 32-bit words of shared memory
// (one a tile row; the pitch keeps lanes of consecutive items on distinct banks), transposes
// them in registers and stores R words of VO elements, one an output row. Lanes take 2^group adjacent o-words of R rows (32 bytes:
// whole sectors), then the next R rows; 4 / R items a thread in flight (4 stores, as phase 2's
// gather). y0: the output offset of the tile's (i0, o0).
template <typename T, int VO, typename IDX>
__device__ __forceinline__ void store_regs(const T* s, T* __restrict__ yb, const PermuteTileArgs& a,
                                           int ti_e, int to_e, IDX y0, IDX i_out) {
  constexpr int E = sizeof(T);
  constexpr int R = 4 / E;
  constexpr int LR = R == 4 ? 2 : 1;
  constexpr int UR = kTileUnroll / R;
  static_assert(E <= 2 && VO * E >= 4, "REGS: 1- or 2-byte elements, words of 4 bytes or more");
  typedef Vec<T, VO, 4> Out;
  const int NT = blockDim.x;
  const int nq = a.ti >> LR;  // items along i (ti: a multiple of R, the pitch 4 (mod 8))
  const int items = nq * a.out_words;
  const int gmask = (1 << a.group) - 1;
  const int pw = a.pitch / R;  // the pitch in 32-bit words
  for (int w0 = threadIdx.x; w0 < items; w0 += UR * NT) {
    Out v[UR][R];
    int nr[UR], nv[UR];
    IDX g[UR];
#pragma unroll
    for (int k = 0; k < UR; ++k) {
      const int w = w0 + k * NT;
      nr[k] = 0;
      nv[k] = 0;
      g[k] = 0;
      if (w < items) {
        const int r = w >> a.group;
        const int og = int(fdiv(unsigned(r) << LR, a.ti_m, a.ti_s));  // r / nq
        const int il = (r - og * nq) << LR;
        const int ol = ((og << a.group) | (w & gmask)) * VO;
        const int rows = ti_e - il, left = to_e - ol;
        if (rows > 0 && left > 0) {
          nr[k] = rows < R ? rows : R;
          nv[k] = left < VO ? left : VO;
          g[k] = y0 + IDX(il) * i_out + ol;
          const unsigned* src = reinterpret_cast<const unsigned*>(s + ol * a.pitch + il);
          unsigned words[VO];
#pragma unroll
          for (int j = 0; j < VO; ++j) words[j] = src[j * pw];
#pragma unroll
          for (int rr = 0; rr < R; ++rr) regs_row<T, VO>(words, rr, v[k][rr]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < UR; ++k) {
#pragma unroll
      for (int rr = 0; rr < R; ++rr) {
        if (rr < nr[k]) {
          T* d = yb + g[k] + IDX(rr) * i_out;
          if (nv[k] == VO) {
            *reinterpret_cast<Word<VO * E>*>(d) = v[k][rr].w;
          } else {
#pragma unroll
            for (int j = 0; j < VO; ++j)
              if (j < nv[k]) d[j] = v[k][rr].e[j];
          }
        }
      }
    }
  }
}

// Phase 2 of permute_tile<..., FO> (a flat output run of FO-element blocks, FO = so = 3: the
// C = 3 side of NCHW -> NHWC; words of VO * E = 16 bytes; shared-memory rows 16-byte aligned:
// a pitch of ti, or a flat input run of a multiple of VO): the run is ti_e blocks of FO
// elements, and VO consecutive blocks (il0 = u * VO) make FO output words. The thread of word
// w (u = w / FO, k = w - u * FO) reads the FO row chunks s[ol * pitch + il0 ..+ VO) as one
// 16-byte word each (lanes 3 to a chunk: broadcast, no bank conflicts), interleaves them in
// registers (element p of the FO words is row p % FO, element p / FO) and stores word k.
// Elements past ti_e in a partial last chunk are read but never stored. y0: the output offset
// of the tile's run.
template <typename T, int VO, int FO, typename IDX>
__device__ __forceinline__ void store_flat(const T* s, T* __restrict__ yb, const PermuteTileArgs& a,
                                           int ti_e, IDX y0) {
  constexpr int E = sizeof(T);
  // words a thread in flight: 4 of int8 (12 loads); 2 of wider elements, which spilled with 4
  constexpr int UN = E == 1 ? kTileUnroll : kTileUnroll / 2;
  static_assert(VO * E == 16 && FO >= 2, "FO: 16-byte words, blocks of 2 or more");
  typedef Vec<T, VO, 16> Row;
  const int NT = blockDim.x;
  const int n_out = ti_e * FO;
  const int words = (n_out + VO - 1) / VO;
  for (int w0 = threadIdx.x; w0 < words; w0 += UN * NT) {
    Row v[UN];
    int nv[UN];
#pragma unroll
    for (int k = 0; k < UN; ++k) {
      const int w = w0 + k * NT;
      nv[k] = 0;
      if (w < words) {
        const int u = w / FO;  // FO: a compile-time constant
        const int kk = w - u * FO;
        const T* src = s + u * VO;
        Row r[FO], o[FO];
#pragma unroll
        for (int ol = 0; ol < FO; ++ol)
          r[ol].w = *reinterpret_cast<const uint4*>(src + ol * a.pitch);
#pragma unroll
        for (int p = 0; p < FO * VO; ++p) o[p / VO].e[p % VO] = r[p % FO].e[p / FO];
        v[k] = o[0];
#pragma unroll
        for (int c = 1; c < FO; ++c)
          if (kk == c) v[k] = o[c];
        nv[k] = n_out - w * VO < VO ? n_out - w * VO : VO;
      }
    }
#pragma unroll
    for (int k = 0; k < UN; ++k) {
      T* d = yb + y0 + IDX(w0 + k * NT) * VO;
      if (nv[k] == VO) {
        *reinterpret_cast<uint4*>(d) = v[k].w;
      } else {
#pragma unroll
        for (int j = 0; j < VO; ++j)
          if (j < nv[k]) d[j] = v[k].e[j];
      }
    }
  }
}

// Rows of the column before (channel c0 - 1) an item of perm::store_skew reads: the largest
// offset b = (c0 * L) mod VO of a column's first word, VO - gcd(R * D, VO) (0 where R * D is a
// multiple of VO: every column starts on a word).
__host__ __device__ constexpr int skew_gcd(int a, int b) {
  return b == 0 ? a : skew_gcd(b, a % b);
}
__host__ __device__ constexpr int skew_spill(int elem, int d) {
  return (4 / elem) * d % (16 / elem) == 0 ? 0
                                           : 16 / elem - skew_gcd((4 / elem) * d, 16 / elem);
}

// Channel j's word of a perm::store_skew item from its NS row words w (and, for j = 0, NA
// words sp of the column before): element m is at slot q = m + (R - 1 - j) D, byte (or
// half-word) j of w[q], or of the channel before where q < ns (row < 0): byte j - 1 of w[q],
// byte R - 1 of sp[m] for j = 0. ns = 0 (a literal) makes every selector a constant.
template <typename T, int VO, int D, int NS, int NA>
__device__ __forceinline__ Vec<T, VO, 4> skew_word(const unsigned (&w)[NS],
                                                   const unsigned (&sp)[NA > 0 ? NA : 1], int j,
                                                   int ns) {
  constexpr int R = 4 / int(sizeof(T));
  Vec<T, VO, 4> v;
#pragma unroll
  for (int m4 = 0; m4 < 4; ++m4) {
    unsigned src[R];
    int sel[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int m = m4 * R + r;
      const int q = m + (R - 1 - j) * D;
      const bool neg = q < ns;
      if (j == 0 && m < NA && neg) {
        src[r] = sp[m < NA ? m : 0];
        sel[r] = R - 1;
      } else {
        src[r] = w[q];
        sel[r] = neg ? j - 1 : j;
      }
    }
    if constexpr (R == 4) {
      const unsigned lo = __byte_perm(src[0], src[1], unsigned(sel[0] | (sel[1] + 4) << 4));
      const unsigned hi = __byte_perm(src[2], src[3], unsigned(sel[2] | (sel[3] + 4) << 4));
      v.u[m4] = __byte_perm(lo, hi, 0x5410);
    } else {
      const unsigned h0 = unsigned(2 * sel[0]), h1 = unsigned(2 * sel[1] + 4);
      v.u[m4] = __byte_perm(src[0], src[1], h0 | (h0 + 1) << 4 | h1 << 8 | (h1 + 1) << 12);
    }
  }
  return v;
}

// Phase 2 of permute_tile<..., SK = D> (1- and 2-byte elements, a flat output run of channels
// of L = so >= VO elements with L mod VO = D in {0, 1, 4}, 16-byte stores, tile rows 4 (mod 8)
// elements apart): the run of the tile is ti_e channels of L elements; channel c's words are
// w = floor(c L / VO) + k for k < floor((c + 1) L / VO) - floor(c L / VO) (the word holding
// the channel's first element is the channel's, whatever of channel c - 1 it holds). An item
// (column u: channels c0 = u R .. c0 + R - 1, one 32-bit shared-memory word a row; k) makes
// word k of each of its R channels: channel j's word starts at row k VO - b - j D
// (b = c0 L mod VO; (R - 1) D < gcd(R D, VO) keeps b + j D under VO), so the R words read
// NS = VO + (R - 1) D rows of the column (one 32-bit load each, shared by the R channels)
// where a gather reads VO elements a word. A negative row is channel c - 1's row + L: the same
// column (byte j - 1), or for j = 0 the column before (byte R - 1, NA loads). Lanes take items
// in runs of 2^group consecutive k (2^group words of a channel's run a store), then the next
// column, then the next run (k fastest alone would put a warp's rows VO apart: 2 banks a
// load). y0: the output offset of the tile's run.
template <typename T, int VO, int D, typename IDX>
__device__ __forceinline__ void store_skew(const T* s, T* __restrict__ yb, const PermuteTileArgs& a,
                                           int ti_e, IDX y0) {
  constexpr int E = sizeof(T);
  constexpr int R = 4 / E;
  constexpr int NS = VO + (R - 1) * D;
  constexpr int NA = skew_spill(E, D);
  static_assert(E <= 2 && VO * E == 16, "SK: 1- or 2-byte elements, 16-byte words");
  static_assert((R - 1) * D < skew_gcd(R * D, VO), "SK: b + j D stays under VO");
  const int L = int(a.so);
  const int n_out = ti_e * L;
  const int nu = a.ti / R;  // columns
  const int K = L / VO + 1;  // the most words a channel owns
  const int gk = a.group;  // log2 of the consecutive k lanes take
  const int items = (nu * ((K + (1 << gk) - 1) >> gk)) << gk;
  const int pw = a.pitch / R;  // the pitch in 32-bit words
  const unsigned* s32 = reinterpret_cast<const unsigned*>(s);
  for (int it = threadIdx.x; it < items; it += blockDim.x) {
    const int pr = it >> gk;
    const int kb = pr / nu;
    const int u = pr - kb * nu;
    const int k = (kb << gk) + (it & ((1 << gk) - 1));
    const int c0 = u * R;
    const int b = NA > 0 ? (c0 * L) & (VO - 1) : 0;  // NA = 0: every column starts on a word
    const int t0 = k * VO - b - (R - 1) * D;  // the row of slot 0
    const int ns = t0 < 0 ? -t0 : 0;          // slots before row 0
    unsigned w[NS];
#pragma unroll
    for (int q = 0; q < NS; ++q) {
      const int t = t0 + q < 0 ? t0 + q + L : t0 + q;
      w[q] = t < L ? s32[t * pw + u] : 0u;  // rows past L: no word of the item reads them
    }
    unsigned sp[NA > 0 ? NA : 1];  // j = 0 before its row 0: the column before, byte R - 1
#pragma unroll
    for (int m = 0; m < NA; ++m)
      sp[m] = m < ns - (R - 1) * D ? s32[(t0 + (R - 1) * D + m + L) * pw + u - 1] : 0u;
#pragma unroll
    for (int j = 0; j < R; ++j) {
      const int c = c0 + j;
      const int wc = (c * L) / VO;  // the channel's first word
      const int g = wc + k;
      if (k >= ((c + 1) * L) / VO - wc || g * VO >= n_out) continue;  // not the channel's
      // items of rows from 0 (all but a channel's first word) select bytes known at compile time
      const Vec<T, VO, 4> v = ns == 0 ? skew_word<T, VO, D, NS, NA>(w, sp, j, 0)
                                      : skew_word<T, VO, D, NS, NA>(w, sp, j, ns);
      T* d = yb + y0 + IDX(g) * VO;
      if ((g + 1) * VO <= n_out) {
        *reinterpret_cast<uint4*>(d) = v.w;
      } else {
#pragma unroll
        for (int x = 0; x < VO; ++x)
          if (g * VO + x < n_out) d[x] = v.e[x];
      }
    }
  }
}

}  // namespace perm

}  // namespace cukern
