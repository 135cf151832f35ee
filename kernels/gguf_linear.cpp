// Linear layers on weights kept in GGUF's (llama.cpp's) block form: y = x W^T (+ b), W never
// dequantized into a copy that outlives the call.
//
// A weight row of K elements is K/32 chunks of 32 elements. A chunk is a whole block of the 32-element
// types (Q4_0 .. Q8_0), one eighth of a 256-element super-block of the K-quants (Q4_K, Q5_K, Q6_K:
// the chunk takes its block's scales), or 32 elements of an F32 / F16 / BF16 row. Every kernel below
// decodes chunks, in registers or into an L1-sized row buffer, and nothing else knows the formats.
//
// A chunk decodes to exactly what the gguf package's numpy dequantization returns (the same float32
// multiplies and adds in the same order; this file builds with -ffp-contract=off so none is fused),
// so dequantize() is bitwise gguf.quants.dequantize and the products below use those exact weights.
//
// Every output is one float32 sum in one fixed order, whichever kernel computes it: four accumulators
// of 8 lanes, lane l of accumulator j taking element 32 c + 8 j + l of chunk c (an FMA each, chunks in
// order), then (a0 + a1) + (a2 + a3) and the lane reduction of hsum8. So a row's result does not depend
// on the batch it is in, the thread split, the register or buffer path, or the instruction set: the
// AVX-512 path holds accumulators 0-1 and 2-3 in two 16-lane registers (the same per-lane FMAs, half the
// instructions), the AVX2 path in four 8-lane ones, and the portable scalar path emulates the lanes with
// std::fma (tests/unit/test_gguf_kernels.py holds all three equal). The best path the build has is the
// default (-1); -march=native decides at build time, and the build is per CPU (kernels/native.py).
//
// Paths, by rows of x (the Python side picks by measurement, benchmarks/gguf_kernels.py):
//  - gemv, few rows (2 with AVX2, 8 with AVX-512): each weight row streamed once, each chunk decoded
//    into registers and FMA'd into every row of x (the memory-bound decode step);
//  - gemv, more rows: each weight row decoded once into a thread's row buffer, then dotted with every
//    row of x (the decode is paid once per weight row, not once per row of x);
//  - gemm (prefill): tiles of weight rows dequantized to float32 and multiplied by torch's GEMM;
//  - gemm_bf16 (prefill, --loopkv-prefill-dtype bfloat16): x and the weight rounded to bfloat16, float32
//    sums and results through oneDNN's brgemm (AMX, or AVX512-BF16 dot products on a weight laid out in
//    their pair layout here); a weight it does not fit takes gemm_dequant's bfloat16 tiles (torch's
//    bfloat16 GEMM, its result rounded to bfloat16).
// Work is split over torch's threads by output feature (at::parallel_for).

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include "bf16_brgemm.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define LOOPKV_GGUF_AVX2 1
#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define LOOPKV_GGUF_AVX512 1
#endif
#endif

namespace {

// ggml's type ids (gguf.GGMLQuantizationType).
enum GgmlType : int64_t {
  T_F32 = 0, T_F16 = 1, T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8,
  T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14, T_BF16 = 30,
};

constexpr int64_t CHUNK = 32;
constexpr int64_t PREFETCH_ROWS = 4;

inline float f16(const uint8_t* p) {  // IEEE half to float, exact (what numpy's astype does)
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef LOOPKV_GGUF_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {  // subnormal: normalise the mantissa
    int shifts = 0;
    while (!(man & 0x400)) man <<= 1, ++shifts;
    bits = sign | (uint32_t(113 - shifts) << 23) | ((man & 0x3ff) << 13);
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// K-quant sub-block j's 6-bit scale and min (llama.cpp's get_scale_min_k4).
inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63, m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// ---- per type: bytes per 32-element chunk's block, the portable decode and the AVX2 decode ----
// scalar(row, c, out): chunk c of a weight row into out[32]. avx(row, c, w): the same into 4 x 8 lanes.

#ifdef LOOPKV_GGUF_AVX2
// 32 int8 values (element order) into four float vectors.
inline void i8_to_ps(__m256i q, __m256* w) {
  const __m128i lo = _mm256_castsi256_si128(q), hi = _mm256_extracti128_si256(q, 1);
  w[0] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo));
  w[1] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8)));
  w[2] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi));
  w[3] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8)));
}
// A block's 16 bytes of nibbles: low nibbles are elements 0-15, high nibbles 16-31.
inline __m256i nibbles32(const uint8_t* qs) {
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
// Bit i of a 32-bit mask as 0x10 in byte i (the fifth bit of Q5_0 / Q5_1).
inline __m256i bits_to_0x10(const uint8_t* qh) {
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
inline void scale(__m256* w, float d) {
  const __m256 vd = _mm256_set1_ps(d);
  for (int j = 0; j < 4; ++j) w[j] = _mm256_mul_ps(vd, w[j]);
}
inline void scale_add(__m256* w, float d, float m) {  // d * q + m, two roundings as numpy
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  for (int j = 0; j < 4; ++j) w[j] = _mm256_add_ps(_mm256_mul_ps(vd, w[j]), vm);
}
inline void scale_sub(__m256* w, float d, float m) {  // d * q - m
  const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
  for (int j = 0; j < 4; ++j) w[j] = _mm256_sub_ps(_mm256_mul_ps(vd, w[j]), vm);
}
#endif

struct Q4_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 18;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    const uint8_t* b = row + c * BYTES;
    const float d = f16(b);
    for (int j = 0; j < 16; ++j) {
      o[j] = d * float((b[2 + j] & 0xF) - 8);
      o[j + 16] = d * float((b[2 + j] >> 4) - 8);
    }
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const uint8_t* b = row + c * BYTES;
    i8_to_ps(_mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8)), w);
    scale(w, f16(b));
  }
