// The linear layers of a decode step on the CPU: y = x W^T (+ b) for a few rows of x, with W's
// output features split over torch's threads.
//
// Why: for a handful of rows ATen hands a linear layer to MKL's gemv / small gemm, which runs it on
// one thread whatever torch.get_num_threads() says. A decode step streams every weight matrix from
// memory once, and one core reads memory at about half the rate of two (SmolLM2's 113 MB float32
// LM head: 10 ms on one thread, 5 ms on two). Each thread runs the same ATen call on a block of
// W's rows, so every output element is the same dot product computed the same way as by the
// unsplit call: the result is bitwise that of F.linear (tests/unit/test_decode_linear.py).

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_linear", &decode_linear, "x @ w.T (+ bias) for a few rows, w's rows split over torch's threads");
}
