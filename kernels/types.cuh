// Storage types, conversion to and from the compute type, math in the compute type, and vector
// packs. Compiled through NVRTC with no CUDA headers: half and bfloat16 are plain 16-bit storage
// types converted with PTX instructions, so the compile check needs nothing but NVRTC itself.
#pragma once
#include "fallbacks.cuh"

namespace cukern {

typedef long long i64;

// ---------------------------------------------------------------------------------------------
// Storage types and conversion to/from the compute type.
struct f16 { unsigned short bits; };
struct bf16 { unsigned short bits; };

// exp through exp2 on the special-function unit: about 2 ulp. Used where its error is far
// below what follows: results stored in 16 bits, and the row sums of an online softmax.
__device__ __forceinline__ float exp_approx(float v) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(v * 1.4426950408889634f));
  return r;
}

template <typename T> struct Num;

// Num<T>::exp is the exponential an op on T-typed data uses: exact for float and double, the
// fast approximation for half and bfloat16, whose rounding (2^-11, 2^-8) dwarfs its error.
template <> struct Num<float> {
  typedef float compute;
  static __device__ __forceinline__ float exp(float v) { return expf(v); }
  static __device__ __forceinline__ float to(float v) { return v; }
  static __device__ __forceinline__ float from(float v) { return v; }
};

template <> struct Num<double> {
  typedef double compute;
  static __device__ __forceinline__ double exp(double v) { return ::exp(v); }
  static __device__ __forceinline__ double to(double v) { return v; }
  static __device__ __forceinline__ double from(double v) { return v; }
};

template <> struct Num<f16> {
  typedef float compute;
  static __device__ __forceinline__ float exp(float v) { return exp_approx(v); }
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
  static __device__ __forceinline__ float exp(float v) { return exp_approx(v); }
  static __device__ __forceinline__ float to(bf16 v) {
    return __uint_as_float(static_cast<unsigned>(v.bits) << 16);
  }
  static __device__ __forceinline__ bf16 from(float v) {
    bf16 h;
#ifdef CUKERN_FALLBACKS
    // cvt.rn.bf16.f32 in integer arithmetic: round to nearest even by adding 0x7fff plus the
    // lowest kept bit, then truncating (past the largest finite value the carry reaches
    // infinity, subnormals stay); a NaN gives the canonical NaN, as cvt does.
    const unsigned u = __float_as_uint(v);
    h.bits = (u & 0x7fffffffu) > 0x7f800000u
                 ? static_cast<unsigned short>(0x7fffu)
                 : static_cast<unsigned short>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(v));  // sm_80 and newer
#endif
    return h;
  }
};

// ---------------------------------------------------------------------------------------------
// Math in the compute type (float or double).

template <typename C> struct Math;

template <> struct Math<float> {
  static __device__ __forceinline__ float inf() { return __int_as_float(0x7f800000); }
  static __device__ __forceinline__ float exp(float v) { return expf(v); }
  static __device__ __forceinline__ float exp_fast(float v) { return exp_approx(v); }
  static __device__ __forceinline__ float log(float v) { return logf(v); }
  static __device__ __forceinline__ float rsqrt(float v) { return rsqrtf(v); }
  static __device__ __forceinline__ float div(float a, float b) { return a / b; }
  // About 2 ulp, no slow path (|b| < 2^126): for weights and means whose last bits do not matter.
  static __device__ __forceinline__ float div_fast(float a, float b) { return __fdividef(a, b); }
};

template <> struct Math<double> {
  static __device__ __forceinline__ double inf() { return __longlong_as_double(0x7ff0000000000000LL); }
  static __device__ __forceinline__ double exp(double v) { return ::exp(v); }
  static __device__ __forceinline__ double exp_fast(double v) { return ::exp(v); }
  static __device__ __forceinline__ double log(double v) { return ::log(v); }
  static __device__ __forceinline__ double rsqrt(double v) { return ::rsqrt(v); }
  static __device__ __forceinline__ double div(double a, double b) { return a / b; }
  static __device__ __forceinline__ double div_fast(double a, double b) { return a / b; }
};

// A max that keeps NaN, so a NaN anywhere in a row reaches every output of that row. In
// float, one instruction (sm_80 and newer) where the generic form takes a compare, a NaN test
// and a select.
template <typename C> __device__ __forceinline__ C max_nan(C a, C b) {
  return (a > b || a != a) ? a : b;
}
template <> __device__ __forceinline__ float max_nan(float a, float b) {
#ifdef CUKERN_FALLBACKS
  // max.NaN in integer arithmetic (float compares flush subnormals under CuPy's -ftz=true):
  // the canonical NaN where either is NaN, else the larger by a map of the bits that orders
  // floats as numbers with -0 below +0, so max(+0, -0) = +0 either way round.
  const unsigned ua = __float_as_uint(a), ub = __float_as_uint(b);
  if ((ua & 0x7fffffffu) > 0x7f800000u || (ub & 0x7fffffffu) > 0x7f800000u) {
    return __uint_as_float(0x7fffffffu);
  }
  const unsigned ka = ua >> 31 ? ~ua : ua | 0x80000000u, kb = ub >> 31 ? ~ub : ub | 0x80000000u;
  return ka >= kb ? a : b;
#else
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));  // NaN: the canonical NaN
  return r;
