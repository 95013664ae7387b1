#include "backend/cuda/graphs.h"

#include "backend/cuda/common.cuh"
#include "core/error.h"

namespace ds::cuda {

void GraphSet::begin(cudaStream_t stream, long long every) {
  DS_CHECK(!capturing_, "graph capture already in progress");
  check_cuda(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
             "cudaStreamBeginCapture");
  stream_ = stream;
  every_ = every;
  cuts_ = 0;
  capturing_ = true;
}

void GraphSet::close_piece() {
  cudaGraph_t graph = nullptr;
  check_cuda(cudaStreamEndCapture(stream_, &graph), "cudaStreamEndCapture");
  cudaGraphExec_t exec = nullptr;
  const cudaError_t e = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  check_cuda(e, "cudaGraphInstantiate");
  open_.push_back(exec);
  // The first launch would otherwise carry the upload (the step that captured runs eagerly).
  check_cuda(cudaGraphUpload(exec, stream_), "cudaGraphUpload");
}

void GraphSet::drop_open() {
  for (cudaGraphExec_t g : open_) cudaGraphExecDestroy(g);
  open_.clear();
}

void GraphSet::cut() {
  if (!capturing_ || every_ <= 0 || ++cuts_ % every_ != 0) return;
  try {
    close_piece();
  } catch (...) {
    capturing_ = false;  // the stream is no longer capturing: end() must not be needed
    drop_open();
    throw;
  }
  check_cuda(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal),
             "cudaStreamBeginCapture");
}

int GraphSet::end() {
  DS_CHECK(capturing_, "no graph capture in progress");
  capturing_ = false;
  try {
    close_piece();
  } catch (...) {
    drop_open();
    throw;
  }
  graphs_.push_back(std::move(open_));
  open_.clear();
  return int(graphs_.size()) - 1;
}

void GraphSet::replay(int g, cudaStream_t stream) const {
  DS_CHECK(g >= 0 && size_t(g) < graphs_.size() && !graphs_[size_t(g)].empty(), "unknown graph");
  for (cudaGraphExec_t exec : graphs_[size_t(g)])
    check_cuda(cudaGraphLaunch(exec, stream), "cudaGraphLaunch");
}

void GraphSet::reset() {
  for (auto& pieces : graphs_)
    for (cudaGraphExec_t g : pieces)
      if (g) cudaGraphExecDestroy(g);
  graphs_.clear();
}

}  // namespace ds::cuda
