#include "parallel/nccl/nccl_comm.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

namespace ds {
namespace {

void check(ncclResult_t r, const char* what) {
  if (r != ncclSuccess) throw Error(std::string("NCCL ") + what + ": " + ncclGetErrorString(r));
}

ncclDataType_t nccl_type(DType t) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::BF16:
      return ncclBfloat16;
    case DType::F16:
      return ncclFloat16;
    case DType::I32:
      return ncclInt32;
    default:
      return ncclUint8;  // bytes: callers pass element counts of 1-byte types only
  }
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(ncclComm_t comm, int rank, int size, cudaStream_t stream)
      : comm_(comm), rank_(rank), size_(size), stream_(stream) {}
  ~NcclCommunicator() override {
    if (comm_) ncclCommDestroy(comm_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const char* name() const override { return "nccl"; }

  void all_reduce_sum(TensorView buf) override {
    DS_CHECK(buf.is_contiguous() && (buf.dtype == DType::F32 || buf.dtype == DType::BF16),
             "all_reduce_sum: a contiguous F32 or BF16 buffer");
    check(ncclAllReduce(buf.data, buf.data, size_t(buf.numel()), nccl_type(buf.dtype), ncclSum,
                        comm_, stream_),
          "all_reduce");
  }
  void all_gather(const TensorView& in, TensorView out) override {
    DS_CHECK(in.is_contiguous() && out.is_contiguous() && in.dtype == out.dtype &&
                 out.numel() == in.numel() * size_,
             "all_gather: out must hold size() contiguous copies of in");
    check(ncclAllGather(in.data, out.data, size_t(in.numel()), nccl_type(in.dtype), comm_, stream_),
          "all_gather");
  }
  // Grouped point-to-point: every pair's part in one launch group.
  void all_to_all(const void* send, std::span<const int64_t> send_counts, void* recv,
                  std::span<const int64_t> recv_counts, DType dtype) override {
    DS_CHECK(int(send_counts.size()) == size_ && int(recv_counts.size()) == size_,
             "all_to_all: one count per rank");
    const size_t es = dtype_info(dtype).type_size;
    const ncclDataType_t t = nccl_type(dtype);
    const size_t unit = t == ncclUint8 ? es : 1;  // other dtypes count elements
    check(ncclGroupStart(), "group start");
    size_t so = 0, ro = 0;
    for (int q = 0; q < size_; ++q) {
      const size_t sn = size_t(send_counts[size_t(q)]), rn = size_t(recv_counts[size_t(q)]);
      if (sn)
        check(
            ncclSend(static_cast<const uint8_t*>(send) + so * es, sn * unit, t, q, comm_, stream_),
            "send");
      if (rn)
        check(ncclRecv(static_cast<uint8_t*>(recv) + ro * es, rn * unit, t, q, comm_, stream_),
              "recv");
      so += sn;
      ro += rn;
    }
    check(ncclGroupEnd(), "group end");
  }
  void barrier() override {
    // A one-element all-reduce on the stream, then wait for it.
    if (!scratch_) {
      if (cudaMalloc(&scratch_, 4) != cudaSuccess) throw Error("NCCL barrier: cudaMalloc failed");
    }
    check(ncclAllReduce(scratch_, scratch_, 1, ncclFloat32, ncclSum, comm_, stream_), "barrier");
    if (cudaStreamSynchronize(stream_) != cudaSuccess) throw Error("NCCL barrier: sync failed");
  }
  // An aborted NCCL communicator cannot be reused: the step fails and so do later ones.
  void abort() override {
    if (comm_) ncclCommAbort(comm_);
    comm_ = nullptr;
  }

 private:
  ncclComm_t comm_;
  int rank_, size_;
  cudaStream_t stream_;
  void* scratch_ = nullptr;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(
    const std::vector<Backend*>& ranks) {
  const int n = int(ranks.size());
  std::vector<int> devices;
  for (const Backend* b : ranks) devices.push_back(cuda_device_of(*b));
  std::vector<ncclComm_t> comms(static_cast<size_t>(n));
  check(ncclCommInitAll(comms.data(), n, devices.data()), "ncclCommInitAll");
  std::vector<std::unique_ptr<Communicator>> out;
  for (int r = 0; r < n; ++r)
    out.push_back(std::make_unique<NcclCommunicator>(
        comms[size_t(r)], r, n, static_cast<cudaStream_t>(cuda_stream_of(*ranks[size_t(r)]))));
  return out;
}

}  // namespace ds
