// The linear layers of a decode step on the CPU: y = x W^T (+ b) for a few rows of x, with W's
// output features split over torch's threads.
//
// Why: for a handful of rows ATen hands a linear layer to MKL's gemv / small gemm, which runs it on
// one thread whatever torch.get_num_threads() says. A decode step streams every weight matrix from
// memory once, and one core reads memory at about half the rate of two (SmolLM2's 113 MB float32
// LM head: 10 ms on one thread, 5 ms on two). Each thread runs the same ATen call on a block of
// W's rows, so every output element is the same dot product computed the same way as by the
// unsplit call: the result is bitwise that of F.linear (tests/unit/test_decode_linear.py).

// gemv_f32: the float32 case of up to a few dozen rows on AVX-512 without MKL. On CPUs where MKL runs
// its generic kernels (AMD EPYC here) its gemv reads weights at ~11 GB/s a thread against ~25 GB/s for
// a plain sum; a decode step is those reads. With more rows (decode batches, a short turn's extend)
// the FMAs bound it, and a register tile over both operands (dot_tile) beats MKL's small gemm up to
// ~32 rows. Each output is one fixed-order sum (below), so a row's result does not depend on the batch
// it is in or on the thread split; it is not F.linear's bits (MKL sums in its own order): closer to
// the float64 sum than MKL's in tests/unit/test_decode_linear.py.

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
// Per dtype, the vector steps of one output's dot product: a block of B elements of w and of x into
// 16 float32 lanes.
struct F32 {
  using E = float;
  using V = __m512;
  using Mask = __mmask16;
  static constexpr int B = 16;
  static V load(const E* p) { return _mm512_loadu_ps(p); }
  static V load(Mask t, const E* p) { return _mm512_maskz_loadu_ps(t, p); }
  static __m512 fma(__m512 acc, V w, V x) { return _mm512_fmadd_ps(w, x, acc); }
};
#endif

