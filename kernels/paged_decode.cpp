// Paged decode attention on the CPU: one query row per sequence against its KV read in place
// from SGLang's pool, whatever the slot layout (no gather of the prefix, one pass over the KV).
//
//   q:          [B, Hq, D]      (float32 / bfloat16 / float16; contiguous)
//   k/v_cache:  [P, Hkv, D]     pool buffers of one layer (same dtype as each other; rows contiguous)
//   kv_indices: [T] int64       pool slot of every key, sequence after sequence, in position order
//   kv_indptr:  [B + 1] int64   offsets of each sequence's keys in kv_indices
//   out:        [B, Hq, D]      softmax(q K^T * scale) V, written in q's dtype
//
// GQA: the g = Hq / Hkv query heads of one KV head are computed together, so each key and value
// row is read once per sequence. Work items are splits of a sequence's keys (with every KV head; the
// portable path: (sequence, KV head, split)) so that a single sequence still keeps every core busy
// (flash-decoding); each split keeps a running max / sum / accumulator (online softmax) and the
// splits are merged at the end.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "exp_nonpositive.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOOPKV_AVX2 1
#endif

namespace {

constexpr int kBlock = 64;  // keys scored before one softmax rescale
// Rows prefetched ahead of use. The rows of one KV head are a gather (slot * row_stride + h * d:
// strided even for contiguous slots, scattered for a sparse plan), which the hardware prefetcher
// does not follow, so without this each row waited on memory: 11 -> 24 M rows/s float32 and
// 13 -> 44 M bfloat16 for 8 x 8K dense keys, 8 -> 34 M for a sparse plan of 64-slot pages (2-core
// EPYC; 8 and 16 rows were within 10% of 12, 4 and 24 slower).
constexpr int kPrefetch = 12;

template <typename KV>
inline void prefetch_row(const KV* row, int d) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int c = 0; c < d * static_cast<int>(sizeof(KV)); c += 64) __builtin_prefetch(p + c);
}

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}
inline float to_float(at::Half x) { return static_cast<float>(x); }

// Row primitives. GCC keeps the plain loops scalar (a float reduction may not be reordered without
// -ffast-math, and the mixed-type loads defeat its cost model), so AVX2 spells them out when D is a
// multiple of 8; the loops stay as the portable path.
#ifdef LOOPKV_AVX2
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256 load8(const at::Half* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float hsum(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
#endif

// out[r] = q[r] . k for the g query rows of one KV head (q: g x d floats, row-major).
template <typename KV>
inline void dots(const float* q, const KV* k, int g, int d, float* out, int out_stride) {
#ifdef LOOPKV_AVX2
  if (d % 8 == 0) {
    for (int r = 0; r < g; ++r) {
      const float* qr = q + static_cast<size_t>(r) * d;
      __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
      int x = 0;
      for (; x + 16 <= d; x += 16) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + x), load8(k + x), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + x + 8), load8(k + x + 8), a1);
      }
      if (x < d) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qr + x), load8(k + x), a0);
      out[static_cast<size_t>(r) * out_stride] = hsum(_mm256_add_ps(a0, a1));
    }
    return;
  }
#endif
  for (int r = 0; r < g; ++r) {
    const float* qr = q + static_cast<size_t>(r) * d;
    float s = 0.f;
    for (int x = 0; x < d; ++x) s += qr[x] * to_float(k[x]);
    out[static_cast<size_t>(r) * out_stride] = s;
  }
}

