// The model-side view helpers: column ranges of weights of every plain dtype (the shared-expert
// fold slices down_proj with them) address the same elements as an index computation.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "core/error.h"
#include "model/binder.h"

namespace ds {
namespace {

TEST(BinderViews, ColsAddressesElementsOfEveryPlainDtype) {
  const int64_t rows = 3, width = 10, begin = 4, n = 5;
  for (DType t : {DType::F32, DType::F16, DType::BF16}) {
    SCOPED_TRACE(std::string(dtype_name(t)));
    const int64_t es = int64_t(dtype_info(t).type_size);
    std::vector<uint8_t> buf(size_t(rows * width * es));
    const TensorView full = TensorView::contiguous(buf.data(), t, {rows, width});
    const TensorView v = cols(full, begin, n);
    EXPECT_EQ(v.shape[0], rows);
    EXPECT_EQ(v.shape[1], n);
    EXPECT_EQ(v.row_stride(), full.row_stride());
    for (int64_t r = 0; r < rows; ++r)
      EXPECT_EQ(static_cast<const uint8_t*>(v.row(r)), buf.data() + (r * width + begin) * es);
  }
}

TEST(BinderViews, ColsRefusesBlockQuantizedTensors) {
  std::vector<uint8_t> buf(34 * 2);
  const TensorView q = TensorView::contiguous(buf.data(), DType::Q8_0, {2, 32});
  EXPECT_THROW(cols(q, 0, 16), Error);
}

}  // namespace
}  // namespace ds
