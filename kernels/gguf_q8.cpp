// y = x W^T (+ b) on GGUF block weights with int8 activations, llama.cpp's decode arithmetic: each row
// of x is quantized once per call to 32-element int8 blocks (Q8_0 / Q8_1), and a weight block meets an
// activation block as one integer dot product (AVX512-VNNI / AVX-VNNI vpdpbusd, AVX2 vpmaddubsw +
// vpmaddwd, or plain ints), scaled once per block. gguf_linear.cpp's gemv instead decodes every weight
// to float32 and FMAs it: bound by the decode, not by memory, at a decode step (~3x fewer instructions here).
//
// Activations (quantize): per block of 32, llama.cpp's quantize_row_q8_0_ref / q8_1_ref rounding:
// d = amax / 127, id = d ? 1 / d : 0, q = roundf(x id) (half away from zero), all float32. d is kept as
// float32, not rounded to fp16 as llama.cpp stores it: the q were computed against the float32 d, the
// blocks live for one call in cache, and fp16 would add a 2^-11 relative error per block for nothing.
// For the types with a min (Q4_1, Q5_1, Q4_K, Q5_K) the block sum enters too; here as per-quad sums
// (elements 4l .. 4l + 3) times d, so the min term is a vector FMA per block (llama.cpp: a scalar one).
//
// Weights: the block layouts and ggml type ids of gguf_linear.cpp. A block's 32 weights are small ints
// q_i with per-block scale dw (Q6_K: one per 16) and, for the types with one, a min mw (K-quants: -dmin m):
// weight_i = dw q_i (+ mw). Signed q (Q4_0, Q5_0, Q8_0, Q6_K) enter the u8 x s8 dot as |q| against
// x's q with q_i's sign (llama.cpp's trick; exact, -128 included).
//
// Every output is one float32 sum in one fixed order, whichever path computes it: for chunk c (32
// elements, in order) and lane l = 0..7 (elements 4l .. 4l + 3), p = the exact int32 dot of the lane;
//     A[c % 2][l] = fma(float(p), dw(l) * dx_c, A[c % 2][l])
//     M[c % 2][l] = fma(mw, dx_c * float(sum of x's q over the lane), M[c % 2][l])   (types with a min)
// then y = hsum8((A0 + A1) + (M0 + M1)) (gguf_linear.cpp's lane reduction), bias added after. So a row's
// result does not depend on its batch, the thread split or the instruction set (portable emulates the
// lanes with std::fma; this file builds with -ffp-contract=off so nothing else fuses); the tests hold all
// paths equal. Work is split over torch's threads by output feature (at::parallel_for); weight rows are
// prefetched a few rows ahead; up to 4 rows of x (AVX-512 builds; 2 on AVX2) share each decoded block.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#include <immintrin.h>
#define LOOPKV_Q8_AVX2 1
#if (defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__)
#define LOOPKV_Q8_VNNI 1  // vpdpbusd on 8 lanes
#endif
#if defined(LOOPKV_Q8_VNNI) && defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#define LOOPKV_Q8_ZMM 1  // vpdpbusd on 16 lanes: two blocks per instruction
#endif
#endif

namespace {

// ggml's type ids (gguf.GGMLQuantizationType), as gguf_linear.cpp.
enum GgmlType : int64_t { T_Q4_0 = 2, T_Q4_1 = 3, T_Q5_0 = 6, T_Q5_1 = 7, T_Q8_0 = 8, T_Q4_K = 12, T_Q5_K = 13, T_Q6_K = 14 };

constexpr int64_t CHUNK = 32;
constexpr int64_t PREFETCH_ROWS = 4;
#ifdef __AVX512F__
constexpr int MR_MAX = 4;  // x rows per pass: 4 x 4 accumulators fit AVX-512's 32 vector registers
#else
constexpr int MR_MAX = 2;
#endif

inline float f16(const uint8_t* p) {  // IEEE half to float, exact (gguf_linear.cpp's)
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef LOOPKV_Q8_AVX2
  return _cvtsh_ss(h);
#else
  uint32_t sign = uint32_t(h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0 && man == 0) {
    bits = sign;
  } else if (exp == 0) {
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

inline void scale_min_k4(int j, const uint8_t* q, int& sc, int& m) {  // llama.cpp's get_scale_min_k4
  if (j < 4) {
    sc = q[j] & 63, m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

#ifdef LOOPKV_Q8_AVX2
inline __m256i nibbles32(const uint8_t* qs) {  // 16 bytes: low nibbles are elements 0-15, high 16-31
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m), _mm_and_si128(q, m));
}
inline __m256i bits_to_0x10(const uint8_t* qh) {  // bit i of a 32-bit mask as 0x10 in byte i
  uint32_t bits;
  std::memcpy(&bits, qh, 4);
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(int(bits)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(0x10));
}
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
#endif

// ---- per type: scalar(row, c, q, d, m): chunk c's 32 weights as ints, the per-lane scale, the min;
// avx(row, c, d, m): the same ints as 32 bytes (element order), scale and min as 8-lane vectors.
// SIGNED: the ints may be negative (the dot takes |q| and moves the sign to x); MIN: a min term.

struct Q4_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 18;
  static constexpr bool SIGNED = true, MIN = false;
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    const uint8_t* b = row + c * BYTES;
    for (int j = 0; j < 16; ++j) q[j] = (b[2 + j] & 0xF) - 8, q[j + 16] = (b[2 + j] >> 4) - 8;
    std::fill(d, d + 8, f16(b)), m = 0;
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256&) {
    const uint8_t* b = row + c * BYTES;
    d = _mm256_set1_ps(f16(b));
    return _mm256_sub_epi8(nibbles32(b + 2), _mm256_set1_epi8(8));
  }
#endif
};

struct Q4_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 20;
  static constexpr bool SIGNED = false, MIN = true;
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    const uint8_t* b = row + c * BYTES;
    for (int j = 0; j < 16; ++j) q[j] = b[4 + j] & 0xF, q[j + 16] = b[4 + j] >> 4;
    std::fill(d, d + 8, f16(b)), m = f16(b + 2);
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256& m) {
    const uint8_t* b = row + c * BYTES;
    d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
    return nibbles32(b + 4);
  }
