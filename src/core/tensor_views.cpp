#include "core/tensor_views.h"

#include "core/error.h"

namespace ds {

TensorView cols(const TensorView& t, int64_t begin, int64_t n) {
  const DTypeInfo& info = dtype_info(t.dtype);
  DS_CHECK(info.block_size == 1 && t.dtype != DType::FP8W,
           "cols: a column range of a block-quantized tensor");
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

}  // namespace ds
