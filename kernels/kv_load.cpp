// A restored history's layer into the CPU KV pool: row i of the stored K and V goes to pool slot
// slots[i], decoded on the way when the tier keeps it as int8 (value = q * scale, one scale per
// token and KV head). The loader thread runs this once per layer beside the forward.
//
// Why not torch: an int8 layer went through torch.mul into a layer-sized float32 temporary and then
// index_copy_ into the pool, so each byte of the pool was written twice and read once more; here
// each stored byte is read once and each pool byte written once, the decode in registers. The GIL
// is released for the call. load_layer copies one layer on the calling thread (a loader thread
// beside the forward must not take the forward's cores); load_layers copies every layer of every
// part, in pieces of rows split over torch's threads (a resume that loads before its forward).
//
// Pools: float32 or bfloat16. Exactness: a row stored in the pool's dtype is copied bit for bit; an
// int8 element becomes float(q) * scale rounded once, the product torch.mul(int8, float32) computes,
// then (a bfloat16 pool) rounded to nearest even as torch's cast does (tests/unit/test_kv_load.py).
//
// Stores: a layer of a restored history is larger than the caches, so ordinary stores first read
// every destination line into the cache (read-for-ownership) only to overwrite it, and evict it
// later. Streaming (non-temporal) stores write the lines straight out: a load of a few MB or more
// writes about half the memory traffic; a small one (a few pages) keeps ordinary stores, whose lines
// the forward reads next while they are still in the cache.

#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 3, what, ": a CPU tensor [T, H, D]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == t.size(2), what, ": each token's [H, D] contiguous");
}

constexpr int64_t STREAM_MIN_BYTES = 2 << 20;  // pool bytes a call writes from which its stores stream

#ifdef __AVX512F__
bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }
#endif

// n bytes from src to dst; streamed where asked and dst is 64-byte aligned (pool rows of a multiple of
// 64 bytes are, from a 64-byte aligned buffer).
void copy_bytes(char* dst, const char* src, int64_t n, bool stream) {
#ifdef __AVX512F__
  if (stream && aligned64(dst)) {
    int64_t i = 0;
    for (; i + 64 <= n; i += 64)
      _mm512_stream_si512(reinterpret_cast<__m512i*>(dst + i), _mm512_loadu_si512(reinterpret_cast<const void*>(src + i)));
    if (i < n) std::memcpy(dst + i, src + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// The pool's element type an int8 row decodes into: float(q) * scale, rounded once more to bfloat16
// (nearest even, as torch's float -> bfloat16 cast; integer arithmetic, so a subnormal product keeps
// its bits where the hardware conversion would flush it, and the decode is bound by the pool's writes
// either way; NaN, which no quantized head holds, is not canonicalised as torch does).
template <typename T>
struct Decoded;

template <>
struct Decoded<float> {
  static float one(float x) { return x; }
#ifdef __AVX512F__
  static constexpr int64_t kBytes = 64;
  static void put(float* out, __m512 x, bool stream) {
    if (stream) _mm512_stream_ps(out, x);
    else _mm512_storeu_ps(out, x);
  }
#endif
};

template <>
struct Decoded<c10::BFloat16> {
  static c10::BFloat16 one(float x) { return c10::BFloat16(x); }
#ifdef __AVX512F__
  static constexpr int64_t kBytes = 32;
  static void put(c10::BFloat16* out, __m512 x, bool stream) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    const __m256i h = _mm512_cvtepi32_epi16(r);
    if (stream) _mm256_stream_si256(reinterpret_cast<__m256i*>(out), h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), h);
  }
#endif
};

template <typename T>
void dequant_row(const int8_t* q, const float* scale, T* out, int64_t heads, int64_t dim, bool stream) {
  for (int64_t h = 0; h < heads; ++h) {
    const float s = scale[h];
    const int8_t* qh = q + h * dim;
    T* oh = out + h * dim;
    int64_t d = 0;
#ifdef __AVX512F__
    const __m512 vs = _mm512_set1_ps(s);
    // streamed stores need each 16-element store aligned to its own size
    const bool st = stream && (reinterpret_cast<uintptr_t>(oh) % Decoded<T>::kBytes) == 0;
    for (; d + 16 <= dim; d += 16) {
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + d));
      Decoded<T>::put(oh + d, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vs), st);
    }
#endif
    for (; d < dim; ++d) oh[d] = Decoded<T>::one(static_cast<float>(qh[d]) * s);
  }
}

// Streamed stores are weakly ordered: fence them before another thread may read the pool.
void fence_streamed() {
#ifdef __AVX512F__
  _mm_sfence();
#endif
}

bool pool_dtype(const torch::Tensor& t) {
  return t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16;
}

// The pool bytes loading these rows writes.
int64_t pool_bytes(const torch::Tensor& src, const torch::Tensor& dst) {
  return src.numel() * static_cast<int64_t>(dst.element_size());
}

