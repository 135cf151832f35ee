// The linear layers of a decode step on the CPU: y = x W^T (+ b) for a few rows of x, with W's
// output features split over torch's threads.
//
// Why: for a handful of rows ATen hands a linear layer to MKL's gemv / small gemm, which runs it on
// one thread whatever torch.get_num_threads() says. A decode step streams every weight matrix from
// memory once, and one core reads memory at about half the rate of two (SmolLM2's 113 MB float32
// LM head: 10 ms on one thread, 5 ms on two). Each thread runs the same ATen call on a block of
// W's rows, so every output element is the same dot product computed the same way as by the
// unsplit call: the result is bitwise that of F.linear (tests/unit/test_decode_linear.py).

// gemv_f32: the float32 few-row case on AVX-512 without MKL. On CPUs where MKL runs its generic
// kernels (AMD EPYC here) its gemv reads weights at ~11 GB/s a thread against ~25 GB/s for a plain
// sum; a decode step is those reads. Each output is one fixed-order sum (below), so a row's result
// does not depend on the batch it is in or on the thread split; it is not F.linear's bits (MKL sums
// in its own order): closer to the float64 sum than MKL's in tests/unit/test_decode_linear.py.

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

// gemv_bf16 needs AVX512-BF16's dot product and AVX512BW's masked 16-bit loads (every CPU with the
// first has the second; -march=native is the only build, but a hand-set flag list need not be).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define LOOPKV_GEMV_BF16 1
#endif

torch::Tensor decode_linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "decode_linear runs on CPU tensors");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "decode_linear: x [M, K], w [N, K]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "decode_linear: x and w share a dtype");
  const int64_t n = w.size(0);
  torch::Tensor out = at::empty({x.size(0), n}, x.options());
  // One block of output features per thread (at::parallel_for runs it inline when it cannot fan out).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(1, (n + threads - 1) / threads);
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    c10::InferenceMode guard;  // the helper threads of the team do not inherit the caller's mode
    c10::optional<torch::Tensor> b;
    if (bias.has_value() && bias->defined()) b = bias->narrow(0, begin, end - begin);
    out.narrow(1, begin, end - begin).copy_(at::linear(x, w.narrow(0, begin, end - begin), b));
  });
  return out;
}

#ifdef __AVX512F__
// y[m] = x[m] . w[n] for MR rows of x against one row of w. The order of every output's
// sum: two accumulators of 16 lanes, k blocks of 16 alternating between them, a trailing odd block
// into the first, the masked tail (K % 16) into the second, then acc0 + acc1 and one fixed lane
// reduction. The same for any MR, so a row's result is the same in any batch. Raw float32 sums out
// (gemv_rows adds the bias).
template <int MR>
static inline void dot_rows(const float* x, int64_t K, const float* wr, float* y) {
  const int64_t k16 = K / 16 * 16;
  const __mmask16 tail = (__mmask16)((1u << (K - k16)) - 1);
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= k16; k += 32) {
    const __m512 w0 = _mm512_loadu_ps(wr + k), w1 = _mm512_loadu_ps(wr + k + 16);
    for (int m = 0; m < MR; ++m) {
      a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a0[m]);
      a1[m] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(x + m * K + k + 16), a1[m]);
    }
  }
  if (k < k16) {
    const __m512 w0 = _mm512_loadu_ps(wr + k);
    for (int m = 0; m < MR; ++m) a0[m] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(x + m * K + k), a0[m]);
  }
  if (tail) {
    const __m512 w0 = _mm512_maskz_loadu_ps(tail, wr + k16);
    for (int m = 0; m < MR; ++m) a1[m] = _mm512_fmadd_ps(w0, _mm512_maskz_loadu_ps(tail, x + m * K + k16), a1[m]);
  }
  for (int m = 0; m < MR; ++m) y[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}
#endif

