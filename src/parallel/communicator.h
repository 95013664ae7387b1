// Collectives between the ranks of a tensor / expert parallel group. A model calls them on
// its own rank's buffers; every rank must make the same calls in the same order.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/tensor.h"

namespace ds {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual const char* name() const = 0;
  // In place: buf (contiguous F32 or BF16 in this rank's memory) becomes the element-wise sum
  // of every rank's buf. Enqueued on the rank's stream (NCCL) or done before returning (CPU).
  virtual void all_reduce_sum(TensorView buf) = 0;
  // out (contiguous, size() * in.numel() elements) = every rank's `in` in rank order.
  virtual void all_gather(const TensorView& in, TensorView out) = 0;
  // send holds size() parts in rank order, part q (send_counts[q] elements of dtype) for rank
  // q; recv gets rank q's part for this rank at element offset sum(recv_counts[0..q)).
  virtual void all_to_all(const void* send, std::span<const int64_t> send_counts, void* recv,
                          std::span<const int64_t> recv_counts, DType dtype) = 0;
  virtual void barrier() = 0;
  // A failing rank calls this so that ranks waiting in (or later entering) a collective throw
  // instead of waiting forever; reset() (all ranks idle) makes the group usable again.
  virtual void abort() {}
  virtual void reset() {}
};

// N ranks as N threads of this process (tests and the CPU backend). Reductions add the ranks'
// values in rank order (rank 0 first) in F32, so a run is reproducible whatever the timing.
std::vector<std::unique_ptr<Communicator>> make_local_communicators(int n);

}  // namespace ds