template <typename T>
void decode_rows(const torch::Tensor& src, const torch::Tensor& sc, const int64_t* slots, torch::Tensor& dst,
                 int64_t r0, int64_t r1, bool stream) {
  const int64_t heads = src.size(1), dim = src.size(2), width = heads * dim;
  const int8_t* q = src.data_ptr<int8_t>();
  const float* s = sc.data_ptr<float>();
  T* out = dst.data_ptr<T>();
  for (int64_t i = r0; i < r1; ++i)
    dequant_row<T>(q + i * src.stride(0), s + i * sc.stride(0), out + slots[i] * width, heads, dim, stream);
}

void check_slots(const torch::Tensor& src, const int64_t* slots, const torch::Tensor& dst) {
  const int64_t n = src.size(0), capacity = dst.size(0);
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slots[i] >= 0 && slots[i] < capacity, "kv_load: slot out of range");
}

void check_scale(const torch::Tensor& src, const c10::optional<torch::Tensor>& scale) {
  if (src.scalar_type() == torch::kChar) {
    TORCH_CHECK(scale.has_value(), "kv_load: rows in the pool's dtype, or int8 with their scales");
    const torch::Tensor& sc = *scale;
    TORCH_CHECK(sc.scalar_type() == torch::kFloat && sc.dim() == 2 && sc.size(0) == src.size(0) &&
                    sc.size(1) == src.size(1) && sc.stride(1) == 1,
                "kv_load: scales [T, H] float32");
  }
}

// Rows [r0, r1) of one layer's K or V (checked: check_slots, check_scale).
void rows(const torch::Tensor& src, const c10::optional<torch::Tensor>& scale, const int64_t* slots, torch::Tensor& dst,
          int64_t r0, int64_t r1, bool stream) {
  if (src.scalar_type() == dst.scalar_type()) {  // stored as the pool keeps it: bytes copied
    const int64_t row = src.size(1) * src.size(2) * dst.element_size();
    const char* in = static_cast<const char*>(src.data_ptr());
    char* out = static_cast<char*>(dst.data_ptr());
    const int64_t stride = src.stride(0) * src.element_size();
    for (int64_t i = r0; i < r1;) {  // a run of consecutive slots from consecutive rows is one copy
      int64_t j = i + 1;
      while (j < r1 && slots[j] == slots[j - 1] + 1 && stride == row) ++j;
      copy_bytes(out + slots[i] * row, in + i * stride, row * (j - i), stream);
      i = j;
    }
  } else if (dst.scalar_type() == torch::kFloat) {
    decode_rows<float>(src, *scale, slots, dst, r0, r1, stream);
  } else {
    decode_rows<c10::BFloat16>(src, *scale, slots, dst, r0, r1, stream);
  }
  if (stream) fence_streamed();
}

void one(const torch::Tensor& src, const c10::optional<torch::Tensor>& scale, const int64_t* slots,
         torch::Tensor& dst, bool stream) {
  check_slots(src, slots, dst);
  TORCH_CHECK(src.scalar_type() == dst.scalar_type() || src.scalar_type() == torch::kChar,
              "kv_load: rows in the pool's dtype, or int8 with their scales");
  check_scale(src, scale);
  rows(src, scale, slots, dst, 0, src.size(0), stream);
}

// Rows of a layer a work item of load_layers copies: the layers of a resume's parts differ in length
// (a long history and a short last turn), so work is split by rows, not by layer.
constexpr int64_t ROWS_PER_ITEM = 512;

}  // namespace

// k_src, v_src: [T, H, D] in the pool's dtype, or int8 (then k_scale, v_scale [T, H] float32); slots [T]
// int64; k_dst, v_dst: the pool's [S, H, D] float32 or bfloat16 layer buffers.
void load_layer(torch::Tensor k_src, torch::Tensor v_src, c10::optional<torch::Tensor> k_scale,
                c10::optional<torch::Tensor> v_scale, torch::Tensor slots, torch::Tensor k_dst, torch::Tensor v_dst) {
  check_rows(k_src, "k_src");
  check_rows(v_src, "v_src");
  check_rows(k_dst, "k_dst");
  check_rows(v_dst, "v_dst");
  TORCH_CHECK(pool_dtype(k_dst) && v_dst.scalar_type() == k_dst.scalar_type(), "kv_load: a float32 or bfloat16 pool");
  TORCH_CHECK(k_dst.stride(0) == k_dst.size(1) * k_dst.size(2) && v_dst.stride(0) == v_dst.size(1) * v_dst.size(2),
              "kv_load: contiguous pool buffers");
  TORCH_CHECK(k_src.sizes() == v_src.sizes() && k_src.size(1) == k_dst.size(1) && k_src.size(2) == k_dst.size(2),
              "kv_load: K, V and the pool share [H, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.size(0) == k_src.size(0),
              "kv_load: slots [T] int64");
  const int64_t* sl = slots.data_ptr<int64_t>();
  const bool stream = 2 * pool_bytes(k_src, k_dst) >= STREAM_MIN_BYTES;
  one(k_src, k_scale, sl, k_dst, stream);
  one(v_src, v_scale, sl, v_dst, stream);
}