#endif
};

struct Q5_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 22;
  static constexpr bool SIGNED = true, MIN = false;
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    const uint8_t* b = row + c * BYTES;
    uint32_t qh;
    std::memcpy(&qh, b + 2, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = int((b[6 + j] & 0xF) | (((qh >> j) & 1) << 4)) - 16;
      q[j + 16] = int((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16;
    }
    std::fill(d, d + 8, f16(b)), m = 0;
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256&) {
    const uint8_t* b = row + c * BYTES;
    d = _mm256_set1_ps(f16(b));
    return _mm256_sub_epi8(_mm256_or_si256(nibbles32(b + 6), bits_to_0x10(b + 2)), _mm256_set1_epi8(16));
  }
#endif
};

struct Q5_1 {
  static constexpr int64_t BLOCK = 32, BYTES = 24;
  static constexpr bool SIGNED = false, MIN = true;
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    const uint8_t* b = row + c * BYTES;
    uint32_t qh;
    std::memcpy(&qh, b + 4, 4);
    for (int j = 0; j < 16; ++j) {
      q[j] = int((b[8 + j] & 0xF) | (((qh >> j) & 1) << 4));
      q[j + 16] = int((b[8 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
    }
    std::fill(d, d + 8, f16(b)), m = f16(b + 2);
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256& m) {
    const uint8_t* b = row + c * BYTES;
    d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
    return _mm256_or_si256(nibbles32(b + 8), bits_to_0x10(b + 4));
  }
#endif
};

struct Q8_0 {
  static constexpr int64_t BLOCK = 32, BYTES = 34;
  static constexpr bool SIGNED = true, MIN = false;
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    const uint8_t* b = row + c * BYTES;
    for (int j = 0; j < 32; ++j) q[j] = int8_t(b[2 + j]);
    std::fill(d, d + 8, f16(b)), m = 0;
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256&) {
    const uint8_t* b = row + c * BYTES;
    d = _mm256_set1_ps(f16(b));
    return load32(b + 2);
  }
#endif
};

// K-quants: chunk c is sub-block c % 8 of super-block c / 8 (layouts: gguf_linear.cpp). Q4_K / Q5_K:
// weight = (d sc) q - (dmin m), the two products rounded to float32 as the gguf package does.
struct Q4_K {
  static constexpr int64_t BLOCK = 256, BYTES = 144;
  static constexpr bool SIGNED = false, MIN = true;
  static const uint8_t* sub(const uint8_t* row, int64_t c, float& dd, float& dm) {
    const uint8_t* b = row + (c / 8) * BYTES;
    int sc, m;
    scale_min_k4(int(c % 8), b + 4, sc, m);
    dd = f16(b) * float(sc), dm = f16(b + 2) * float(m);
    return b;
  }
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    float dd, dm;
    const uint8_t* b = sub(row, c, dd, dm);
    const int s = int(c % 8), shift = 4 * (s % 2);
    const uint8_t* qs = b + 16 + 32 * (s / 2);
    for (int l = 0; l < 32; ++l) q[l] = (qs[l] >> shift) & 0xF;
    std::fill(d, d + 8, dd), m = -dm;
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256& m) {
    float dd, dm;
    const uint8_t* b = sub(row, c, dd, dm);
    const int s = int(c % 8);
    d = _mm256_set1_ps(dd), m = _mm256_set1_ps(-dm);
    return _mm256_and_si256(_mm256_srli_epi16(load32(b + 16 + 32 * (s / 2)), 4 * (s % 2)), _mm256_set1_epi8(0x0F));
  }
#endif
};