// acc[r] += p[r * p_stride] * v for the g rows (acc: g x d floats).
template <typename KV>
inline void axpys(float* acc, const float* p, int p_stride, const KV* v, int g, int d) {
#ifdef LOOPKV_AVX2
  if (d % 8 == 0) {
    for (int x = 0; x < d; x += 8) {
      const __m256 vv = load8(v + x);
      for (int r = 0; r < g; ++r) {
        float* a = acc + static_cast<size_t>(r) * d + x;
        _mm256_storeu_ps(a, _mm256_fmadd_ps(_mm256_set1_ps(p[static_cast<size_t>(r) * p_stride]), vv, _mm256_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  for (int r = 0; r < g; ++r) {
    const float pr = p[static_cast<size_t>(r) * p_stride];
    float* a = acc + static_cast<size_t>(r) * d;
    for (int x = 0; x < d; ++x) a[x] += pr * to_float(v[x]);
  }
}

// One split of one (sequence, KV head): keys kv_indices[t0, t1).
template <typename KV>
void decode_split(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* slots, int64_t t0,
                  int64_t t1, int64_t row_stride, int g, int d, float scale, float* m_out, float* l_out,
                  float* acc) {
  std::vector<float> scores(static_cast<size_t>(g) * kBlock);
  for (int r = 0; r < g; ++r) {
    m_out[r] = -std::numeric_limits<float>::infinity();
    l_out[r] = 0.f;
  }
  std::fill(acc, acc + static_cast<size_t>(g) * d, 0.f);
  for (int64_t b0 = t0; b0 < t1; b0 += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, t1 - b0));
    for (int j = 0; j < n; ++j) {
      if (b0 + j + kPrefetch < t1) prefetch_row(k_cache + slots[b0 + j + kPrefetch] * row_stride, d);
      dots(q, k_cache + slots[b0 + j] * row_stride, g, d, scores.data() + j, kBlock);
    }
    for (int r = 0; r < g; ++r) {
      float* sr = scores.data() + static_cast<size_t>(r) * kBlock;
      for (int j = 0; j < n; ++j) sr[j] *= scale;
    }
    for (int r = 0; r < g; ++r) {
      float* sr = scores.data() + static_cast<size_t>(r) * kBlock;
      float m_new = m_out[r];
      for (int j = 0; j < n; ++j) m_new = std::max(m_new, sr[j]);
      // 0 on the first block (running max -inf): the empty accumulator is scaled away
      const float correction = m_out[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m_out[r] - m_new);
      float* ar = acc + static_cast<size_t>(r) * d;
      if (correction != 1.f) {
        for (int x = 0; x < d; ++x) ar[x] *= correction;
      }
      float l = l_out[r] * correction;
#pragma omp simd reduction(+ : l)
      for (int j = 0; j < n; ++j) {
        sr[j] = exp_nonpositive(sr[j] - m_new);
        l += sr[j];
      }
      m_out[r] = m_new;
      l_out[r] = l;
    }
    for (int j = 0; j < n; ++j) {
      if (b0 + j + kPrefetch < t1) prefetch_row(v_cache + slots[b0 + j + kPrefetch] * row_stride, d);
      axpys(acc, scores.data() + j, kBlock, v_cache + slots[b0 + j] * row_stride, g, d);
    }
  }
}

// ---- every KV head of a split at once (head dim 64 or 128, AVX2 or AVX-512; the path decode_impl takes) ----
// Why: the one-head path above reads a strided slice of each pool row per pass (128 of a SmolLM2
// bfloat16 row's 384 bytes) and pays a horizontal sum and an accumulator load/store per key and query
// row; at 4K keys it ran at about a third of the memory's bandwidth. Here a work item is a split of
// one sequence with every KV head: a block of keys is read once, whole rows in order, and serves each
// head from L1/L2; a key is converted once for up to four query rows whose accumulators stay in
// registers, and four keys' scores share one reduction. Pool rows cross a 4 KB page every few keys,
// where the hardware prefetcher stops, so the next block's rows are prefetched in software, spread
// over the block's passes. The order of sums differs from the one-head path (float32 rounding, tests); it
// depends only on the sequence's own length, as the splits do, so a row's result does not depend on
// the batch, and a head's result not on the other heads (a sparse plan at full budget is the dense
// result bit for bit).
#if defined(__AVX512F__) && defined(__AVX512BW__)
struct Lanes {
  using V = __m512;
  static constexpr int N = 16;
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V load(const at::BFloat16* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
  }
  static V load(const at::Half* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static float sum(V v) { return _mm512_reduce_add_ps(v); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static float hmax(V v) { return _mm512_reduce_max_ps(v); }
  // out[i] = sum of p[i]'s lanes, four at once (a quarter of four reductions' shuffles)
  static void sum4(const V* p, float* out) {
    const V x0 = _mm512_add_ps(_mm512_shuffle_f32x4(p[0], p[1], 0x44), _mm512_shuffle_f32x4(p[0], p[1], 0xEE));
    const V x1 = _mm512_add_ps(_mm512_shuffle_f32x4(p[2], p[3], 0x44), _mm512_shuffle_f32x4(p[2], p[3], 0xEE));
    V y = _mm512_add_ps(_mm512_shuffle_f32x4(x0, x1, 0x88), _mm512_shuffle_f32x4(x0, x1, 0xDD));
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0x4E));
    y = _mm512_add_ps(y, _mm512_permute_ps(y, 0xB1));
    _mm_storeu_ps(out, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, y)));
  }
};
#define LOOPKV_HEADS_PATH 1
#elif defined(LOOPKV_AVX2)
struct Lanes {
  using V = __m256;
  static constexpr int N = 8;
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V load(const at::BFloat16* p) { return load8(p); }
  static V load(const at::Half* p) { return load8(p); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static float sum(V v) { return hsum(v); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static float hmax(V v) {
    __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
  }
  static void sum4(const V* p, float* out) {
    for (int i = 0; i < 4; ++i) out[i] = hsum(p[i]);
  }
};
#define LOOPKV_HEADS_PATH 1
#endif

#ifdef LOOPKV_HEADS_PATH
// The K and V rows (every head) of the next block's keys, into L2, one row every few calls, the
// calls spread over every pass of the current block (each head's scores and its P V). Issued for a
// whole block at once, 48 KB of prefetches filled the core's miss buffers and stalled it until they
// came, so reading the pool added to the compute instead of hiding behind it; into L1 they evicted
// the block being scored (a block's K and V rows do not fit L1 beside it). K rows first (needed
// first), then V.
template <typename KV>
struct Prefetch {
  const KV* k = nullptr;
  const KV* v = nullptr;
  const int64_t* slots = nullptr;
  int64_t n = 0, row_stride = 0, row_bytes = 0;
  int every = 0, wait = 0;  // a row every ``every`` calls; calls until the next one
  int64_t row = 0;          // the next row: K of key ``row``, then V of key ``row - n``
  Prefetch(const KV* k_, const KV* v_, const int64_t* slots_, int64_t n_, int64_t row_stride_, int64_t row_bytes_,
           int64_t calls)
      : k(k_), v(v_), slots(slots_), n(n_), row_stride(row_stride_), row_bytes(row_bytes_) {
    every = n > 0 ? static_cast<int>(std::max<int64_t>(calls / (2 * n), 1)) : 0;
  }
  void operator()() {
    if (row >= 2 * n || --wait > 0) return;
    wait = every;
    const char* base = reinterpret_cast<const char*>(row < n ? k + slots[row] * row_stride : v + slots[row - n] * row_stride);
    for (int64_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(base + at, 0, 2);  // to L2 (see above)
    ++row;
  }
};

// Query rows r0 .. r0 + R of one KV head over one block of n keys (rows[j] + head offset): each key
// converted once for the R rows, R x D accumulators in registers.
template <int D, int R, typename KV>
inline void rows_scores(const float* q, const KV* const* krows, int64_t off, int n, float scale, float* scores,
                        Prefetch<KV>& pf) {
  constexpr int V = D / Lanes::N;
  using Vec = typename Lanes::V;
  // a[r][t]: key t's products with query row r, V lanes-wide partial sums folded into one vector
  auto key = [&](int j, Vec* a, int t) {
    pf();
    const KV* k = krows[j] + off;
    Vec kv[V];
    for (int i = 0; i < V; ++i) kv[i] = Lanes::load(k + i * Lanes::N);
    for (int r = 0; r < R; ++r) {
      const float* qr = q + r * D;
      Vec a0 = Lanes::mul(Lanes::load(qr), kv[0]), a1 = Lanes::mul(Lanes::load(qr + Lanes::N), kv[1]);
      for (int i = 2; i < V; i += 2) {
        a0 = Lanes::fma(Lanes::load(qr + i * Lanes::N), kv[i], a0);
        a1 = Lanes::fma(Lanes::load(qr + (i + 1) * Lanes::N), kv[i + 1], a1);
      }
      a[r * 4 + t] = Lanes::add(a0, a1);
    }
  };
  Vec a[R * 4];
  int j = 0;
  for (; j + 4 <= n; j += 4) {
    for (int t = 0; t < 4; ++t) key(j + t, a, t);
    for (int r = 0; r < R; ++r) {
      float* sr = scores + r * kBlock + j;
      Lanes::sum4(a + r * 4, sr);
      for (int t = 0; t < 4; ++t) sr[t] *= scale;
    }
  }
  for (; j < n; ++j) {
    key(j, a, 0);
    for (int r = 0; r < R; ++r) scores[r * kBlock + j] = Lanes::sum(a[r * 4]) * scale;
  }
}

// max(init, x[0 .. n))
inline float block_max(const float* x, int n, float init) {
  typename Lanes::V m = Lanes::set1(init);
  int j = 0;
  for (; j + Lanes::N <= n; j += Lanes::N) m = Lanes::max(m, Lanes::load(x + j));
  float out = Lanes::hmax(m);
  for (; j < n; ++j) out = std::max(out, x[j]);
  return out;
}

template <int D, int R, typename KV>
inline void rows_pv(const KV* const* vrows, int64_t off, int n, const float* p, const float* correction, float* acc,
                    Prefetch<KV>& pf) {
  constexpr int V = D / Lanes::N;
  typename Lanes::V a[R][V];
  for (int r = 0; r < R; ++r) {
    const typename Lanes::V c = Lanes::set1(correction[r]);
    for (int i = 0; i < V; ++i) a[r][i] = Lanes::mul(Lanes::load(acc + r * D + i * Lanes::N), c);
  }
  for (int j = 0; j < n; ++j) {
    pf();
    const KV* v = vrows[j] + off;
    for (int i = 0; i < V; ++i) {
      const typename Lanes::V vv = Lanes::load(v + i * Lanes::N);
      for (int r = 0; r < R; ++r) a[r][i] = Lanes::fma(Lanes::set1(p[r * kBlock + j]), vv, a[r][i]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < V; ++i) Lanes::store(acc + r * D + i * Lanes::N, a[r][i]);
}

// Query rows taken together: as many as keep their accumulators in half the vector registers (32
// with AVX-512, 16 with AVX2), at most 4.
template <int D>
constexpr int kRows = std::clamp((Lanes::N == 16 ? 16 : 8) / (D / Lanes::N), 1, 4);

template <int D, typename KV>
inline void group_scores(const float* q, const KV* const* krows, int64_t off, int n, int g, float scale, float* scores,
                         Prefetch<KV>& pf) {
  for (int r = 0; r < g;) {
    const int R = std::min(kRows<D>, g - r);
    const float* qr = q + r * D;
    float* sr = scores + r * kBlock;
    if (R == 4) rows_scores<D, (kRows<D> >= 4 ? 4 : 1), KV>(qr, krows, off, n, scale, sr, pf);
    else if (R == 3) rows_scores<D, (kRows<D> >= 3 ? 3 : 1), KV>(qr, krows, off, n, scale, sr, pf);
    else if (R == 2) rows_scores<D, (kRows<D> >= 2 ? 2 : 1), KV>(qr, krows, off, n, scale, sr, pf);
    else rows_scores<D, 1, KV>(qr, krows, off, n, scale, sr, pf);
    r += R;
  }
}

template <int D, typename KV>
inline void group_pv(const KV* const* vrows, int64_t off, int n, int g, const float* p, const float* corr, float* acc,
                     Prefetch<KV>& pf) {
  for (int r = 0; r < g;) {
    const int R = std::min(kRows<D>, g - r);
    const float* pr = p + r * kBlock;
    float* ar = acc + r * D;
    if (R == 4) rows_pv<D, (kRows<D> >= 4 ? 4 : 1), KV>(vrows, off, n, pr, corr + r, ar, pf);
    else if (R == 3) rows_pv<D, (kRows<D> >= 3 ? 3 : 1), KV>(vrows, off, n, pr, corr + r, ar, pf);
    else if (R == 2) rows_pv<D, (kRows<D> >= 2 ? 2 : 1), KV>(vrows, off, n, pr, corr + r, ar, pf);
    else rows_pv<D, 1, KV>(vrows, off, n, pr, corr + r, ar, pf);
    r += R;
  }
}

// One KV head over one block of n keys: scores, online-softmax update of the g query rows' running
// max / sum, accumulators (g x D) rescaled and P V added.
template <int D, typename KV>
void head_block(const float* q, const KV* const* krows, const KV* const* vrows, int64_t off, int n, int g,
                float scale, float* m_run, float* l_run, float* acc, float* scores, Prefetch<KV>& pf) {
  group_scores<D, KV>(q, krows, off, n, g, scale, scores, pf);
  float corr[8];
  for (int r = 0; r < g; ++r) {
    float* sr = scores + r * kBlock;
    const float m_new = block_max(sr, n, m_run[r]);
    // 0 on the first block (running max -inf): the empty accumulator is scaled away
    corr[r] = m_run[r] == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m_run[r] - m_new);
    float l = l_run[r] * corr[r];
#pragma omp simd reduction(+ : l)
    for (int j = 0; j < n; ++j) {
      sr[j] = exp_nonpositive(sr[j] - m_new);
      l += sr[j];
    }
    m_run[r] = m_new;
    l_run[r] = l;
  }
  group_pv<D, KV>(vrows, off, n, g, scores, corr, acc, pf);
}

// One split [t0, t1) of one sequence, every KV head: m/l (hkv x g) and acc (hkv x g x D) per head.
template <int D, typename KV>
void decode_split_heads(const float* q, const KV* k_cache, const KV* v_cache, const int64_t* slots, int64_t t0,
                        int64_t t1, int64_t row_stride, int hkv, int g, float scale, float* m_out, float* l_out,
                        float* acc) {
  const KV* krows[kBlock];
  const KV* vrows[kBlock];
  float scores[8 * kBlock];  // g <= 8 (checked by the caller)
  const int64_t row_bytes = static_cast<int64_t>(hkv) * D * sizeof(KV);
  for (int i = 0; i < hkv * g; ++i) m_out[i] = -std::numeric_limits<float>::infinity(), l_out[i] = 0.f;
  std::fill(acc, acc + static_cast<size_t>(hkv) * g * D, 0.f);
  for (int64_t b0 = t0; b0 < t1; b0 += kBlock) {
    const int n = static_cast<int>(std::min<int64_t>(kBlock, t1 - b0));
    for (int j = 0; j < n; ++j) {
      krows[j] = k_cache + slots[b0 + j] * row_stride;
      vrows[j] = v_cache + slots[b0 + j] * row_stride;
    }
    // the next block's rows, all heads, spread over this block's passes (each head's scores and P V,
    // one call per key and group of query rows): pool rows cross a 4 KB page every few keys, where
    // the hardware prefetcher stops
    const int64_t calls = static_cast<int64_t>(hkv) * 2 * ((g + kRows<D> - 1) / kRows<D>) * n;
    Prefetch<KV> pf(k_cache, v_cache, slots + b0 + n, std::min<int64_t>(kBlock, t1 - b0 - n), row_stride, row_bytes,
                    calls);
    for (int h = 0; h < hkv; ++h)
      head_block<D, KV>(q + static_cast<size_t>(h) * g * D, krows, vrows, static_cast<int64_t>(h) * D, n, g, scale,
                        m_out + h * g, l_out + h * g, acc + static_cast<size_t>(h) * g * D, scores, pf);
  }
}
#endif

template <typename KV, typename QO>
void decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& kv_indices, const torch::Tensor& kv_indptr, double scale, torch::Tensor& out,
                 int64_t min_split, bool per_head) {
  const int64_t bs = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t hkv = k_cache.size(1);
  const int g = static_cast<int>(hq / hkv);
  const int64_t row_stride = k_cache.stride(0);  // head h of slot s starts at s * row_stride + h * d
  const int64_t* slots = kv_indices.data_ptr<int64_t>();
  const int64_t* indptr = kv_indptr.data_ptr<int64_t>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const QO* qp = q.data_ptr<QO>();
  QO* op = out.data_ptr<QO>();

  // Splits per sequence from its own length only (a few per thread for long sequences, none shorter
  // than min_split keys), so a sequence's result does not depend on what else is in the batch.
  const int64_t max_splits = std::max<int64_t>(1, 4 * at::get_num_threads());
  std::vector<int64_t> split_first(bs + 1, 0), splits(bs, 1);
  for (int64_t b = 0; b < bs; ++b) {
    const int64_t len = indptr[b + 1] - indptr[b];
    splits[b] = std::clamp<int64_t>(len / std::max<int64_t>(1, min_split), 1, max_splits);
    split_first[b + 1] = split_first[b] + splits[b];
  }
  const int64_t items = split_first[bs] * hkv;
  std::vector<float> part_m(items * g), part_l(items * g), part_acc(items * g * d);

#ifdef LOOPKV_HEADS_PATH
  if (!per_head && (d == 64 || d == 128) && g <= 8) {  // items are splits, every KV head in each
    at::parallel_for(0, split_first[bs], 1, [&](int64_t begin, int64_t end) {
      std::vector<float> qf(static_cast<size_t>(hq) * d);
      for (int64_t flat = begin; flat < end; ++flat) {
        const int64_t b = std::upper_bound(split_first.begin(), split_first.end(), flat) - split_first.begin() - 1;
        const int64_t part = flat - split_first[b];
        const int64_t len = indptr[b + 1] - indptr[b];
        const int64_t t0 = indptr[b] + len * part / splits[b], t1 = indptr[b] + len * (part + 1) / splits[b];
        const QO* qb = qp + b * hq * d;
        for (int64_t x = 0; x < hq * d; ++x) qf[x] = to_float(qb[x]);
        const int64_t item = flat * hkv;  // the part arrays' (split, head) order, as the one-head path's
        auto run = d == 64 ? decode_split_heads<64, KV> : decode_split_heads<128, KV>;
        run(qf.data(), kc, vc, slots, t0, t1, row_stride, static_cast<int>(hkv), g, static_cast<float>(scale),
            &part_m[item * g], &part_l[item * g], &part_acc[item * g * d]);
      }
    });
  } else
#endif
  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(static_cast<size_t>(g) * d);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % hkv, flat = item / hkv;
      const int64_t b = std::upper_bound(split_first.begin(), split_first.end(), flat) - split_first.begin() - 1;
      const int64_t part = flat - split_first[b];
      const int64_t len = indptr[b + 1] - indptr[b];
      const int64_t t0 = indptr[b] + len * part / splits[b], t1 = indptr[b] + len * (part + 1) / splits[b];
      const QO* qb = qp + (b * hq + h * g) * d;
      for (int64_t x = 0; x < g * d; ++x) qf[x] = to_float(qb[x]);
      decode_split<KV>(qf.data(), kc + h * d, vc + h * d, slots, t0, t1, row_stride, g, static_cast<int>(d),
                       static_cast<float>(scale), &part_m[item * g], &part_l[item * g], &part_acc[item * g * d]);
    }
  });

  // Merge the splits of each (sequence, KV head): rescale to the common max, sum, normalise.
  at::parallel_for(0, bs * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> o(static_cast<size_t>(g) * d);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / hkv, h = bh % hkv;
      for (int r = 0; r < g; ++r) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < splits[b]; ++p) m = std::max(m, part_m[((split_first[b] + p) * hkv + h) * g + r]);
        float l = 0.f;
        std::fill(o.begin() + r * d, o.begin() + (r + 1) * d, 0.f);
        for (int64_t p = 0; p < splits[b]; ++p) {
          const int64_t item = (split_first[b] + p) * hkv + h;
          const float w = part_l[item * g + r] == 0.f ? 0.f : std::exp(part_m[item * g + r] - m);
          l += part_l[item * g + r] * w;
          const float* a = &part_acc[(item * g + r) * d];
          for (int64_t x = 0; x < d; ++x) o[r * d + x] += a[x] * w;
        }
        QO* dst = op + (b * hq + h * g + r) * d;
        const float inv = l > 0.f ? 1.f / l : 0.f;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<QO>(o[r * d + x] * inv);
      }
    }
  });
}

