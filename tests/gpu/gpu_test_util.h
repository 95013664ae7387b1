// Shared harness for GPU op tests: deterministic random inputs, tensors on any backend,
// upload/download helpers, paged-KV / step-metadata builders, and a tolerance comparison that
// reports the worst element. Header-only; include it from tests/gpu/*.cpp.
//
//   DS_REQUIRE_GPU();                                  // skips when there is no CUDA device
//   Backend& gpu = test::cuda_backend();               // one shared CUDA backend per process
//   Backend& cpu = test::cpu_backend();                // one shared CPU backend (reference)
//   auto x = test::random_floats(n, /*seed=*/1);
//   test::BackendTensor dx = test::upload_floats(gpu, DType::F32, {rows, cols}, x);
//   ... run the op ...
//   EXPECT_TRUE(test::all_close(test::download_floats(gpu, dy), want, {.abs = 1e-6, .rel = 1e-5},
//                               "rms_norm", {rows, cols}));
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/switches.h"
#include "backend/kv_fp8.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/tensor.h"

// Skips the current test (from the test body) when this machine has no CUDA device.
#define DS_REQUIRE_GPU()                                                       \
  do {                                                                         \
    if (::ds::cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device here"; \
  } while (0)

namespace ds::test {

// ---- backends ----------------------------------------------------------------------------

// Pool fraction of the shared test backend: leaves room for a second, small backend (the pool
// tests) and for other processes on the GPU.
inline constexpr double kTestGpuMemoryUtilization = 0.4;

// One CUDA backend (device 0) shared by every test of the process, created on first use.
inline Backend& cuda_backend() {
  static std::unique_ptr<Backend> b = [] {
    BackendOptions o;
    o.gpu_memory_utilization = kTestGpuMemoryUtilization;
    return make_cuda_backend(o, 0);
  }();
  return *b;
}

// One CPU backend shared by every test: the reference the CUDA ops are compared with.
inline Backend& cpu_backend() {
  static std::unique_ptr<Backend> b = make_cpu_backend(BackendOptions{});
  return *b;
}

// ---- random values and dtype rounding ----------------------------------------------------

// Deterministic uniform floats in [lo, hi).
inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f,
                                        float hi = 1.0f) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

// Deterministic uniform integers in [lo, hi] (both inclusive).
inline std::vector<int32_t> random_ints(size_t n, uint32_t seed, int32_t lo, int32_t hi) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int32_t> d(lo, hi);
  std::vector<int32_t> v(n);
  for (int32_t& x : v) x = d(rng);
  return v;
}

inline size_t element_bytes(DType t) {
  DS_CHECK(dtype_info(t).block_size == 1, "test helpers take plain dtypes only");
  return size_t(dtype_info(t).type_size);
}

// The value v becomes once stored as t (F32, F16 or BF16) and read back.
inline float round_to(DType t, float v) {
  switch (t) {
    case DType::F32:
      return v;
    case DType::F16:
      return fp16_to_f32(f32_to_fp16(v));
    case DType::BF16:
      return bf16_to_f32(f32_to_bf16(v));
    default:
      throw Error("round_to: unsupported dtype " + std::string(dtype_name(t)));
  }
}
inline std::vector<float> round_to(DType t, std::span<const float> v) {
  std::vector<float> r(v.size());
  for (size_t i = 0; i < v.size(); ++i) r[i] = round_to(t, v[i]);
  return r;
}

// Host bytes of v stored as t (F32, F16, BF16).
inline std::vector<uint8_t> encode(DType t, std::span<const float> v) {
  std::vector<uint8_t> out(v.size() * element_bytes(t));
  for (size_t i = 0; i < v.size(); ++i) {
    if (t == DType::F32) {
      std::memcpy(&out[i * 4], &v[i], 4);
    } else if (t == DType::F16 || t == DType::BF16) {
      const uint16_t h = t == DType::F16 ? f32_to_fp16(v[i]) : f32_to_bf16(v[i]);
      std::memcpy(&out[i * 2], &h, 2);
    } else {
      throw Error("encode: unsupported dtype " + std::string(dtype_name(t)));
    }
  }
  return out;
}

// n elements of type t (F32, F16, BF16, I32) at `bytes`, as floats.
inline std::vector<float> decode(DType t, const void* bytes, size_t n) {
  std::vector<float> out(n);
  const auto* p = static_cast<const uint8_t*>(bytes);
  for (size_t i = 0; i < n; ++i) {
    if (t == DType::F32) {
      std::memcpy(&out[i], p + i * 4, 4);
    } else if (t == DType::I32) {
      int32_t x;
      std::memcpy(&x, p + i * 4, 4);
      out[i] = float(x);
    } else {
      uint16_t h;
      std::memcpy(&h, p + i * 2, 2);
      if (t == DType::F16)
        out[i] = fp16_to_f32(h);
      else if (t == DType::BF16)
        out[i] = bf16_to_f32(h);
      else
        throw Error("decode: unsupported dtype " + std::string(dtype_name(t)));
    }
  }
  return out;
}

// ---- tensors on a backend ----------------------------------------------------------------

// A contiguous view of `dims` (1 to 4, outermost first) over data.
inline TensorView make_view(void* data, DType t, const std::vector<int64_t>& dims,
                            Device device = {}) {
  DS_CHECK(!dims.empty() && dims.size() <= size_t(kMaxDims), "make_view rank");
  TensorView v;
  v.data = data;
  v.dtype = t;
  v.device = device;
  v.ndim = int(dims.size());
  int64_t s = int64_t(element_bytes(t));
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[size_t(d)] = dims[size_t(d)];
    v.stride[size_t(d)] = s;
    s *= dims[size_t(d)];
  }
  return v;
}

