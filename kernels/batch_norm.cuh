// Batch norm over the channel axis of an (A, C, B) = (outer, channels, inner) dense tensor, with
// fused add and ReLU, its ReLU bit mask, and the backward (cukern/ops/batch_norm.py: formulas).
//
// Memory is read as flat packs of PACK elements (16 bytes where alignment allows) in memory order;
// the element at flat index e belongs to channel (e / B) % C. Two layouts:
//   planes   (B > 1: NCHW)                   a pack lies in one channel's plane, or (SPAN:
//                                            B not a multiple of PACK, 7x7 in 16-byte packs:
//                                            C * B % PACK == 0, B >= PACK) spans two:
//                                            reductions skip the other plane's elements
//                                            (bn::plane_bits), elementwise passes take both
//                                            channels' coefficients (bn::plane_span); SPAN is
//                                            a template argument, so whole-pack planes run the
//                                            plain loops
//   columns  (B == 1, C % PACK == 0: NHWC)   a pack holds PACK consecutive channels
//
// Kernels (the planner, cukern/plan/batch_norm.py, shapes every launch at run time):
//   batch_norm_stats_planes<T, PACK, SPAN>        partial Welford states per (channel, split);
//   batch_norm_stats_cols<T, PACK>                with one split, the finished channels
//   batch_norm_finalize<C>                        fixed-order merge -> mean, invstd, running
//                                                 stats, per-channel coefficients (or eval's)
//   batch_norm_apply<T, PACK, COLS, ADD, SPAN>    y = relu?((x - mean) * scale + shift [+ z]),
//                                                 the ReLU mask by __ballot_sync
//   batch_norm_grad_planes<T, PACK, SPAN>         partial (sum g, sum g * (x - mean)); with
//   batch_norm_grad_cols<T, PACK>                 one split, dweight, dbias, dx coefficients
//   batch_norm_grad_finalize<C>                   dweight, dbias, the dx coefficients
//   batch_norm_dx<T, PACK, COLS, SPAN>            dx (and daddend = the masked dy)
//   batch_norm_train_planes<T, PACK, ADD>         training forward in one read: a block a
//                                                 channel held in shared memory (statistics,
//                                                 finish, apply)
//   batch_norm_train_cols<T, PACK, ADD>           the same over columns: a block (or a
//                                                 cluster) a tile of channels
// Every merge runs in a fixed order (no float atomics; the one-read kernel ORs mask words):
// results are bitwise reproducible.
#pragma once
#include "batch_norm_parts.cuh"
#include "cluster.cuh"