#endif
};

struct Q4_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 20;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    const uint8_t* b = row + c * BYTES;
    const float d = f16(b), m = f16(b + 2);
    for (int j = 0; j < 16; ++j) {
      o[j] = d * float(b[4 + j] & 0xF) + m;
      o[j + 16] = d * float(b[4 + j] >> 4) + m;
    }
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const uint8_t* b = row + c * BYTES;
    i8_to_ps(nibbles32(b + 4), w);
    scale_add(w, f16(b), f16(b + 2));
  }
#endif
};

struct Q5_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 22;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    const uint8_t* b = row + c * BYTES;
    const float d = f16(b);
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      o[j] = d * float(int((b[6 + j] & 0xF) | (((qh >> j) & 1) << 4)) - 16);
      o[j + 16] = d * float(int((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
    }
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const uint8_t* b = row + c * BYTES;
    const __m256i q = _mm256_or_si256(nibbles32(b + 6), bits_to_0x10(b + 2));
    i8_to_ps(_mm256_sub_epi8(q, _mm256_set1_epi8(16)), w);
    scale(w, f16(b));
  }
#endif
};

struct Q5_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 24;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    const uint8_t* b = row + c * BYTES;
    const float d = f16(b), m = f16(b + 2);
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; ++j) {
      o[j] = d * float((b[8 + j] & 0xF) | (((qh >> j) & 1) << 4)) + m;
      o[j + 16] = d * float((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) + m;
    }
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const uint8_t* b = row + c * BYTES;
    i8_to_ps(_mm256_or_si256(nibbles32(b + 8), bits_to_0x10(b + 4)), w);
    scale_add(w, f16(b), f16(b + 2));
  }
#endif
};

struct Q8_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 34;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    const uint8_t* b = row + c * BYTES;
    const float d = f16(b);
    for (int j = 0; j < 32; ++j) o[j] = float(int8_t(b[2 + j])) * d;
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const uint8_t* b = row + c * BYTES;
    i8_to_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), w);
    scale(w, f16(b));
  }
#endif
};

// Q4_K: d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles; sub-block s (32 elements)
// is the low (s even) or high (s odd) nibbles of bytes 32 (s / 2) .. 32 (s / 2) + 31.
struct Q4_K {
  static constexpr int64_t BLOCK = 256, BYTES = 144;
  static const uint8_t* sub(const uint8_t* row, int64_t c, float& dd, float& dm) {
    const uint8_t* b = row + (c / 8) * BYTES;
    const int s = int(c % 8);
    int sc, m;
    scale_min_k4(s, b + 4, sc, m);
    dd = f16(b) * float(sc), dm = f16(b + 2) * float(m);
    return b;
  }
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    float dd, dm;
    const uint8_t* b = sub(row, c, dd, dm);
    const int s = int(c % 8), shift = 4 * (s % 2);
    const uint8_t* q = b + 16 + 32 * (s / 2);
    for (int l = 0; l < 32; ++l) o[l] = dd * float((q[l] >> shift) & 0xF) - dm;
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    float dd, dm;
    const uint8_t* b = sub(row, c, dd, dm);
    const int s = int(c % 8);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * (s / 2)));
    i8_to_ps(_mm256_and_si256(_mm256_srli_epi16(q, 4 * (s % 2)), _mm256_set1_epi8(0x0F)), w);
    scale_sub(w, dd, dm);
  }
#endif
};

