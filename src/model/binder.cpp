#include "model/binder.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"

namespace ds {

TensorView cols(const TensorView& t, int64_t begin, int64_t n) {
  const DTypeInfo& info = dtype_info(t.dtype);
  DS_CHECK(info.block_size == 1, "cols: a column range of a block-quantized tensor");
  TensorView v = t;
  v.data = static_cast<uint8_t*>(t.data) + begin * info.type_size;
  v.shape[1] = n;
  return v;
}

TensorView heads_view(const TensorView& t, int heads, int hd) {
  TensorView v = t;
  v.ndim = 3;
  v.shape = {t.shape[0], heads, hd, 0};
  v.stride = {t.stride[0], int64_t(hd) * 4, 4, 0};
  return v;
}

TensorView heads_first(const TensorView& t) {
  TensorView v = t;
  v.shape = {t.shape[1], t.shape[0], t.shape[2], 0};
  v.stride = {t.stride[1], t.stride[0], t.stride[2], 0};
  return v;
}

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

TensorView WeightBinder::place(const TensorView& host) {
  bytes_ += host.nbytes();
  if (be_.device().kind == DeviceKind::CPU) return host;  // the mapped file itself
  DS_CHECK(host.is_contiguous(), "weights must be contiguous to upload");
  owned_.push_back(be_.alloc(host.nbytes()));
  TensorView d = host;
  d.data = owned_.back()->data();
  d.device = be_.device();
  be_.upload(d, host.data, host.nbytes());
  return d;
}

TensorView WeightBinder::upload(const void* host, DType dtype,
                                std::initializer_list<int64_t> dims) {
  TensorView h = TensorView::contiguous(const_cast<void*>(host), dtype, dims);
  owned_.push_back(be_.alloc(h.nbytes()));
  TensorView d = TensorView::contiguous(owned_.back()->data(), dtype, dims, be_.device());
  be_.upload(d, host, h.nbytes());
  return d;
}

TensorView WeightBinder::checked(const std::string& name, int64_t rows, int64_t cols, Op op) {
  TensorView t = w_.get(name);
  check_shape(t, rows, cols, name);
  if (!be_.supports(op, t.dtype))
    throw UnsupportedError(be_.name() + " has no " + std::string(op_name(op)) + " for " +
                           std::string(dtype_name(t.dtype)) + " weights (" + name + ")");
  return t;
}

TensorView WeightBinder::table(const std::string& name, int64_t rows, int64_t cols) {
  TensorView t = w_.get(name);
  check_shape(t, rows, cols, name);
  if (!be_.supports(Op::Embed, t.dtype))
    throw UnsupportedError(be_.name() + ": embedding of " + std::string(dtype_name(t.dtype)));
  return place(t);
}

TensorView WeightBinder::linear_f32(const std::string& name, int64_t rows, int64_t cols) {
  const TensorView t = w_.get(name);
  check_shape(t, rows, cols, name);
  if (!t.is_contiguous()) throw Error("tensor '" + name + "' is not contiguous");
  std::vector<float> host(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows * cols; ++i) host[size_t(i)] = host_element(t, i);
  bytes_ += t.nbytes();
  return upload(host.data(), DType::F32, {rows, cols});
}

TensorView WeightBinder::norm(const std::string& name, int64_t n) {
  const TensorView t = w_.get(name);
  if (t.ndim != 1 || t.shape[0] != n)
    throw Error("tensor '" + name + "' has shape " + t.shape_str() + ", expected [" +
                std::to_string(n) + "]");
  std::vector<float> host(size_t(t.shape[0]));
  try {
    for (int64_t i = 0; i < n; ++i) host[size_t(i)] = host_element(t, i);
  } catch (const UnsupportedError&) {
    throw UnsupportedError("tensor '" + name + "' has dtype " + std::string(dtype_name(t.dtype)) +
                           "; norms must be F32/F16/BF16");
  }
  bytes_ += t.nbytes();
  return upload(host.data(), DType::F32, {n});
}

std::optional<TensorView> WeightBinder::fuse_rows(std::initializer_list<TensorView> parts) {
  const TensorView& first = *parts.begin();
  int64_t rows = 0;
  for (const auto& t : parts) {
    if (t.dtype != first.dtype || t.cols() != first.cols() || !t.is_contiguous())
      return std::nullopt;
    rows += t.rows();
  }
  owned_.push_back(be_.alloc(size_t(rows) * first.row_bytes()));
  TensorView fused = owned_.back()->view(first.dtype, {rows, first.cols()});
  int64_t at = 0;
  for (const auto& t : parts) {
    be_.upload(fused.slice_rows(at, at + t.rows()), t.data, t.nbytes());
    bytes_ += t.nbytes();
    at += t.rows();
  }
  return fused;
}

}  // namespace ds