namespace cukern {

// ---------------------------------------------------------------------------------------------
// Statistics, planes layout: block (channel c = blockIdx.x, split s = blockIdx.y) reads the
// packs [A W s / S, A W (s + 1) / S) of its channel's flat run of A planes of W packs (a split
// may start or end inside a plane: a few large planes still fill the GPU).
// SPAN (B not a multiple of PACK, bn::plane_bits): W = plane_packs, the packs at a plane's ends
// hold other channels' elements, skipped; else W = B / PACK, every pack whole, and the loop is
// the plain one (no per-pack bit test, 32 bytes in flight a thread: bn::unroll_for).
template <typename T, int PACK, bool SPAN>
__global__ void __launch_bounds__(kBnReduceThreads)
    batch_norm_stats_planes(const T* __restrict__ x, bn::Stats<typename Num<T>::compute>* part,
                            i64 A, int Cn, int B, int W, unsigned w_m, unsigned w_s, int S,
                            CUKERN_BN_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = SPAN ? bn::unroll_reduce(PACK * sizeof(T)) : bn::unroll_for(PACK * sizeof(T));
  const int c = blockIdx.x, s = blockIdx.y;
  // the split's packs [f0, f1) of the channel's A * W, as plane a0 and offsets in its run
  const i64 f0 = A * W * s / S, f1 = A * W * (s + 1) / S, a0 = f0 / W;
  const unsigned j_lo = static_cast<unsigned>(f0 - a0 * W), L = static_cast<unsigned>(f1 - a0 * W);
  const bn::FastDiv div{static_cast<unsigned>(W), w_m, w_s};
  const i64 plane_stride = static_cast<i64>(Cn) * B;
  const i64 first = (a0 * Cn + c) * B;  // the split's first plane's first element
  // every thread shifts by the split's first value of the channel (one broadcast load)
  bn::Running<C> run{bn::Stats<C>::identity(), {Num<T>::to(x[first]), C(0), C(0)}, 0};
  bn::Shifted<C>& acc = run.cur;
  int& n = run.n;
  const unsigned nt = blockDim.x;
  for (unsigned j0 = j_lo + threadIdx.x; j0 < L; j0 += nt * U) {
    if (n >= bn::kFoldValues) run.fold();
    Pack<T, PACK> p[U];
    unsigned in[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned j = j0 + u * nt;
      in[u] = 0;
      if (j < L) {
        const unsigned a = div.div(j), w = j - a * W;
        if (SPAN) {
          const i64 start = first + a * plane_stride;
          in[u] = bn::plane_bits<PACK>(static_cast<int>(w) * PACK -
                                       static_cast<int>(start % PACK), B);
          if (in[u] != 0u) p[u] = bn::load_pack<T, PACK>(x, start / PACK + w);
        } else {
          in[u] = bn::kFullPack<PACK>;
          p[u] = bn::load_pack<T, PACK>(x, (first + a * plane_stride) / PACK + w);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (in[u] == bn::kFullPack<PACK>) {
        n += PACK;
#pragma unroll
        for (int k = 0; k < PACK; ++k) acc.add(pack_value(p[u], k));
      } else if (SPAN && in[u] != 0u) {  // a plane's end packs
        n += __popc(in[u]);
#pragma unroll
        for (int k = 0; k < PACK; ++k)
          if ((in[u] >> k) & 1u) acc.add(pack_value(p[u], k));
      }
    }
  }
  unsigned phase = 0;
  const bn::Stats<C> w = allreduce_block(run.stats(), phase);
  if (threadIdx.x != 0) return;
  if (S == 1) {  // the whole channel: finish it here, no merge launch
    bn::Finish<C>{CUKERN_BN_FINISH_ARGS}(c, w);
  } else {
    part[static_cast<i64>(c) * S + s] = w;
  }
}

// Statistics, columns layout: block (TX, TY) covers channel packs [TX blockIdx.x, +TX) over the
// rows [A s / S, A (s + 1) / S), s = blockIdx.y; a thread keeps PACK channels' states, the block
// folds its rows in shared memory (blockDim.x * blockDim.y * PACK states).
template <typename T, int PACK>
__global__ void __launch_bounds__(kBnReduceThreads, 4)
    batch_norm_stats_cols(const T* __restrict__ x, bn::Stats<typename Num<T>::compute>* part,
                          i64 A, int Cp, int S, CUKERN_BN_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = bn::unroll_cols_stats(PACK * sizeof(T));
  const int s = blockIdx.y, tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
  const int cp = blockIdx.x * blockDim.x + tx;
  const bool valid = cp < Cp;
  const i64 r0 = A * s / S, r1 = A * (s + 1) / S;
  // every thread of a column shifts by the split's first row (one pack, the same for all rows)
  bn::Shifted<C> acc[PACK] = {};
  int n = 0;
  if (valid) {
    typedef Pack<T, PACK> P;
    const P k0 = bn::load_pack<T, PACK>(x, r0 * Cp + cp);
#pragma unroll
    for (int k = 0; k < PACK; ++k) acc[k] = bn::Shifted<C>{bn::value(k0, k), C(0), C(0)};
    const unsigned count = bn::rows_below(r0 + ty, r1, ny);
    n = static_cast<int>(count);
    bn::for_rows<U, P>(
        (r0 + ty) * Cp + cp, static_cast<i64>(ny) * Cp, count,
        [&](i64 i) { return bn::load_pack<T, PACK>(x, i); },
        [&](const P& p) {
#pragma unroll
          for (int k = 0; k < PACK; ++k) acc[k].add(bn::value(p, k));
        });
  }
  bn::Stats<C>* sm = dynamic_smem<bn::Stats<C>>();
#pragma unroll
  for (int k = 0; k < PACK; ++k) sm[(ty * blockDim.x + tx) * PACK + k] = acc[k].stats(n);
  bn::cols_finish_or_store<PACK>(sm, part, S, s, cp, valid,
                                 bn::Finish<C>{CUKERN_BN_FINISH_ARGS});
}

// Per channel (a warp or a block each: bn::Merger; blockDim (32, Y)): training merges the S
// partial states in a fixed order, writes mean, invstd (and the biased variance), updates the
// running statistics with the unbiased variance; eval takes mean and variance from the running
// statistics. Both write the coefficients {mean, weight * invstd, bias} of the apply pass.
template <typename C>
__global__ void __launch_bounds__(256)
    batch_norm_finalize(const bn::Stats<C>* __restrict__ part, int S, int Cn,
                        CUKERN_BN_FINISH_PARAMS(C)) {
  const bn::Merger g(Cn);
  if (g.c >= Cn) return;  // a whole warp (of a warp-a-channel block)
  const bn::Finish<C> finish{CUKERN_BN_FINISH_ARGS};
  const typename bn::Finish<C>::Inputs in = finish.load(g.c);
  bn::Stats<C> st = bn::Stats<C>::identity();
  if (training) st = bn::fold_partials(part + static_cast<i64>(g.c) * S, S, g.t, g.nt, g.block);
  if (g.t == 0) finish(g.c, st, in);
}

// y = relu?((x - mean) * scale + shift [+ addend]) over the flat packs of the tensor (coef
// null: eval, the coefficients computed from running_mean, running_var, weight, bias and eps
// as the finalize kernel would, saving its launch), grid-strided: each thread takes U packs
// G = gridDim.x * blockDim.x apart (planes: bn::unroll_for, ~32 bytes; columns:
// bn::unroll_cols, ~128 bytes of x and addend), so each warp covers 32 consecutive packs at a
// time (the mask's ballots); the grid is about one wave, so a thread loops over many packs.
// j = the pack's index within one (C, B) sample (CBp packs); its channels are bn::plane_span(j)
// (planes: one, or two where B is not a multiple of PACK) or PACK j.. (columns, where the host
// makes G a multiple of CBp, so a thread's channels never change and their coefficients,
// loaded once, stay in registers). mask (or null): ceil(numel / 32) words. 16-bit planes are
// held to 6 blocks an SM, 40 registers (with an addend 5 and 48), their counts before rsqrtf
// (unbounded 48 and 56: eval fp16 (64, 1024, 14, 14) 85 against 88% of copy on the H200);
// columns kernels take 100 or more and keep theirs.
template <typename T, int PACK, bool COLS, bool ADD, bool SPAN>
__global__ void __launch_bounds__(256, !COLS && sizeof(T) == 2 ? (ADD ? 5 : 6) : 0)
    batch_norm_apply(const T* __restrict__ x, const T* __restrict__ addend,
                     const bn::Coef<typename Num<T>::compute>* __restrict__ coef,
                     T* __restrict__ y, unsigned* __restrict__ mask, i64 total, int CBp, int d,
                     unsigned d_m, unsigned d_s, unsigned upp, int relu,
                     const typename Num<T>::compute* running_mean,
                     const typename Num<T>::compute* running_var,
                     const typename Num<T>::compute* weight,
                     const typename Num<T>::compute* bias, typename Num<T>::compute eps) {
  typedef typename Num<T>::compute C;
  constexpr int U = COLS ? bn::unroll_cols((ADD ? 2 : 1) * PACK * static_cast<int>(sizeof(T)))
                         : bn::unroll_for(PACK * sizeof(T));
  const i64 G = static_cast<i64>(gridDim.x) * blockDim.x;
  const int lane = static_cast<int>(lane_id());
  const i64 warp0 = static_cast<i64>(blockIdx.x) * blockDim.x + (threadIdx.x - lane);
  const bn::FastDiv div{static_cast<unsigned>(d), d_m, d_s};
  const unsigned rG = static_cast<unsigned>(G % CBp);
  unsigned j = static_cast<unsigned>((warp0 + lane) % CBp);
  const i64 nwords = (total * PACK + 31) / 32;
  const bn::EvalParams<C, COLS || SPAN || sizeof(T) != 4> params{running_mean, running_var,
                                                                 weight, bias, eps};
  bn::Coef<C> fixed[COLS ? PACK : 1];
  if (COLS) {
#pragma unroll
    for (int k = 0; k < (COLS ? PACK : 1); ++k) fixed[k] = params(coef, j * PACK + k);
  }
  for (i64 wb = warp0; wb < total; wb += G * U) {
    Pack<T, PACK> xv[U], av[U];
    unsigned ju[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 t = wb + u * G + lane;
      ju[u] = j;
      if (t < total) {
        xv[u] = bn::load_pack<T, PACK>(x, t);
        if (ADD) av[u] = bn::load_pack<T, PACK>(addend, t);
      }
      j += rG;
      if (j >= static_cast<unsigned>(CBp)) j -= CBp;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 wbu = wb + u * G;
      if (wbu >= total) break;  // the whole warp
      const i64 t = wbu + lane;
      const bool ok = t < total;
      bn::Coef<C> q0, q1;
      int n0 = PACK;
      if (!COLS) {
        const bn::PlaneSpan sp = bn::plane_span<SPAN, PACK>(div, ju[u], upp);
        n0 = sp.n0;
        q0 = params(coef, sp.c0);
        q1 = SPAN && n0 < PACK ? params(coef, sp.c0 + 1) : q0;
      }
      C v[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const bn::Coef<C> qk = COLS ? fixed[COLS ? k : 0] : (!SPAN || k < n0 ? q0 : q1);
        v[k] = (pack_value(xv[u], k) - qk.mean) * qk.a + qk.b;
        if (ADD) v[k] += pack_value(av[u], k);
        if (relu) v[k] = v[k] < C(0) ? C(0) : v[k];
      }
      if (ok) bn::store_pack<T, PACK>(y, t, v);
      if (mask != nullptr) bn::write_mask<PACK>(mask, wbu, v, ok, nwords);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// One-read training forward, planes layout (B a multiple of PACK), a block a channel
// (c = blockIdx.x): the channel's A planes of W = B / PACK packs go to shared memory by
// asynchronous copies (and the addend's beside them), the block's Welford state finishes the
// channel (bn::Finish: mean, invstd, running statistics) and y (+ addend, ReLU) is written from
// shared memory: x crosses HBM once and the launch is the whole call. Each thread reads back
// only the packs it copied (summing them group by group as they land, bn::copy_then_use, was
// within 2 points either way here). mask (or null, zeroed by the host): bn::or_mask_bits, a
// plane's end words being shared with the neighbouring channels' blocks. Dynamic shared
// memory: A W packs (2 A W with ADD); the planner takes this kernel only where that fits.
template <typename T, int PACK, bool ADD>
__global__ void __launch_bounds__(kBnOneReadThreads)
    batch_norm_train_planes(const T* __restrict__ x, const T* __restrict__ addend,
                            T* __restrict__ y, unsigned* __restrict__ mask, int relu, i64 A,
                            int Cn, int W, unsigned w_m, unsigned w_s,
                            CUKERN_BN_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  typedef typename Pack<T, PACK>::word_t Word;
  const int c = blockIdx.x;
  const unsigned L = static_cast<unsigned>(A * W), nt = blockDim.x;
  const bn::PlaneWalk walk{{static_cast<unsigned>(W), w_m, w_s}, W, static_cast<i64>(c) * W,
                           static_cast<i64>(Cn) * W};
  Word* xs = dynamic_smem<Word>();
  Word* zs = xs + L;
  const Word* xw = reinterpret_cast<const Word*>(x);
  for (unsigned j = threadIdx.x; j < L; j += nt) {
    const i64 gi = walk.at(j);
    bn::pack_to_smem(xs + j, xw + gi);
    if (ADD) bn::pack_to_smem(zs + j, reinterpret_cast<const Word*>(addend) + gi);
  }
  // every thread shifts by the channel's first value (one broadcast load)
  bn::Running<C> run{bn::Stats<C>::identity(),
                     {Num<T>::to(x[walk.first * PACK]), C(0), C(0)}, 0};
  cp_async_wait_all();
  for (unsigned j = threadIdx.x; j < L; j += nt) {
    if (run.n >= bn::kFoldValues) run.fold();
    Pack<T, PACK> p;
    p.word = xs[j];
    run.n += PACK;
#pragma unroll
    for (int k = 0; k < PACK; ++k) run.cur.add(pack_value(p, k));
  }
  unsigned phase = 0;
  const bn::Stats<C> st = allreduce_block(run.stats(), phase);
  if (threadIdx.x == 0) bn::Finish<C>{CUKERN_BN_FINISH_ARGS}(c, st);
  // the apply pass's coefficients, as bn::Finish computes them
  const C mean = st.mean;
  const C scale = (weight != nullptr ? weight[c] : C(1)) * (C(1) / sqrt(st.m2 / count + eps));
  const C shift = bias != nullptr ? bias[c] : C(0);
  for (unsigned j0 = 0; j0 < L; j0 += nt) {  // warp-uniform trips: or_mask_bits shuffles
    const unsigned j = j0 + threadIdx.x;
    const bool in = j < L;
    const i64 gi = in ? walk.at(j) : 0;
    unsigned kept = 0u;
    if (in) {
      Pack<T, PACK> p, z;
      p.word = xs[j];
      if (ADD) z.word = zs[j];
      C v[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        v[k] = (pack_value(p, k) - mean) * scale + shift;
        if (ADD) v[k] += pack_value(z, k);
        if (relu) v[k] = v[k] < C(0) ? C(0) : v[k];
        kept |= v[k] > C(0) ? 1u << k : 0u;
      }
      bn::store_pack<T, PACK>(y, gi, v);
    }
    if (mask != nullptr) bn::or_mask_bits<PACK>(mask, gi * PACK, kept, in);
  }
}

// ---------------------------------------------------------------------------------------------
// One-read training forward, columns layout (channels adjacent, C % PACK == 0): block (k, t)
// holds tile t (channel packs [TX t, TX t + TX), TX = blockDim.x, a power of two <= 32) of the
// rows [A k / K, A (k + 1) / K) in shared memory, K = the cluster's size (a launch attribute,
// sm_90; 1 elsewhere) along grid x. A thread copies (cp.async, summed group by group as they
// land: bn::copy_then_use) and reads back the packs of channel pack tx in rows ty, ty + TY,
// ...; its shifted sums fold across the warp (shuffles between lanes TX apart), the block
// (warp by warp, in order) and the cluster (the K blocks' states read from distributed shared
// memory in rank order, so every block has the same bits); rank 0 finishes the channels
// (bn::Finish) and every block writes its rows' y (+ addend, ReLU, the mask ORed into zeroed
// words: a row's tile shares its words with other tiles). Dynamic shared memory: 3 states a
// channel for every warp, the block's states and the coefficients (to a 128-byte boundary),
// then the tile (and the addend's): the planner's train_cols step sizes it.
template <typename T, int PACK, bool ADD>
__global__ void __launch_bounds__(kBnOneReadThreads, 2)  // two blocks of 100 KB an SM
    batch_norm_train_cols(const T* __restrict__ x, const T* __restrict__ addend,
                          T* __restrict__ y, unsigned* __restrict__ mask, int relu, i64 A, int Cp,
                          CUKERN_BN_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  typedef typename Pack<T, PACK>::word_t Word;
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  unsigned K = 1, rank = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  K = static_cast<unsigned>(cluster_size());
  rank = cluster_rank();
#endif
  const i64 r0 = A * rank / K;
  const int rows = static_cast<int>(A * (rank + 1) / K - r0);
  const int cp = blockIdx.y * TX + tx, nch = TX * PACK;
  // first the states (at the same offset in every block of the cluster: their rows differ),
  // 128-byte aligned, then the tile
  const int nwarps = (TX * TY + 31) / 32;
  C* wst = dynamic_smem<C>();  // [warp][3][nch]
  C* blk = wst + 3 * nwarps * nch;  // the block's states [3][nch], then coefficients [3][nch]
  C* cf = blk + 3 * nch;
  const int scratch = ((3 * nwarps + 6) * nch * static_cast<int>(sizeof(C)) + 127) / 128 * 128;
  Word* xs = reinterpret_cast<Word*>(reinterpret_cast<char*>(wst) + scratch);
  Word* zs = xs + rows * TX;
  const Word* xw = reinterpret_cast<const Word*>(x);
  // this thread's rows ty + i TY, i < mine, shifted by the block's first row of each channel
  // (one broadcast load), folded every kFoldValues
  const int mine = ty < rows ? (rows - ty + TY - 1) / TY : 0;
  bn::Stats<C> done[PACK];
  bn::Shifted<C> cur[PACK];
  if (mine > 0) {
    const Pack<T, PACK> k0 = bn::load_pack<T, PACK>(x, r0 * Cp + cp);
#pragma unroll
    for (int k = 0; k < PACK; ++k) {
      done[k] = bn::Stats<C>::identity();
      cur[k] = bn::Shifted<C>{pack_value(k0, k), C(0), C(0)};
    }
  }
  int n = 0;
  bn::copy_then_use(
      mine,
      [&](int i) {
        const int r = ty + i * TY;
        const i64 gi = (r0 + r) * Cp + cp;
        bn::pack_to_smem(xs + r * TX + tx, xw + gi);
        if (ADD) bn::pack_to_smem(zs + r * TX + tx, reinterpret_cast<const Word*>(addend) + gi);
      },
      [&](int i) {
        if (n >= bn::kFoldValues) {
#pragma unroll
          for (int k = 0; k < PACK; ++k) {
            done[k] = bn::Stats<C>::merge(done[k], cur[k].stats(n));
            cur[k] = bn::Shifted<C>{done[k].mean, C(0), C(0)};
          }
          n = 0;
        }
        Pack<T, PACK> p;
        p.word = xs[(ty + i * TY) * TX + tx];
        n += 1;
#pragma unroll
        for (int k = 0; k < PACK; ++k) cur[k].add(pack_value(p, k));
      });
  const int lane = static_cast<int>(lane_id()), warp = (ty * TX + tx) / 32;
#pragma unroll
  for (int k = 0; k < PACK; ++k) {
    bn::Stats<C> st = mine > 0 ? bn::Stats<C>::merge(done[k], cur[k].stats(n))
                               : bn::Stats<C>::identity();
    for (int off = TX; off < 32; off *= 2) st = bn::Stats<C>::merge(st, st.shfl_xor(off));
    if (lane < TX) {
      const int j = tx * PACK + k;
      wst[(warp * 3 + 0) * nch + j] = st.n;
      wst[(warp * 3 + 1) * nch + j] = st.mean;
      wst[(warp * 3 + 2) * nch + j] = st.m2;
    }
  }
  __syncthreads();
  const int t = ty * TX + tx;
  for (int j = t; j < nch; j += TX * TY) {  // the block's state of channel j, warps in order
    bn::Stats<C> st = bn::Stats<C>::identity();
    for (int w = 0; w < nwarps; ++w)
      st = bn::Stats<C>::merge(
          st, bn::Stats<C>{wst[(w * 3) * nch + j], wst[(w * 3 + 1) * nch + j],
                           wst[(w * 3 + 2) * nch + j]});
    blk[j] = st.n;
    blk[nch + j] = st.mean;
    blk[2 * nch + j] = st.m2;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (K > 1) cluster_sync();  // every block's states visible to the cluster
#endif
  for (int j = t; j < nch; j += TX * TY) {
    bn::Stats<C> st{blk[j], blk[nch + j], blk[2 * nch + j]};
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    if (K > 1) {  // the cluster's blocks in rank order: the same bits in every block
      st = bn::Stats<C>::identity();
      for (unsigned q = 0; q < K; ++q) {
        const bn::Stats<C> o{cluster_load(cluster_map(blk + j, q), C(0)),
                             cluster_load(cluster_map(blk + nch + j, q), C(0)),
                             cluster_load(cluster_map(blk + 2 * nch + j, q), C(0))};
        st = bn::Stats<C>::merge(st, o);
      }
    }
#endif
    const int c = blockIdx.y * nch + j;
    if (rank == 0) bn::Finish<C>{CUKERN_BN_FINISH_ARGS}(c, st);
    // the apply pass's coefficients, as bn::Finish computes them
    cf[j] = st.mean;
    cf[nch + j] = (weight != nullptr ? weight[c] : C(1)) * (C(1) / sqrt(st.m2 / count + eps));
    cf[2 * nch + j] = bias != nullptr ? bias[c] : C(0);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (K > 1) cluster_arrive(false);  // done reading the other blocks' states (waited at exit)
#endif
  __syncthreads();
  C mean[PACK], scale[PACK], shift[PACK];
#pragma unroll
  for (int k = 0; k < PACK; ++k) {
    mean[k] = cf[tx * PACK + k];
    scale[k] = cf[nch + tx * PACK + k];
    shift[k] = cf[2 * nch + tx * PACK + k];
  }
  for (int rb = 0; rb < rows; rb += TY) {  // block-uniform trips: or_mask_bits shuffles
    const int r = rb + ty;
    const bool in = r < rows;
    const i64 gi = in ? (r0 + r) * Cp + cp : 0;
    unsigned kept = 0u;
    if (in) {
      Pack<T, PACK> p, z;
      p.word = xs[r * TX + tx];
      if (ADD) z.word = zs[r * TX + tx];
      C v[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        v[k] = (pack_value(p, k) - mean[k]) * scale[k] + shift[k];
        if (ADD) v[k] += pack_value(z, k);
        if (relu) v[k] = v[k] < C(0) ? C(0) : v[k];
        kept |= v[k] > C(0) ? 1u << k : 0u;
      }
      bn::store_pack<T, PACK>(y, gi, v);
    }
    if (mask != nullptr) bn::or_mask_bits<PACK>(mask, gi * PACK, kept, in);
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (K > 1) cluster_wait();  // no block leaves while another reads its states
#endif
}

// ---------------------------------------------------------------------------------------------
// Backward. g = dy where the mask keeps it (dy without a mask); per channel the partial sums
// (sum g, sum g * (x - mean)), shaped as the statistics kernels.
template <typename T, int PACK, bool SPAN>
__global__ void __launch_bounds__(kBnReduceThreads)
    batch_norm_grad_planes(const T* __restrict__ dy, const T* __restrict__ x,
                           const unsigned* __restrict__ mask,
                           const typename Num<T>::compute* __restrict__ mean,
                           bn::GradSums<typename Num<T>::compute>* part, i64 A, int Cn, int B,
                           int W, unsigned w_m, unsigned w_s, int S,
                           CUKERN_BN_GRAD_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = SPAN ? bn::unroll_reduce(PACK * sizeof(T)) : bn::unroll_for(PACK * sizeof(T));
  const int c = blockIdx.x, s = blockIdx.y;
  // the split's packs [f0, f1) of the channel's A * W, as plane a0 and offsets in its run
  const i64 f0 = A * W * s / S, f1 = A * W * (s + 1) / S, a0 = f0 / W;
  const unsigned j_lo = static_cast<unsigned>(f0 - a0 * W), L = static_cast<unsigned>(f1 - a0 * W);
  const bn::FastDiv div{static_cast<unsigned>(W), w_m, w_s};
  const i64 plane_stride = static_cast<i64>(Cn) * B;
  const i64 first = (a0 * Cn + c) * B;  // the split's first plane's first element
  // !SPAN: B is a multiple of PACK, so packs index from the split's first pack by whole planes
  const i64 first_pack = first / PACK, plane_packs = plane_stride / PACK;
  const C m = mean[c];
  C sg = C(0), sgx = C(0);
  const unsigned nt = blockDim.x;
  // U packs nt apart: groups wholly inside the split take no bounds test (check false; each
  // call site inlines its own copy)
  auto group = [&](unsigned j0, bool check) {
    Pack<T, PACK> pd[U], px[U];
    unsigned bits[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned j = j0 + u * nt;
      bits[u] = 0;
      if (!check || j < L) {
        const unsigned a = div.div(j), w = j - a * W;
        const i64 start = first + a * plane_stride;
        const unsigned in = SPAN ? bn::plane_bits<PACK>(static_cast<int>(w) * PACK -
                                                        static_cast<int>(start % PACK), B)
                                 : bn::kFullPack<PACK>;
        if (in != 0u) {
          const i64 i = SPAN ? start / PACK + w : first_pack + static_cast<i64>(a) * plane_packs + w;
          pd[u] = bn::load_pack<T, PACK>(dy, i);
          px[u] = bn::load_pack<T, PACK>(x, i);
          bits[u] = in & (mask != nullptr ? bn::mask_bits<PACK>(mask, i) : ~0u);
        }
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {  // bits[u] == 0 past the split or the plane: nothing added
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const bool keep = (bits[u] >> k) & 1u;
        const C g = pack_value(pd[u], k);
        sg += keep ? g : C(0);
        sgx += keep ? g * (pack_value(px[u], k) - m) : C(0);
      }
    }
  };
  unsigned j0 = j_lo + threadIdx.x;
  for (; static_cast<i64>(j0) + (U - 1) * static_cast<i64>(nt) < L; j0 += nt * U)
    group(j0, false);
  if (j0 < L) group(j0, true);
  unsigned phase = 0;
  const bn::GradSums<C> r = allreduce_block(bn::GradSums<C>{{sg, sgx}}, phase);
  if (threadIdx.x != 0) return;
  if (S == 1) {  // the whole channel: finish it here, no merge launch
    bn::GradFinish<C>{CUKERN_BN_GRAD_FINISH_ARGS}(c, r);
  } else {
    part[static_cast<i64>(c) * S + s] = r;
  }
}

// At least 3 blocks an SM (the planner's bn_cols_reduce_blocks_per_sm): ptxas gave
// grad_cols<bf16, 8> 128 registers (2 blocks) unbounded, 79 with no spill bounded.
template <typename T, int PACK>
__global__ void __launch_bounds__(kBnReduceThreads, 3)
    batch_norm_grad_cols(const T* __restrict__ dy, const T* __restrict__ x,
                         const unsigned* __restrict__ mask,
                         const typename Num<T>::compute* __restrict__ mean,
                         bn::GradSums<typename Num<T>::compute>* part, i64 A, int Cp, int S,
                         CUKERN_BN_GRAD_FINISH_PARAMS(typename Num<T>::compute)) {
  typedef typename Num<T>::compute C;
  constexpr int U = bn::unroll_reduce(PACK * sizeof(T));
  const int s = blockIdx.y, tx = threadIdx.x, ty = threadIdx.y, ny = blockDim.y;
  const int cp = blockIdx.x * blockDim.x + tx;
  const bool valid = cp < Cp;
  const i64 r0 = A * s / S, r1 = A * (s + 1) / S;
  C m[PACK], sg[PACK], sgx[PACK];
#pragma unroll
  for (int k = 0; k < PACK; ++k) {
    m[k] = valid ? mean[cp * PACK + k] : C(0);
    sg[k] = sgx[k] = C(0);
  }
  if (valid) {
    struct Item {
      Pack<T, PACK> d, x;
      unsigned bits;  // the mask's bits of the pack (all set without a mask)
    };
    bn::for_rows<U, Item>(
        (r0 + ty) * Cp + cp, static_cast<i64>(ny) * Cp, bn::rows_below(r0 + ty, r1, ny),
        [&](i64 i) {
          Item it;
          it.d = bn::load_pack<T, PACK>(dy, i);
          it.x = bn::load_pack<T, PACK>(x, i);
          it.bits = mask != nullptr ? bn::mask_bits<PACK>(mask, i) : ~0u;
          return it;
        },
        [&](const Item& it) {
#pragma unroll
          for (int k = 0; k < PACK; ++k) {
            const bool keep = (it.bits >> k) & 1u;
            const C g = bn::value(it.d, k);
            sg[k] += keep ? g : C(0);
            sgx[k] += keep ? g * (bn::value(it.x, k) - m[k]) : C(0);
          }
        });
  }
  bn::GradSums<C>* sm = dynamic_smem<bn::GradSums<C>>();
#pragma unroll
  for (int k = 0; k < PACK; ++k)
    sm[(ty * blockDim.x + tx) * PACK + k] = bn::GradSums<C>{{sg[k], sgx[k]}};
  bn::cols_finish_or_store<PACK>(sm, part, S, s, cp, valid,
                                 bn::GradFinish<C>{CUKERN_BN_GRAD_FINISH_ARGS});
}

// Per channel (a warp or a block each: bn::Merger): the S partial sums merged in a fixed order,
// then bn::GradFinish.
template <typename C>
__global__ void __launch_bounds__(256)
    batch_norm_grad_finalize(const bn::GradSums<C>* __restrict__ part, int S, int Cn,
                             const C* __restrict__ mean, CUKERN_BN_GRAD_FINISH_PARAMS(C)) {
  const bn::Merger g(Cn);
  if (g.c >= Cn) return;  // a whole warp (of a warp-a-channel block)
  const bn::GradSums<C> st =
      bn::fold_partials(part + static_cast<i64>(g.c) * S, S, g.t, g.nt, g.block);
  if (g.t == 0) bn::GradFinish<C>{CUKERN_BN_GRAD_FINISH_ARGS}(g.c, st);
}

// dx = k1 * g + k2 * (x - mean) + k3 over the flat packs (as batch_norm_apply; columns:
// bn::unroll_cols of dy and x); x is not read when it is null (eval: k2 = 0). daddend (or
// null) = g.
template <typename T, int PACK, bool COLS, bool SPAN>
__global__ void __launch_bounds__(256)
    batch_norm_dx(const T* __restrict__ dy, const T* __restrict__ x,
                  const unsigned* __restrict__ mask,
                  const bn::Coef<typename Num<T>::compute>* __restrict__ coef,
                  T* __restrict__ dx, T* __restrict__ daddend, i64 total, int CBp, int d,
                  unsigned d_m, unsigned d_s, unsigned upp) {
  typedef typename Num<T>::compute C;
  constexpr int U = COLS ? bn::unroll_cols(2 * PACK * static_cast<int>(sizeof(T)))
                         : bn::unroll_for(PACK * sizeof(T));
  const i64 G = static_cast<i64>(gridDim.x) * blockDim.x;
  const int lane = static_cast<int>(lane_id());
  const i64 warp0 = static_cast<i64>(blockIdx.x) * blockDim.x + (threadIdx.x - lane);
  const bn::FastDiv div{static_cast<unsigned>(d), d_m, d_s};
  const unsigned rG = static_cast<unsigned>(G % CBp);
  unsigned j = static_cast<unsigned>((warp0 + lane) % CBp);
  bn::Coef<C> fixed[COLS ? PACK : 1];
  if (COLS) {
#pragma unroll
    for (int k = 0; k < (COLS ? PACK : 1); ++k) fixed[k] = coef[j * PACK + k];
  }
  for (i64 t0 = warp0 + lane; t0 - lane < total; t0 += G * U) {
    Pack<T, PACK> pd[U], px[U];
    unsigned bits[U], ju[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 t = t0 + u * G;
      ju[u] = j;
      bits[u] = 0;
      if (t < total) {
        pd[u] = bn::load_pack<T, PACK>(dy, t);
        if (x != nullptr) px[u] = bn::load_pack<T, PACK>(x, t);
        bits[u] = mask != nullptr ? bn::mask_bits<PACK>(mask, t) : ~0u;
      }
      j += rG;
      if (j >= static_cast<unsigned>(CBp)) j -= CBp;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const i64 t = t0 + u * G;
      if (t >= total) continue;
      bn::Coef<C> q0, q1;
      int n0 = PACK;
      if (!COLS) {
        const bn::PlaneSpan sp = bn::plane_span<SPAN, PACK>(div, ju[u], upp);
        n0 = sp.n0;
        q0 = coef[sp.c0];
        q1 = SPAN && n0 < PACK ? coef[sp.c0 + 1] : q0;
      }
      C g[PACK], r[PACK];
#pragma unroll
      for (int k = 0; k < PACK; ++k) {
        const bn::Coef<C> qk = COLS ? fixed[COLS ? k : 0] : (!SPAN || k < n0 ? q0 : q1);
        g[k] = (bits[u] >> k) & 1u ? pack_value(pd[u], k) : C(0);
        r[k] = qk.a * g[k] + qk.c;
        if (x != nullptr) r[k] += qk.b * (pack_value(px[u], k) - qk.mean);
      }
      bn::store_pack<T, PACK>(dx, t, r);
      if (daddend != nullptr) bn::store_pack<T, PACK>(daddend, t, g);
    }
  }
}

}  // namespace cukern