// Q5_K: Q4_K's layout with 32 bytes of high bits after the scales: sub-block s's fifth bit is bit s.
struct Q5_K {
  static constexpr int64_t BLOCK = 256, BYTES = 176;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    const uint8_t* b = row + (c / 8) * BYTES;
    const int s = int(c % 8), shift = 4 * (s % 2);
    int sc, m;
    scale_min_k4(s, b + 4, sc, m);
    const float dd = f16(b) * float(sc), dm = f16(b + 2) * float(m);
    const uint8_t *qh = b + 16, *q = b + 48 + 32 * (s / 2);
    for (int l = 0; l < 32; ++l) o[l] = dd * float(((q[l] >> shift) & 0xF) | (((qh[l] >> s) & 1) << 4)) - dm;
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const uint8_t* b = row + (c / 8) * BYTES;
    const int s = int(c % 8);
    int sc, m;
    scale_min_k4(s, b + 4, sc, m);
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 48 + 32 * (s / 2)));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(q, 4 * (s % 2)), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, s), _mm256_set1_epi8(1)), 4);
    i8_to_ps(_mm256_or_si256(lo, hi), w);
    scale_sub(w, f16(b) * float(sc), f16(b + 2) * float(m));
  }
#endif
};

// Q6_K: 128 bytes of low nibbles, 64 of 2-bit highs, 16 int8 scales (one per 16 elements), d (f16).
// Chunk s (0-7) of a block: half g = s / 4, r = s % 4: low nibbles (r < 2) or high of ql[64 g + 32 (r % 2) ..],
// bits 2r, 2r + 1 of qh[32 g ..]; minus 32.
struct Q6_K {
  static constexpr int64_t BLOCK = 256, BYTES = 210;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    const uint8_t* b = row + (c / 8) * BYTES;
    const int s = int(c % 8), g = s / 4, r = s % 4;
    const uint8_t *ql = b + 64 * g + 32 * (r % 2), *qh = b + 128 + 32 * g;
    const float d = f16(b + 208);
    const float d0 = d * float(int8_t(b[192 + 2 * s])), d1 = d * float(int8_t(b[193 + 2 * s]));
    for (int l = 0; l < 32; ++l) {
      const int q = int(((ql[l] >> (4 * (r / 2))) & 0xF) | (((qh[l] >> (2 * r)) & 3) << 4)) - 32;
      o[l] = (l < 16 ? d0 : d1) * float(q);
    }
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const uint8_t* b = row + (c / 8) * BYTES;
    const int s = int(c % 8), g = s / 4, r = s % 4;
    const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * g + 32 * (r % 2)));
    const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * g));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(ql, 4 * (r / 2)), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * r), _mm256_set1_epi8(3)), 4);
    i8_to_ps(_mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32)), w);
    const float d = f16(b + 208);
    const __m256 d0 = _mm256_set1_ps(d * float(int8_t(b[192 + 2 * s])));
    const __m256 d1 = _mm256_set1_ps(d * float(int8_t(b[193 + 2 * s])));
    w[0] = _mm256_mul_ps(d0, w[0]), w[1] = _mm256_mul_ps(d0, w[1]);
    w[2] = _mm256_mul_ps(d1, w[2]), w[3] = _mm256_mul_ps(d1, w[3]);
  }
#endif
};

struct F32 {
  static constexpr int64_t BLOCK = 1, BYTES = 4;
  static void scalar(const uint8_t* row, int64_t c, float* o) { std::memcpy(o, row + c * 128, 128); }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const float* p = reinterpret_cast<const float*>(row + c * 128);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_loadu_ps(p + 8 * j);
  }
#endif
};

struct F16 {
  static constexpr int64_t BLOCK = 1, BYTES = 2;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    for (int j = 0; j < 32; ++j) o[j] = f16(row + c * 64 + 2 * j);
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + c * 64);
    for (int j = 0; j < 4; ++j) w[j] = _mm256_cvtph_ps(_mm_loadu_si128(p + j));
  }
#endif
};

struct BF16 {
  static constexpr int64_t BLOCK = 1, BYTES = 2;
  static void scalar(const uint8_t* row, int64_t c, float* o) {
    for (int j = 0; j < 32; ++j) {
      uint16_t h;
      std::memcpy(&h, row + c * 64 + 2 * j, 2);
      const uint32_t bits = uint32_t(h) << 16;
      std::memcpy(o + j, &bits, 4);
    }
  }
#ifdef LOOPKV_GGUF_AVX2
  static void avx(const uint8_t* row, int64_t c, __m256* w) {
    const __m128i* p = reinterpret_cast<const __m128i*>(row + c * 64);
    for (int j = 0; j < 4; ++j)
      w[j] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(p + j)), 16));
  }
#endif
};

// ---- the fixed summation order (see the top): 4 accumulators x 8 lanes, then hsum8 ----

inline float hsum8_scalar(const float* s) {  // the lane reduction of hsum8, spelled out
  float t[4], u[2];
  for (int i = 0; i < 4; ++i) t[i] = s[i] + s[i + 4];
  for (int i = 0; i < 2; ++i) u[i] = t[i] + t[i + 2];
  return u[0] + u[1];
}