// A view of `dims` with byte `strides` over the same memory as base, starting `offset_bytes`
// in (for row-padded, sliced or permuted views such as {H, T, d} over a [T, H, d] buffer).
inline TensorView strided_view(const TensorView& base, const std::vector<int64_t>& dims,
                               const std::vector<int64_t>& strides, int64_t offset_bytes = 0) {
  DS_CHECK(dims.size() == strides.size() && !dims.empty() && dims.size() <= size_t(kMaxDims),
           "strided_view rank");
  TensorView v = base;
  v.data = static_cast<uint8_t*>(base.data) + offset_bytes;
  v.ndim = int(dims.size());
  v.shape = {};
  v.stride = {};
  for (size_t d = 0; d < dims.size(); ++d) {
    v.shape[d] = dims[d];
    v.stride[d] = strides[d];
  }
  return v;
}

// A buffer on some backend and a contiguous view of all of it.
struct BackendTensor {
  std::unique_ptr<Buffer> buffer;
  TensorView view;
  size_t numel() const { return size_t(view.numel()); }
  template <typename T>
  T* ptr() const {
    return view.ptr<T>();
  }
};

// Uploads raw bytes as a contiguous tensor of `dims`.
inline BackendTensor upload_bytes(Backend& b, DType t, const std::vector<int64_t>& dims,
                                  const void* host, size_t bytes) {
  BackendTensor r;
  r.buffer = b.alloc(std::max<size_t>(bytes, 1));
  r.view = make_view(r.buffer->data(), t, dims, b.device());
  DS_CHECK(r.view.nbytes() == bytes, "upload_bytes: dims do not match the byte count");
  if (bytes) b.upload(r.view, host, bytes);
  return r;
}

// A zero-filled tensor.
inline BackendTensor zeros(Backend& b, DType t, const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  std::vector<uint8_t> z(size_t(n) * element_bytes(t), 0);
  return upload_bytes(b, t, dims, z.data(), z.size());
}

// Floats stored as t (F32, F16, BF16); v.size() must equal the product of dims.
inline BackendTensor upload_floats(Backend& b, DType t, const std::vector<int64_t>& dims,
                                   std::span<const float> v) {
  const std::vector<uint8_t> bytes = encode(t, v);
  return upload_bytes(b, t, dims, bytes.data(), bytes.size());
}

// A [n] I32 tensor (ids, positions, slot mappings, block tables).
inline BackendTensor upload_ints(Backend& b, std::span<const int32_t> v) {
  return upload_bytes(b, DType::I32, {int64_t(v.size())}, v.data(), v.size() * 4);
}

// The whole of t's buffer (its contiguous view), synchronizing the backend first.
inline std::vector<uint8_t> download_bytes(Backend& b, const BackendTensor& t) {
  std::vector<uint8_t> out(t.view.nbytes());
  b.synchronize();
  if (!out.empty()) b.download(out.data(), t.view, out.size());
  return out;
}