struct Q5_K {
  static constexpr int64_t BLOCK = 256, BYTES = 176;
  static constexpr bool SIGNED = false, MIN = true;
  static const uint8_t* sub(const uint8_t* row, int64_t c, float& dd, float& dm) {
    const uint8_t* b = row + (c / 8) * BYTES;
    int sc, m;
    scale_min_k4(int(c % 8), b + 4, sc, m);
    dd = f16(b) * float(sc), dm = f16(b + 2) * float(m);
    return b;
  }
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    float dd, dm;
    const uint8_t* b = sub(row, c, dd, dm);
    const int s = int(c % 8), shift = 4 * (s % 2);
    const uint8_t *qh = b + 16, *qs = b + 48 + 32 * (s / 2);
    for (int l = 0; l < 32; ++l) q[l] = ((qs[l] >> shift) & 0xF) | (((qh[l] >> s) & 1) << 4);
    std::fill(d, d + 8, dd), m = -dm;
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256& m) {
    float dd, dm;
    const uint8_t* b = sub(row, c, dd, dm);
    const int s = int(c % 8);
    d = _mm256_set1_ps(dd), m = _mm256_set1_ps(-dm);
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(load32(b + 48 + 32 * (s / 2)), 4 * (s % 2)), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load32(b + 16), s), _mm256_set1_epi8(1)), 4);
    return _mm256_or_si256(lo, hi);
  }
#endif
};

// Q6_K: q - 32 with one int8 scale per 16 elements: lanes 0-3 take the first, lanes 4-7 the second.
struct Q6_K {
  static constexpr int64_t BLOCK = 256, BYTES = 210;
  static constexpr bool SIGNED = true, MIN = false;
  static void scalar(const uint8_t* row, int64_t c, int* q, float* d, float& m) {
    const uint8_t* b = row + (c / 8) * BYTES;
    const int s = int(c % 8), g = s / 4, r = s % 4;
    const uint8_t *ql = b + 64 * g + 32 * (r % 2), *qh = b + 128 + 32 * g;
    for (int l = 0; l < 32; ++l) q[l] = int(((ql[l] >> (4 * (r / 2))) & 0xF) | (((qh[l] >> (2 * r)) & 3) << 4)) - 32;
    const float dd = f16(b + 208);
    std::fill(d, d + 4, dd * float(int8_t(b[192 + 2 * s]))), std::fill(d + 4, d + 8, dd * float(int8_t(b[193 + 2 * s])));
    m = 0;
  }
#ifdef LOOPKV_Q8_AVX2
  static __m256i avx(const uint8_t* row, int64_t c, __m256& d, __m256&) {
    const uint8_t* b = row + (c / 8) * BYTES;
    const int s = int(c % 8), g = s / 4, r = s % 4;
    const float dd = f16(b + 208);
    d = _mm256_set_m128(_mm_set1_ps(dd * float(int8_t(b[193 + 2 * s]))), _mm_set1_ps(dd * float(int8_t(b[192 + 2 * s]))));
    const __m256i lo = _mm256_and_si256(_mm256_srli_epi16(load32(b + 64 * g + 32 * (r % 2)), 4 * (r / 2)), _mm256_set1_epi8(0x0F));
    const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(load32(b + 128 + 32 * g), 2 * r), _mm256_set1_epi8(3)), 4);
    return _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
  }
#endif
};

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
  }
  TORCH_CHECK(false, "gguf_q8: ggml type ", type,
              " has no int8-activation kernel (supported: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K)");
}

// ---- activations: llama.cpp's Q8 rounding, per row of x ----

struct Xq {  // M rows of K elements, quantized
  int64_t M, K;
  const int8_t* q;     // [M, K]
  const float* d;      // [M, K / 32]
  const float* dq;     // [M, K / 4]: d of the block times the sum of q over each quad (the min term's operand)
  int32_t* s;          // [M, K / 32]: the block sums (exposed for tests)
  // The 16-lane path's operands, per pair of blocks (64 elements) in its lane order (row_dot_zmm):
  const int8_t* qi;    // [M, K]: q with the halves of a pair interleaved (the 4-bit types' byte order)
  const float* dxn;    // [M, K / 4]: d per lane, blocks in order (lanes 0-7 block 2p, 8-15 block 2p + 1)
  const float* dxi;    // [M, K / 4]: d per lane in the interleaved order
  const float* dqi;    // [M, K / 4]: dq in the interleaved order
};

inline float roundf_away(float v) { return std::round(v); }  // roundf: half away from zero

void quantize_block_scalar(const float* x, int8_t* q, float& d, float* dq, int32_t& s) {
  float amax = 0;
  for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[i]));
  d = amax / 127.0f;
  const float id = d != 0.0f ? 1.0f / d : 0.0f;
  s = 0;
  for (int l = 0; l < 8; ++l) {
    int sq = 0;
    for (int i = 4 * l; i < 4 * l + 4; ++i) {
      q[i] = int8_t(int(roundf_away(x[i] * id)));
      sq += q[i];
    }
    dq[l] = d * float(sq), s += sq;
  }
}

