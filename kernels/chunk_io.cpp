// Disk reads straight into their destinations (CPU): a chunk-pruned restore's into the KV pool, a
// whole segment's into its rows tensors. See chunk_io.py.
//
// A segment file stores each (chunk, layer) extent as the chunk's K rows then its V rows (one
// pool page each; an int8 tier's values, then their scales), padded to a sector, and a crc32 per
// extent in its header. read_extents reads runs of extents with preadv, each piece of an extent
// landing where the caller chose (pool pages, or a whole read's rows tensors: no buffer in file
// order copied again; the padding in a scratch buffer), then checks every extent's crc32 over the
// bytes it read. All of it runs without the GIL: the forward's Python thread keeps it while a
// restore reads.
//
// copy_spans copies a host-tier history's chunks into their pool pages the same way (one memcpy
// per chunk's K or V rows, no gathered temporary, no GIL).
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

// The crc32 that wrote the checksums (zlib's polynomial), found at run time in a library the
// process has (use_crc32): zlib-ng's PCLMUL one where Python has it (19 MB in 0.7 ms, zlib's 4.7).
using Crc32 = uint32_t (*)(uint32_t, const unsigned char*, uint32_t);
using ZlibCrc32 = unsigned long (*)(unsigned long, const unsigned char*, unsigned int);  // zlib's own ABI
Crc32 ng_crc32 = nullptr;
ZlibCrc32 z_crc32 = nullptr;

inline uint32_t crc32_of(uint32_t crc, const unsigned char* p, int64_t n) {
  return ng_crc32 ? ng_crc32(crc, p, static_cast<uint32_t>(n))
                  : static_cast<uint32_t>(z_crc32(crc, p, static_cast<unsigned int>(n)) & 0xffffffffUL);
}

}  // namespace

// Take ``symbol`` from the shared library ``path`` (zlib_abi: zlib's ``crc32``, else zlib-ng's
// ``zng_crc32``); -> whether it was found.
bool use_crc32(const std::string& path, const std::string& symbol, bool zlib_abi) {
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  void* fn = lib ? dlsym(lib, symbol.c_str()) : nullptr;
  if (!fn) return false;
  if (zlib_abi) {
    z_crc32 = reinterpret_cast<ZlibCrc32>(fn);
    ng_crc32 = nullptr;
  } else {
    ng_crc32 = reinterpret_cast<Crc32>(fn);
  }
  return true;
}

bool available() { return ng_crc32 != nullptr || z_crc32 != nullptr; }