template <typename KV>
void dispatch_q(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& idx,
                const torch::Tensor& indptr, double scale, torch::Tensor& out, int64_t min_split, bool per_head) {
  switch (q.scalar_type()) {
    case at::kFloat: return decode_impl<KV, float>(q, k, v, idx, indptr, scale, out, min_split, per_head);
    case at::kBFloat16: return decode_impl<KV, at::BFloat16>(q, k, v, idx, indptr, scale, out, min_split, per_head);
    case at::kHalf: return decode_impl<KV, at::Half>(q, k, v, idx, indptr, scale, out, min_split, per_head);
    default: TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
}

}  // namespace

// The operands paged_decode and extend_attention share: q / out [rows, Hq, D] contiguous on the CPU,
// a K and a V pool buffer [P, Hkv, D] with contiguous rows and one layout, dtypes paired.
void check_attention_operands(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& out) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "the attention kernels run on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.is_contiguous() && out.is_contiguous(),
              "q and out: contiguous [rows, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.stride(0) == v_cache.stride(0),
              "k/v cache: [P, Hkv, D] with the same layout");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2), "k/v cache rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "k/v share a dtype; out has q's dtype");
}

void paged_decode_path(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_indices,
                       torch::Tensor kv_indptr, double scale, torch::Tensor out, int64_t min_split, bool per_head) {
  check_attention_operands(q, k_cache, v_cache, out);
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0, "head_dim / GQA mismatch");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong &&
                  kv_indices.is_contiguous() && kv_indptr.is_contiguous() && kv_indptr.numel() == q.size(0) + 1,
              "kv_indices / kv_indptr: contiguous int64, indptr has B + 1 entries");
  switch (k_cache.scalar_type()) {
    case at::kFloat: return dispatch_q<float>(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split, per_head);
    case at::kBFloat16:
      return dispatch_q<at::BFloat16>(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split, per_head);
    case at::kHalf: return dispatch_q<at::Half>(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split, per_head);
    default: TORCH_CHECK(false, "paged_decode: unsupported KV dtype ", k_cache.scalar_type());
  }
}

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_indices,
                  torch::Tensor kv_indptr, double scale, torch::Tensor out, int64_t min_split) {
  paged_decode_path(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split, false);
}