// The whole of t's buffer decoded to floats (F32, F16, BF16, I32).
inline std::vector<float> download_floats(Backend& b, const BackendTensor& t) {
  const std::vector<uint8_t> bytes = download_bytes(b, t);
  return decode(t.view.dtype, bytes.data(), t.numel());
}

// The elements a (possibly strided, up to 4-D) view addresses, outermost first, gathered from
// a host copy of the buffer that starts at `base` (host_bytes = download_bytes of it).
inline std::vector<float> gather_view(const std::vector<uint8_t>& host_bytes, const void* base,
                                      const TensorView& v) {
  const int64_t off0 = static_cast<const uint8_t*>(v.data) - static_cast<const uint8_t*>(base);
  std::array<int64_t, kMaxDims> shape{1, 1, 1, 1}, stride{0, 0, 0, 0};
  for (int d = 0; d < v.ndim; ++d) {
    shape[size_t(kMaxDims - v.ndim + d)] = v.shape[size_t(d)];
    stride[size_t(kMaxDims - v.ndim + d)] = v.stride[size_t(d)];
  }
  std::vector<float> out;
  out.reserve(size_t(v.numel()));
  const size_t es = element_bytes(v.dtype);
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d) {
          const int64_t o = off0 + a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3];
          DS_CHECK(o >= 0 && size_t(o) + es <= host_bytes.size(), "gather_view out of range");
          out.push_back(decode(v.dtype, &host_bytes[size_t(o)], 1)[0]);
        }
  return out;
}

// Element indices (into the buffer starting at base, in units of v's element size) of every
// element v addresses, outermost first: for checking a strided output and that the padding
// around it was left alone.
inline std::vector<size_t> view_offsets(const void* base, const TensorView& v) {
  const int64_t es = int64_t(element_bytes(v.dtype));
  const int64_t off0 = static_cast<const uint8_t*>(v.data) - static_cast<const uint8_t*>(base);
  std::array<int64_t, kMaxDims> shape{1, 1, 1, 1}, stride{0, 0, 0, 0};
  for (int d = 0; d < v.ndim; ++d) {
    shape[size_t(kMaxDims - v.ndim + d)] = v.shape[size_t(d)];
    stride[size_t(kMaxDims - v.ndim + d)] = v.stride[size_t(d)];
  }
  std::vector<size_t> out;
  out.reserve(size_t(v.numel()));
  for (int64_t a = 0; a < shape[0]; ++a)
    for (int64_t b = 0; b < shape[1]; ++b)
      for (int64_t c = 0; c < shape[2]; ++c)
        for (int64_t d = 0; d < shape[3]; ++d) {
          const int64_t o = off0 + a * stride[0] + b * stride[1] + c * stride[2] + d * stride[3];
          DS_CHECK(o >= 0 && o % es == 0, "view_offsets: misaligned element");
          out.push_back(size_t(o / es));
        }
  return out;
}

// ---- comparison --------------------------------------------------------------------------

// Element i passes when |got - want| <= abs + rel * |want|.
struct Tolerance {
  double abs = 0.0;
  double rel = 0.0;
};

// "[3, 5]" for flat index i of a tensor of `shape` (or "i" when shape is empty).
inline std::string index_str(size_t i, const std::vector<int64_t>& shape) {
  if (shape.empty()) return std::to_string(i);
  std::vector<int64_t> idx(shape.size());
  size_t r = i;
  for (size_t d = shape.size(); d-- > 0;) {
    idx[d] = int64_t(r % size_t(std::max<int64_t>(shape[d], 1)));
    r /= size_t(std::max<int64_t>(shape[d], 1));
  }
  std::string s = "[";
  for (size_t d = 0; d < idx.size(); ++d) s += (d ? ", " : "") + std::to_string(idx[d]);
  return s + "]";
}

