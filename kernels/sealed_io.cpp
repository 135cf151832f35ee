// Whole reads of sealed (encrypted) segment files straight into their destinations (CPU). See
// sealed_io.py.
//
// A sealed file keeps the plain layout; each extent is one AES-256-GCM unit whose ciphertext fills
// its place byte for byte, its 16-byte tag in the header (sgl_loopkv/cache/cipher.py). read_sealed
// reads runs of extents into the thread's staging buffer (kept between calls), then opens every
// extent under its tag, nonce salt | u32 unit and aad seg_id | 0 | u32 unit (big-endian, as cipher.py
// seals them), decrypting its pieces straight where the caller chose: the same targets as
// chunk_io.cpp's read_extents, which cannot decrypt. All of it runs without the GIL, where the
// Python path held it for every extent (a loop the forward's Python waited on).
//
// AES-GCM comes from the process's libcrypto (OpenSSL 1.1 / 3 EVP API), found at run time
// (use_libcrypto): no OpenSSL headers or link-time dependency. Without it, callers read in Python.
#include <torch/extension.h>

#include <dlfcn.h>
#include <limits.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

namespace {

// The EVP functions used, as OpenSSL 1.1 and 3 export them (opaque pointers for the types).
struct Evp {
  void* (*ctx_new)() = nullptr;
  void (*ctx_free)(void*) = nullptr;
  const void* (*aes_256_gcm)() = nullptr;
  int (*decrypt_init)(void*, const void*, void*, const unsigned char*, const unsigned char*) = nullptr;
  int (*decrypt_update)(void*, unsigned char*, int*, const unsigned char*, int) = nullptr;
  int (*decrypt_final)(void*, unsigned char*, int*) = nullptr;
  int (*ctrl)(void*, int, int, void*) = nullptr;
  // OpenSSL 3's: a new IV without the legacy init path (nullptr on 1.1, which takes decrypt_init)
  int (*init2)(void*, const void*, const unsigned char*, const unsigned char*, int, const void*) = nullptr;
};
Evp evp;
constexpr int EVP_CTRL_GCM_SET_IVLEN = 0x9, EVP_CTRL_GCM_SET_TAG = 0x11;
constexpr int64_t TAG = 16, NONCE = 12, SALT = 8;

template <class F>
bool sym(void* lib, const char* name, F& f) {
  f = reinterpret_cast<F>(dlsym(lib, name));
  return f != nullptr;
}

inline void put_u32_be(unsigned char* p, uint32_t v) {
  p[0] = static_cast<unsigned char>(v >> 24), p[1] = static_cast<unsigned char>(v >> 16);
  p[2] = static_cast<unsigned char>(v >> 8), p[3] = static_cast<unsigned char>(v);
}

// One EVP context for a call: the key set once, an IV per unit.
struct Opener {
  void* ctx;
  explicit Opener(const std::string& key) : ctx(evp.ctx_new()) {
    if (!ctx || evp.decrypt_init(ctx, evp.aes_256_gcm(), nullptr, nullptr, nullptr) != 1 ||
        evp.ctrl(ctx, EVP_CTRL_GCM_SET_IVLEN, static_cast<int>(NONCE), nullptr) != 1 ||
        evp.decrypt_init(ctx, nullptr, nullptr, reinterpret_cast<const unsigned char*>(key.data()), nullptr) != 1) {
      if (ctx) evp.ctx_free(ctx);
      throw std::runtime_error("read_sealed: libcrypto refused the AES-256-GCM context");
    }
  }
  ~Opener() { evp.ctx_free(ctx); }
  // Decrypt the ``P`` pieces of a unit (``size[p]`` bytes each, then ``pad`` bytes of padding) from
  // ``data`` straight to ``to[p]`` (the padding to ``scratch``); whether ``tag`` holds. GCM decrypts
  // as a stream, so the pieces need no staging copy; on a failed tag they hold garbage (not ok).
  bool open(const unsigned char* data, const int64_t* to, const int64_t* size, int64_t P, int64_t pad,
            unsigned char* scratch, const unsigned char* nonce, const unsigned char* aad, int aad_len,
            const unsigned char* tag) {
    int len = 0;
    if ((evp.init2 ? evp.init2(ctx, nullptr, nullptr, nonce, 0, nullptr) : evp.decrypt_init(ctx, nullptr, nullptr, nullptr, nonce)) != 1)
      return false;
    if (evp.decrypt_update(ctx, nullptr, &len, aad, aad_len) != 1) return false;
    for (int64_t p = 0; p < P; data += size[p], ++p)
      if (evp.decrypt_update(ctx, reinterpret_cast<unsigned char*>(to[p]), &len, data, static_cast<int>(size[p])) != 1)
        return false;
    if (pad && evp.decrypt_update(ctx, scratch, &len, data, static_cast<int>(pad)) != 1) return false;
    if (evp.ctrl(ctx, EVP_CTRL_GCM_SET_TAG, static_cast<int>(TAG), const_cast<unsigned char*>(tag)) != 1) return false;
    return evp.decrypt_final(ctx, scratch, &len) == 1;
  }
};

}  // namespace

