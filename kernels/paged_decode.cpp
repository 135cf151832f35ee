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
// row is read once per (sequence, KV head). Work items are (sequence, KV head, split of the keys)
// so that a single sequence still keeps every core busy (flash-decoding); each split keeps a
// running max / sum / accumulator (online softmax) and the splits are merged at the end.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define LOOPKV_AVX2 1
#endif

namespace {

constexpr int kBlock = 64;  // keys scored before one softmax rescale

// exp(x) for x <= 0 (scores minus their running max), written so the compiler vectorizes the loop
// that calls it: Cody-Waite range reduction and a degree-6 polynomial (relative error ~2e-7, like
// expf). std::exp is a scalar call per score and dominated the kernel's compute.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.3f);  // exp(-87.3) ~ 1e-38: smaller values underflow to (almost) 0 anyway
  // round to nearest by the 1.5 * 2^23 trick: nearbyint is a libm call per element without -ffast-math
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
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
    for (int j = 0; j < n; ++j) dots(q, k_cache + slots[b0 + j] * row_stride, g, d, scores.data() + j, kBlock);
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
    for (int j = 0; j < n; ++j) axpys(acc, scores.data() + j, kBlock, v_cache + slots[b0 + j] * row_stride, g, d);
  }
}

template <typename KV, typename QO>
void decode_impl(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                 const torch::Tensor& kv_indices, const torch::Tensor& kv_indptr, double scale, torch::Tensor& out,
                 int64_t min_split) {
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
                const torch::Tensor& indptr, double scale, torch::Tensor& out, int64_t min_split) {
  switch (q.scalar_type()) {
    case at::kFloat: return decode_impl<KV, float>(q, k, v, idx, indptr, scale, out, min_split);
    case at::kBFloat16: return decode_impl<KV, at::BFloat16>(q, k, v, idx, indptr, scale, out, min_split);
    case at::kHalf: return decode_impl<KV, at::Half>(q, k, v, idx, indptr, scale, out, min_split);
    default: TORCH_CHECK(false, "paged_decode: unsupported query dtype ", q.scalar_type());
  }
}

}  // namespace

void paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor kv_indices,
                  torch::Tensor kv_indptr, double scale, torch::Tensor out, int64_t min_split) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "paged_decode runs on CPU tensors");
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.is_contiguous() && out.is_contiguous(),
              "q and out: contiguous [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.sizes() == v_cache.sizes() && k_cache.stride(0) == v_cache.stride(0),
              "k/v cache: [P, Hkv, D] with the same layout");
  TORCH_CHECK(k_cache.stride(2) == 1 && k_cache.stride(1) == k_cache.size(2), "k/v cache rows must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() && out.scalar_type() == q.scalar_type(),
              "k/v share a dtype; out has q's dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0, "head_dim / GQA mismatch");
  TORCH_CHECK(kv_indices.scalar_type() == at::kLong && kv_indptr.scalar_type() == at::kLong &&
                  kv_indices.is_contiguous() && kv_indptr.is_contiguous() && kv_indptr.numel() == q.size(0) + 1,
              "kv_indices / kv_indptr: contiguous int64, indptr has B + 1 entries");
  switch (k_cache.scalar_type()) {
    case at::kFloat: return dispatch_q<float>(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split);
    case at::kBFloat16:
      return dispatch_q<at::BFloat16>(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split);
    case at::kHalf: return dispatch_q<at::Half>(q, k_cache, v_cache, kv_indices, kv_indptr, scale, out, min_split);
    default: TORCH_CHECK(false, "paged_decode: unsupported KV dtype ", k_cache.scalar_type());
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
  m.def("intra_op_parallel", &intra_op_parallel, "at::parallel_for runs on torch's intra-op threads");
}