// Every layer of every part at once, split by rows over torch's threads: what a CPU resume runs on
// the scheduler thread before the forward (cache/loader.py says why not beside it). Arguments as
// load_layer's, one list entry per layer (empty scale lists for rows in the pool's dtype).
void load_layers(std::vector<torch::Tensor> k_src, std::vector<torch::Tensor> v_src, std::vector<torch::Tensor> k_scale,
                 std::vector<torch::Tensor> v_scale, std::vector<torch::Tensor> slots, std::vector<torch::Tensor> k_dst,
                 std::vector<torch::Tensor> v_dst) {
  const int64_t n = static_cast<int64_t>(k_src.size());
  TORCH_CHECK(v_src.size() == k_src.size() && slots.size() == k_src.size() && k_dst.size() == k_src.size() &&
                  v_dst.size() == k_src.size(),
              "kv_load: one entry per layer in every list");
  const bool quant = !k_scale.empty();
  TORCH_CHECK(!quant || (k_scale.size() == k_src.size() && v_scale.size() == k_src.size()), "kv_load: one scale per layer");
  // checks first, on this thread: a TORCH_CHECK must not throw inside the parallel region
  for (int64_t i = 0; i < n; ++i) {
    check_rows(k_src[i], "k_src");
    check_rows(v_src[i], "v_src");
    check_rows(k_dst[i], "k_dst");
    check_rows(v_dst[i], "v_dst");
    TORCH_CHECK(pool_dtype(k_dst[i]) && v_dst[i].scalar_type() == k_dst[i].scalar_type(),
                "kv_load: a float32 or bfloat16 pool");
    TORCH_CHECK(k_src[i].sizes() == v_src[i].sizes() && k_src[i].size(1) == k_dst[i].size(1) &&
                    k_src[i].size(2) == k_dst[i].size(2) && k_dst[i].is_contiguous() && v_dst[i].is_contiguous(),
                "kv_load: K, V and a contiguous pool share [H, D]");
    TORCH_CHECK(slots[i].scalar_type() == torch::kLong && slots[i].dim() == 1 && slots[i].is_contiguous() &&
                    slots[i].size(0) == k_src[i].size(0),
                "kv_load: slots [T] int64");
    TORCH_CHECK(quant == (k_src[i].scalar_type() == torch::kChar), "kv_load: int8 rows need their scales");
    TORCH_CHECK(quant || (k_src[i].scalar_type() == k_dst[i].scalar_type() &&
                          v_src[i].scalar_type() == v_dst[i].scalar_type() && v_src[i].scalar_type() == k_src[i].scalar_type()),
                "kv_load: rows in the pool's dtype, or int8 with their scales");
    const int64_t* sl = slots[i].data_ptr<int64_t>();
    for (int64_t j = 0; j < slots[i].size(0); ++j)
      TORCH_CHECK(sl[j] >= 0 && sl[j] < k_dst[i].size(0) && sl[j] < v_dst[i].size(0), "kv_load: slot out of range");
    if (quant)
      for (auto* sc : {&k_scale[i], &v_scale[i]})
        TORCH_CHECK(sc->scalar_type() == torch::kFloat && sc->dim() == 2 && sc->size(0) == k_src[i].size(0) &&
                        sc->size(1) == k_src[i].size(1) && sc->stride(1) == 1,
                    "kv_load: scales [T, H] float32");
  }
  int64_t total = 0;
  for (int64_t i = 0; i < n; ++i) total += pool_bytes(k_src[i], k_dst[i]) + pool_bytes(v_src[i], v_dst[i]);
  const bool stream = total >= STREAM_MIN_BYTES;
  std::vector<std::array<int64_t, 3>> items;  // (entry, first row, end row)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0, t = k_src[i].size(0); r < t; r += ROWS_PER_ITEM)
      items.push_back({i, r, std::min(r + ROWS_PER_ITEM, t)});
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end; ++w) {
      const auto [i, r0, r1] = items[w];
      const int64_t* sl = slots[i].data_ptr<int64_t>();
      rows(k_src[i], quant ? c10::optional<torch::Tensor>(k_scale[i]) : c10::nullopt, sl, k_dst[i], r0, r1, stream);
      rows(v_src[i], quant ? c10::optional<torch::Tensor>(v_scale[i]) : c10::nullopt, sl, v_dst[i], r0, r1, stream);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("load_layer", &load_layer, py::call_guard<py::gil_scoped_release>());
  m.def("load_layers", &load_layers, py::call_guard<py::gil_scoped_release>());
}
