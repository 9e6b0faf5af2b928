// perm::store_skew (kernels/permute_parts.cuh, through permute.cuh) compiled as host code and run by one emulated thread
// (blockDim 1: it walks every item) over tiles of every extent, run length and lane grouping,
// against the transpose it must write and nothing beside it; tests/test_permute_skew_cpu.py
// builds it with -DPERMUTE_CUH=<the header> and runs it. The CUDA builtins the header uses are
// stubbed below (__byte_perm as PTX prmt defines it). Prints "<runs> runs, <failed> failed".
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#define __host__
#define __device__
#define __forceinline__ inline
#define __global__
#define __launch_bounds__(x)
#define __restrict__
#define __shared__
struct uint4 {
  unsigned x, y, z, w;
};
struct Dim3 {
  unsigned x, y, z;
};
static Dim3 threadIdx{0, 0, 0}, blockDim{1, 1, 1}, blockIdx{0, 0, 0}, gridDim{1, 1, 1};
static inline unsigned __umulhi(unsigned a, unsigned b) {
  return unsigned((static_cast<unsigned long long>(a) * b) >> 32);
}
static inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
  unsigned char b[8];
  memcpy(b, &x, 4);
  memcpy(b + 4, &y, 4);
  unsigned r = 0;
  for (int n = 0; n < 4; ++n) r |= unsigned(b[(s >> (4 * n)) & 7]) << (8 * n);
  return r;
}
static inline void __syncthreads() {}
uint4 perm_smem[1];
#include PERMUTE_CUH

using cukern::PermuteTileArgs;

// One tile of ti_e channels (of ti) by L rows, input order at row * pitch (pitch 4 mod 8
// elements, the rest of shared memory garbage), through store_skew into a run 64 bytes into a
// buffer: the number of wrong elements, inside the run or beside it.
template <typename T, int D>
int run(int ti, int ti_e, int L, int words, unsigned seed) {
  constexpr int E = sizeof(T), VO = 16 / E;
  const int pitch = ti + 4;
  std::vector<uint4> smem(size_t(L) * pitch * E / 16 + 2);
  T* s = reinterpret_cast<T*>(smem.data());
  srand(seed);
  for (size_t i = 0; i < smem.size() * 16 / E; ++i) s[i] = T(rand());
  std::vector<T> x(size_t(L) * ti_e);
  for (int ol = 0; ol < L; ++ol) {
    for (int il = 0; il < ti_e; ++il) {
      x[size_t(ol) * ti_e + il] = T(rand());
      s[ol * pitch + il] = x[size_t(ol) * ti_e + il];
    }
  }
  PermuteTileArgs a;
  memset(&a, 0, sizeof(a));
  a.so = L;
  a.ti = ti;
  a.pitch = pitch;
  a.group = __builtin_ctz(unsigned(words));
  const int pad = 64;
  std::vector<uint4> yv((size_t(ti_e) * L * E + 2 * pad) / 16 + 2);
  T* y = reinterpret_cast<T*>(yv.data());
  const size_t ny = yv.size() * 16 / E;
  for (size_t i = 0; i < ny; ++i) y[i] = T(0x5A5A);
  const size_t y0 = pad / E, end = y0 + size_t(ti_e) * L;
  cukern::perm::store_skew<T, VO, D, int>(s, y, a, ti_e, int(y0));
  int bad = 0;
  for (int il = 0; il < ti_e; ++il)
    for (int ol = 0; ol < L; ++ol) bad += y[y0 + il * L + ol] != x[size_t(ol) * ti_e + il];
  for (size_t i = 0; i < ny; ++i) bad += (i < y0 || i >= end) && y[i] != T(0x5A5A);
  return bad;
}

int main() {
  int fails = 0, runs = 0;
  auto count = [&](int bad) {
    fails += bad != 0;
    ++runs;
  };
  for (int words : {1, 2, 4, 16}) {
    for (int ti : {16, 32, 64, 128}) {
      for (int ti_e = 1; ti_e <= ti; ti_e += ti_e < 8 ? 1 : 5) {
        for (int L : {17, 33, 49, 81, 145}) count(run<unsigned char, 1>(ti, ti_e, L, words, L));
        for (int L : {20, 36, 100, 196}) count(run<unsigned char, 4>(ti, ti_e, L, words, L));
        for (int L : {16, 32, 48, 784}) count(run<unsigned char, 0>(ti, ti_e, L, words, L));
        if (ti > 64) continue;
        for (int L : {9, 17, 25, 49, 81}) count(run<unsigned short, 1>(ti, ti_e, L, words, L));
        for (int L : {12, 20, 196}) count(run<unsigned short, 4>(ti, ti_e, L, words, L));
        for (int L : {8, 24, 40}) count(run<unsigned short, 0>(ti, ti_e, L, words, L));
      }
    }
  }
  printf("%d runs, %d failed\n", runs, fails);
  return fails != 0;
}
