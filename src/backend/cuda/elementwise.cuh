// Row-wise F32 elementwise kernels, strided copies and the activation conversion GEMMs use.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"

namespace ds::cuda {

// x += y; both [rows, n] F32, rows may be strided.
void launch_add(const TensorView& x, const TensorView& y, cudaStream_t stream);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, n + i]; gate_up [T, 2n], out [T, n] F32.
void launch_silu_mul(const TensorView& gate_up, const TensorView& out, cudaStream_t stream);

// dst = src (same dtype and shape, any plain dtype); leading dims may be strided.
void launch_copy(const TensorView& src, const TensorView& dst, cudaStream_t stream);

// Row r of src ([rows, K] F32, leading dims strided) rounded to `dtype` (F32, F16 or BF16)
// into dst + r * ld elements: a dense operand for cuBLAS.
void launch_convert_rows(const TensorView& src, DType dtype, void* dst, int64_t ld,
                         cudaStream_t stream);

}  // namespace ds::cuda