template <class Q>
void row_dot_scalar(const float* x, int64_t M, int64_t K, const uint8_t* wrow, float* buf, float* y, int64_t ldy) {
  for (int64_t c = 0; c < K / CHUNK; ++c) Q::scalar(wrow, c, buf + c * CHUNK);
  for (int64_t m = 0; m < M; ++m) {
    float acc[4][8] = {};
    const float* xm = x + m * K;
    for (int64_t c = 0; c < K / CHUNK; ++c)
      for (int j = 0; j < 4; ++j)
        for (int l = 0; l < 8; ++l) {
          const int64_t k = c * CHUNK + 8 * j + l;
          acc[j][l] = std::fma(buf[k], xm[k], acc[j][l]);
        }
    float s[8];
    for (int l = 0; l < 8; ++l) s[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
    y[m * ldy] = hsum8_scalar(s);
  }
}

#ifdef LOOPKV_GGUF_AVX2
inline float hsum8(__m256 v) {
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // t[i] = s[i] + s[i + 4]
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));                                           // u[i] = t[i] + t[i + 2]
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));                          // u[0] + u[1]
}

// MR rows of x against one weight row, each chunk decoded into registers once for all MR rows.
template <class Q, int MR>
inline void row_dot_regs(const float* x, int64_t K, const uint8_t* wrow, float* y, int64_t ldy) {
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t c = 0; c < K / CHUNK; ++c) {
    __m256 w[4];
    Q::avx(wrow, c, w);
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(x + m * K + c * CHUNK + 8 * j), acc[m][j]);
  }
  for (int m = 0; m < MR; ++m)
    y[m * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
}

// MR rows of x against one weight row already decoded into buf (float32, K elements).
template <int MR>
inline void row_dot_buf(const float* x, int64_t K, const float* buf, float* y, int64_t ldy) {
  __m256 acc[MR][4];
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += CHUNK)
    for (int j = 0; j < 4; ++j) {
      const __m256 w = _mm256_loadu_ps(buf + k + 8 * j);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + m * K + k + 8 * j), acc[m][j]);
    }
  for (int m = 0; m < MR; ++m)
    y[m * ldy] = hsum8(_mm256_add_ps(_mm256_add_ps(acc[m][0], acc[m][1]), _mm256_add_ps(acc[m][2], acc[m][3])));
}

template <class Q>
void row_dot_avx(const float* x, int64_t M, int64_t K, const uint8_t* wrow, float* buf, float* y, int64_t ldy) {
  if (M <= 2) {
    if (M == 2) row_dot_regs<Q, 2>(x, K, wrow, y, ldy);
    else row_dot_regs<Q, 1>(x, K, wrow, y, ldy);
    return;
  }
  for (int64_t c = 0; c < K / CHUNK; ++c) {
    __m256 w[4];
    Q::avx(wrow, c, w);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(buf + c * CHUNK + 8 * j, w[j]);
  }
  int64_t m = 0;
  for (; m + 3 <= M; m += 3) row_dot_buf<3>(x + m * K, K, buf, y + m * ldy, ldy);
  if (M - m == 2) row_dot_buf<2>(x + m * K, K, buf, y + m * ldy, ldy);
  if (M - m == 1) row_dot_buf<1>(x + m * K, K, buf, y + m * ldy, ldy);
}
#endif

#ifdef LOOPKV_GGUF_AVX512
// ---- AVX-512: the same chunks, 16 lanes. z[0] holds accumulators 0 and 1 of the 8-lane order (its
// lanes 0-7 and 8-15: elements 0-15 of the chunk), z[1] accumulators 2 and 3 (elements 16-31), so each
// lane sees the same FMA sequence as the AVX2 path and the reduction below is the same sum, bit for bit.

inline void i8_to_ps512(__m256i q, __m512* z) {  // 32 int8 values (element order) into two float vectors
  z[0] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
  z[1] = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
}