#ifdef LOOPKV_Q8_AVX2
void quantize_block_avx(const float* x, int8_t* q, float& d, float* dq, int32_t& s) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 v[4];
  for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(x + 8 * j);
  __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_andnot_ps(sign, v[0]), _mm256_andnot_ps(sign, v[1])),
                            _mm256_max_ps(_mm256_andnot_ps(sign, v[2]), _mm256_andnot_ps(sign, v[3])));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  const float amax = _mm_cvtss_f32(m4);  // a max: exact in any order (NaN aside)
  d = amax / 127.0f;
  const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f), half = _mm256_set1_ps(0.5f), one = _mm256_set1_ps(1.0f);
  __m256i i32[4];
  for (int j = 0; j < 4; ++j) {  // roundf: trunc, then one away from zero where the (exact) fraction is >= 0.5
    const __m256 t = _mm256_mul_ps(v[j], id);
    const __m256 tr = _mm256_round_ps(t, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(t, tr)), half, _CMP_GE_OQ);
    const __m256 step = _mm256_or_ps(_mm256_and_ps(t, sign), one);  // +-1 with t's sign
    i32[j] = _mm256_cvttps_epi32(_mm256_add_ps(tr, _mm256_and_ps(up, step)));
  }
  // to int16, then int8 (both saturating, |q| <= 127 here); packs interleave the 128-bit lanes: undo it
  const __m256i a = _mm256_packs_epi32(i32[0], i32[1]), b = _mm256_packs_epi32(i32[2], i32[3]);
  __m256i q8 = _mm256_packs_epi16(a, b);
  q8 = _mm256_permutevar8x32_epi32(q8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), q8);
  const __m256i quads = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), q8), _mm256_set1_epi16(1));
  _mm256_storeu_ps(dq, _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(quads)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(quads), _mm256_extracti128_si256(quads, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
  s = _mm_cvtsi128_si32(s4);
}
#endif

// Instruction-set paths, each the same bits (see the top); -1 asks for the best this build has.
enum Path : int64_t { PORTABLE = 0, AVX2 = 1, VNNI = 2, ZMM = 3 };

constexpr int64_t best_path() {
#if defined(LOOPKV_Q8_ZMM)
  return ZMM;
#elif defined(LOOPKV_Q8_VNNI)
  return VNNI;
#elif defined(LOOPKV_Q8_AVX2)
  return AVX2;
#else
  return PORTABLE;
#endif
}

int64_t resolve(int64_t path) {
  TORCH_CHECK(path >= -1 && path <= best_path(), "gguf_q8: path ", path, " is not built here (best ", best_path(), ")");
  return path < 0 ? best_path() : path;
}

void quantize_rows(const float* x, int64_t M, int64_t K, int8_t* q, float* d, float* dq, int32_t* s, int64_t path) {
  const int64_t nc = K / CHUNK;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t i = m * nc + c, k = m * K + c * CHUNK;
#ifdef LOOPKV_Q8_AVX2
      if (path != PORTABLE) {
        quantize_block_avx(x + k, q + k, d[i], dq + i * 8, s[i]);
        continue;
      }
#endif
      quantize_block_scalar(x + k, q + k, d[i], dq + i * 8, s[i]);
    }
}

// The 16-lane path's copies (Xq): per pair p of blocks, lane j (4 elements) of the natural order is
// block 2p + j / 8, quad j % 8; of the interleaved order block 2p + (j / 4) % 2, quad j % 4 + 4 (j / 8),
// i.e. bytes [block 2p elements 0-15, block 2p + 1 elements 0-15, 2p 16-31, 2p + 1 16-31].
void lane_copies(const Xq& x, int8_t* qi, float* dxn, float* dxi, float* dqi) {
  const int64_t nc = x.K / CHUNK;
  for (int64_t m = 0; m < x.M; ++m)
    for (int64_t c = 0; c + 2 <= nc; c += 2) {
      const int64_t k = m * x.K + c * CHUNK, i = m * nc + c;
      for (int j = 0; j < 16; ++j) {
        const int64_t bn = j / 8, bi = (j / 4) % 2, quad = j % 4 + 4 * (j / 8);
        for (int e = 0; e < 4; ++e) qi[k + 4 * j + e] = x.q[k + bi * CHUNK + 4 * quad + e];
        dxn[(k + 4 * j) / 4] = x.d[i + bn];
        dxi[(k + 4 * j) / 4] = x.d[i + bi];
        dqi[(k + 4 * j) / 4] = x.dq[(i + bi) * 8 + quad];
      }
    }
}

// ---- the dot: portable ----