// A decode step's new keys and values into the pool: row i of k / v ([n, Hkv * D] or [n, Hkv, D], float32)
// to slot loc[i], converted to the pool's dtype as torch's .to() does (round to nearest even), the
// values SGLang's set_kv_buffer writes in one call instead of two casts and two indexed copies.
template <typename KV>
void store_rows(const float* src, KV* dst, const int64_t* loc, int64_t n, int64_t width, int64_t stride) {
  for (int64_t i = 0; i < n; ++i) {
    KV* row = dst + loc[i] * stride;
    const float* x = src + i * width;
    for (int64_t j = 0; j < width; ++j) row[j] = static_cast<KV>(x[j]);
  }
}

void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor loc) {
  TORCH_CHECK(k.device().is_cpu() && k_cache.device().is_cpu(), "store_kv: CPU tensors");
  TORCH_CHECK(k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat && k.is_contiguous() && v.is_contiguous(),
              "store_kv: k and v contiguous float32");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides() &&
                  k_cache.scalar_type() == v_cache.scalar_type(),
              "store_kv: k/v cache [P, Hkv, D] with one layout and dtype");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2), "store_kv: cache rows contiguous");
  const int64_t width = k_cache.size(1) * k_cache.size(2), n = loc.numel();
  TORCH_CHECK(k.numel() == n * width && v.numel() == n * width, "store_kv: k/v hold ", n, " rows of ", width);
  TORCH_CHECK(loc.scalar_type() == at::kLong && loc.is_contiguous(), "store_kv: loc contiguous int64");
  const int64_t* lp = loc.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(lp[i] >= 0 && lp[i] < k_cache.size(0), "store_kv: slot ", lp[i], " outside the pool's ", k_cache.size(0));
  const int64_t stride = k_cache.stride(0);
  switch (k_cache.scalar_type()) {
    case at::kFloat:
      store_rows(k.data_ptr<float>(), k_cache.data_ptr<float>(), lp, n, width, stride);
      return store_rows(v.data_ptr<float>(), v_cache.data_ptr<float>(), lp, n, width, stride);
    case at::kBFloat16:
      store_rows(k.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(), lp, n, width, stride);
      return store_rows(v.data_ptr<float>(), v_cache.data_ptr<at::BFloat16>(), lp, n, width, stride);
    case at::kHalf:
      store_rows(k.data_ptr<float>(), k_cache.data_ptr<at::Half>(), lp, n, width, stride);
      return store_rows(v.data_ptr<float>(), v_cache.data_ptr<at::Half>(), lp, n, width, stride);
    default: TORCH_CHECK(false, "store_kv: unsupported KV dtype ", k_cache.scalar_type());
  }
}