// The AVX2 decode, joined into two 16-lane vectors: the types without a decode of their own below.
template <class Q>
inline void decode512(const uint8_t* row, int64_t c, __m512* z) {
  __m256 w[4];
  Q::avx(row, c, w);
  z[0] = _mm512_insertf32x8(_mm512_castps256_ps512(w[0]), w[1], 1);
  z[1] = _mm512_insertf32x8(_mm512_castps256_ps512(w[2]), w[3], 1);
}
// 4-bit types: the block's 16 possible weights computed once (exactly as numpy: the same multiply and
// add per value), then each element looked up by its nibble (vpermps reads only an index's low 4 bits,
// so a zero-extended byte indexes by its low nibble and the byte shifted right by 4 by its high one).
inline __m512 iota16() {  // not a static: its guard check would make the loops spill their accumulators
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline void lookup_nibbles(const uint8_t* qs, __m512 lut, __m512* z) {  // 16 bytes: low nibbles, then high
  const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  z[0] = _mm512_permutexvar_ps(q, lut);
  z[1] = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), lut);
}
template <>
inline void decode512<Q4_0>(const uint8_t* row, int64_t c, __m512* z) {
  const uint8_t* b = row + c * Q4_0::BYTES;
  const __m512 q = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f));  // float(q - 8), exact
  lookup_nibbles(b + 2, _mm512_mul_ps(_mm512_set1_ps(f16(b)), q), z);
}
template <>
inline void decode512<Q4_1>(const uint8_t* row, int64_t c, __m512* z) {
  const uint8_t* b = row + c * Q4_1::BYTES;
  lookup_nibbles(b + 4, _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(f16(b)), iota16()), _mm512_set1_ps(f16(b + 2))), z);
}
template <>
inline void decode512<Q8_0>(const uint8_t* row, int64_t c, __m512* z) {
  const uint8_t* b = row + c * Q8_0::BYTES;
  i8_to_ps512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 2)), z);
  const __m512 vd = _mm512_set1_ps(f16(b));
  z[0] = _mm512_mul_ps(z[0], vd), z[1] = _mm512_mul_ps(z[1], vd);
}
template <>
inline void decode512<Q4_K>(const uint8_t* row, int64_t c, __m512* z) {  // 32 bytes, one nibble each
  float dd, dm;
  const uint8_t* b = Q4_K::sub(row, c, dd, dm);
  const int s = int(c % 8);
  const __m512 lut = _mm512_sub_ps(_mm512_mul_ps(_mm512_set1_ps(dd), iota16()), _mm512_set1_ps(dm));
  const uint8_t* q = b + 16 + 32 * (s / 2);
  const __m128i shift = _mm_cvtsi32_si128(4 * (s % 2));
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * h)));
    z[h] = _mm512_permutexvar_ps(_mm512_srl_epi32(v, shift), lut);
  }
}

inline float hsum16x2(__m512 z0, __m512 z1) {  // (a0 + a1) + (a2 + a3), then hsum8: the AVX2 reduction
  const __m256 a01 = _mm256_add_ps(_mm512_castps512_ps256(z0), _mm512_extractf32x8_ps(z0, 1));
  const __m256 a23 = _mm256_add_ps(_mm512_castps512_ps256(z1), _mm512_extractf32x8_ps(z1, 1));
  return hsum8(_mm256_add_ps(a01, a23));
}

// Q4_0 / Q4_1 rows: every block's scale (and min) converted from half precision in one pass before the
// products, so the loop over blocks builds each lookup table from two broadcast loads. The conversions
// and the table are the same operations as decode512's (the same bits); converted in the loop they took
// about a third of its vector instructions, and a one-row product is bound by those, not by memory.
constexpr int64_t SCALE_RUN = 128;  // blocks converted per pass (stack arrays)

template <class Q>
constexpr bool lut_scales = std::is_same_v<Q, Q4_0> || std::is_same_v<Q, Q4_1>;

template <class Q>
inline void block_scales(const uint8_t* row, int64_t c0, int64_t n, float* d, float* m) {
  int64_t b = 0;
  for (; b + 16 <= n; b += 16) {  // 16 blocks' leading halves, gathered as 32-bit words
    const __m512i idx = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                           _mm512_set1_epi32(int(Q::BYTES)));
    const uint8_t* base = row + (c0 + b) * Q::BYTES;
    // Q4_0 blocks are 18 bytes: a 32-bit word from the block start holds d and the first quant byte
    const __m512i v = _mm512_i32gather_epi32(idx, base, 1);
    _mm512_storeu_ps(d + b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)));
    if constexpr (std::is_same_v<Q, Q4_1>) _mm512_storeu_ps(m + b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16))));
  }
  for (; b < n; ++b) {
    d[b] = f16(row + (c0 + b) * Q::BYTES);
    if constexpr (std::is_same_v<Q, Q4_1>) m[b] = f16(row + (c0 + b) * Q::BYTES + 2);
  }
}

template <class Q, int MR>
inline void row_dot_lut512(const float* x, int64_t K, const uint8_t* wrow, float* y, int64_t ldy) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  alignas(64) float d[SCALE_RUN], mn[SCALE_RUN];
  const int64_t blocks = K / CHUNK;
  for (int64_t c0 = 0; c0 < blocks; c0 += SCALE_RUN) {
    const int64_t n = std::min(SCALE_RUN, blocks - c0);
    block_scales<Q>(wrow, c0, n, d, mn);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t c = c0 + i;
      __m512 z[2];
      if constexpr (std::is_same_v<Q, Q4_1>) {
        lookup_nibbles(wrow + c * Q::BYTES + 4, _mm512_add_ps(_mm512_mul_ps(_mm512_set1_ps(d[i]), iota16()), _mm512_set1_ps(mn[i])), z);
      } else {
        lookup_nibbles(wrow + c * Q::BYTES + 2, _mm512_mul_ps(_mm512_set1_ps(d[i]), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f))), z);
      }
      for (int m = 0; m < MR; ++m)
        for (int j = 0; j < 2; ++j) acc[m][j] = _mm512_fmadd_ps(z[j], _mm512_loadu_ps(x + m * K + c * CHUNK + 16 * j), acc[m][j]);
    }
  }
  for (int m = 0; m < MR; ++m) y[m * ldy] = hsum16x2(acc[m][0], acc[m][1]);
}

