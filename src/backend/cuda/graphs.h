// The CUDA backend's graphs: a capture may be cut at the model's layer boundaries into pieces,
// each its own executable graph, which replay launches in order on the stream.
//
// Why pieces: where launching a graph costs the host time in proportion to its kernels (drivers
// before the constant-time launch of straight-line graphs), the device runs none of them until
// the launch call returns; cut every few layers, it starts on the first piece while the host
// launches the rest. DEEPSERVE_GRAPH_PIECE_LAYERS=N cuts every N layers (unset: one graph a
// step). Off by default: on the H100's driver (580) a launch of 1,150 kernels costs the host
// ~3 us, each cut ~1.3-2.9 us more, and the kernel after a cut waits for the whole piece before
// it (stream order) where dependent launch would have overlapped it with one kernel: W5's layers
// -1.3% with a piece a layer (docs/PERFORMANCE.md, thirty-sixth section).
#pragma once

#include <cuda_runtime.h>

#include <vector>

namespace ds::cuda {

class GraphSet {
 public:
  GraphSet() = default;
  GraphSet(const GraphSet&) = delete;
  GraphSet& operator=(const GraphSet&) = delete;
  ~GraphSet() { reset(); }

  // Starts recording the stream's work; `every` > 0: cut() ends a piece at every every-th call.
  void begin(cudaStream_t stream, long long every);
  // A layer boundary (counted; a piece ends at every every-th one). A no-op when not capturing.
  void cut();
  // Ends the capture: the graph's id for replay().
  int end();
  // Launches graph g's pieces in order on the stream.
  void replay(int g, cudaStream_t stream) const;
  void reset();
  bool capturing() const { return capturing_; }
  size_t pieces(int g) const { return graphs_.at(size_t(g)).size(); }

 private:
  void close_piece();  // ends the stream capture, instantiates and uploads its piece
  void drop_open();    // destroys the pieces of a capture that failed

  std::vector<std::vector<cudaGraphExec_t>> graphs_;
  std::vector<cudaGraphExec_t> open_;  // the pieces of the capture in progress
  cudaStream_t stream_ = nullptr;
  long long every_ = 0, cuts_ = 0;
  bool capturing_ = false;
};

}  // namespace ds::cuda