#ifdef LOOPKV_GEMV_BF16
// The bfloat16 overload of dot_rows, on AVX512-BF16's dot product (vdpbf16ps: each float32 lane adds the
// exact products of one pair of bf16 elements): blocks of 32 elements alternating between two
// accumulators, a trailing odd block into the first, the masked tail (K % 32) into the second, then
// acc0 + acc1 and one fixed lane reduction, the same for any MR. Raw float32 sums out: gemv_rows
// adds the bias and rounds once to bfloat16.
template <int MR>
static inline void dot_rows(const uint16_t* x, int64_t K, const uint16_t* wr, float* y) {
  const int64_t k32 = K / 32 * 32;
  const __mmask32 tail = (__mmask32)((1ull << (K - k32)) - 1);
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 64 <= k32; k += 64) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k), w1 = (__m512bh)_mm512_loadu_si512(wr + k + 32);
    for (int m = 0; m < MR; ++m) {
      a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
      a1[m] = _mm512_dpbf16_ps(a1[m], w1, (__m512bh)_mm512_loadu_si512(x + m * K + k + 32));
    }
  }
  if (k < k32) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(wr + k);
    for (int m = 0; m < MR; ++m) a0[m] = _mm512_dpbf16_ps(a0[m], w0, (__m512bh)_mm512_loadu_si512(x + m * K + k));
  }
  if (tail) {
    const __m512bh w0 = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + k32);
    for (int m = 0; m < MR; ++m)
      a1[m] = _mm512_dpbf16_ps(a1[m], w0, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + m * K + k32));
  }
  for (int m = 0; m < MR; ++m) y[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}
#endif

#ifdef __AVX512F__
// y[M, N] = x W^T (+ b) for a few rows of x, either dtype: W's rows split over torch's threads, each
// weight row read once from memory and used for every row of x (4 at a time) while it is in L1; the
// bias added to each float32 sum and the result converted once to the output type.
template <typename E, typename O>
static void gemv_rows(const E* xp, const E* wp, const float* bp, O* yp, int64_t M, int64_t K, int64_t N) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(64, (N + threads - 1) / threads);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    float y[4];
    for (int64_t n = n0; n < n1; ++n) {
      const E* wr = wp + n * K;
      const float bn = bp ? bp[n] : 0.f;
      for (int64_t m = 0; m < M;) {
        const int64_t mr = std::min<int64_t>(4, M - m);
        switch (mr) {
          case 4: dot_rows<4>(xp + m * K, K, wr, y); break;
          case 3: dot_rows<3>(xp + m * K, K, wr, y); break;
          case 2: dot_rows<2>(xp + m * K, K, wr, y); break;
          default: dot_rows<1>(xp + m * K, K, wr, y); break;
        }
        for (int64_t i = 0; i < mr; ++i) yp[(m + i) * N + n] = O(y[i] + bn);  // bf16: one rounding (RNE)
        m += mr;
      }
    }
  });
}
#endif

bool has_gemv() {
#ifdef __AVX512F__
  return true;
#else
  return false;
#endif
}

torch::Tensor gemv_f32(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#ifdef __AVX512F__
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_f32 runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat, "gemv_f32: float32 operands");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_f32: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv_f32: contiguous operands");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == N, "gemv_f32: bias [N], float32");
    b = bias->contiguous();
  }
  torch::Tensor out = at::empty({M, N}, x.options());
  gemv_rows(x.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
            out.data_ptr<float>(), M, K, N);
  return out;
#else
  TORCH_CHECK(false, "gemv_f32 needs AVX-512 (has_gemv() is false here)");
#endif
}

bool has_gemv_bf16() {
#ifdef LOOPKV_GEMV_BF16
  return true;
#else
  return false;
#endif
}

torch::Tensor gemv_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
#ifdef LOOPKV_GEMV_BF16
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "gemv_bf16 runs on CPU tensors");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16, "gemv_bf16: bfloat16 operands");
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv_bf16: x [M, K], w [N, K]");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous(), "gemv_bf16: contiguous operands");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  torch::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == N, "gemv_bf16: bias [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  torch::Tensor out = at::empty({M, N}, x.options());
  gemv_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
            reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), b.defined() ? b.data_ptr<float>() : nullptr,
            out.data_ptr<at::BFloat16>(), M, K, N);
  return out;
#else
  TORCH_CHECK(false, "gemv_bf16 needs AVX512-BF16 and AVX512BW (has_gemv_bf16() is false here)");
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_linear", &decode_linear, "x @ w.T (+ bias) for a few rows, w's rows split over torch's threads");
  m.def("has_gemv", &has_gemv, "whether gemv_f32 was compiled (AVX-512)");
  m.def("gemv_f32", &gemv_f32, "x @ w.T (+ bias), float32, few rows, one fixed summation order per output");
  m.def("has_gemv_bf16", &has_gemv_bf16, "whether gemv_bf16 was compiled (AVX512-BF16)");
  m.def("gemv_bf16", &gemv_bf16, "x @ w.T (+ bias), bfloat16, few rows, float32 sums in one fixed order");
}