// The same over the one-KV-head-per-item path whatever the head dim (tests and
// benchmarks/studies/decode_attention.py compare the two).
void paged_decode_per_head(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_indices,
                           torch::Tensor kv_indptr, double scale, torch::Tensor out, int64_t min_split) {
  paged_decode_path(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split, true);
}

// Sparse decode's page selection for one sequence in one layer (the torch path is
// sgl_loopkv.selection.pages: score_bound, group_max over a physical page, top_pages), in one call:
// a decode step selects in every layer of every sequence, and the ~20 small torch ops it took cost
// more than the sparse attention they plan.
//
//   q:     [H, g, D] float32   the step's queries grouped by KV head
//   summ:  [H, cap, 2, D] float32, head-major (min row, max row) per logical page; the first n used
//   returns ascending physical page ids [H, k], k = max(budget, forced pages): the first `sink` and
//   last `local` physical pages always, then the best by max over the group's heads and the
//   physical page's logical pages of sum_d max(q_d * kmin_d, q_d * kmax_d); ties go to the lower id.
torch::Tensor select_pages(torch::Tensor q, torch::Tensor summ, int64_t n, int64_t per, int64_t budget, int64_t sink,
                           int64_t local) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: contiguous float32 [H, g, D]");
  TORCH_CHECK(summ.dim() == 4 && summ.scalar_type() == at::kFloat && summ.stride(3) == 1 && summ.stride(2) == summ.size(3) &&
                  summ.stride(1) == 2 * summ.size(3) && summ.size(0) == q.size(0) && summ.size(3) == q.size(2) &&
                  summ.size(2) == 2 && n <= summ.size(1) && per >= 1,
              "summ: float32 [H, cap >= n, 2, D] with contiguous pages");
  const int64_t H = q.size(0), g = q.size(1), d = q.size(2);
  const int64_t n_phys = (n + per - 1) / per;
  const int64_t sink_end = std::min(sink, n_phys), local_from = std::max<int64_t>(n_phys - local, 0);
  const int64_t k = std::min(n_phys, std::max(budget, sink_end + n_phys - std::max(local_from, sink_end)));
  auto out = torch::empty({H, k}, torch::kLong);
  int64_t* po = out.data_ptr<int64_t>();
  std::vector<float> qq(static_cast<size_t>(g) * 2 * d), page(n_phys), tmp(g);
  std::vector<int64_t> order(n_phys);
  for (int64_t h = 0; h < H; ++h) {
    const float* qh = q.data_ptr<float>() + h * g * d;
    for (int64_t r = 0; r < g; ++r)  // [q-, q+] pairs with (min, max): max(q*kmin, q*kmax) = q- kmin + q+ kmax
      for (int64_t x = 0; x < d; ++x) {
        qq[r * 2 * d + x] = std::min(qh[r * d + x], 0.f);
        qq[r * 2 * d + d + x] = std::max(qh[r * d + x], 0.f);
      }
    const float* sh = summ.data_ptr<float>() + h * summ.stride(0);
    std::fill(page.begin(), page.end(), -std::numeric_limits<float>::infinity());
    for (int64_t j = 0; j < n; ++j) {
      dots(qq.data(), sh + j * summ.stride(1), static_cast<int>(g), static_cast<int>(2 * d), tmp.data(), 1);
      float& p = page[j / per];
      for (int64_t r = 0; r < g; ++r) p = std::max(p, tmp[r]);
    }
    for (int64_t i = 0; i < n_phys; ++i)
      if (i < sink_end || i >= local_from) page[i] = std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < n_phys; ++i) order[i] = i;
    std::nth_element(order.begin(), order.begin() + (k - 1), order.end(), [&](int64_t a, int64_t b) {
      return page[a] > page[b] || (page[a] == page[b] && a < b);
    });
    std::sort(order.begin(), order.begin() + k);
    std::copy(order.begin(), order.begin() + k, po + h * k);
  }
  return out;
}

