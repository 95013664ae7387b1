// Views into F32 activations that the model forward and the backends' composite ops share.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace ds {

// Columns [begin, begin + n) of a 2-D view of a plain (not block-quantized) dtype.
TensorView cols(const TensorView& t, int64_t begin, int64_t n);
// A [rows, heads * hd] F32 view (any row stride) as [rows, heads, hd].
TensorView heads_view(const TensorView& t, int heads, int hd);
// A [rows, heads, hd] view as [heads, rows, hd] (heads become batches of batched_matmul).
TensorView heads_first(const TensorView& t);

}  // namespace ds