template <class Q, int MR>
inline void row_dot_regs512(const float* x, int64_t K, const uint8_t* wrow, float* y, int64_t ldy) {
  if constexpr (lut_scales<Q>) return row_dot_lut512<Q, MR>(x, K, wrow, y, ldy);
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < K / CHUNK; ++c) {
    __m512 z[2];
    decode512<Q>(wrow, c, z);
    for (int m = 0; m < MR; ++m)
      for (int j = 0; j < 2; ++j) acc[m][j] = _mm512_fmadd_ps(z[j], _mm512_loadu_ps(x + m * K + c * CHUNK + 16 * j), acc[m][j]);
  }
  for (int m = 0; m < MR; ++m) y[m * ldy] = hsum16x2(acc[m][0], acc[m][1]);
}

template <int MR>
inline void row_dot_buf512(const float* x, int64_t K, const float* buf, float* y, int64_t ldy) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += CHUNK)
    for (int j = 0; j < 2; ++j) {
      const __m512 w = _mm512_loadu_ps(buf + k + 16 * j);
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_fmadd_ps(w, _mm512_loadu_ps(x + m * K + k + 16 * j), acc[m][j]);
    }
  for (int m = 0; m < MR; ++m) y[m * ldy] = hsum16x2(acc[m][0], acc[m][1]);
}

template <class Q>
void row_dot_avx512(const float* x, int64_t M, int64_t K, const uint8_t* wrow, float* buf, float* y, int64_t ldy) {
  switch (M) {  // up to 8 rows: 16 accumulators and a decoded chunk fit the 32 registers
    case 1: return row_dot_regs512<Q, 1>(x, K, wrow, y, ldy);
    case 2: return row_dot_regs512<Q, 2>(x, K, wrow, y, ldy);
    case 3: return row_dot_regs512<Q, 3>(x, K, wrow, y, ldy);
    case 4: return row_dot_regs512<Q, 4>(x, K, wrow, y, ldy);
    case 5: return row_dot_regs512<Q, 5>(x, K, wrow, y, ldy);
    case 6: return row_dot_regs512<Q, 6>(x, K, wrow, y, ldy);
    case 7: return row_dot_regs512<Q, 7>(x, K, wrow, y, ldy);
    case 8: return row_dot_regs512<Q, 8>(x, K, wrow, y, ldy);
  }
  for (int64_t c = 0; c < K / CHUNK; ++c) {
    __m512 z[2];
    decode512<Q>(wrow, c, z);
    _mm512_storeu_ps(buf + c * CHUNK, z[0]);
    _mm512_storeu_ps(buf + c * CHUNK + 16, z[1]);
  }
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) row_dot_buf512<4>(x + m * K, K, buf, y + m * ldy, ldy);
  switch (M - m) {
    case 3: row_dot_buf512<3>(x + m * K, K, buf, y + m * ldy, ldy); break;
    case 2: row_dot_buf512<2>(x + m * K, K, buf, y + m * ldy, ldy); break;
    case 1: row_dot_buf512<1>(x + m * K, K, buf, y + m * ldy, ldy); break;
  }
}
#endif

// Instruction-set paths, each the same bits (see the top); -1 asks for the best this build has.
enum Path : int64_t { PORTABLE = 0, AVX2 = 1, AVX512 = 2 };

constexpr int64_t best_path() {
#if defined(LOOPKV_GGUF_AVX512)
  return AVX512;
#elif defined(LOOPKV_GGUF_AVX2)
  return AVX2;
#else
  return PORTABLE;
#endif
}

int64_t resolve(int64_t path) {
  TORCH_CHECK(path >= -1 && path <= best_path(), "gguf_linear: path ", path, " is not built here (best ", best_path(), ")");
  return path < 0 ? best_path() : path;
}

template <class Q>
void dequant_row(const uint8_t* wrow, int64_t K, float* out, int64_t path) {
#ifdef LOOPKV_GGUF_AVX512
  if (path == AVX512) {
    for (int64_t c = 0; c < K / CHUNK; ++c) {
      __m512 z[2];
      decode512<Q>(wrow, c, z);
      _mm512_storeu_ps(out + c * CHUNK, z[0]);
      _mm512_storeu_ps(out + c * CHUNK + 16, z[1]);
    }
    return;
  }
#endif
#ifdef LOOPKV_GGUF_AVX2
  if (path != PORTABLE) {
    for (int64_t c = 0; c < K / CHUNK; ++c) {
      __m256 w[4];
      Q::avx(wrow, c, w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + c * CHUNK + 8 * j, w[j]);
    }
    return;
  }
#endif
  for (int64_t c = 0; c < K / CHUNK; ++c) Q::scalar(wrow, c, out + c * CHUNK);
}

