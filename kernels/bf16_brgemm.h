// oneDNN's bfloat16 batch-reduce GEMM (at::native::cpublas::brgemm) on this CPU: how its B operand must
// be laid out, probed once per process. Shared by gguf_linear.cpp and prefill_attention.cpp (ninja's
// header dependencies rebuild both when it changes).
//
// torch's oneDNN packs bfloat16 (cpublas::pack) only for AMX, but its brgemm also runs on AVX512-BF16's
// dot products (vdpbf16ps: a pair of bfloat16 products summed into float32) when B is in their pair
// ("VNNI") layout [K/2][N][2]. A product checked against its exact value decides, so a CPU or oneDNN
// that runs neither takes the caller's float32 path rather than an error or wrong sums.
#pragma once

#include <ATen/native/CPUBlas.h>

#include <exception>
#include <vector>

namespace loopkv_bf16 {

enum class Layout { kNone, kPacked, kPairs };

inline Layout probe_layout() {
  if (at::native::cpublas::could_pack(at::kBFloat16)) return Layout::kPacked;
  constexpr int64_t K = 4, N = 64;
  std::vector<at::BFloat16> a(K), b(K / 2 * N * 2);
  std::vector<float> c(N, 0.f);
  for (int64_t k = 0; k < K; ++k) a[k] = at::BFloat16(static_cast<float>(k + 1));
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) b[(k / 2 * N + n) * 2 + k % 2] = at::BFloat16(static_cast<float>(n - k));
  try {
    at::native::cpublas::brgemm(1, N, K, K, N, N, false, a.data(), b.data(), c.data(), true);
    at::native::cpublas::brgemm_release(true);
  } catch (const std::exception&) {
    return Layout::kNone;
  }
  for (int64_t n = 0; n < N; ++n) {
    float want = 0.f;
    for (int64_t k = 0; k < K; ++k) want += static_cast<float>((k + 1) * (n - k));  // small integers: exact
    if (c[n] != want) return Layout::kNone;
  }
  return Layout::kPairs;
}

inline Layout layout() {
  static const Layout chosen = probe_layout();
  return chosen;
}

inline bool available() { return layout() != Layout::kNone; }

// B [K, N] (leading dimension ld) into what brgemm reads: oneDNN's packing, or the pair layout
// (element (k, n) at ((k / 2) * N + n) * 2 + k % 2). N is a leading dimension oneDNN packs (64).
inline void pack_b(int64_t K, int64_t N, int64_t ld, const at::BFloat16* src, at::BFloat16* dst) {
  if (layout() == Layout::kPacked) {
    at::native::cpublas::pack(K, N, ld, N, at::kBFloat16, at::kBFloat16, src, dst);
    return;
  }
  for (int64_t k = 0; k < K; ++k)
    for (int64_t n = 0; n < N; ++n) dst[((k >> 1) * N + n) * 2 + (k & 1)] = src[k * ld + n];
}

}  // namespace loopkv_bf16
