// A finished turn's KV on its way into the tiers: int8 rows with their scales (an int8 tier), and the
// per-chunk min/max key summaries every stored segment keeps (page selection, pruned re-prefill).
//
// Why not torch: the store runs on the scheduler thread after a turn's last token, and every request
// behind it waits. torch's quantize is seven passes over a float32 copy of the turn (cast, abs, amax,
// divide, round, clamp, cast), each into a fresh temporary: a 5K-token turn of the default model took
// ~0.4 s on one core, the summaries another ~0.09 s. Here each pool byte is read once per function and
// each output byte written once, one (token, head) row of D values at a time in registers.
//
// Exactness: the same bits as the torch code they replace (tests/unit/test_kv_quant.py):
// - quantize: x as float32; scale = max|x| / 127 (float32 division); q = round-half-even(x / max(scale,
//   FLT_MIN)) clamped to +-127: the division, not a multiply by a reciprocal, as torch divides;
// - chunk_minmax: float32 min and max of a chunk's keys (a last partial chunk summarises what it has).
// NaN, which no KV row holds, is not propagated as torch's amax/amin would.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// One row of D values into float32 (a bfloat16 row widened exactly).
template <typename T>
inline void widen(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = to_float(src[i]);
}

inline int8_t quantize_one(float x, float divisor) {
  float r = std::nearbyint(x / divisor);  // the default rounding mode: half to even, as torch.round
  return static_cast<int8_t>(std::min(std::max(r, -127.0f), 127.0f));
}

// Row of d float32 values -> d int8 values; returns the row's scale.
float quantize_row(const float* x, int8_t* q, int64_t d) {
  float amax = 0.0f;
  for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::fabs(x[i]));
  const float scale = amax / 127.0f;
  const float divisor = std::max(scale, FLT_MIN);
  for (int64_t i = 0; i < d; ++i) q[i] = quantize_one(x[i], divisor);
  return scale;
}

#ifdef __AVX512F__
// 16 values of a row as float32 (a bfloat16 lane widened exactly: its bits are a float's top half).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// quantize_row for rows of up to kMaxVec * 16 values, a multiple of 16, held in registers.
constexpr int64_t kMaxVec = 8;
template <typename T>
float quantize_row_avx512(const T* src, int8_t* q, int64_t d) {
  __m512 x[kMaxVec];
  const int64_t n = d / 16;
  const __m512 sign = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  __m512 m = _mm512_setzero_ps();
  for (int64_t v = 0; v < n; ++v) {
    x[v] = load16(src + v * 16);
    m = _mm512_max_ps(m, _mm512_and_ps(x[v], sign));
  }
  const float scale = _mm512_reduce_max_ps(m) / 127.0f;
  const __m512 div = _mm512_set1_ps(std::max(scale, FLT_MIN)), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  for (int64_t v = 0; v < n; ++v) {
    __m512 r = _mm512_roundscale_ps(_mm512_div_ps(x[v], div), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    r = _mm512_min_ps(_mm512_max_ps(r, lo), hi);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + v * 16), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
  }
  return scale;
}
#endif

template <typename T>
void quantize_rows(const T* src, int8_t* q, float* scale, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, 256, [&](int64_t begin, int64_t end) {
#ifdef __AVX512F__
    if (d % 16 == 0 && d <= kMaxVec * 16) {
      for (int64_t r = begin; r < end; ++r) scale[r] = quantize_row_avx512(src + r * d, q + r * d, d);
      return;
    }
#endif
    std::vector<float> row(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* x;
      if constexpr (std::is_same_v<T, float>) {
        x = src + r * d;
      } else {
        widen(src + r * d, row.data(), d);
        x = row.data();
      }
      scale[r] = quantize_row(x, q + r * d, d);
    }
  });
}

template <typename T>
void minmax_chunks(const T* k, int64_t lead_stride, float* out, int64_t lead, int64_t t, int64_t h, int64_t d,
                   int64_t chunk) {
  const int64_t n = (t + chunk - 1) / chunk;
  at::parallel_for(0, lead * n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t l = item / n, c = item % n;
      const int64_t t0 = c * chunk, t1 = std::min(t0 + chunk, t);
      for (int64_t head = 0; head < h; ++head) {
        float* mn = out + ((item * h + head) * 2) * d;  // out[l, c, head, 0, :] and [.., 1, :]
        float* mx = mn + d;
        const T* row = k + l * lead_stride + (t0 * h + head) * d;
        for (int64_t i = 0; i < d; ++i) mn[i] = mx[i] = to_float(row[i]);
        for (int64_t tok = t0 + 1; tok < t1; ++tok) {
          row += h * d;
          for (int64_t i = 0; i < d; ++i) {
            const float x = to_float(row[i]);
            mn[i] = std::min(mn[i], x);
            mx[i] = std::max(mx[i], x);
          }
        }
      }
    }
  });
}

void check_float(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), what, ": a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16, what, ": float32 or bfloat16");
}

}  // namespace

// kv [..., D] float32 or bfloat16, contiguous -> (q int8 [..., D], scale float32 [...]): one symmetric
// scale per row of D values (QuantKV.quantize).
std::vector<torch::Tensor> quantize(const torch::Tensor& kv) {
  check_float(kv, "kv");
  TORCH_CHECK(kv.dim() >= 1 && kv.size(-1) > 0, "kv: rows of at least one value");
  const int64_t d = kv.size(-1), rows = kv.numel() / d;
  auto q = torch::empty(kv.sizes(), kv.options().dtype(at::kChar));
  auto scale = torch::empty(kv.sizes().slice(0, kv.dim() - 1), kv.options().dtype(at::kFloat));
  if (kv.scalar_type() == at::kFloat)
    quantize_rows(kv.data_ptr<float>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, d);
  else
    quantize_rows(kv.data_ptr<at::BFloat16>(), q.data_ptr<int8_t>(), scale.data_ptr<float>(), rows, d);
  return {q, scale};
}

// k [N, T, H, D] float32 or bfloat16, each [T, H, D] contiguous (N strided: a stored turn's keys are
// kv[:, 0] of its [L, 2, T, H, D]) -> [N, ceil(T / chunk), H, 2, D] float32: per chunk of `chunk` tokens
// and head, the keys' min and max (selection.pages.chunk_minmax).
torch::Tensor chunk_minmax(const torch::Tensor& k, int64_t chunk) {
  TORCH_CHECK(k.device().is_cpu() && k.dim() == 4 && chunk > 0, "k: a CPU [N, T, H, D] and a positive chunk");
  TORCH_CHECK(k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16, "k: float32 or bfloat16");
  const int64_t n = k.size(0), t = k.size(1), h = k.size(2), d = k.size(3);
  TORCH_CHECK(k.stride(3) == 1 && k.stride(2) == d && k.stride(1) == h * d, "k: each [T, H, D] contiguous");
  auto out = torch::empty({n, (t + chunk - 1) / chunk, h, 2, d}, k.options().dtype(at::kFloat));
  if (out.numel() == 0) return out;
  if (k.scalar_type() == at::kFloat)
    minmax_chunks(k.data_ptr<float>(), k.stride(0), out.data_ptr<float>(), n, t, h, d, chunk);
  else
    minmax_chunks(k.data_ptr<at::BFloat16>(), k.stride(0), out.data_ptr<float>(), n, t, h, d, chunk);
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize", &quantize, py::call_guard<py::gil_scoped_release>());
  m.def("chunk_minmax", &chunk_minmax, py::call_guard<py::gil_scoped_release>());
}
