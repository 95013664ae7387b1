// NCCL communicators, one per CUDA backend of this process (ncclCommInitAll): one engine
// thread and one worker thread per GPU drive the ranks in lock step, so a single process
// owns every GPU and no launcher or rendezvous across processes is needed. Built only when
// CMake found NCCL (DEEPSERVE_HAVE_NCCL).
#pragma once

#include <memory>
#include <vector>

#include "backend/backend.h"
#include "parallel/communicator.h"

namespace ds {

// Rank r uses ranks[r]'s device and stream; collectives are enqueued on that stream (so they
// can be captured into a CUDA graph with the rest of the step).
std::vector<std::unique_ptr<Communicator>> make_nccl_communicators(
    const std::vector<Backend*>& ranks);

}  // namespace ds