// The plan rows of selected pages: rows[h] = slots[positions of pages[h] below length] * hkv + h
// (row `slot * Hkv + h` of the pool viewed as one-head rows); only the sequence's last page can be
// partial (sgl_loopkv.selection.pages.pages_to_positions is the torch path).
torch::Tensor page_rows(torch::Tensor pages, torch::Tensor slots, int64_t page, int64_t length) {
  TORCH_CHECK(pages.dim() == 2 && pages.scalar_type() == at::kLong && pages.is_contiguous(), "pages: int64 [H, k]");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) >= length,
              "slots: int64 [>= length]");
  const int64_t H = pages.size(0), k = pages.size(1);
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t cut = (k > 0 && pg[k - 1] == (length - 1) / page) ? (page - length % page) % page : 0;
  const int64_t m = k * page - cut;
  auto out = torch::empty({H, m}, torch::kLong);
  int64_t* po = out.data_ptr<int64_t>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t h = 0; h < H; ++h) {
    int64_t* row = po + h * m;
    int64_t w = 0;
    for (int64_t i = 0; i < k; ++i) {
      const int64_t p0 = pg[h * k + i] * page, p1 = std::min(p0 + page, length);
      TORCH_CHECK(p0 < length, "page_rows: page ", pg[h * k + i], " is past the sequence's end");
      for (int64_t p = p0; p < p1 && w < m; ++p) row[w++] = sl[p] * H + h;
    }
    TORCH_CHECK(w == m, "page_rows: head ", h, "'s pages do not end at the sequence's last page");
  }
  return out;
}

// Sparse decode's page summaries brought up to date with the keys of positions [from, to) (the torch
// path is sgl_loopkv.selection.pages.chunk_minmax over those keys): a logical page's (min, max) rows
// fold in its new keys, a page started at `from` or later takes its first key. Keys never change once
// written and min/max are exact, so folding equals recomputing the page; in place, no allocation (as
// ~8 small torch ops per sequence and layer it cost about as much as the sparse attention itself).
//
//   summ:    [H, cap, 2, D] float32, head-major; rows of positions < from are already up to date
//   k_cache: [P, H, D] one layer's key buffer (float32 / bfloat16 / float16); slots: int64 [>= to]
template <typename KV>
void fold_keys(float* summ, int64_t s_head, const KV* k, int64_t k_slot, const int64_t* slots, int64_t from,
               int64_t to, int64_t page, int64_t H, int64_t d) {
  for (int64_t h = 0; h < H; ++h)
    for (int64_t p = from; p < to; ++p) {
      float* mn = summ + h * s_head + (p / page) * 2 * d;
      float* mx = mn + d;
      const KV* kr = k + slots[p] * k_slot + h * d;
      if (p % page == 0) {
        for (int64_t x = 0; x < d; ++x) mn[x] = mx[x] = to_float(kr[x]);
      } else {
        for (int64_t x = 0; x < d; ++x) {
          const float v = to_float(kr[x]);
          mn[x] = std::min(mn[x], v);
          mx[x] = std::max(mx[x], v);
        }
      }
    }
}