template <class F>
auto dispatch(int64_t type, F&& f) {
  switch (type) {
    case T_Q4_0: return f(Q4_0{});
    case T_Q4_1: return f(Q4_1{});
    case T_Q5_0: return f(Q5_0{});
    case T_Q5_1: return f(Q5_1{});
    case T_Q8_0: return f(Q8_0{});
    case T_Q4_K: return f(Q4_K{});
    case T_Q5_K: return f(Q5_K{});
    case T_Q6_K: return f(Q6_K{});
    case T_F32: return f(F32{});
    case T_F16: return f(F16{});
    case T_BF16: return f(BF16{});
  }
  TORCH_CHECK(false, "gguf_linear: unsupported ggml type ", type);
}

// Checks the operands, returns (N, K). w: uint8 [N, row bytes] holding N rows of K elements.
std::pair<int64_t, int64_t> check_weight(const torch::Tensor& w, int64_t type, int64_t K) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf_linear: blocks are a contiguous uint8 CPU tensor [N, row bytes]");
  TORCH_CHECK(K > 0 && K % CHUNK == 0, "gguf_linear: K (", K, ") must be a positive multiple of 32");
  const int64_t row_bytes = dispatch(type, [&](auto q) {
    using Q = decltype(q);
    TORCH_CHECK(K % Q::BLOCK == 0, "gguf_linear: K (", K, ") is not a multiple of the block size ", Q::BLOCK);
    return K / Q::BLOCK * Q::BYTES;
  });
  TORCH_CHECK(w.size(1) == row_bytes, "gguf_linear: a row of ", K, " elements of type ", type, " is ", row_bytes,
              " bytes, blocks have ", w.size(1));
  return {w.size(0), K};
}

int64_t grain_for(int64_t n) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(1, (n + threads - 1) / threads);
}

}  // namespace

std::vector<std::string> paths() {  // the paths this build has, by their Path number
  std::vector<std::string> out = {"portable"};
  if (best_path() >= AVX2) out.push_back("avx2");
  if (best_path() >= AVX512) out.push_back("avx512");
  return out;
}

torch::Tensor dequantize(torch::Tensor w, int64_t type, int64_t K, int64_t path) {
  const auto [N, K_] = check_weight(w, type, K);
  path = resolve(path);
  torch::Tensor out = at::empty({N, K_}, at::TensorOptions().dtype(at::kFloat));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t rb = w.size(1);
  dispatch(type, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, N, grain_for(N), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) dequant_row<Q>(wp + n * rb, K_, op + n * K_, path);
    });
    return 0;
  });
  return out;
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w, int64_t type, c10::optional<torch::Tensor> bias, int64_t path) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "gguf gemv: x is float32 [M, K]");
  const auto [N, K] = check_weight(w, type, x.size(1));
  x = x.contiguous();
  const int64_t M = x.size(0), rb = w.size(1);
  torch::Tensor out = at::empty({M, N}, x.options());
  if (M == 0) return out;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  path = resolve(path);
  dispatch(type, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, N, grain_for(N), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(K);
      for (int64_t n = begin; n < end; ++n) {
#ifdef LOOPKV_GGUF_AVX512
        if (path != PORTABLE && n + PREFETCH_ROWS < end)  // a few rows ahead: the hardware prefetcher alone
          // leaves a one-row decode waiting on memory (benchmarks/gguf_kernels.py: ~2x at the LM head)
          for (int64_t b = 0; b < rb; b += 64) _mm_prefetch(reinterpret_cast<const char*>(wp + (n + PREFETCH_ROWS) * rb + b), _MM_HINT_T0);
        if (path == AVX512) {
          row_dot_avx512<Q>(xp, M, K, wp + n * rb, buf.data(), op + n, N);
          continue;
        }
#endif
#ifdef LOOPKV_GGUF_AVX2
        if (path == AVX2) {
          row_dot_avx<Q>(xp, M, K, wp + n * rb, buf.data(), op + n, N);
          continue;
        }
#endif
        row_dot_scalar<Q>(xp, M, K, wp + n * rb, buf.data(), op + n, N);
      }
    });
    return 0;
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gguf gemv: bias [N]");
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out;
}

