// Causal attention of a prefill's float32 query rows over bfloat16 keys and values (the KV pool's
// dtype on the GGUF path), on bfloat16 matrix units (AMX) at close to float32 accuracy.
//
// Why: a long prefill spends about as long in attention as in its linear layers, and torch's CPU
// flash kernel takes one dtype for q, k and v: float32 (the keys widened first) runs at the float32
// FMA roof, bfloat16 rounds the queries to 8 bits, which moved this weak model's teacher-forced
// tokens (docs/decisions/2026-12-06-bf16-prefill-gemms.md). Here every float32 operand of a product
// is split in two bfloat16 parts, x = hi + lo with hi = bf16(x), lo = bf16(x - hi), which keep 16 of
// float32's 24 mantissa bits (relative error <= 2^-17). Keys and values are bfloat16 already, so
//   q k^T = q_hi k^T + q_lo k^T        p v = p_hi v + p_lo v
// are bfloat16 GEMMs with float32 sums through oneDNN's batch-reduce GEMM (at::native::cpublas::brgemm,
// the kernel torch's flash attention calls; AMX where present), each pair one call: the packed keys
// and values are stacked twice along the reduction against [x_hi | x_lo]. q is scaled before its
// split; softmax runs online in float32 per tile of 256 keys, as in torch's flash kernel. The result
// is within 2^-12 of the values' magnitude of a float64 softmax over the same keys, where torch's
// float32 kernel is within about 2^-16 (tests/unit/test_prefill_attention.py).
//
// With split_weights false the softmax weights are rounded to bfloat16 once (relative error <= 2^-9
// each, as FlashAttention's P V on GPUs) and P V is one bfloat16 product, half the split's; the
// normalizer stays the float32 sum of the unrounded weights, so the result moves by at most 2^-9 of the
// values' magnitude, and a fifth of the kernel's time goes. The queries stay split either way: their
// rounding moves every score of a row, which is what cost a bfloat16 prefill its fidelity.
//
// Layout: q, out [n, Hq, D] float32; k, v [L, Hkv, D] bfloat16, any row and head strides (a gathered
// extend's KV or pool views); row r of q sits at position L - n + r and sees keys 0 .. L - n + r.
// Hq is a multiple of Hkv (GQA: consecutive query heads share a KV head). A work item is one query
// head and block of rows; items are ordered so a contiguous split over threads gets equal work
// (the causal triangle makes late blocks dearer), and a row's result depends only on its own
// sequence. Keys and values are packed into oneDNN's layout once per call, per KV head and tile.

#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <torch/extension.h>

#include "bf16_brgemm.h"
#include "exp_nonpositive.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t TILE = 256;     // keys per online-softmax step
constexpr int64_t PACK_N = 64;    // a packed B's columns (keys for q k^T, head dims for p v): what oneDNN packs
constexpr int64_t BLOCK_M = 256;  // query rows per work item

// x = hi + lo, both bfloat16, rounded to nearest even (at::BFloat16's rounding; finite x), over
// arrays: plain integer steps the compiler vectorizes, where at::BFloat16's constructor is a call.
inline uint16_t bf16_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float bits_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void split_row(const float* x, int64_t count, uint16_t* hi, uint16_t* lo) {
#pragma omp simd
  for (int64_t i = 0; i < count; ++i) {
    const uint16_t h = bf16_bits(x[i]);
    hi[i] = h;
    lo[i] = bf16_bits(x[i] - bits_float(h));
  }
}

// e = exp(s - mx) for s[0 .. seen) into p_hi = bf16(e) and, unless pl is null, p_lo = bf16(e - p_hi);
// returns the sum of e (unrounded: the normalizer is float32 either way).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
// One conversion instruction per 16 weights and part (vcvtneps2bf16, round to nearest even as
// bf16_bits; it flushes subnormal inputs to zero, which only a weight below 1e-38 is).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x));
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
inline float weights_split(const float* s, int64_t seen, float mx, uint16_t* ph, uint16_t* pl) {
  const __m512 m = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; j += 16) {
    const __mmask16 k = seen - j >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (seen - j)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + j), m)));
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
    const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    _mm256_mask_storeu_epi16(ph + j, k, h);
    if (pl != nullptr) _mm256_mask_storeu_epi16(pl + j, k, (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, hf)));
    sum = _mm512_add_ps(sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#else
inline float weights_split(const float* s, int64_t seen, float mx, uint16_t* ph, uint16_t* pl) {
  float sum = 0.f;
  if (pl == nullptr) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < seen; ++j) {
      const float e = exp_nonpositive(s[j] - mx);
      sum += e;
      ph[j] = bf16_bits(e);
    }
    return sum;
  }
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < seen; ++j) {
    const float e = exp_nonpositive(s[j] - mx);
    const uint16_t h = bf16_bits(e);
    sum += e;
    ph[j] = h;
    pl[j] = bf16_bits(e - bits_float(h));
  }
  return sum;
}
#endif

}  // namespace