inline float hsum8_scalar(const float* s) {  // gguf_linear.cpp's lane reduction, spelled out
  float t[4], u[2];
  for (int i = 0; i < 4; ++i) t[i] = s[i] + s[i + 4];
  for (int i = 0; i < 2; ++i) u[i] = t[i] + t[i + 2];
  return u[0] + u[1];
}

template <class Q>
void row_dot_scalar(const Xq& xq, const uint8_t* wrow, float* y, int64_t ldy) {
  const int64_t K = xq.K, nc = K / CHUNK;
  for (int64_t m = 0; m < xq.M; ++m) {
    float A[2][8] = {}, Mn[2][8] = {};
    const int8_t* xr = xq.q + m * K;
    for (int64_t c = 0; c < nc; ++c) {
      int q[32];
      float dw[8], mw;
      Q::scalar(wrow, c, q, dw, mw);
      const float dx = xq.d[m * nc + c];
      for (int l = 0; l < 8; ++l) {
        int p = 0;
        for (int i = 4 * l; i < 4 * l + 4; ++i) p += q[i] * int(xr[c * CHUNK + i]);
        A[c % 2][l] = std::fma(float(p), dw[l] * dx, A[c % 2][l]);
        if (Q::MIN) Mn[c % 2][l] = std::fma(mw, xq.dq[(m * nc + c) * 8 + l], Mn[c % 2][l]);
      }
    }
    float s[8];
    for (int l = 0; l < 8; ++l) s[l] = Q::MIN ? (A[0][l] + A[1][l]) + (Mn[0][l] + Mn[1][l]) : A[0][l] + A[1][l];
    y[m * ldy] = hsum8_scalar(s);
  }
}

#ifdef LOOPKV_Q8_AVX2
inline float hsum8(__m256 v) {  // gguf_linear.cpp's
  __m128 t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  t = _mm_add_ps(t, _mm_movehl_ps(t, t));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// Per lane (4 bytes), the exact int32 sum of u8 w times s8 x.
template <bool VNNI_>
inline __m256i dot_u8s8(__m256i w, __m256i x) {
#ifdef LOOPKV_Q8_VNNI
  if constexpr (VNNI_) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
#else
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w, x);
#endif
  }
#endif
  // pairs into int16: at most 2 * 128 * 127 (|q| <= 128, |x| <= 127), no saturation
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}

// MR rows of x (from row m0) against one weight row: each block decoded once for all MR rows.
template <class Q, int MR, bool VNNI_>
inline void row_dot_avx(const Xq& xq, int64_t m0, const uint8_t* wrow, float* y, int64_t ldy) {
  const int64_t K = xq.K, nc = K / CHUNK;
  __m256 A[MR][2], Mn[MR][2];
  for (int m = 0; m < MR; ++m) A[m][0] = A[m][1] = Mn[m][0] = Mn[m][1] = _mm256_setzero_ps();
  const int8_t* xr = xq.q + m0 * K;
  const float* dx = xq.d + m0 * nc;
  const float* dq = xq.dq + m0 * nc * 8;
  auto step = [&](int64_t c, int h) {
    __m256 vd, vm;
    const __m256i w = Q::avx(wrow, c, vd, vm);
    const __m256i wu = Q::SIGNED ? _mm256_abs_epi8(w) : w;
    for (int m = 0; m < MR; ++m) {
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr + m * K + c * CHUNK));
      if (Q::SIGNED) xv = _mm256_sign_epi8(xv, w);
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8<VNNI_>(wu, xv));
      A[m][h] = _mm256_fmadd_ps(p, _mm256_mul_ps(vd, _mm256_set1_ps(dx[m * nc + c])), A[m][h]);
      if (Q::MIN) Mn[m][h] = _mm256_fmadd_ps(vm, _mm256_loadu_ps(dq + (m * nc + c) * 8), Mn[m][h]);
    }
  };
  int64_t c = 0;
  for (; c + 2 <= nc; c += 2) step(c, 0), step(c + 1, 1);
  if (c < nc) step(c, 0);
  for (int m = 0; m < MR; ++m) {
    __m256 s = _mm256_add_ps(A[m][0], A[m][1]);
    if (Q::MIN) s = _mm256_add_ps(s, _mm256_add_ps(Mn[m][0], Mn[m][1]));
    y[m * ldy] = hsum8(s);
  }
}

template <class Q, bool VNNI_>
void rows_dot_avx(const Xq& xq, const uint8_t* wrow, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + MR_MAX <= xq.M; m += MR_MAX) row_dot_avx<Q, MR_MAX, VNNI_>(xq, m, wrow, y + m * ldy, ldy);
  switch (xq.M - m) {
    case 3: row_dot_avx<Q, 3, VNNI_>(xq, m, wrow, y + m * ldy, ldy); break;
    case 2: row_dot_avx<Q, 2, VNNI_>(xq, m, wrow, y + m * ldy, ldy); break;
    case 1: row_dot_avx<Q, 1, VNNI_>(xq, m, wrow, y + m * ldy, ldy); break;
  }
}
#endif