#ifdef LOOPKV_GEMV_BF16
// vdpbf16ps: each float32 lane adds the exact products of one pair of bf16 elements.
struct BF16 {
  using E = uint16_t;
  using V = __m512bh;
  using Mask = __mmask32;
  static constexpr int B = 32;
  static V load(const E* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static V load(Mask t, const E* p) { return (__m512bh)_mm512_maskz_loadu_epi16(t, p); }
  static __m512 fma(__m512 acc, V w, V x) { return _mm512_dpbf16_ps(acc, w, x); }
};
#endif

#ifdef __AVX512F__
// Every output is one float32 sum in one order, whatever kernel below computes it: two accumulators of
// 16 lanes, blocks of B elements alternating between them (even blocks into the first, odd into the
// second), the masked tail (K % B) last into the second, then acc0 + acc1 and one fixed lane
// reduction. So a row's result is the same in any batch, on any thread split and through either
// kernel (tests/unit/test_decode_linear.py).

// One row of w against MR rows of x, one pass over K with both accumulators live: the few-row calls,
// which memory bounds (one sequential stream per weight row, what the hardware prefetcher follows best).
template <class T, int MR>
static inline void dot_stream(const typename T::E* x, int64_t K, const typename T::E* w, float* y) {
  constexpr int B = T::B;
  const int64_t kb = K / B * B;
  const typename T::Mask tail = (typename T::Mask)((1ull << (K - kb)) - 1);
  __m512 a0[MR], a1[MR];
  for (int m = 0; m < MR; ++m) a0[m] = a1[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 2 * B <= kb; k += 2 * B) {
    const typename T::V w0 = T::load(w + k), w1 = T::load(w + k + B);
    for (int m = 0; m < MR; ++m) {
      a0[m] = T::fma(a0[m], w0, T::load(x + m * K + k));
      a1[m] = T::fma(a1[m], w1, T::load(x + m * K + k + B));
    }
  }
  if (k < kb) {
    const typename T::V w0 = T::load(w + k);
    for (int m = 0; m < MR; ++m) a0[m] = T::fma(a0[m], w0, T::load(x + m * K + k));
  }
  if (tail) {
    const typename T::V w0 = T::load(tail, w + kb);
    for (int m = 0; m < MR; ++m) a1[m] = T::fma(a1[m], w0, T::load(tail, x + m * K + kb));
  }
  for (int m = 0; m < MR; ++m) y[m] = _mm512_reduce_add_ps(_mm512_add_ps(a0[m], a1[m]));
}

// Keeps v in a register: without it GCC folds a load into each FMA that uses it (NR or MR loads where
// one does), and the loads, not the FMAs, bound the loop.
template <typename V>
static inline void pin(V& v) {
  asm volatile("" : "+v"(v));
}

// acc[j][m] += w[j] . x[m] over the blocks at k0, k0 + 2B, ... below kb, prefetching the same blocks of
// the rows at pf (a later tile of w) into L2 when pf is set.
template <class T, int NR, int MR>
static inline void every_other_block(const typename T::E* x, int64_t K, const typename T::E* w, int64_t k0, int64_t kb,
                                     __m512 (&acc)[NR][MR], const typename T::E* pf) {
  for (int64_t k = k0; k + T::B <= kb; k += 2 * T::B) {
    if (pf)
      for (int j = 0; j < NR; ++j) _mm_prefetch((const char*)(pf + j * K + k), _MM_HINT_T1);
    typename T::V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = T::load(w + j * K + k), pin(wv[j]);
    for (int m = 0; m < MR; ++m) {
      typename T::V xv = T::load(x + m * K + k);
      pin(xv);
      for (int j = 0; j < NR; ++j) acc[j][m] = T::fma(acc[j][m], wv[j], xv);
    }
  }
}

// y[m * NR + j] = x[m] . w[j] for a tile of MR rows of x and NR rows of w: the calls with more rows,
// which the FMAs bound. Each x block loaded feeds NR weight rows and each w block MR rows of x; with one
// weight row at a time all of x streamed from L2 for every weight row (16 rows: 53 ms a SmolLM2 step
// against ~35 ms tiled). The even blocks, then the odd ones (2 x NR x MR accumulators live would spill).
template <class T, int NR, int MR>
static inline void dot_tile(const typename T::E* x, int64_t K, const typename T::E* w, float* y,
                            const typename T::E* pf) {
  const int64_t kb = K / T::B * T::B;
  const typename T::Mask tail = (typename T::Mask)((1ull << (K - kb)) - 1);
  __m512 a0[NR][MR], a1[NR][MR];
  for (int j = 0; j < NR; ++j)
    for (int m = 0; m < MR; ++m) a0[j][m] = a1[j][m] = _mm512_setzero_ps();
  every_other_block<T, NR, MR>(x, K, w, 0, kb, a0, pf);
  every_other_block<T, NR, MR>(x, K, w, T::B, kb, a1, pf);
  if (tail) {
    typename T::V wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = T::load(tail, w + j * K + kb);
    for (int m = 0; m < MR; ++m) {
      const typename T::V xv = T::load(tail, x + m * K + kb);
      for (int j = 0; j < NR; ++j) a1[j][m] = T::fma(a1[j][m], wv[j], xv);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int j = 0; j < NR; ++j) y[m * NR + j] = _mm512_reduce_add_ps(_mm512_add_ps(a0[j][m], a1[j][m]));
}

constexpr int STREAM_ROWS = 2;  // up to here dot_stream (as fast or faster at 1-2 rows, slower from 4)
constexpr int TILE_W = 4;       // weight rows per tile
constexpr int TILE_X = 4;       // rows of x per tile (5-6: no faster)
constexpr int PREFETCH_TILES = 4;  // how far ahead a tile's rows are prefetched (1: 16 rows 38 ms, 4: 34)

// Every row of x (TILE_X at a time) against the NR rows of w at wr (output features n ...): bias added,
// converted once to O. The first pass over the tile prefetches the rows at pf.
template <class T, int NR, typename O>
static inline void tile_rows(const typename T::E* xp, const typename T::E* wr, const float* bp, O* yp, int64_t n,
                             int64_t M, int64_t K, int64_t N, const typename T::E* pf) {
  float y[TILE_X * NR];
  for (int64_t m = 0; m < M; m += TILE_X) {
    const int64_t mr = std::min<int64_t>(TILE_X, M - m);
    const typename T::E* p = m == 0 ? pf : nullptr;
    switch (mr) {
      case 4: dot_tile<T, NR, 4>(xp + m * K, K, wr, y, p); break;
      case 3: dot_tile<T, NR, 3>(xp + m * K, K, wr, y, p); break;
      case 2: dot_tile<T, NR, 2>(xp + m * K, K, wr, y, p); break;
      default: dot_tile<T, NR, 1>(xp + m * K, K, wr, y, p); break;
    }
    for (int64_t i = 0; i < mr; ++i)
      for (int j = 0; j < NR; ++j) yp[(m + i) * N + n + j] = O(y[i * NR + j] + (bp ? bp[n + j] : 0.f));  // bf16: RNE
  }
}

// y[M, N] = x W^T (+ b), either dtype, W's rows split over torch's threads (in whole tiles); the bias
// added to each float32 sum and the result converted once to the output type.
template <class T, typename O>
static void gemv_rows(const typename T::E* xp, const typename T::E* wp, const float* bp, O* yp, int64_t M, int64_t K,
                      int64_t N) {
  static_assert(TILE_X == 4, "tile_rows dispatches 1-4 rows of x");
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t grain = std::max<int64_t>(64, ((N + threads - 1) / threads + TILE_W - 1) / TILE_W * TILE_W);
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    if (M <= STREAM_ROWS) {
      float y[STREAM_ROWS];
      for (int64_t n = n0; n < n1; ++n) {
        if (M == 2) dot_stream<T, 2>(xp, K, wp + n * K, y);
        else dot_stream<T, 1>(xp, K, wp + n * K, y);
        for (int64_t i = 0; i < M; ++i) yp[i * N + n] = O(y[i] + (bp ? bp[n] : 0.f));
      }
      return;
    }
    int64_t n = n0;
    for (; n + TILE_W <= n1; n += TILE_W) {
      const int64_t ahead = n + PREFETCH_TILES * TILE_W;
      tile_rows<T, TILE_W>(xp, wp + n * K, bp, yp, n, M, K, N, ahead + TILE_W <= n1 ? wp + ahead * K : nullptr);
    }
    for (; n < n1; ++n) tile_rows<T, 1>(xp, wp + n * K, bp, yp, n, M, K, N, nullptr);
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
  gemv_rows<F32>(x.data_ptr<float>(), w.data_ptr<float>(), b.defined() ? b.data_ptr<float>() : nullptr,
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
  gemv_rows<BF16>(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()),
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