void update_summaries(torch::Tensor summ, torch::Tensor k_cache, torch::Tensor slots, int64_t from, int64_t to,
                      int64_t page) {
  TORCH_CHECK(summ.dim() == 4 && summ.scalar_type() == at::kFloat && summ.stride(3) == 1 &&
                  summ.stride(2) == summ.size(3) && summ.stride(1) == 2 * summ.size(3) && summ.size(2) == 2,
              "summ: float32 [H, cap, 2, D] with contiguous pages");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2) &&
                  k_cache.size(1) == summ.size(0) && k_cache.size(2) == summ.size(3),
              "k_cache: [P, H, D] with contiguous rows, H and D as summ's");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.size(0) >= to,
              "slots: contiguous int64 [>= to]");
  TORCH_CHECK(page >= 1 && 0 <= from && from <= to && (to + page - 1) / page <= summ.size(1),
              "update_summaries: positions past the summaries' capacity");
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t p = from; p < to; ++p)
    TORCH_CHECK(sl[p] >= 0 && sl[p] < k_cache.size(0), "update_summaries: slot ", sl[p], " outside the key buffer");
  float* sm = summ.data_ptr<float>();
  const int64_t H = summ.size(0), d = summ.size(3), s_head = summ.stride(0), k_slot = k_cache.stride(0);
  switch (k_cache.scalar_type()) {
    case at::kFloat: return fold_keys(sm, s_head, k_cache.data_ptr<float>(), k_slot, sl, from, to, page, H, d);
    case at::kBFloat16:
      return fold_keys(sm, s_head, k_cache.data_ptr<at::BFloat16>(), k_slot, sl, from, to, page, H, d);
    case at::kHalf: return fold_keys(sm, s_head, k_cache.data_ptr<at::Half>(), k_slot, sl, from, to, page, H, d);
    default: TORCH_CHECK(false, "update_summaries: unsupported key dtype ", k_cache.scalar_type());
  }
}

// Extend attention on the CPU: n new query rows of one sequence over its L keys (the last n its own,
// causal: row r sees keys 0 .. L - n + r), read in place from the pool through their slots.
//
//   q:        [n, Hq, D]   (float32 / bfloat16 / float16; contiguous), out: the same
//   kv_slots: [L] int64    pool slot of every key in position order
//
// Why: a returning turn's few new rows over a cached history (a chat turn, a chunk-pruned restore's
// kept chunks) cost torch 6-10 small ops a layer whatever their size: 0.25-0.4 ms at 16 rows over
// 416 keys where the arithmetic is ~0.05 ms, and SDPA's masked path 2.8 ms over 4K keys. Work items
// are (KV head, block of rows); each gathers its head's keys once into a transposed float block
// (so that a query row's scores over 16 keys are 16 lanes of FMAs, no horizontal sums), scores all
// its rows (the g query heads of the KV head x the block's rows) against them, takes an exact
// softmax per row (max, exp, sum over the row's visible keys), then accumulates P V four rows at a
// time. Not SDPA's bits (another summation order); within float32 rounding of it (tests).
namespace {

constexpr int kExtendRows = 8;  // extend rows per work item (x g query heads)

template <int D, typename KV, typename QO>
void extend_item(const QO* q, const KV* kc, const KV* vc, const int64_t* slots, int64_t L, int64_t n, int64_t r0,
                 int64_t r1, int64_t h, int64_t hq, int g, int64_t row_stride, float scale, QO* out,
                 std::vector<float>& kt, std::vector<float>& vv, std::vector<float>& sc, std::vector<float>& qf) {
  const int64_t keys = L - n + r1;  // the block's last row sees this many keys
  const int64_t nb = (keys + 15) / 16, kpad = nb * 16;
  const int rows = static_cast<int>(r1 - r0) * g;  // query rows: (extend row, query head of h)
  // keys transposed per block of 16 ([block][D][16]: a row's 16 scores are one vector of FMAs), values as rows
  constexpr bool copy_v = !std::is_same<KV, float>::value;  // float32 values are read in place
  kt.assign(static_cast<size_t>(kpad) * D, 0.f);
  if (copy_v) vv.resize(static_cast<size_t>(keys) * D);
  for (int64_t j = 0; j < keys; ++j) {
    if (j + kPrefetch < keys) {
      prefetch_row(kc + slots[j + kPrefetch] * row_stride + h * D, D);
      prefetch_row(vc + slots[j + kPrefetch] * row_stride + h * D, D);
    }
    const KV* kr = kc + slots[j] * row_stride + h * D;
    const KV* vr = vc + slots[j] * row_stride + h * D;
    float* kb = kt.data() + (j / 16) * 16 * D + j % 16;
    for (int x = 0; x < D; ++x) kb[x * 16] = to_float(kr[x]);
    if (copy_v) {
      float* vd = vv.data() + static_cast<size_t>(j) * D;
      for (int x = 0; x < D; ++x) vd[x] = to_float(vr[x]);
    }
  }
  qf.resize(static_cast<size_t>(rows) * D);
  for (int64_t r = r0; r < r1; ++r)
    for (int a = 0; a < g; ++a)
      for (int x = 0; x < D; ++x)
        qf[((r - r0) * g + a) * D + x] = to_float(q[(r * hq + h * g + a) * D + x]) * scale;
  // scores, eight rows at a time: each loaded key vector feeds eight independent FMA chains (one
  // row's 64 chained FMAs waited on the FMA latency: 4x slower)
  sc.resize(static_cast<size_t>(rows) * kpad);
  for (int i0 = 0; i0 < rows; i0 += 8) {
    const float* qi[8];
    for (int a = 0; a < 8; ++a) qi[a] = qf.data() + static_cast<size_t>(std::min(i0 + a, rows - 1)) * D;
    for (int64_t b = 0; b < nb; ++b) {
      const float* kb = kt.data() + b * 16 * D;
      float acc[8][16] = {};
      for (int x = 0; x < D; ++x) {
        for (int a = 0; a < 8; ++a) {
          const float qx = qi[a][x];
#pragma omp simd
          for (int c = 0; c < 16; ++c) acc[a][c] += qx * kb[x * 16 + c];
        }
      }
      for (int a = 0; a < 8 && i0 + a < rows; ++a)
        std::memcpy(sc.data() + static_cast<size_t>(i0 + a) * kpad + b * 16, acc[a], sizeof acc[a]);
    }
  }
  // softmax per row over its visible keys (the rest weigh 0)
  std::vector<float> inv(rows);
  for (int i = 0; i < rows; ++i) {
    const int64_t vis = L - n + r0 + i / g + 1;
    float* si = sc.data() + static_cast<size_t>(i) * kpad;
    float m = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < vis; ++j) m = std::max(m, si[j]);
    float l = 0.f;
#pragma omp simd reduction(+ : l)
    for (int64_t j = 0; j < vis; ++j) {
      si[j] = exp_nonpositive(si[j] - m);
      l += si[j];
    }
    for (int64_t j = vis; j < kpad; ++j) si[j] = 0.f;
    inv[i] = 1.f / l;
  }
  // out rows = P V, four rows at a time (4 x D accumulators in registers for D = 64)
  for (int i0 = 0; i0 < rows; i0 += 4) {
    const int nr = std::min(4, rows - i0);
    const int64_t vis = L - n + r0 + (i0 + nr - 1) / g + 1;  // the group's last row sees the most
    float acc[4][D] = {};
    const float* p[4];
    for (int a = 0; a < 4; ++a) p[a] = sc.data() + static_cast<size_t>(i0 + std::min(a, nr - 1)) * kpad;
    for (int64_t j = 0; j < vis; ++j) {
      const float* vj = copy_v ? vv.data() + static_cast<size_t>(j) * D
                               : reinterpret_cast<const float*>(vc + slots[j] * row_stride + h * D);
      for (int a = 0; a < 4; ++a) {
        const float pa = p[a][j];
#pragma omp simd
        for (int x = 0; x < D; ++x) acc[a][x] += pa * vj[x];
      }
    }
    for (int a = 0; a < nr; ++a) {
      const int i = i0 + a;
      const int64_t r = r0 + i / g, head = h * g + i % g;
      QO* o = out + (r * hq + head) * D;
      for (int x = 0; x < D; ++x) o[x] = static_cast<QO>(acc[a][x] * inv[i]);
    }
  }
}