#ifdef LOOPKV_Q8_ZMM
// ---- 16 lanes: blocks c and c + 1 per instruction. Each lane is a lane of A[c % 2] / M[c % 2] above
// (the same FMAs in the same order); Pair<Q> decodes a pair, natural order unless IL (Xq's lane orders).

template <class Q>
struct Pair {  // two 8-lane decodes side by side
  static constexpr bool IL = false;
  static __m512i get(const uint8_t* row, int64_t c, __m512& d, __m512& m) {
    __m256 d0, d1, m0 = _mm256_setzero_ps(), m1 = m0;
    const __m256i w0 = Q::avx(row, c, d0, m0), w1 = Q::avx(row, c + 1, d1, m1);
    d = _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1);
    m = _mm512_insertf32x8(_mm512_castps256_ps512(m0), m1, 1);
    return _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
  }
};
// 4-bit blocks: the two blocks' 16 bytes of nibbles side by side, low nibbles then high: the
// interleaved order, in 5 instructions.
inline __m512i nibble_pair(const uint8_t* q0, const uint8_t* q1) {
  const __m256i y = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q0))),
                                            _mm_loadu_si128(reinterpret_cast<const __m128i*>(q1)), 1);
  return _mm512_and_si512(_mm512_inserti64x4(_mm512_castsi256_si512(y), _mm256_srli_epi16(y, 4), 1), _mm512_set1_epi8(0x0F));
}
inline __m512i il_index(int a, int b) { return _mm512_setr_epi32(a, a, a, a, b, b, b, b, a, a, a, a, b, b, b, b); }
template <>
struct Pair<Q4_0> {
  static constexpr bool IL = true;
  static __m512i get(const uint8_t* row, int64_t c, __m512& d, __m512&) {
    const uint8_t* b = row + c * Q4_0::BYTES;
    uint16_t h0, h1;
    std::memcpy(&h0, b, 2), std::memcpy(&h1, b + Q4_0::BYTES, 2);
    const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(int(uint32_t(h0) | (uint32_t(h1) << 16))));  // exact
    d = _mm512_permutexvar_ps(il_index(0, 1), _mm512_castps128_ps512(dd));
    return _mm512_sub_epi8(nibble_pair(b + 2, b + Q4_0::BYTES + 2), _mm512_set1_epi8(8));
  }
};
template <>
struct Pair<Q4_1> {
  static constexpr bool IL = true;
  static __m512i get(const uint8_t* row, int64_t c, __m512& d, __m512& m) {
    const uint8_t* b = row + c * Q4_1::BYTES;
    uint32_t h0, h1;
    std::memcpy(&h0, b, 4), std::memcpy(&h1, b + Q4_1::BYTES, 4);
    const __m128 dm = _mm_cvtph_ps(_mm_cvtsi64_si128(int64_t(uint64_t(h0) | (uint64_t(h1) << 32))));  // d0 m0 d1 m1
    d = _mm512_permutexvar_ps(il_index(0, 2), _mm512_castps128_ps512(dm));
    m = _mm512_permutexvar_ps(il_index(1, 3), _mm512_castps128_ps512(dm));
    return nibble_pair(b + 4, b + Q4_1::BYTES + 4);
  }
};