// Passes when every element is within its own bound (|got - want| <= bound[i]); NaN or inf
// where want is finite always fails. The failure message names `what`, the number of bad
// elements and the worst one (largest error / bound) with its index, got, want and bound.
inline ::testing::AssertionResult all_close_bounds(std::span<const float> got,
                                                   std::span<const double> want,
                                                   std::span<const double> bound,
                                                   const std::string& what,
                                                   const std::vector<int64_t>& shape = {}) {
  if (got.size() != want.size() || bound.size() != want.size())
    return ::testing::AssertionFailure()
           << what << ": size mismatch (got " << got.size() << ", want " << want.size()
           << ", bounds " << bound.size() << ")";
  size_t bad = 0, worst = 0;
  double worst_ratio = -1.0, max_abs = 0.0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::abs(double(got[i]) - want[i]);
    double ratio;
    if (!std::isfinite(double(got[i])) && std::isfinite(want[i]))
      ratio = INFINITY;
    else if (!std::isfinite(want[i]))
      ratio = (std::isnan(want[i]) ? std::isnan(got[i]) : double(got[i]) == want[i]) ? 0 : INFINITY;
    else
      ratio = bound[i] > 0 ? err / bound[i] : (err == 0 ? 0 : INFINITY);
    if (std::isfinite(err)) max_abs = std::max(max_abs, err);
    if (ratio > 1.0) ++bad;
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  std::ostringstream m;
  m.precision(9);
  m << what << ": " << bad << " of " << got.size() << " elements out of tolerance; worst at "
    << index_str(worst, shape) << ": got " << got[worst] << ", want " << want[worst] << ", |err| "
    << std::abs(double(got[worst]) - want[worst]) << " > bound " << bound[worst] << " (x"
    << worst_ratio << "); max |err| over finite elements " << max_abs;
  return ::testing::AssertionFailure() << m.str();
}

inline ::testing::AssertionResult all_close(std::span<const float> got,
                                            std::span<const double> want, Tolerance tol,
                                            const std::string& what,
                                            const std::vector<int64_t>& shape = {}) {
  std::vector<double> bound(want.size());
  for (size_t i = 0; i < want.size(); ++i)
    bound[i] = tol.abs + tol.rel * (std::isfinite(want[i]) ? std::abs(want[i]) : 0.0);
  return all_close_bounds(got, want, bound, what, shape);
}

inline ::testing::AssertionResult all_close(std::span<const float> got, std::span<const float> want,
                                            Tolerance tol, const std::string& what,
                                            const std::vector<int64_t>& shape = {}) {
  const std::vector<double> w(want.begin(), want.end());
  return all_close(got, w, tol, what, shape);
}

// Exact equality (integers, copies): the same report, with a zero bound.
inline ::testing::AssertionResult all_equal(std::span<const float> got, std::span<const float> want,
                                            const std::string& what,
                                            const std::vector<int64_t>& shape = {}) {
  return all_close(got, want, Tolerance{}, what, shape);
}

// ---- the same inputs on both backends -----------------------------------------------------

// The same contents on the CPU backend and the CUDA backend (the shared ones above).
struct Twin {
  BackendTensor cpu, gpu;
};

inline Twin twin_floats(DType t, const std::vector<int64_t>& dims, std::span<const float> v) {
  return {upload_floats(cpu_backend(), t, dims, v), upload_floats(cuda_backend(), t, dims, v)};
}

inline Twin twin_ints(std::span<const int32_t> v) {
  return {upload_ints(cpu_backend(), v), upload_ints(cuda_backend(), v)};
}