template <typename KV, typename QO>
void extend_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& kv_slots, double scale, torch::Tensor& out) {
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), hkv = k_cache.size(1), L = kv_slots.size(0);
  const int g = static_cast<int>(hq / hkv);
  const int64_t blocks = (n + kExtendRows - 1) / kExtendRows;
  const int64_t* slots = kv_slots.data_ptr<int64_t>();
  const KV* kc = k_cache.data_ptr<KV>();
  const KV* vc = v_cache.data_ptr<KV>();
  const QO* qp = q.data_ptr<QO>();
  QO* op = out.data_ptr<QO>();
  at::parallel_for(0, hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt, vv, sc, qf;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item % hkv, b = item / hkv;
      const int64_t r0 = b * kExtendRows, r1 = std::min(n, r0 + kExtendRows);
      if (d == 64)
        extend_item<64, KV, QO>(qp, kc, vc, slots, L, n, r0, r1, h, hq, g, k_cache.stride(0), static_cast<float>(scale),
                                op, kt, vv, sc, qf);
      else
        extend_item<128, KV, QO>(qp, kc, vc, slots, L, n, r0, r1, h, hq, g, k_cache.stride(0),
                                 static_cast<float>(scale), op, kt, vv, sc, qf);
    }
  });
}

template <typename KV>
void extend_dispatch_q(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& slots, double scale, torch::Tensor& out) {
  switch (q.scalar_type()) {
    case at::kFloat: return extend_impl<KV, float>(q, k, v, slots, scale, out);
    case at::kBFloat16: return extend_impl<KV, at::BFloat16>(q, k, v, slots, scale, out);
    case at::kHalf: return extend_impl<KV, at::Half>(q, k, v, slots, scale, out);
    default: TORCH_CHECK(false, "extend_attention: unsupported query dtype ", q.scalar_type());
  }
}

}  // namespace

void extend_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_slots,
                      double scale, torch::Tensor out) {
  check_attention_operands(q, k_cache, v_cache, out);
  TORCH_CHECK(q.size(2) == k_cache.size(2) && (q.size(2) == 64 || q.size(2) == 128) &&
                  q.size(1) % k_cache.size(1) == 0,
              "extend_attention: head_dim 64 or 128, GQA (Hq a multiple of Hkv)");
  TORCH_CHECK(kv_slots.scalar_type() == at::kLong && kv_slots.is_contiguous() && kv_slots.dim() == 1 &&
                  kv_slots.size(0) >= q.size(0),
              "kv_slots: contiguous int64 [L], L >= the new rows");
  switch (k_cache.scalar_type()) {
    case at::kFloat: return extend_dispatch_q<float>(q, k_cache, v_cache, kv_slots, scale, out);
    case at::kBFloat16: return extend_dispatch_q<at::BFloat16>(q, k_cache, v_cache, kv_slots, scale, out);
    case at::kHalf: return extend_dispatch_q<at::Half>(q, k_cache, v_cache, kv_slots, scale, out);
    default: TORCH_CHECK(false, "extend_attention: unsupported KV dtype ", k_cache.scalar_type());
  }
}

// Whether at::parallel_for spreads work over torch's threads here (it is serial when the extension
// is built without OpenMP: a decode step's attention then ran on one of the two cores).
bool intra_op_parallel() {
#ifdef INTRA_OP_PARALLEL
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "Paged decode attention over SGLang's KV pool (CPU)");
  m.def("store_kv", &store_kv, "A decode step's new K/V rows into the pool's slots, in its dtype (CPU)");
  m.def("paged_decode_per_head", &paged_decode_per_head, "paged_decode over its one-KV-head-per-item path (CPU)");
  m.def("extend_attention", &extend_attention, "Causal attention of a few new rows over their KV in the pool (CPU)");
  m.def("select_pages", &select_pages, "Sparse decode page selection for one sequence and layer (CPU)");
  m.def("page_rows", &page_rows, "Plan rows (slot * Hkv + head) of selected pages (CPU)");
  m.def("update_summaries", &update_summaries, "Fold new keys into sparse decode's page summaries (CPU)");
  m.def("intra_op_parallel", &intra_op_parallel, "at::parallel_for runs on torch's intra-op threads");
}