// Prefill: tiles of `tile` weight rows dequantized to float32 (in parallel), each multiplied by
// torch's GEMM (MKL / oneDNN, threaded by itself); the transient tile is the only float copy.
torch::Tensor gemm_dequant(torch::Tensor x, torch::Tensor w, int64_t type, c10::optional<torch::Tensor> bias,
                           int64_t tile, bool bf16) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "gguf gemm: x is float32 [M, K]");
  const auto [N, K] = check_weight(w, type, x.size(1));
  TORCH_CHECK(tile > 0, "gguf gemm: tile > 0");
  x = x.contiguous();
  torch::Tensor out = at::empty({x.size(0), N}, x.options());
  const bool has_bias = bias.has_value() && bias->defined();
  // bf16: x and each tile rounded to bfloat16 (one rounding each) and multiplied by oneDNN's bfloat16 GEMM,
  // float32 accumulation inside, the result rounded to bfloat16 once; the bias is added in float32.
  const torch::Tensor xin = bf16 ? x.to(at::kBFloat16) : x;
  for (int64_t n0 = 0; n0 < N; n0 += tile) {
    const int64_t tn = std::min(tile, N - n0);
    torch::Tensor wt = dequantize(w.narrow(0, n0, tn), type, K, -1);
    if (bf16) wt = wt.to(at::kBFloat16);
    torch::Tensor dst = out.narrow(1, n0, tn);
    if (bf16 || !has_bias) {
      dst.copy_(at::mm(xin, wt.t()));
      if (has_bias) dst.add_(bias->to(at::kFloat).narrow(0, n0, tn));
    } else {
      dst.copy_(at::addmm(bias->to(at::kFloat).narrow(0, n0, tn), x, wt.t()));
    }
  }
  return out;
}

// Prefill in bfloat16 with float32 results: x and the dequantized weight rounded to bfloat16 once each
// (round to nearest even), their products summed in float32 by oneDNN's batch-reduce GEMM (the kernel
// torch's CPU flash attention calls: AMX, or AVX512-BF16 dot products) and the float32 sums kept: no
// rounding of the result, unlike a bfloat16 torch GEMM. The weight is decoded and packed once per call,
// in tiles of PACK_N rows (a leading dimension oneDNN packs), then dropped.
constexpr int64_t PACK_N = 64;
constexpr int64_t BLOCK_M = 64;

bool gemm_bf16_fits(int64_t N, int64_t K) {
  return N % PACK_N == 0 && K % 2 == 0 && loopkv_bf16::available();
}

torch::Tensor gemm_bf16(torch::Tensor x, torch::Tensor w, int64_t type, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "gguf gemm: x is float32 [M, K]");
  const auto [N, K] = check_weight(w, type, x.size(1));
  TORCH_CHECK(gemm_bf16_fits(N, K), "gguf gemm_bf16: needs N % 64 == 0, even K and oneDNN's bfloat16 packing");
  const int64_t M = x.size(0), tiles = N / PACK_N, rb = w.size(1);
  const torch::Tensor xb = x.contiguous().to(at::kBFloat16);
  torch::Tensor packed = at::empty({tiles, K * PACK_N}, xb.options());
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::BFloat16* pp = packed.data_ptr<at::BFloat16>();
  const int64_t path = resolve(-1);
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> rows(PACK_N * K);
    std::vector<at::BFloat16> kn(K * PACK_N);  // the tile transposed: B [K, PACK_N]
    for (int64_t t = begin; t < end; ++t) {
      dispatch(type, [&](auto q) {
        using Q = decltype(q);
        for (int64_t r = 0; r < PACK_N; ++r) dequant_row<Q>(wp + (t * PACK_N + r) * rb, K, rows.data() + r * K, path);
        return 0;
      });
      for (int64_t k = 0; k < K; ++k)
        for (int64_t r = 0; r < PACK_N; ++r) kn[k * PACK_N + r] = at::BFloat16(rows[r * K + k]);
      loopkv_bf16::pack_b(K, PACK_N, PACK_N, kn.data(), pp + t * K * PACK_N);
    }
  });
  torch::Tensor out = at::empty({M, N}, x.options());
  const at::BFloat16* xp = xb.data_ptr<at::BFloat16>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, (M + BLOCK_M - 1) / BLOCK_M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const int64_t m0 = b * BLOCK_M, mm = std::min(BLOCK_M, M - m0);
      for (int64_t t = 0; t < tiles; ++t)
        at::native::cpublas::brgemm(mm, PACK_N, K, K, PACK_N, N, false, xp + m0 * K, pp + t * K * PACK_N,
                                    op + m0 * N + t * PACK_N, true);
    }
    at::native::cpublas::brgemm_release(true);
  });
  if (bias.has_value() && bias->defined()) out.add_(bias->to(at::kFloat));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paths", &paths, "the instruction-set paths compiled here, indexed by the path argument: portable, avx2, avx512");
  m.def("dequantize", &dequantize, "GGUF blocks [N, row bytes] -> float32 [N, K] (bitwise gguf.quants.dequantize)");
  m.def("gemv", &gemv, "x [M, K] @ dequant(w).T (+ bias), streamed from the blocks, one fixed order per output");
  m.def("gemm_bf16", &gemm_bf16, "x @ dequant(w).T (+ bias): bfloat16 operands, float32 sums and result (oneDNN)");
  m.def("gemm_bf16_fits", &gemm_bf16_fits, "whether gemm_bf16 takes a weight of N rows of K (and oneDNN runs a bfloat16 brgemm here)");
  m.def("gemm_dequant", &gemm_dequant,
        "x @ dequant(w).T (+ bias): tiles of the weight through torch's GEMM, float32 or (bf16) bfloat16");
}