inline int64_t product(const std::vector<int64_t>& dims) {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

// Element strides -> byte strides.
inline std::vector<int64_t> byte_strides(std::vector<int64_t> s, DType t) {
  for (int64_t& x : s) x *= int64_t(element_bytes(t));
  return s;
}

// A view of `dims` with element strides over t's buffer, offset_elems elements in.
inline TensorView view_of(const BackendTensor& t, const std::vector<int64_t>& dims,
                          const std::vector<int64_t>& elem_strides, int64_t offset_elems = 0) {
  const int64_t es = int64_t(element_bytes(t.view.dtype));
  return strided_view(t.view, dims, byte_strides(elem_strides, t.view.dtype), offset_elems * es);
}

// Bounds over a whole buffer of `total` elements: view_bounds[i] at the view's i-th element,
// 0 elsewhere (padding around a strided output must be left exactly as it was).
inline std::vector<double> buffer_bounds(size_t total, const std::vector<size_t>& view_idx,
                                         std::span<const double> view_bounds) {
  std::vector<double> b(total, 0.0);
  for (size_t i = 0; i < view_idx.size(); ++i) b[view_idx[i]] = view_bounds[i];
  return b;
}

inline std::vector<double> to_double(std::span<const float> v) {
  return {v.begin(), v.end()};
}

// ---- paged KV caches and step metadata ---------------------------------------------------

// One sequence of a step: context_len cached tokens after the step, of which the last
// query_len are this step's (query_len <= context_len).
struct StepSeq {
  int query_len = 1;
  int context_len = 1;
};

// AttentionMeta's arrays on the host, before upload.
struct HostStep {
  std::vector<int32_t> query_start;   // [num_seqs + 1]
  std::vector<int32_t> context_lens;  // [num_seqs]
  std::vector<int32_t> block_tables;  // [num_seqs, max_blocks_per_seq], unused entries 0
  std::vector<int32_t> slot_mapping;  // [num_tokens]
  std::vector<int32_t> positions;     // [num_tokens]
  int num_seqs = 0;
  int num_tokens = 0;
  int max_blocks_per_seq = 0;
  int max_query_len = 0;
  int max_context_len = 0;
  // Cache slot of position j of sequence s.
  int32_t slot(int s, int j, int block_size) const {
    return block_tables[size_t(s) * size_t(max_blocks_per_seq) + size_t(j / block_size)] *
               block_size +
           j % block_size;
  }
};

// Blocks are handed out from a seeded shuffle of [0, num_blocks) so tables are scattered;
// throws when num_blocks is too small for the sequences.
inline HostStep make_step(std::span<const StepSeq> seqs, int block_size, int num_blocks,
                          uint32_t seed) {
  HostStep h;
  h.num_seqs = int(seqs.size());
  for (const StepSeq& s : seqs) {
    DS_CHECK(s.query_len >= 0 && s.query_len <= s.context_len, "make_step: query_len");
    h.max_blocks_per_seq =
        std::max(h.max_blocks_per_seq, (s.context_len + block_size - 1) / block_size);
    h.max_query_len = std::max(h.max_query_len, s.query_len);
    h.max_context_len = std::max(h.max_context_len, s.context_len);
  }
  std::vector<int32_t> order(static_cast<size_t>(num_blocks));
  std::iota(order.begin(), order.end(), 0);
  std::mt19937 rng(seed);
  std::shuffle(order.begin(), order.end(), rng);
  h.block_tables.assign(size_t(h.num_seqs) * size_t(h.max_blocks_per_seq), 0);
  size_t next = 0;
  h.query_start.push_back(0);
  for (int s = 0; s < h.num_seqs; ++s) {
    const StepSeq& q = seqs[size_t(s)];
    for (int b = 0; b < (q.context_len + block_size - 1) / block_size; ++b) {
      DS_CHECK(next < order.size(), "make_step: not enough blocks");
      h.block_tables[size_t(s) * size_t(h.max_blocks_per_seq) + size_t(b)] = order[next++];
    }
    for (int j = q.context_len - q.query_len; j < q.context_len; ++j) {
      h.positions.push_back(j);
      h.slot_mapping.push_back(h.slot(s, j, block_size));
    }
    h.num_tokens += q.query_len;
    h.query_start.push_back(h.num_tokens);
    h.context_lens.push_back(q.context_len);
  }
  return h;
}

// A step's arrays uploaded to a backend, and the AttentionMeta pointing at them.
struct BackendStep {
  BackendTensor query_start, context_lens, block_tables, slot_mapping, positions;
  AttentionMeta meta;
};

inline BackendStep upload_step(Backend& b, const HostStep& h) {
  BackendStep r;
  r.query_start = upload_ints(b, h.query_start);
  r.context_lens = upload_ints(b, h.context_lens);
  r.block_tables = upload_ints(b, h.block_tables);
  r.slot_mapping = upload_ints(b, h.slot_mapping);
  r.positions = upload_ints(b, h.positions);
  r.meta.num_seqs = h.num_seqs;
  r.meta.num_tokens = h.num_tokens;
  r.meta.query_start = r.query_start.ptr<int32_t>();
  r.meta.context_lens = r.context_lens.ptr<int32_t>();
  r.meta.block_tables = r.block_tables.ptr<int32_t>();
  r.meta.max_blocks_per_seq = h.max_blocks_per_seq;
  r.meta.slot_mapping = r.slot_mapping.ptr<int32_t>();
  r.meta.positions = r.positions.ptr<int32_t>();
  r.meta.max_query_len = h.max_query_len;
  r.meta.max_context_len = h.max_context_len;
  return r;
}

// Shape of a paged cache; latent = an MLA cache (v == nullptr, kv_heads == 1).
struct KvSpec {
  DType dtype = DType::BF16;
  int num_blocks = 1;
  int block_size = 16;
  int kv_heads = 1;
  int head_dim = 64;
  bool latent = false;
  int64_t elements() const { return int64_t(num_blocks) * block_size * kv_heads * head_dim; }
};

// A paged cache on a backend. k_host / v_host hold what the cache holds (rounded to the cache
// dtype; FP8: dequantized), flat [num_blocks * block_size, kv_heads, head_dim], for building
// references. An FP8 cache (dtype F8_E4M3) gets codes and per-token scales made by kvfp8 on the
// host, split at rope_split for a latent cache.
struct BackendKv {
  BackendTensor k, v;    // v empty when latent
  BackendTensor ks, vs;  // FP8 scales
  PagedKv kv;
  std::vector<float> k_host, v_host;
};

// FP8 rows of x ([rows, head_dim]): codes, scales ([rows, parts]) and the dequantized values.
inline void quantize_fp8_rows(std::vector<float>& x, int head_dim, int split,
                              std::vector<uint8_t>& codes, std::vector<float>& scales) {
  const size_t rows = x.size() / size_t(head_dim);
  const int parts = split > 0 ? 2 : 1;
  codes.resize(x.size());
  scales.resize(rows * size_t(parts));
  for (size_t r = 0; r < rows; ++r) {
    float* row = &x[r * size_t(head_dim)];
    float* sc = &scales[r * size_t(parts)];
    kvfp8::quantize_head(row, head_dim, split, &codes[r * size_t(head_dim)], sc);
    for (int d = 0; d < head_dim; ++d)
      row[d] = kvfp8::dequant(codes[r * size_t(head_dim) + size_t(d)], sc[split > 0 && d >= split]);
  }
}

// Filled with seeded uniform values in [-1, 1) (FP8: times a per-row magnitude, so the
// scales differ); the same spec and seed give the same contents on every backend.
inline BackendKv random_paged_kv(Backend& b, const KvSpec& s, uint32_t seed, int rope_split = 0) {
  DS_CHECK(!s.latent || s.kv_heads == 1, "a latent cache has one kv head");
  const std::vector<int64_t> dims = {int64_t(s.num_blocks) * s.block_size, s.kv_heads, s.head_dim};
  BackendKv r;
  const bool fp8 = s.dtype == DType::F8_E4M3;
  auto fill = [&](uint32_t sd, int split, std::vector<float>& host, BackendTensor& codes_t,
                  BackendTensor& scales_t) {
    host = random_floats(size_t(s.elements()), sd);
    if (!fp8) {
      host = round_to(s.dtype, host);
      codes_t = upload_floats(b, s.dtype, dims, host);
      return;
    }
    for (size_t i = 0; i < host.size(); ++i) host[i] *= 0.25f + float((i / size_t(s.head_dim)) % 7);
    std::vector<uint8_t> codes;
    std::vector<float> scales;
    quantize_fp8_rows(host, s.head_dim, split, codes, scales);
    codes_t = upload_bytes(b, DType::U8, {int64_t(codes.size())}, codes.data(), codes.size());
    scales_t = upload_floats(b, DType::F32, {int64_t(scales.size())}, scales);
  };
  fill(seed, s.latent ? rope_split : 0, r.k_host, r.k, r.ks);
  if (!s.latent) fill(seed + 7919, 0, r.v_host, r.v, r.vs);
  r.kv.k = r.k.view.data;
  r.kv.v = s.latent ? nullptr : r.v.view.data;
  r.kv.dtype = s.dtype;
  r.kv.num_blocks = s.num_blocks;
  r.kv.block_size = s.block_size;
  r.kv.kv_heads = s.kv_heads;
  r.kv.head_dim = s.head_dim;
  if (fp8) {
    r.kv.rope_split = s.latent ? rope_split : 0;
    r.kv.k_scale = r.ks.ptr<float>();
    r.kv.v_scale = s.latent ? nullptr : r.vs.ptr<float>();
  }
  return r;
}

// Whether two downloads are the same bits.
inline bool bits_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

// Forces a switch or threshold of the CUDA backend for one scope.
struct Forced {
  cuda::EnvSwitch* sw = nullptr;
  cuda::EnvCount* count = nullptr;
  Forced(cuda::EnvSwitch& s, int mode) : sw(&s) { s.force(mode); }
  Forced(cuda::EnvCount& c, long long v) : count(&c) { c.force(v); }
  ~Forced() {
    if (sw) sw->force(-1);
    if (count) count->force(0);
  }
  Forced(const Forced&) = delete;
  Forced& operator=(const Forced&) = delete;
};

}  // namespace ds::test