bool available() { return loopkv_bf16::available(); }

torch::Tensor flash_split(torch::Tensor q, torch::Tensor k, torch::Tensor v, double scale, bool split_weights) {
  TORCH_CHECK(available(), "prefill attention: no bfloat16 brgemm on this CPU (AMX or AVX512-BF16)");
  TORCH_CHECK(q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 3 && q.stride(2) == 1,
              "prefill attention: q is float32 [n, Hq, D], last dim contiguous");
  TORCH_CHECK(k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16 && k.dim() == 3 && v.dim() == 3 &&
                  k.stride(2) == 1 && v.stride(2) == 1 && k.sizes() == v.sizes(),
              "prefill attention: k and v are bfloat16 [L, Hkv, D], last dim contiguous");
  const int64_t n = q.size(0), hq = q.size(1), d = q.size(2), L = k.size(0), hkv = k.size(1);
  TORCH_CHECK(k.size(2) == d && d % PACK_N == 0, "prefill attention: head dim a multiple of 64, same for q and k");
  TORCH_CHECK(hkv > 0 && hq % hkv == 0 && n <= L, "prefill attention: Hq a multiple of Hkv, n <= L");
  const int64_t g = hq / hkv, tiles = (L + TILE - 1) / TILE, offset = L - n;
  const int64_t vk = split_weights ? 2 * TILE : TILE;  // the P V reduction: [p_hi | p_lo] or p_hi alone
  torch::Tensor out = at::empty({n, hq, d}, q.options());
  if (n == 0) return out;

  // Packed per KV head and tile of keys, each twice along the reduction so one GEMM sums both halves
  // of a split operand: B = [k^T; k^T] [2d, TILE] against A = [q_hi | q_lo], B = [v; v] [2 TILE, d]
  // against A = [p_hi | p_lo] (B = v [TILE, d] against p_hi when the weights are rounded once). A last
  // tile's missing keys are zeros (masked scores, weight-0 values).
  torch::Tensor kp = at::empty({hkv, tiles, 2 * d * TILE}, k.options());
  torch::Tensor vp = at::empty({hkv, tiles, vk * d}, k.options());
  const at::BFloat16 *kb = k.data_ptr<at::BFloat16>(), *vb = v.data_ptr<at::BFloat16>();
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  at::BFloat16 *kpp = kp.data_ptr<at::BFloat16>(), *vpp = vp.data_ptr<at::BFloat16>();
  at::parallel_for(0, hkv * tiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<at::BFloat16> kt(2 * d * TILE), vt(2 * TILE * d);
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / tiles, j0 = (it % tiles) * TILE, cnt = std::min(TILE, L - j0);
      std::fill(kt.begin(), kt.end(), at::BFloat16(0.f));
      std::fill(vt.begin(), vt.begin() + vk * d, at::BFloat16(0.f));
      for (int64_t j = 0; j < cnt; ++j) {
        const at::BFloat16* kr = kb + (j0 + j) * ks0 + h * ks1;
        for (int64_t c = 0; c < d; ++c) kt[c * TILE + j] = kt[(d + c) * TILE + j] = kr[c];
        std::memcpy(vt.data() + j * d, vb + (j0 + j) * vs0 + h * vs1, d * sizeof(at::BFloat16));
        if (split_weights)
          std::memcpy(vt.data() + (TILE + j) * d, vb + (j0 + j) * vs0 + h * vs1, d * sizeof(at::BFloat16));
      }
      at::BFloat16* kdst = kpp + it * 2 * d * TILE;
      for (int64_t c0 = 0; c0 < TILE; c0 += PACK_N)
        loopkv_bf16::pack_b(2 * d, PACK_N, TILE, kt.data() + c0, kdst + c0 * 2 * d);
      at::BFloat16* vdst = vpp + it * vk * d;
      for (int64_t c0 = 0; c0 < d; c0 += PACK_N) loopkv_bf16::pack_b(vk, PACK_N, d, vt.data() + c0, vdst + c0 * vk);
    }
  });

  // work items: (query head, block of rows), ordered block 0, last, 1, last - 1, ... within each head
  const int64_t blocks = (n + BLOCK_M - 1) / BLOCK_M;
  std::vector<int64_t> order(blocks);
  for (int64_t i = 0, lo = 0, hi = blocks - 1; i < blocks; ++i) order[i] = (i % 2 == 0) ? lo++ : hi--;
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const float fscale = static_cast<float>(scale), neg_inf = -std::numeric_limits<float>::infinity();

  at::parallel_for(0, hq * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint16_t> qhl(BLOCK_M * 2 * d);     // rows of [q_hi | q_lo], q pre-scaled
    std::vector<uint16_t> phl(BLOCK_M * 2 * TILE);  // rows of [p_hi | p_lo]
    std::vector<float> s(BLOCK_M * TILE), qs(d), acc(BLOCK_M * d), m(BLOCK_M), l(BLOCK_M);
    const auto* qa = reinterpret_cast<const at::BFloat16*>(qhl.data());
    const auto* pa = reinterpret_cast<const at::BFloat16*>(phl.data());
    for (int64_t it = begin; it < end; ++it) {
      const int64_t h = it / blocks, r0 = order[it % blocks] * BLOCK_M, rows = std::min(BLOCK_M, n - r0);
      const int64_t kvh = h / g;
      for (int64_t r = 0; r < rows; ++r) {
        const float* qr = qp + (r0 + r) * qs0 + h * qs1;
        for (int64_t c = 0; c < d; ++c) qs[c] = qr[c] * fscale;
        split_row(qs.data(), d, qhl.data() + r * 2 * d, qhl.data() + r * 2 * d + d);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t last_key = offset + r0 + rows;  // keys [0, last_key) are seen by some row
      for (int64_t j0 = 0; j0 < last_key; j0 += TILE) {
        const int64_t t = j0 / TILE;
        const at::BFloat16* kt = kpp + (kvh * tiles + t) * 2 * d * TILE;
        for (int64_t c0 = 0; c0 < TILE; c0 += PACK_N)
          at::native::cpublas::brgemm(rows, PACK_N, 2 * d, 2 * d, PACK_N, TILE, false, qa, kt + c0 * 2 * d,
                                      s.data() + c0);
        for (int64_t r = 0; r < rows; ++r) {
          float* sr = s.data() + r * TILE;
          const int64_t seen = std::clamp<int64_t>(offset + r0 + r + 1 - j0, 0, TILE);  // keys j0 .. j0 + seen - 1
          // the running max as a ternary: std::max's NaN ordering keeps GCC's loop scalar, a
          // latency-bound chain that cost more than the GEMMs
          float mx = m[r];
#pragma omp simd reduction(max : mx)
          for (int64_t j = 0; j < seen; ++j) mx = sr[j] > mx ? sr[j] : mx;
          // weights e = exp(s - max), summed and split into [p_hi | p_lo] in one pass; unseen keys weigh 0
          uint16_t* ph = phl.data() + r * 2 * TILE;
          uint16_t* pl = ph + TILE;
          const float sum = weights_split(sr, seen, mx, ph, split_weights ? pl : nullptr);
          std::fill(ph + seen, ph + TILE, uint16_t(0));
          if (split_weights) std::fill(pl + seen, pl + TILE, uint16_t(0));
          // a row that sees no key of this tile keeps its state (corr 1); a first seen tile starts it
          float corr = 1.f;
          if (seen > 0) {
            corr = m[r] == neg_inf ? 0.f : exp_nonpositive(m[r] - mx);
            m[r] = mx;
          }
          l[r] = l[r] * corr + sum;
          float* ar = acc.data() + r * d;
#pragma omp simd
          for (int64_t c = 0; c < d; ++c) ar[c] *= corr;
        }
        const at::BFloat16* vt = vpp + (kvh * tiles + t) * vk * d;
        for (int64_t c0 = 0; c0 < d; c0 += PACK_N)
          at::native::cpublas::brgemm(rows, PACK_N, vk, 2 * TILE, PACK_N, d, true, pa, vt + c0 * vk, acc.data() + c0);
      }
      for (int64_t r = 0; r < rows; ++r) {
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        float* o = op + (r0 + r) * hq * d + h * d;
        for (int64_t c = 0; c < d; ++c) o[c] = acc[r * d + c] * inv;
      }
    }
    at::native::cpublas::brgemm_release(true);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether oneDNN runs a bfloat16 brgemm here (AMX or AVX512-BF16)");
  m.def("flash_split", &flash_split,
        "causal attention, float32 q [n, Hq, D] over bfloat16 k, v [L, Hkv, D] -> float32 [n, Hq, D]: "
        "q split into two bfloat16 parts, the softmax weights too (split_weights) or rounded to bfloat16 once; "
        "bfloat16 GEMMs with float32 sums",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"), py::arg("split_weights") = true);
}
