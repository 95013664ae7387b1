// Non-owning tensor views over host or device memory.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "core/dtype.h"
#include "core/error.h"

namespace ds {

enum class DeviceKind : uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;
  bool operator==(const Device&) const = default;
  std::string str() const {
    return kind == DeviceKind::CPU ? "cpu" : "cuda:" + std::to_string(index);
  }
};

constexpr int kMaxDims = 4;

// Row-major view: shape[0] is the outermost dimension, shape[ndim-1] the contiguous one.
// Strides are in bytes so block-quantized rows (whose element stride is fractional) fit.
// The innermost dimension is always contiguous.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::F32;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> stride{};  // bytes
  Device device{};

  static TensorView contiguous(void* data, DType dtype, std::initializer_list<int64_t> dims,
                               Device device = {}) {
    TensorView t;
    t.data = data;
    t.dtype = dtype;
    t.device = device;
    t.ndim = int(dims.size());
    DS_CHECK(t.ndim >= 1 && t.ndim <= kMaxDims, "tensor rank out of range");
    int i = 0;
    for (int64_t d : dims) t.shape[i++] = d;
    // Element stride of the contiguous dimension; 0 for block formats, whose elements
    // have no byte address of their own.
    t.stride[t.ndim - 1] = dtype_info(dtype).block_size == 1 ? dtype_info(dtype).type_size : 0;
    int64_t s = int64_t(dtype_bytes(dtype, t.shape[t.ndim - 1]));
    for (int d = t.ndim - 2; d >= 0; --d) {
      t.stride[d] = s;
      s *= t.shape[d];
    }
    return t;
  }

  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  int64_t rows() const {
    if (ndim <= 1) return 1;
    int64_t r = 1;
    for (int i = 0; i < ndim - 1; ++i) r *= shape[i];
    return r;
  }
  int64_t cols() const { return ndim == 0 ? 0 : shape[ndim - 1]; }
  size_t row_bytes() const { return dtype_bytes(dtype, cols()); }
  int64_t row_stride() const { return ndim <= 1 ? int64_t(row_bytes()) : stride[ndim - 2]; }
  bool is_contiguous() const {
    if (ndim == 0) return true;
    int64_t s = int64_t(row_bytes());
    for (int d = ndim - 2; d >= 0; --d) {
      if (stride[d] != s) return false;
      s *= shape[d];
    }
    return true;
  }
  size_t nbytes() const { return size_t(rows()) * row_bytes(); }

  template <typename T>
  T* ptr() const {
    return static_cast<T*>(data);
  }
  // Pointer to the start of row r of a 2-D (or flattened leading dims, if contiguous) view.
  uint8_t* row(int64_t r) const { return static_cast<uint8_t*>(data) + r * row_stride(); }

  // Rows [begin, end) of the outermost dimension.
  TensorView slice_rows(int64_t begin, int64_t end) const {
    TensorView t = *this;
    t.data = static_cast<uint8_t*>(data) + begin * stride[0];
    t.shape[0] = end - begin;
    return t;
  }

  std::string shape_str() const {
    std::string s = "[";
    for (int i = 0; i < ndim; ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
  }
};

}  // namespace ds
