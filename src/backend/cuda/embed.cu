#include <algorithm>

#include "backend/cuda/embed.cuh"
#include "backend/cuda/pdl.cuh"

namespace ds::cuda {
namespace {

template <typename T>
__global__ void embed_kernel(const void* table, int64_t table_stride, int64_t vocab,
                             const int32_t* __restrict__ ids, int n, void* out, RowIndex orow,
                             int64_t dim, DeviceErrors* errors) {
  pdl::enter();
  embed_rows(ids, n, vocab, out, orow, dim, errors, [&](float* o, int32_t id) {
    const T* row = at_bytes<T>(table, int64_t(id) * table_stride);
    for (int64_t i = threadIdx.x; i < dim; i += blockDim.x) o[i] = to_f32(row[i]);
  });
}

template <typename T>
void launch_typed(const EmbedArgs& a, cudaStream_t stream) {
  const int64_t dim = a.table.cols();
  const int threads = int(std::clamp<int64_t>((dim + 31) / 32 * 32, 32, 256));
  const unsigned blocks = unsigned(std::min(a.n, 1 << 20));
  pdl::launch(embed_kernel<T>, blocks, threads, 0, stream, a.table.data, a.table.row_stride(),
              a.table.shape[0], a.ids, a.n, a.out.data, row_index(a.out), dim, a.errors);
}

}  // namespace

void launch_embed(const EmbedArgs& a, cudaStream_t stream) {
  DS_CHECK(a.out.dtype == DType::F32, "embed writes F32");
  DS_CHECK(a.table.ndim == 2, "embed table must be [vocab, hidden]");
  DS_CHECK(a.out.rows() >= a.n && a.out.cols() == a.table.cols(),
           "embed shapes " + a.table.shape_str() + " -> " + a.out.shape_str());
  check_inner_dense(a.table, "embed");
  check_inner_dense(a.out, "embed");
  if (a.n <= 0 || a.table.cols() == 0) return;
  dispatch_float(a.table.dtype, "embed table",
                 [&](auto t) { launch_typed<decltype(t)>(a, stream); });
  check_cuda(cudaGetLastError(), "embed");
}

}  // namespace ds::cuda
