#include <algorithm>

#include "backend/cuda/common.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/pdl.cuh"

namespace ds::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxGridY = 65535;

// Grid: x over column chunks of kThreads, y over rows (looping when there are more rows).
dim3 row_grid(int64_t rows, int64_t cols) {
  return dim3(std::max(1u, ceil_div(cols, kThreads)), unsigned(std::min(rows, kMaxGridY)));
}

__global__ void add_kernel(void* x, RowIndex xr, const void* y, RowIndex yr, int64_t rows,
                           int64_t n) {
  pdl::enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    at_bytes<float>(x, xr.offset(r))[i] += at_bytes<float>(y, yr.offset(r))[i];
}

__global__ void silu_mul_kernel(const void* gu, RowIndex gr, void* out, RowIndex orow, int64_t rows,
                                int64_t n) {
  pdl::enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const float* g = at_bytes<float>(gu, gr.offset(r));
    const float a = g[i];
    at_bytes<float>(out, orow.offset(r))[i] = a / (1.0f + expf(-a)) * g[n + i];
  }
}

// Copies rows of `units` elements of type U (U chosen so every address is U-aligned).
template <typename U>
__global__ void copy_kernel(const void* src, RowIndex sr, void* dst, RowIndex dr, int64_t rows,
                            int64_t units) {
  pdl::enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= units) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    at_bytes<U>(dst, dr.offset(r))[i] = at_bytes<U>(src, sr.offset(r))[i];
}

template <typename T>
__global__ void convert_kernel(const void* src, RowIndex sr, T* dst, int64_t ld, int64_t rows,
                               int64_t k) {
  pdl::enter();
  const int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= k) return;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
    dst[r * ld + i] = from_f32<T>(at_bytes<float>(src, sr.offset(r))[i]);
}

void check_launch(const char* what) {
  check_cuda(cudaGetLastError(), what);
}

bool aligned_to(const TensorView& v, int64_t a) {
  if (reinterpret_cast<uintptr_t>(v.data) % uintptr_t(a) != 0) return false;
  for (int d = 0; d + 1 < v.ndim; ++d)
    if (v.shape[size_t(d)] > 1 && v.stride[size_t(d)] % a != 0) return false;
  return true;
}

template <typename U>
void copy_units(const TensorView& src, const TensorView& dst, cudaStream_t stream) {
  const int64_t rows = src.rows(), units = int64_t(src.row_bytes()) / int64_t(sizeof(U));
  pdl::launch(copy_kernel<U>, row_grid(rows, units), kThreads, 0, stream, src.data, row_index(src),
              dst.data, row_index(dst), rows, units);
  check_launch("copy");
}

}  // namespace

void launch_add(const TensorView& x, const TensorView& y, cudaStream_t stream) {
  DS_CHECK(x.dtype == DType::F32 && y.dtype == DType::F32, "add takes F32");
  DS_CHECK(x.rows() == y.rows() && x.cols() == y.cols(),
           "add shapes " + x.shape_str() + " += " + y.shape_str());
  check_inner_dense(x, "add");
  check_inner_dense(y, "add");
  if (x.numel() == 0) return;
  pdl::launch(add_kernel, row_grid(x.rows(), x.cols()), kThreads, 0, stream, x.data, row_index(x),
              y.data, row_index(y), x.rows(), x.cols());
  check_launch("add");
}

void launch_silu_mul(const TensorView& gate_up, const TensorView& out, cudaStream_t stream) {
  DS_CHECK(gate_up.dtype == DType::F32 && out.dtype == DType::F32, "silu_mul takes F32");
  DS_CHECK(gate_up.rows() == out.rows() && gate_up.cols() == 2 * out.cols(),
           "silu_mul shapes " + gate_up.shape_str() + " -> " + out.shape_str());
  check_inner_dense(gate_up, "silu_mul");
  check_inner_dense(out, "silu_mul");
  if (out.numel() == 0) return;
  pdl::launch(silu_mul_kernel, row_grid(out.rows(), out.cols()), kThreads, 0, stream, gate_up.data,
              row_index(gate_up), out.data, row_index(out), out.rows(), out.cols());
  check_launch("silu_mul");
}

void launch_copy(const TensorView& src, const TensorView& dst, cudaStream_t stream) {
  DS_CHECK(src.dtype == dst.dtype && src.rows() == dst.rows() && src.cols() == dst.cols(),
           "copy shapes " + src.shape_str() + " -> " + dst.shape_str());
  DS_CHECK(dtype_info(src.dtype).block_size == 1 || (rows_uniform(src) && rows_uniform(dst)),
           "copy of block-quantized rows needs evenly spaced rows");
  if (src.numel() == 0) return;
  const size_t row_bytes = src.row_bytes();
  if (rows_uniform(src) && rows_uniform(dst) && src.row_stride() >= int64_t(row_bytes) &&
      dst.row_stride() >= int64_t(row_bytes)) {
    check_cuda(
        cudaMemcpy2DAsync(dst.data, size_t(dst.row_stride()), src.data, size_t(src.row_stride()),
                          row_bytes, size_t(src.rows()), cudaMemcpyDeviceToDevice, stream),
        "copy");
    return;
  }
  if (row_bytes % 16 == 0 && aligned_to(src, 16) && aligned_to(dst, 16))
    copy_units<uint4>(src, dst, stream);
  else if (row_bytes % 4 == 0 && aligned_to(src, 4) && aligned_to(dst, 4))
    copy_units<uint32_t>(src, dst, stream);
  else
    copy_units<uint8_t>(src, dst, stream);
}

void launch_convert_rows(const TensorView& src, DType dtype, void* dst, int64_t ld,
                         cudaStream_t stream) {
  DS_CHECK(src.dtype == DType::F32, "activations must be F32");
  check_inner_dense(src, "convert");
  const int64_t rows = src.rows(), k = src.cols();
  DS_CHECK(ld >= k, "convert: ld < K");
  if (rows == 0 || k == 0) return;
  const dim3 grid = row_grid(rows, k);
  const RowIndex ri = row_index(src);
  dispatch_float(dtype, "convert to", [&](auto t) {
    using T = decltype(t);
    pdl::launch(convert_kernel<T>, grid, kThreads, 0, stream, src.data, ri, static_cast<T*>(dst),
                ld, rows, k);
  });
  check_launch("convert");
}

}  // namespace ds::cuda