// blocks [nb, 2] int64: a read's file offset and its extent count (the extents follow one another
// in the file); extents are numbered across blocks in order. An extent is P pieces of sizes[p] bytes
// each (a float tier's K rows then V rows: P = 2; an int8 tier's K and V values then K and V scales:
// P = 4), then padding to extent_bytes. targets [n, P] int64: each extent's piece destinations;
// crcs [n] int64: each extent's stored crc32 (over its pieces and padding, in file order).
// -> (ok [n] bool: read whole and checksum equal, bytes read, seconds in preadv, seconds in crc32).
std::tuple<torch::Tensor, int64_t, double, double> read_extents(
    int64_t fd, const torch::Tensor& blocks, const torch::Tensor& targets, const torch::Tensor& crcs,
    const torch::Tensor& sizes, int64_t extent_bytes) {
  TORCH_CHECK(available(), "read_extents: no crc32 (use_crc32 first)");
  TORCH_CHECK(blocks.dtype() == torch::kInt64 && blocks.dim() == 2 && blocks.size(1) == 2 && blocks.is_contiguous(),
              "blocks must be contiguous int64 [nb, 2]");
  TORCH_CHECK(sizes.dtype() == torch::kInt64 && sizes.dim() == 1 && sizes.numel() >= 1 && sizes.is_contiguous(),
              "sizes must be int64 [P]");
  const int64_t P = sizes.numel();
  const int64_t n = targets.size(0);
  TORCH_CHECK(targets.dtype() == torch::kInt64 && targets.dim() == 2 && targets.size(1) == P &&
                  targets.is_contiguous(), "targets must be contiguous int64 [n, P]");
  TORCH_CHECK(crcs.dtype() == torch::kInt64 && crcs.numel() == n && crcs.is_contiguous(), "crcs must be int64 [n]");
  const int64_t* size = sizes.data_ptr<int64_t>();
  int64_t used = 0;
  for (int64_t p = 0; p < P; ++p) {
    TORCH_CHECK(size[p] > 0, "piece sizes must be positive");
    used += size[p];
  }
  TORCH_CHECK(extent_bytes >= used, "extent_bytes must hold the pieces");
  const int64_t* b = blocks.data_ptr<int64_t>();
  const int64_t nb = blocks.size(0);
  int64_t total = 0;
  for (int64_t i = 0; i < nb; ++i) total += b[2 * i + 1];
  TORCH_CHECK(total == n, "blocks cover ", total, " extents, targets ", n);

  auto ok = torch::zeros({n}, torch::kBool);
  bool* okp = ok.data_ptr<bool>();
  const int64_t* t = targets.data_ptr<int64_t>();
  const int64_t* want = crcs.data_ptr<int64_t>();
  const int64_t pad = extent_bytes - used;
  const int64_t per_extent = P + (pad ? 1 : 0);
  const int64_t per_call = std::max<int64_t>(IOV_MAX / per_extent, 1);  // extents one preadv takes
  std::vector<unsigned char> scratch(pad ? pad * per_call : 0);
  std::vector<iovec> iov;
  iov.reserve(per_call * per_extent);
  int64_t bytes = 0, e = 0;
  double read_s = 0.0, crc_s = 0.0;
  using clock = std::chrono::steady_clock;
  for (int64_t i = 0; i < nb; ++i) {
    int64_t offset = b[2 * i];
    for (int64_t left = b[2 * i + 1]; left > 0;) {
      const int64_t m = std::min(left, per_call);
      iov.clear();
      for (int64_t j = 0; j < m; ++j) {
        for (int64_t p = 0; p < P; ++p)
          iov.push_back({reinterpret_cast<void*>(t[P * (e + j) + p]), static_cast<size_t>(size[p])});
        if (pad) iov.push_back({scratch.data() + j * pad, static_cast<size_t>(pad)});
      }
      const auto t0 = clock::now();
      ssize_t got;
      do {
        got = preadv(static_cast<int>(fd), iov.data(), static_cast<int>(iov.size()), offset);
      } while (got < 0 && errno == EINTR);
      if (got < 0) throw std::runtime_error(std::string("read_extents: preadv failed: ") + std::strerror(errno));
      const auto t1 = clock::now();
      bytes += got;
      const int64_t whole = std::min<int64_t>(got / extent_bytes, m);  // a short read: the rest stay not ok
      for (int64_t j = 0; j < whole; ++j) {
        uint32_t c = 0;
        for (int64_t p = 0; p < P; ++p)
          c = crc32_of(c, reinterpret_cast<const unsigned char*>(t[P * (e + j) + p]), size[p]);
        if (pad) c = crc32_of(c, scratch.data() + j * pad, pad);
        okp[e + j] = static_cast<int64_t>(c) == want[e + j];
      }
      read_s += std::chrono::duration<double>(t1 - t0).count();
      crc_s += std::chrono::duration<double>(clock::now() - t1).count();
      if (whole < m) return {ok, bytes, read_s, crc_s};  // end of file: nothing more to read
      e += m;
      left -= m;
      offset += m * extent_bytes;
    }
  }
  return {ok, bytes, read_s, crc_s};
}

// spans [n, 2] int64: destination and source addresses of ``nbytes`` each (they never overlap).
void copy_spans(const torch::Tensor& spans, int64_t nbytes) {
  TORCH_CHECK(spans.dtype() == torch::kInt64 && spans.dim() == 2 && spans.size(1) == 2 && spans.is_contiguous(),
              "spans must be contiguous int64 [n, 2]");
  TORCH_CHECK(nbytes > 0, "nbytes must be positive");
  const int64_t* s = spans.data_ptr<int64_t>();
  for (int64_t i = 0, n = spans.size(0); i < n; ++i)
    std::memcpy(reinterpret_cast<void*>(s[2 * i]), reinterpret_cast<const void*>(s[2 * i + 1]), nbytes);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("use_crc32", &use_crc32, "Take the crc32 function from a shared library");
  m.def("available", &available, "A crc32 was found");
  m.def("read_extents", &read_extents, "Read and verify segment extents into KV pool pages (CPU)",
        py::call_guard<py::gil_scoped_release>());
  m.def("copy_spans", &copy_spans, "Copy equal-sized spans between addresses (CPU)",
        py::call_guard<py::gil_scoped_release>());
}