// NR weight rows (rb bytes apart; outputs 1 apart) against MR rows of x: at one row of x, two weight
// rows in flight share x's loads and hide each other's latencies.
template <class Q, int MR, int NR = 1>
inline void row_dot_zmm(const Xq& xq, int64_t m0, const uint8_t* wrow0, int64_t rb, float* y0, int64_t ldy) {
  using P = Pair<Q>;
  const int64_t K = xq.K, nc = K / CHUNK, n4 = K / 4;
  __m512 A[NR][MR], Mn[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) A[r][m] = Mn[r][m] = _mm512_setzero_ps();
  const int8_t* xr = (P::IL ? xq.qi : xq.q) + m0 * K;
  const float* dxl = (P::IL ? xq.dxi : xq.dxn) + m0 * n4;
  const float* dql = (P::IL ? xq.dqi : xq.dq) + m0 * n4;
  int64_t c = 0;
  for (; c + 2 <= nc; c += 2)
    for (int r = 0; r < NR; ++r) {
      __m512 vd, vm;
      const __m512i w = P::get(wrow0 + r * rb, c, vd, vm);
      __m512i wu = w;
      __mmask64 neg = 0;
      if (Q::SIGNED) wu = _mm512_abs_epi8(w), neg = _mm512_movepi8_mask(w);
      for (int m = 0; m < MR; ++m) {
        __m512i xv = _mm512_loadu_si512(xr + m * K + c * CHUNK);
        if (Q::SIGNED) xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
        const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), wu, xv));
        A[r][m] = _mm512_fmadd_ps(p, _mm512_mul_ps(vd, _mm512_loadu_ps(dxl + m * n4 + c * 8)), A[r][m]);
        if (Q::MIN) Mn[r][m] = _mm512_fmadd_ps(vm, _mm512_loadu_ps(dql + m * n4 + c * 8), Mn[r][m]);
      }
    }
  for (int r = 0; r < NR; ++r)
  for (int m = 0; m < MR; ++m) {
    const uint8_t* wrow = wrow0 + r * rb;
    float* y = y0 + r;
    auto split = [](__m512 v, __m256& h0, __m256& h1) {  // back to A[0] / A[1]'s 8-lane order
      const __m256 lo = _mm512_castps512_ps256(v), hi = _mm512_extractf32x8_ps(v, 1);
      if (P::IL) h0 = _mm256_permute2f128_ps(lo, hi, 0x20), h1 = _mm256_permute2f128_ps(lo, hi, 0x31);
      else h0 = lo, h1 = hi;
    };
    __m256 a0, a1, n0, n1;
    split(A[r][m], a0, a1), split(Mn[r][m], n0, n1);
    if (c < nc) {  // an odd last block: A[0]'s last term, through the 8-lane step
      __m256 vd, vm = _mm256_setzero_ps();
      const __m256i w = Q::avx(wrow, c, vd, vm);
      __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq.q + (m0 + m) * K + c * CHUNK));
      if (Q::SIGNED) xv = _mm256_sign_epi8(xv, w);
      const __m256 p = _mm256_cvtepi32_ps(dot_u8s8<true>(Q::SIGNED ? _mm256_abs_epi8(w) : w, xv));
      a0 = _mm256_fmadd_ps(p, _mm256_mul_ps(vd, _mm256_set1_ps(xq.d[(m0 + m) * nc + c])), a0);
      if (Q::MIN) n0 = _mm256_fmadd_ps(vm, _mm256_loadu_ps(xq.dq + (m0 + m) * n4 + c * 8), n0);
    }
    __m256 s = _mm256_add_ps(a0, a1);
    if (Q::MIN) s = _mm256_add_ps(s, _mm256_add_ps(n0, n1));
    y[m * ldy] = hsum8(s);
  }
}

template <class Q>
void rows_dot_zmm(const Xq& xq, const uint8_t* wrow, float* y, int64_t ldy) {
  int64_t m = 0;
  for (; m + MR_MAX <= xq.M; m += MR_MAX) row_dot_zmm<Q, MR_MAX>(xq, m, wrow, 0, y + m * ldy, ldy);
  switch (xq.M - m) {
    case 3: row_dot_zmm<Q, 3>(xq, m, wrow, 0, y + m * ldy, ldy); break;
    case 2: row_dot_zmm<Q, 2>(xq, m, wrow, 0, y + m * ldy, ldy); break;
    case 1: row_dot_zmm<Q, 1>(xq, m, wrow, 0, y + m * ldy, ldy); break;
  }
}
#endif

int64_t grain_for(int64_t n) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  return std::max<int64_t>(1, (n + threads - 1) / threads);
}

// One allocation per call (q, d, dq, s, and the 16-lane path's copies), carved into Xq's arrays.
struct Quantized {
  torch::Tensor buf;
  Xq x;
};

Quantized quantize(const torch::Tensor& x, int64_t path) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.is_contiguous(),
              "gguf_q8: x is a contiguous float32 CPU tensor [M, K]");
  const int64_t M = x.size(0), K = x.size(1), n = M * K, lanes = path == ZMM;
  TORCH_CHECK(K > 0 && K % CHUNK == 0, "gguf_q8: K (", K, ") must be a positive multiple of 32");
  // floats first (d, s, dq, then dxn, dxi, dqi), then the int8 arrays
  const int64_t nf = 2 * (n / CHUNK) + n / 4 + 3 * lanes * (n / 4);
  Quantized out{at::empty({nf * 4 + n + lanes * n}, at::TensorOptions().dtype(at::kByte)), {}};
  float* f = reinterpret_cast<float*>(out.buf.data_ptr<uint8_t>());
  int8_t* q = reinterpret_cast<int8_t*>(f + nf);
  Xq& v = out.x;
  v.M = M, v.K = K, v.q = q, v.d = f, v.s = reinterpret_cast<int32_t*>(f + n / CHUNK), v.dq = f + 2 * (n / CHUNK);
  quantize_rows(x.data_ptr<float>(), M, K, q, f, f + 2 * (n / CHUNK), v.s, path);
  if (lanes) {
    float* l = f + 2 * (n / CHUNK) + n / 4;
    v.dxn = l, v.dxi = l + n / 4, v.dqi = l + n / 2, v.qi = q + n;
    lane_copies(v, q + n, l, l + n / 4, l + n / 2);
  }
  return out;
}

}  // namespace

