// The element-wise steps of a Llama layer on the CPU, one call each: RMSNorm (with the residual add),
// the neox rotary embedding of the query and key heads, and SiLU(gate) * up.
//
// Why: on the GGUF path a decode step's matrices stream a quarter of float32's bytes, and what is left
// around them is SGLang's torch composition of these steps: five to seven tensor ops per norm, four per
// rotary embedding, three per activation, each a dispatch and a temporary for one 576-wide row. Per
// step that cost about as much as every matrix of the layer stack together. Here each step is one call
// that reads its input once and writes its output once.
//
// Numbers: float32 in and out. The rotary embedding is the same products and sums as SGLang's
// forward_native, each rounded once (compiled with -ffp-contract=off: no fused multiply-add), so its
// results are bitwise torch's. The norm's sum of squares runs in 16 float lanes summed in double, not
// torch's reduction order, and SiLU takes a polynomial exp (exp_poly), not torch's vectorised one: both
// within float32 rounding of torch (tests/unit/test_layer_ops.py), which is why the float32 path, whose contract is
// bitwise SGLang's forward, keeps torch's ops and only the GGUF path calls these.
//
// Rows are independent and split over torch's threads from a size on; a row's result does not depend
// on the batch around it.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

constexpr int64_t PARALLEL_MIN_ELEMENTS = 1 << 15;  // below this a call stays on the calling thread

int64_t grain(int64_t row_elements) { return std::max<int64_t>(1, PARALLEL_MIN_ELEMENTS / row_elements); }

void check_matrix(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat32, what, ": a float32 CPU tensor");
  TORCH_CHECK(t.dim() == 2 && t.stride(1) == 1, what, ": [rows, columns] with contiguous rows");
}

// out = r * (1 / sqrt(mean(r^2) + eps)) * w for one row r of h elements.
inline void norm_row(const float* r, const float* w, float eps, int64_t h, float* out) {
  float lanes[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= h; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += r[i + j] * r[i + j];
  double sum = 0;
  for (int j = 0; j < 16; ++j) sum += lanes[j];
  for (; i < h; ++i) sum += static_cast<double>(r[i]) * r[i];
  const float inv = 1.0f / std::sqrt(static_cast<float>(sum / h) + eps);
  for (int64_t k = 0; k < h; ++k) out[k] = (r[k] * inv) * w[k];
}

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_matrix(x, "x");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h && weight.scalar_type() == torch::kFloat32,
              "weight: float32 [hidden]");
  auto out = torch::empty({n, h}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0);
  at::parallel_for(0, n, grain(h), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) norm_row(xp + row * xs, wp, static_cast<float>(eps), h, op + row * h);
  });
  return out;
}

// residual' = x + residual; out = rms_norm(residual'). Returns (out, residual').
std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& residual,
                                                      const torch::Tensor& weight, double eps) {
  check_matrix(x, "x");
  check_matrix(residual, "residual");
  const int64_t n = x.size(0), h = x.size(1);
  TORCH_CHECK(residual.size(0) == n && residual.size(1) == h, "residual: the shape of x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == h && weight.scalar_type() == torch::kFloat32,
              "weight: float32 [hidden]");
  auto out = torch::empty({n, h}, x.options());
  auto sum = torch::empty({n, h}, x.options());
  const float *xp = x.data_ptr<float>(), *rp = residual.data_ptr<float>(), *wp = weight.data_ptr<float>();
  float *op = out.data_ptr<float>(), *sp = sum.data_ptr<float>();
  const int64_t xs = x.stride(0), rs = residual.stride(0);
  at::parallel_for(0, n, grain(h), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      float* s = sp + row * h;
      const float *a = xp + row * xs, *c = rp + row * rs;
      for (int64_t k = 0; k < h; ++k) s[k] = a[k] + c[k];
      norm_row(s, wp, static_cast<float>(eps), h, op + row * h);
    }
  });
  return {out, sum};
}