// Take AES-256-GCM from the libcrypto at ``path`` (a name dlopen resolves); -> whether it was found.
bool use_libcrypto(const std::string& path) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  Evp e;
  const bool ok = lib && sym(lib, "EVP_CIPHER_CTX_new", e.ctx_new) && sym(lib, "EVP_CIPHER_CTX_free", e.ctx_free) &&
                  sym(lib, "EVP_aes_256_gcm", e.aes_256_gcm) && sym(lib, "EVP_DecryptInit_ex", e.decrypt_init) &&
                  sym(lib, "EVP_DecryptUpdate", e.decrypt_update) && sym(lib, "EVP_DecryptFinal_ex", e.decrypt_final) &&
                  sym(lib, "EVP_CIPHER_CTX_ctrl", e.ctrl);
  if (ok) {
    sym(lib, "EVP_CipherInit_ex2", e.init2);
    evp = e;
  }
  return ok;
}

bool available() { return evp.ctx_new != nullptr; }

// blocks [nb, 2] int64: a read's file offset and its extent count (consecutive extents); units [n]
// int64: each extent's unit number (its place in file order); tags [units, 16] uint8: the header's
// tags; targets [n, P] int64 and sizes [P] int64: each extent's pieces' destinations and sizes (the
// rest of extent_bytes is padding), as chunk_io.cpp's read_extents takes them.
// -> (ok [n] bool: read whole and its tag holds, bytes read, seconds in pread, seconds opening).
std::tuple<torch::Tensor, int64_t, double, double> read_sealed(
    int64_t fd, const torch::Tensor& blocks, const torch::Tensor& units, const torch::Tensor& tags,
    const torch::Tensor& targets, const torch::Tensor& sizes, int64_t extent_bytes, const std::string& key,
    const std::string& salt, const std::string& seg_id) {
  TORCH_CHECK(available(), "read_sealed: no libcrypto (use_libcrypto first)");
  TORCH_CHECK(key.size() == 32 && salt.size() == SALT, "read_sealed: a 32-byte key and an 8-byte salt");
  TORCH_CHECK(blocks.dtype() == torch::kInt64 && blocks.dim() == 2 && blocks.size(1) == 2 && blocks.is_contiguous(),
              "blocks must be contiguous int64 [nb, 2]");
  TORCH_CHECK(sizes.dtype() == torch::kInt64 && sizes.dim() == 1 && sizes.numel() >= 1 && sizes.is_contiguous(),
              "sizes must be int64 [P]");
  const int64_t P = sizes.numel(), n = targets.size(0);
  TORCH_CHECK(targets.dtype() == torch::kInt64 && targets.dim() == 2 && targets.size(1) == P && targets.is_contiguous(),
              "targets must be contiguous int64 [n, P]");
  TORCH_CHECK(units.dtype() == torch::kInt64 && units.numel() == n && units.is_contiguous(), "units must be int64 [n]");
  TORCH_CHECK(tags.dtype() == torch::kUInt8 && tags.dim() == 2 && tags.size(1) == TAG && tags.is_contiguous(),
              "tags must be contiguous uint8 [units, 16]");
  const int64_t* size = sizes.data_ptr<int64_t>();
  int64_t used = 0;
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(size[p] > 0, "piece sizes must be positive");
    used += size[p];
  }
  TORCH_CHECK(extent_bytes >= used && extent_bytes <= INT_MAX, "extent_bytes must hold the pieces");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t nb = blocks.size(0), n_units = tags.size(0);
  int64_t total = 0;
  for (int64_t i = 0; i < nb; ++i) total += b[2 * i + 1];
  TORCH_CHECK(total == n, "blocks cover ", total, " extents, targets ", n);
  const int64_t* unit = units.data_ptr<int64_t>();
  for (int64_t e = 0; e < n; ++e) TORCH_CHECK(unit[e] >= 0 && unit[e] < n_units && unit[e] <= UINT32_MAX, "unit out of range");

  auto ok = torch::zeros({n}, torch::kBool);
  bool* okp = ok.data_ptr<bool>();
  const int64_t* t = targets.data_ptr<int64_t>();
  const unsigned char* tag = tags.data_ptr<uint8_t>();
  // about a megabyte a pread, as the plain reader's pieces
  const int64_t per_call = std::max<int64_t>((int64_t(1) << 20) / extent_bytes, 1);
  // the reading thread's own buffers, kept between calls: a whole read calls once per piece
  thread_local std::vector<unsigned char> staging, scratch;
  staging.resize(std::max<size_t>(staging.size(), per_call * extent_bytes));
  scratch.resize(std::max<size_t>(scratch.size(), std::max<int64_t>(extent_bytes - used, TAG)));
  const int64_t pad = extent_bytes - used;
  unsigned char nonce[NONCE];
  std::memcpy(nonce, salt.data(), SALT);
  std::vector<unsigned char> aad(seg_id.size() + 5);
  std::memcpy(aad.data(), seg_id.data(), seg_id.size());
  aad[seg_id.size()] = 0;
  Opener opener(key);
  int64_t bytes = 0, e = 0;
  double read_s = 0.0, open_s = 0.0;
  using clock = std::chrono::steady_clock;
  for (int64_t i = 0; i < nb; ++i) {
    int64_t offset = b[2 * i];
    for (int64_t left = b[2 * i + 1]; left > 0;) {
      const int64_t m = std::min(left, per_call), want = m * extent_bytes;
      const auto t0 = clock::now();
      int64_t got = 0;
      while (got < want) {  // a short read before the end of the file: read on
        const ssize_t r = pread(static_cast<int>(fd), staging.data() + got, want - got, offset + got);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) throw std::runtime_error(std::string("read_sealed: pread failed: ") + std::strerror(errno));
        if (r == 0) break;
        got += r;
      }
      const auto t1 = clock::now();
      bytes += got;
      const int64_t whole = std::min<int64_t>(got / extent_bytes, m);  // cut short: the rest stay not ok
      for (int64_t j = 0; j < whole; ++j) {
        const uint32_t u = static_cast<uint32_t>(unit[e + j]);
        put_u32_be(nonce + SALT, u), put_u32_be(aad.data() + seg_id.size() + 1, u);
        okp[e + j] = opener.open(staging.data() + j * extent_bytes, t + P * (e + j), size, P, pad, scratch.data(), nonce,
                                 aad.data(), static_cast<int>(aad.size()), tag + TAG * u);
      }
      read_s += std::chrono::duration<double>(t1 - t0).count();
      open_s += std::chrono::duration<double>(clock::now() - t1).count();
      if (whole < m) return {ok, bytes, read_s, open_s};  // end of file: nothing more to read
      e += m;
      left -= m;
      offset += m * extent_bytes;
    }
  }
  return {ok, bytes, read_s, open_s};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_libcrypto", &use_libcrypto, "Take AES-256-GCM from a libcrypto (dlopen name or path)");
  m.def("available", &available, "A libcrypto was found");
  m.def("read_sealed", &read_sealed, "Read and open sealed segment extents into their destinations (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