#endif
}
// max_nan, commutative bit for bit (for a state's merge): max(+0, -0) = +0 either way round, and
// the NaN it returns does not depend on the order (a + b would keep either NaN's payload).
// Float's max_nan is already.
template <typename C> __device__ __forceinline__ C max_nan_commutative(C a, C b) {
  return max_nan(a, b);
}
template <> __device__ __forceinline__ double max_nan_commutative(double a, double b) {
  return (a != a || b != b) ? __longlong_as_double(0x7fffffffffffffffLL) : fmax(a, b);
}

// Products and sums that are never contracted into fused multiply-adds (for bit-exact symmetry).
__device__ __forceinline__ float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ double add_rn(double a, double b) { return __dadd_rn(a, b); }

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

// Element i of a pack in the compute type. bfloat16 is the top half of a float: each value
// comes out of its 32-bit word with one shift or mask (per-element conversion costs about two
// instructions: extract, then shift).
template <typename T, int N>
__device__ __forceinline__ typename Num<T>::compute pack_value(const Pack<T, N>& p, int i) {
  return Num<T>::to(p.elem[i]);
}
template <int N> __device__ __forceinline__ float pack_value(const Pack<bf16, N>& p, int i) {
  if constexpr (N >= 2) {
    const unsigned w = reinterpret_cast<const unsigned*>(&p.word)[i / 2];
    return __uint_as_float(i % 2 ? (w & 0xffff0000u) : (w << 16));
  } else {
    return Num<bf16>::to(p.elem[i]);
  }
}

// The vector word of N values, assembled with integer ops, and stored with one instruction.
// (Through the union, the compiler takes the word apart again and stores it in 2- to 4-byte
// pieces: four or more store instructions a pack.)
template <typename T, int N> struct WordOf;
template <typename H> __device__ __forceinline__ unsigned pair16(const H* e) {
  return static_cast<unsigned>(e[0].bits) | (static_cast<unsigned>(e[1].bits) << 16);
}
#define CUKERN_HALF_WORDS(H)                                                              \
  template <> struct WordOf<H, 1> {                                                       \
    static __device__ __forceinline__ unsigned short make(const H* e) { return e[0].bits; } \
  };                                                                                      \
  template <> struct WordOf<H, 2> {                                                       \
    static __device__ __forceinline__ unsigned make(const H* e) { return pair16(e); }    \
  };                                                                                      \
  template <> struct WordOf<H, 4> {                                                       \
    static __device__ __forceinline__ uint2 make(const H* e) {                           \
      return make_uint2(pair16(e), pair16(e + 2));                                        \
    }                                                                                     \
  };                                                                                      \
  template <> struct WordOf<H, 8> {                                                       \
    static __device__ __forceinline__ uint4 make(const H* e) {                           \
      return make_uint4(pair16(e), pair16(e + 2), pair16(e + 4), pair16(e + 6));          \
    }                                                                                     \
  };
CUKERN_HALF_WORDS(f16)
CUKERN_HALF_WORDS(bf16)
#undef CUKERN_HALF_WORDS
template <> struct WordOf<float, 1> {
  static __device__ __forceinline__ unsigned make(const float* e) { return __float_as_uint(e[0]); }
};
template <> struct WordOf<float, 2> {
  static __device__ __forceinline__ uint2 make(const float* e) {
    return make_uint2(__float_as_uint(e[0]), __float_as_uint(e[1]));
  }
};
template <> struct WordOf<float, 4> {
  static __device__ __forceinline__ uint4 make(const float* e) {
    return make_uint4(__float_as_uint(e[0]), __float_as_uint(e[1]), __float_as_uint(e[2]),
                      __float_as_uint(e[3]));
  }
};
__device__ __forceinline__ uint2 double_bits(double v) {
  const unsigned long long b = static_cast<unsigned long long>(__double_as_longlong(v));
  return make_uint2(static_cast<unsigned>(b), static_cast<unsigned>(b >> 32));
}
template <> struct WordOf<double, 1> {
  static __device__ __forceinline__ uint2 make(const double* e) { return double_bits(e[0]); }
};
template <> struct WordOf<double, 2> {
  static __device__ __forceinline__ uint4 make(const double* e) {
    const uint2 a = double_bits(e[0]), b = double_bits(e[1]);
    return make_uint4(a.x, a.y, b.x, b.y);
  }
};

}  // namespace cukern