std::vector<std::string> paths() {  // the paths this build has, by their Path number
  std::vector<std::string> out = {"portable"};
#ifdef LOOPKV_Q8_AVX2
  out.push_back("avx2");
#endif
#ifdef LOOPKV_Q8_VNNI
  out.push_back("vnni256");
#endif
#ifdef LOOPKV_Q8_ZMM
  out.push_back("avx512vnni");
#endif
  return out;
}

std::vector<int64_t> supported_types() { return {T_Q4_0, T_Q4_1, T_Q5_0, T_Q5_1, T_Q8_0, T_Q4_K, T_Q5_K, T_Q6_K}; }

std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> quantize_q8(torch::Tensor x, int64_t path) {
  const Quantized q = quantize(x.contiguous(), resolve(path));
  const int64_t M = q.x.M, K = q.x.K;
  auto from = [&](const void* p, at::IntArrayRef size, at::ScalarType t) {
    return torch::from_blob(const_cast<void*>(p), size, at::TensorOptions().dtype(t)).clone();
  };
  return {from(q.x.q, {M, K}, at::kChar), from(q.x.d, {M, K / CHUNK}, at::kFloat), from(q.x.s, {M, K / CHUNK}, at::kInt)};
}

torch::Tensor gemv_q8(torch::Tensor x, torch::Tensor w, int64_t type, c10::optional<torch::Tensor> bias, int64_t path) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2, "gguf_q8: x is float32 [M, K]");
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.dim() == 2 && w.is_contiguous(),
              "gguf_q8: blocks are a contiguous uint8 CPU tensor [N, row bytes]");
  const int64_t K = x.size(1), N = w.size(0), rb = w.size(1);
  TORCH_CHECK(K > 0 && K % CHUNK == 0, "gguf_q8: K (", K, ") must be a positive multiple of 32");
  const int64_t row_bytes = dispatch(type, [&](auto q) {
    using Q = decltype(q);
    TORCH_CHECK(K % Q::BLOCK == 0, "gguf_q8: K (", K, ") is not a multiple of the block size ", Q::BLOCK);
    return K / Q::BLOCK * Q::BYTES;
  });
  TORCH_CHECK(rb == row_bytes, "gguf_q8: a row of ", K, " elements of type ", type, " is ", row_bytes, " bytes, blocks have ", rb);
  path = resolve(path);
  x = x.contiguous();
  torch::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out;
  const Quantized qx = quantize(x, path);
  const Xq& xq = qx.x;
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  dispatch(type, [&](auto q) {
    using Q = decltype(q);
    at::parallel_for(0, N, grain_for(N), [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
#ifdef LOOPKV_Q8_AVX2
        if (path != PORTABLE) {
          if (n + PREFETCH_ROWS < end)  // a few rows ahead, as gguf_linear.cpp's gemv
            for (int64_t b = 0; b < rb; b += 64) _mm_prefetch(reinterpret_cast<const char*>(wp + (n + PREFETCH_ROWS) * rb + b), _MM_HINT_T0);
#ifdef LOOPKV_Q8_ZMM
          if (path == ZMM) {
            if (xq.M <= 2 && n + 1 < end) {  // two weight rows at a time (row_dot_zmm)
              if (xq.M == 1) row_dot_zmm<Q, 1, 2>(xq, 0, wp + n * rb, rb, op + n, N);
              else row_dot_zmm<Q, 2, 2>(xq, 0, wp + n * rb, rb, op + n, N);
              if (n + 1 + PREFETCH_ROWS < end)
                for (int64_t b = 0; b < rb; b += 64) _mm_prefetch(reinterpret_cast<const char*>(wp + (n + 1 + PREFETCH_ROWS) * rb + b), _MM_HINT_T0);
              ++n;
            } else {
              rows_dot_zmm<Q>(xq, wp + n * rb, op + n, N);
            }
            continue;
          }
#endif
#ifdef LOOPKV_Q8_VNNI
          if (path == VNNI) {
            rows_dot_avx<Q, true>(xq, wp + n * rb, op + n, N);
            continue;
          }
#endif
          rows_dot_avx<Q, false>(xq, wp + n * rb, op + n, N);
          continue;
        }
#endif
        row_dot_scalar<Q>(xq, wp + n * rb, op + n, N);
      }
    });
    return 0;
  });
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gguf_q8: bias [N]");
    out.add_(bias->to(at::kFloat).view({1, N}));
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paths", &paths, "the instruction-set paths compiled here, indexed by the path argument");
  m.def("supported_types", &supported_types, "the ggml type ids gemv_q8 takes");
  m.def("quantize_q8", &quantize_q8, "x [M, K] -> (q int8 [M, K], d float32 [M, K/32], s int32 [M, K/32]): llama.cpp's Q8 rounding",
        py::arg("x"), py::arg("path") = -1);
  m.def("gemv_q8", &gemv_q8, "x [M, K] @ W.T (+ bias) with x quantized to int8 blocks, integer block dots",
        py::arg("x"), py::arg("blocks"), py::arg("qtype"), py::arg("bias") = py::none(), py::arg("path") = -1);
}
