#include "model/binder.h"

#include <algorithm>
#include <cstring>
#include <thread>

#include "backend/cpu/quants.h"
#include "backend/fp8w.h"
#include "backend/w4a16.h"
#include "core/error.h"
#include "core/log.h"
#include "model/gptq.h"

namespace ds {

void ensure_scratch(Backend& be, std::unique_ptr<Buffer>& buf, int64_t elems) {
  const size_t bytes = size_t(std::max<int64_t>(elems, 1)) * 4;
  if (!buf || buf->size() < bytes) buf = be.alloc(bytes);
}

void check_shape(const TensorView& t, int64_t rows, int64_t cols, const std::string& name) {
  if (t.ndim != 2 || t.shape[0] != rows || t.shape[1] != cols)
    throw Error("tensor '" + name + "' has shape " + t.shape_str() + ", expected [" +
                std::to_string(rows) + ", " + std::to_string(cols) + "]");
}

float host_element(const TensorView& t, int64_t i) {
  const uint8_t* p =
      static_cast<const uint8_t*>(t.data) + i * int64_t(dtype_info(t.dtype).type_size);
  switch (t.dtype) {
    case DType::F32: {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    case DType::F16:
      return fp16_to_f32(uint16_t(p[0] | p[1] << 8));
    case DType::BF16:
      return bf16_to_f32(uint16_t(p[0] | p[1] << 8));
    default:
      throw UnsupportedError("dtype " + std::string(dtype_name(t.dtype)) +
                             " where F32, F16 or BF16 is needed");
  }
}

void WeightBinder::count(const TensorView& t) {
  const bool padded = row_scaled_dtype(t.dtype);
  const uint64_t b = padded ? uint64_t(t.rows()) * uint64_t(t.row_stride()) : uint64_t(t.nbytes());
  bytes_ += b;
  auto& f = formats_[std::string(dtype_name(t.dtype))];
  f.first += b;
  f.second += uint64_t(t.numel());
}

void* WeightBinder::alloc_placed(size_t bytes) {
  owned_.push_back(be_.alloc(bytes));
  placed_.push_back(owned_.back()->data());
  return owned_.back()->data();
}

void WeightBinder::release(const void* data) {
  std::erase(placed_, data);
  std::erase_if(owned_, [&](const std::unique_ptr<Buffer>& b) { return b->data() == data; });
}

namespace {
// The dummy recipe of a weight as fill_random parameters, rounded through its dtype.
RandomFill fill_of(const DummyInit& init, DType round_as) {
  RandomFill f;
  f.seed = init.seed;
  f.mean = init.mean;
  f.std = init.std;
  f.round_as = round_as;
  return f;
}
}  // namespace

TensorView WeightBinder::place(const TensorView& host) {
  if (std::find(placed_.begin(), placed_.end(), host.data) != placed_.end()) return host;
  count(host);
  if (be_.device().kind == DeviceKind::CPU) return host;  // the mapped file itself
  DS_CHECK(host.is_contiguous(), "weights must be contiguous to upload");
  owned_.push_back(be_.alloc(host.nbytes()));
  TensorView d = host;
  d.data = owned_.back()->data();
  d.device = be_.device();
  be_.upload(d, host.data, host.nbytes());
  return d;
}

std::vector<TensorView> WeightBinder::split_cols(const TensorView& w, int parts) {
  DS_CHECK(w.ndim == 2 && parts > 0 && w.cols() % parts == 0,
           "split_cols: the columns do not split evenly");
  const int64_t n = w.cols() / parts;
  std::vector<TensorView> out;
  if (!row_scaled_dtype(w.dtype)) {
    for (int i = 0; i < parts; ++i) out.push_back(cols(w, i * n, n));
    return out;
  }
  const int64_t rows = w.rows(), K = w.cols(), src = w.row_stride();
  std::vector<uint8_t> all(size_t(rows * src));
  be_.download(all.data(), w, all.size());
  std::vector<uint8_t> packed;
  for (int i = 0; i < parts; ++i) {
    out.push_back(alloc_weight(w.dtype, rows, n));
    const int64_t dst = out.back().row_stride();
    packed.resize(size_t(rows * dst));
    for (int64_t r = 0; r < rows; ++r)
      slice_packed_row(w.dtype, all.data() + r * src, K, i * n, n, packed.data() + r * dst);
    be_.upload(out.back(), packed.data(), packed.size());
    be_.synchronize();  // `packed` is refilled next
  }
  return out;
}

TensorView WeightBinder::upload(const void* host, DType dtype,
                                std::initializer_list<int64_t> dims) {
  TensorView h = TensorView::contiguous(const_cast<void*>(host), dtype, dims);
  owned_.push_back(be_.alloc(h.nbytes()));
  TensorView d = TensorView::contiguous(owned_.back()->data(), dtype, dims, be_.device());
  be_.upload(d, host, h.nbytes());
  return d;
}

Fp8Checkpoint Fp8Checkpoint::of(const WeightSource& w, const std::string& name,
                                const TensorView& t) {
  Fp8Checkpoint f;
  f.codes = t;
  const int64_t N = t.rows(), K = t.cols();
  if (!t.is_contiguous()) throw UnsupportedError("FP8 tensor '" + name + "' is not contiguous");
  if (const auto s = w.find(name + "_scale_inv")) {  // DeepSeek-V3: [ceil(N/128), ceil(K/128)]
    if (s->ndim != 2 || s->shape[0] != (N + 127) / 128 || s->shape[1] != (K + 127) / 128)
      throw UnsupportedError("FP8 tensor '" + name + "': " + name + "_scale_inv has shape " +
                             s->shape_str() + "; only 128 x 128 block scales are supported");
    f.scales = *s;
    f.block_rows = 128;
  } else if (const auto c = w.find(name + "_scale")) {  // per channel [N] / [N, 1], per tensor
    if (c->numel() != N && c->numel() != 1)
      throw UnsupportedError("FP8 tensor '" + name + "': " + name + "_scale has shape " +
                             c->shape_str() + "; per-channel ([N] or [N, 1]) or per-tensor only");
    f.scales = *c;
    f.block_rows = c->numel() == 1 ? 0 : 1;
  } else {
    throw UnsupportedError("FP8 tensor '" + name + "' has no " + name + "_scale_inv (128 x 128 " +
                           "blocks) or " + name + "_scale (per channel) beside it");
  }
  return f;
}

float Fp8Checkpoint::scale(int64_t n, int64_t g) const {
  if (block_rows == 0) return host_element(scales, 0);
  if (block_rows == 1) return host_element(scales, n);
  return host_element(scales, (n / block_rows) * scales.shape[1] + g);
}

void Fp8Checkpoint::row(int64_t n, float* out) const {
  const int64_t K = codes.cols();
  const uint8_t* c = codes.row(n);
  for (int64_t g = 0; g * fp8w::kGroup < K; ++g) {
    const float s = scale(n, g);
    for (int64_t k = g * fp8w::kGroup; k < std::min<int64_t>(K, (g + 1) * fp8w::kGroup); ++k)
      out[k] = fp8w::decode(c[k]) * s;
  }
}

void Fp8Checkpoint::fp8w_row(int64_t n, uint8_t* dst) const {
  const int64_t K = codes.cols();
  std::memset(dst, 0, size_t(fp8w::row_stride(K)));
  std::memcpy(dst, codes.row(n), size_t(K));
  for (int64_t g = 0; g < fp8w::groups(K); ++g) fp8w::set_scale(dst, K, g, scale(n, g));
}

namespace {
// Calls fn(r) for every r in [0, rows), on all cores when the tensor is big (each row's bytes
// depend on that row alone); experts are small (2048 x 1408 in DeepSeek-V2-Lite) but
// thousands: one thread each took 203 s.
template <typename Fn>
void parallel_rows(int64_t rows, int64_t cols, Fn fn) {
  const int64_t threads = rows * cols >= (int64_t(1) << 18)
                              ? std::max<int64_t>(1, std::thread::hardware_concurrency())
                              : 1;
  auto from = [&](int64_t r0) {
    for (int64_t r = r0; r < rows; r += threads) fn(r);
  };
  std::vector<std::thread> pool;
  for (int64_t i = 1; i < threads; ++i) pool.emplace_back(from, i);
  from(0);
  for (auto& th : pool) th.join();
}

// A float row as a row of dt (W4A16, FP8W, BF16 or F32).
void encode_row(const float* row, int64_t cols, DType dt, uint8_t* out) {
  if (dt == DType::W4A16)
    quantize_w4a16_row(row, cols, out);
  else if (dt == DType::FP8W)
    quantize_fp8w_row(row, cols, out);
  else if (dt == DType::BF16)
    for (int64_t c = 0; c < cols; ++c) {
      const uint16_t b = f32_to_bf16(row[c]);
      std::memcpy(out + 2 * c, &b, 2);
    }
  else
    std::memcpy(out, row, size_t(cols) * 4);
}
}  // namespace

TensorView WeightBinder::alloc_weight(DType dt, int64_t rows, int64_t cols) {
  if (dt == DType::W4A16)
    return w4a16_view(alloc_placed(w4a16_bytes(rows, cols)), rows, cols, be_.device());
  if (dt == DType::FP8W)
    return fp8w_view(alloc_placed(fp8w_bytes(rows, cols)), rows, cols, be_.device());
  return TensorView::contiguous(alloc_placed(size_t(rows) * dtype_bytes(dt, cols)), dt,
                                {rows, cols}, be_.device());
}

std::optional<std::string> WeightBinder::int4_stem(const std::string& name) const {
  if (!int4_ || !name.ends_with("weight") || w_.find(name)) return std::nullopt;
  const std::string stem = name.substr(0, name.size() - 6);
  if (!w_.find(stem + "qweight")) return std::nullopt;
  return stem;
}

TensorView WeightBinder::checked_int4(const std::string& stem, int64_t rows, int64_t cols, Op op,
                                      Quantizable q) {
  const Int4Checkpoint ck = Int4Checkpoint::of(w_, *int4_, stem, rows, cols);
  const bool big = q == Quantizable::Yes && (op == Op::MatMul || op == Op::MoeFfn);
  const bool exact = ck.w4a16_blocker().empty();
  // Exact GPTQ binds as W4A16 as stored; the rest is dequantized exactly, then converted.
  DType dt = DType::F32;
  if (big && exact && (quant_ == WeightQuant::None || quant_ == WeightQuant::W4A16))
    dt = DType::W4A16;
  else if (big && quant_ == WeightQuant::W4A16 && cols % w4a16::kGroup == 0)
    dt = DType::W4A16;
  else if (big && quant_ == WeightQuant::FP8)
    dt = DType::FP8W;
  else if (big)
    dt = DType::BF16;
  const std::string why = exact ? "" : ck.w4a16_blocker();
  if (!(exact && dt == DType::W4A16) &&
      int4_notes_.insert(why + std::string(dtype_name(dt))).second)
    log_info(stem + "qweight (and 4-bit weights like it) dequantized, bound as " +
             std::string(dtype_name(dt)) + ": " +
             (why.empty() ? std::string(big ? "--quantize" : "not a big matmul") : why));
  if (!be_.supports(op, dt))
    throw UnsupportedError(be_.name() + " has no " + std::string(op_name(op)) + " for " +
                           std::string(dtype_name(dt)) + " weights (" + stem + "qweight)");
  TensorView d = alloc_weight(dt, rows, cols);
  std::vector<uint8_t> packed(size_t(rows) * size_t(d.row_stride()));
  parallel_rows(rows, cols, [&](int64_t r) {
    uint8_t* out = packed.data() + r * d.row_stride();
    if (exact && dt == DType::W4A16) return ck.w4a16_row(r, out);
    thread_local std::vector<float> row;
    row.resize(size_t(cols));
    ck.row(r, row.data());
    encode_row(row.data(), cols, dt, out);
  });
  be_.upload(d, packed.data(), packed.size());
  count(d);
  return d;
}

TensorView WeightBinder::checked(const std::string& name, int64_t rows, int64_t cols, Op op,
                                 Quantizable q) {
  if (const auto stem = int4_stem(name)) return checked_int4(*stem, rows, cols, op, q);
  TensorView t = w_.get(name);
  check_shape(t, rows, cols, name);
  const bool f8 = t.dtype == DType::F8_E4M3;  // an FP8 checkpoint's weight (with its scales)
  const bool plain = t.dtype == DType::F32 || t.dtype == DType::F16 || t.dtype == DType::BF16;
  // GGUF blocks convert only when asked: as stored they run as they are.
  const bool gguf = ggml_block_type(t.dtype) && quant_ != WeightQuant::None;
  const bool big = q == Quantizable::Yes && (op == Op::MatMul || op == Op::MoeFfn);
  const bool w4_fits = cols % w4a16::kGroup == 0;
  if (quant_ == WeightQuant::W4A16 && big && (plain || f8 || gguf) && !w4_fits)
    log_info(name + " stays " + std::string(f8 ? "FP8W" : dtype_name(t.dtype)) +
             ": K = " + std::to_string(cols) + " is not a multiple of 128");
  // FP8 checkpoint weights bind as FP8W (or W4A16 / BF16 when asked); those used otherwise
  // (MLA's kv_b_proj, an FP8 output projection) are dequantized to F32.
  DType dt = t.dtype;
  if (big && (plain || f8 || gguf) && quant_ == WeightQuant::W4A16 && w4_fits)
    dt = DType::W4A16;
  else if (big && (plain || f8 || gguf) && quant_ == WeightQuant::BF16)
    dt = DType::BF16;
  else if (big && (f8 || ((plain || gguf) && quant_ == WeightQuant::FP8)))
    dt = DType::FP8W;
  else if (f8)
    dt = DType::F32;
  if (!be_.supports(op, dt))
    throw UnsupportedError(be_.name() + " has no " + std::string(op_name(op)) + " for " +
                           std::string(dtype_name(dt)) + " weights (" + name + ")");
  const auto init = w_.dummy_init(name);
  if (!init && dt == t.dtype) return t;
  TensorView d = alloc_weight(dt, rows, cols);
  if (init) {
    be_.fill_random(d, fill_of(*init, t.dtype));
  } else {  // convert the checkpoint's rows on the host, one upload
    DS_CHECK(t.is_contiguous(), "tensor '" + name + "' is not contiguous");
    std::optional<Fp8Checkpoint> f8s;
    if (f8) f8s = Fp8Checkpoint::of(w_, name, t);
    std::vector<uint8_t> packed(size_t(rows) * size_t(d.row_stride()));
    parallel_rows(rows, cols, [&](int64_t r) {
      uint8_t* out = packed.data() + r * d.row_stride();
      if (f8 && dt == DType::FP8W) return f8s->fp8w_row(r, out);  // exact: codes and scales
      thread_local std::vector<float> row;
      row.resize(size_t(cols));
      if (f8)
        f8s->row(r, row.data());
      else if (ggml_block_type(t.dtype))
        cpu::dequantize_row_ref(t.dtype, static_cast<const uint8_t*>(t.data) + r * t.row_stride(),
                                row.data(), cols);
      else
        for (int64_t c = 0; c < cols; ++c) row[size_t(c)] = host_element(t, r * cols + c);
      encode_row(row.data(), cols, dt, out);
    });
    be_.upload(d, packed.data(), packed.size());
  }
  count(d);
  return d;
}

TensorView WeightBinder::host_plain(const std::string& name, std::vector<float>& keep) const {
  if (const auto stem = int4_stem(name)) {  // a 4-bit weight used other than as a matmul
    const Int4Checkpoint ck = Int4Checkpoint::of(w_, *int4_, *stem);
    keep.resize(size_t(ck.rows() * ck.cols()));
    for (int64_t r = 0; r < ck.rows(); ++r) ck.row(r, keep.data() + r * ck.cols());
    return TensorView::contiguous(keep.data(), DType::F32, {ck.rows(), ck.cols()});
  }
  const TensorView t = w_.get(name);
  if (t.dtype != DType::F8_E4M3) return t;
  const Fp8Checkpoint f = Fp8Checkpoint::of(w_, name, t);
  keep.resize(size_t(t.numel()));
  for (int64_t r = 0; r < t.rows(); ++r) f.row(r, keep.data() + r * t.cols());
  return TensorView::contiguous(keep.data(), DType::F32, {t.rows(), t.cols()});
}

TensorView WeightBinder::permuted(const std::string& name, std::array<int64_t, 3> dims,
                                  std::array<int64_t, 3> strides) {
  std::vector<float> keep;
  const TensorView t = host_plain(name, keep);
  const size_t es = dtype_info(t.dtype).type_size;
  DS_CHECK(dtype_info(t.dtype).block_size == 1, "permuted: a block-quantized tensor");
  const size_t bytes = size_t(dims[0] * dims[1] * dims[2]) * es;
  if (const auto init = w_.dummy_init(name)) {
    owned_.push_back(be_.alloc(bytes));
    TensorView d = owned_.back()->view(t.dtype, {dims[0], dims[1], dims[2]});
    RandomFill f = fill_of(*init, t.dtype);
    f.map = strides;
    be_.fill_random(d, f);
    return d;
  }
  std::vector<uint8_t> out(bytes);
  const int64_t C = t.cols();
  size_t o = 0;
  for (int64_t a = 0; a < dims[0]; ++a)
    for (int64_t b = 0; b < dims[1]; ++b)
      for (int64_t c = 0; c < dims[2]; ++c, o += es) {
        const int64_t i = a * strides[0] + b * strides[1] + c * strides[2];
        std::memcpy(&out[o], t.row(i / C) + (i % C) * int64_t(es), es);
      }
  return upload(out.data(), t.dtype, {dims[0], dims[1], dims[2]});
}

TensorView WeightBinder::table(const std::string& name, int64_t rows, int64_t cols) {
  TensorView t = w_.get(name);
  check_shape(t, rows, cols, name);
  if (!be_.supports(Op::Embed, t.dtype))
    throw UnsupportedError(be_.name() + ": embedding of " + std::string(dtype_name(t.dtype)));
  if (const auto init = w_.dummy_init(name)) {
    TensorView d =
        TensorView::contiguous(alloc_placed(t.nbytes()), t.dtype, {rows, cols}, be_.device());
    be_.fill_random(d, fill_of(*init, t.dtype));
    count(d);
    return d;
  }
  return place(t);
}

// A dummy weight generated straight into F32 backend memory (rounded through its dtype).
TensorView WeightBinder::dummy_f32(const std::string& name, const TensorView& t,
                                   const DummyInit& init) {
  owned_.push_back(be_.alloc(size_t(t.numel()) * 4));
  TensorView d = t.ndim == 1 ? owned_.back()->view(DType::F32, {t.shape[0]})
                             : owned_.back()->view(DType::F32, {t.shape[0], t.shape[1]});
  be_.fill_random(d, fill_of(init, t.dtype));
  count(d);
  return d;
}

TensorView WeightBinder::linear_f32(const std::string& name, int64_t rows, int64_t cols) {
  std::vector<float> keep;
  const TensorView t = host_plain(name, keep);
  check_shape(t, rows, cols, name);
  if (const auto init = w_.dummy_init(name)) return dummy_f32(name, t, *init);
  if (!t.is_contiguous()) throw Error("tensor '" + name + "' is not contiguous");
  std::vector<float> host(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) host[size_t(i)] = host_element(t, i);
  const TensorView d = upload(host.data(), DType::F32, {rows, cols});
  count(d);
  return d;
}

TensorView WeightBinder::norm(const std::string& name, int64_t n) {
  const TensorView t = w_.get(name);
  if (t.ndim != 1 || t.shape[0] != n)
    throw Error("tensor '" + name + "' has shape " + t.shape_str() + ", expected [" +
                std::to_string(n) + "]");
  if (const auto init = w_.dummy_init(name)) return dummy_f32(name, t, *init);
  std::vector<float> host(size_t(t.shape[0]));
  try {
    for (int64_t i = 0; i < n; ++i) host[size_t(i)] = host_element(t, i);
  } catch (const UnsupportedError&) {
    throw UnsupportedError("tensor '" + name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                           "; norms must be F32/F16/BF16");
  }
  const TensorView d = upload(host.data(), DType::F32, {n});
  count(d);
  return d;
}

std::optional<TensorView> WeightBinder::fuse_rows(std::initializer_list<TensorView> parts) {
  const TensorView& first = *parts.begin();
  auto is_placed = [&](const TensorView& t) {
    return std::find(placed_.begin(), placed_.end(), t.data) != placed_.end();
  };
  const bool placed = is_placed(first);
  int64_t rows = 0;
  for (const auto& t : parts) {
    if (t.dtype != first.dtype || t.cols() != first.cols() || is_placed(t) != placed ||
        (!placed && !t.is_contiguous()))
      return std::nullopt;
    rows += t.rows();
  }
  const bool w4 = first.dtype == DType::W4A16, f8 = first.dtype == DType::FP8W;
  owned_.push_back(be_.alloc(w4   ? w4a16_bytes(rows, first.cols())
                             : f8 ? fp8w_bytes(rows, first.cols())
                                  : size_t(rows) * first.row_bytes()));
  TensorView fused = w4   ? w4a16_view(owned_.back()->data(), rows, first.cols(), be_.device())
                     : f8 ? fp8w_view(owned_.back()->data(), rows, first.cols(), be_.device())
                          : owned_.back()->view(first.dtype, {rows, first.cols()});
  int64_t at = 0;
  for (const auto& t : parts) {
    TensorView dst = fused.slice_rows(at, at + t.rows());
    if (placed) {  // made in backend memory: a device copy of its bytes, then freed
      const int64_t n = t.rows() * t.row_stride();
      be_.copy(TensorView::contiguous(t.data, DType::U8, {n}, be_.device()),
               TensorView::contiguous(dst.data, DType::U8, {n}, be_.device()));
      release(t.data);
    } else {
      be_.upload(dst, t.data, t.nbytes());
      count(t);
    }
    at += t.rows();
  }
  return fused;
}

}  // namespace ds
