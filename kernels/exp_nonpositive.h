// exp(x) for x <= 0 (scores minus their running max), written so the compiler vectorizes the loop
// that calls it: Cody-Waite range reduction and a degree-6 polynomial (relative error ~2e-7, like
// expf). std::exp is a scalar call per score and dominated the attention kernels' compute. Shared by
// paged_decode.cpp and prefill_attention.cpp (packaged with them, a change rebuilds both).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

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