// The first q_heads + kv_heads heads of each row of qkv rotated (neox: the halves of a head pair up), with
// the cos | sin row of each position from cos_sin [positions, head_dim]. Returns (q [n, q_heads * d],
// k [n, kv_heads * d]), contiguous.
std::tuple<torch::Tensor, torch::Tensor> rope_neox(const torch::Tensor& qkv, const torch::Tensor& positions,
                                                   const torch::Tensor& cos_sin, int64_t q_heads, int64_t kv_heads,
                                                   int64_t head_dim) {
  check_matrix(qkv, "qkv");
  check_matrix(cos_sin, "cos_sin");
  TORCH_CHECK(cos_sin.size(1) == head_dim && head_dim % 2 == 0, "cos_sin: [positions, head_dim]");
  TORCH_CHECK(cos_sin.stride(0) == head_dim, "cos_sin: contiguous");
  TORCH_CHECK(qkv.size(1) >= (q_heads + kv_heads) * head_dim, "qkv: narrower than the rotated heads");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == qkv.size(0),
              "positions: int64, one per row");
  const int64_t n = qkv.size(0), half = head_dim / 2, limit = cos_sin.size(0);
  auto q = torch::empty({n, q_heads * head_dim}, qkv.options());
  auto k = torch::empty({n, kv_heads * head_dim}, qkv.options());
  const float *src = qkv.data_ptr<float>(), *cs = cos_sin.data_ptr<float>();
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t row = 0; row < n; ++row)
    TORCH_CHECK(pos[row] >= 0 && pos[row] < limit, "position ", pos[row], " outside the rotary cache");
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  const int64_t stride = qkv.stride(0);
  at::parallel_for(0, n, grain((q_heads + kv_heads) * head_dim), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const float *cos = cs + pos[row] * head_dim, *sin = cos + half;
      for (int64_t head = 0; head < q_heads + kv_heads; ++head) {
        const float* x = src + row * stride + head * head_dim;
        float* y = head < q_heads ? qp + (row * q_heads + head) * head_dim
                                  : kp + (row * kv_heads + head - q_heads) * head_dim;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[half + i];
          y[i] = x1 * cos[i] - x2 * sin[i];
          y[half + i] = x2 * cos[i] + x1 * sin[i];
        }
      }
    }
  });
  return {q, k};
}

// e^x in float32 without a library call, so that the loop below vectorises: Cephes' expf (a degree-6
// polynomial on x - n ln 2 with n = round(x / ln 2), ln 2 split in two, times 2^n built in the exponent
// bits), about one unit in the last place. Branch-free: past the float range the result is inf or 0.
// exp_nonpositive.h (the attention kernels') is the same polynomial for x <= 0 only; this one also takes
// x > 0 (silu of a negative gate) and the clamp differs, so it stays its own.
inline float exp_poly(float x) {
  const float xc = std::min(std::max(x, -87.0f), 88.0f);
  const float n = (xc * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (xc - n * 0.693359375f) - n * -2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  const float e = y * scale;
  return x > 88.72f ? std::numeric_limits<float>::infinity() : (x < -87.0f ? 0.0f : e);
}

// silu(gate) * up for gate_up = [gate | up] per row; returns [n, columns / 2].
torch::Tensor silu_mul(const torch::Tensor& gate_up) {
  check_matrix(gate_up, "gate_up");
  const int64_t n = gate_up.size(0), width = gate_up.size(1) / 2;
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up: an even number of columns");
  auto out = torch::empty({n, width}, gate_up.options());
  const float* src = gate_up.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  const int64_t stride = gate_up.stride(0);
  at::parallel_for(0, n, grain(2 * width), [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const float *g = src + row * stride, *u = g + width;
      float* y = dst + row * width;
      for (int64_t i = 0; i < width; ++i) y[i] = g[i] / (1.0f + exp_poly(-g[i])) * u[i];
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of each row (float32)");
  m.def("add_rms_norm", &add_rms_norm, "(rms_norm(x + residual), x + residual)");
  m.def("rope_neox", &rope_neox, "neox rotary embedding of the query and key heads: (q, k)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of [gate | up] rows");
}
