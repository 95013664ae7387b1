// In-process communicator: ranks are threads sharing one rendezvous. Each collective posts
// pointers, meets at a barrier, reads the other ranks' buffers directly, and meets again
// before anyone may reuse them.
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "backend/backend.h"
#include "core/error.h"
#include "parallel/communicator.h"

namespace ds {
namespace {

struct Rendezvous {
  explicit Rendezvous(int n) : n(n), in(size_t(n)), counts(size_t(n)) {}
  const int n;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::vector<const void*> in;                   // each rank's posted buffer
  std::vector<std::span<const int64_t>> counts;  // all_to_all: each rank's send counts
  std::vector<float> sum;                        // all_reduce: the reduced values

  void wait() {
    std::unique_lock lock(mu);
    if (aborted) throw Error("collective aborted: another rank failed");
    const uint64_t g = generation;
    if (++arrived == n) {
      arrived = 0;
      ++generation;
      cv.notify_all();
      return;
    }
    cv.wait(lock, [&] { return generation != g || aborted; });
    if (generation == g) throw Error("collective aborted: another rank failed");
  }
};

float load(const void* p, DType t, int64_t i) {
  if (t == DType::F32) return static_cast<const float*>(p)[i];
  return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

class LocalCommunicator final : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<Rendezvous> r, int rank) : r_(std::move(r)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return r_->n; }
  const char* name() const override { return "in-process"; }

  void all_reduce_sum(TensorView buf) override {
    DS_CHECK(buf.is_contiguous() && (buf.dtype == DType::F32 || buf.dtype == DType::BF16),
             "all_reduce_sum: a contiguous F32 or BF16 buffer");
    DS_CHECK(buf.device.kind == DeviceKind::CPU, "the in-process communicator needs host memory");
    const int64_t n = buf.numel();
    {
      std::lock_guard lock(r_->mu);
      if (r_->sum.size() < size_t(n)) r_->sum.resize(size_t(n));
      r_->in[size_t(rank_)] = buf.data;
    }
    r_->wait();
    // Each rank reduces its own chunk, in rank order, into the shared sum.
    const int64_t b = n * rank_ / r_->n, e = n * (rank_ + 1) / r_->n;
    for (int64_t i = b; i < e; ++i) {
      float s = 0.0f;
      for (int q = 0; q < r_->n; ++q) s += load(r_->in[size_t(q)], buf.dtype, i);
      r_->sum[size_t(i)] = s;
    }
    r_->wait();
    if (buf.dtype == DType::F32) {
      std::memcpy(buf.data, r_->sum.data(), size_t(n) * 4);
    } else {
      auto* o = static_cast<uint16_t*>(buf.data);
      for (int64_t i = 0; i < n; ++i) o[i] = f32_to_bf16(r_->sum[size_t(i)]);
    }
    r_->wait();  // nobody reuses sum (or resizes it) before every rank has copied it out
  }

  void all_gather(const TensorView& in, TensorView out) override {
    DS_CHECK(in.is_contiguous() && out.is_contiguous() && in.dtype == out.dtype &&
                 out.numel() == in.numel() * r_->n,
             "all_gather: out must hold size() contiguous copies of in");
    const size_t bytes = size_t(in.nbytes());
    {
      std::lock_guard lock(r_->mu);
      r_->in[size_t(rank_)] = in.data;
    }
    r_->wait();
    for (int q = 0; q < r_->n; ++q)
      std::memcpy(static_cast<uint8_t*>(out.data) + size_t(q) * bytes, r_->in[size_t(q)], bytes);
    r_->wait();
  }

  void all_to_all(const void* send, std::span<const int64_t> send_counts, void* recv,
                  std::span<const int64_t> recv_counts, DType dtype) override {
    DS_CHECK(int(send_counts.size()) == r_->n && int(recv_counts.size()) == r_->n,
             "all_to_all: one count per rank");
    const size_t es = dtype_info(dtype).type_size;
    {
      std::lock_guard lock(r_->mu);
      r_->in[size_t(rank_)] = send;
      r_->counts[size_t(rank_)] = send_counts;
    }
    r_->wait();
    size_t at = 0;
    for (int q = 0; q < r_->n; ++q) {
      const auto& c = r_->counts[size_t(q)];
      int64_t off = 0;
      for (int j = 0; j < rank_; ++j) off += c[size_t(j)];
      DS_CHECK(c[size_t(rank_)] == recv_counts[size_t(q)],
               "all_to_all: rank " + std::to_string(q) + " sends " +
                   std::to_string(c[size_t(rank_)]) + " elements, rank " + std::to_string(rank_) +
                   " expects " + std::to_string(recv_counts[size_t(q)]));
      std::memcpy(static_cast<uint8_t*>(recv) + at,
                  static_cast<const uint8_t*>(r_->in[size_t(q)]) + size_t(off) * es,
                  size_t(c[size_t(rank_)]) * es);
      at += size_t(c[size_t(rank_)]) * es;
    }
    r_->wait();
  }

  void barrier() override { r_->wait(); }

  void abort() override {
    std::lock_guard lock(r_->mu);
    r_->aborted = true;
    r_->cv.notify_all();
  }
  void reset() override {
    std::lock_guard lock(r_->mu);
    r_->aborted = false;
    r_->arrived = 0;
  }

 private:
  std::shared_ptr<Rendezvous> r_;
  int rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_local_communicators(int n) {
  DS_CHECK(n >= 1, "a communicator group needs at least one rank");
  auto r = std::make_shared<Rendezvous>(n);
  std::vector<std::unique_ptr<Communicator>> out;
  for (int i = 0; i < n; ++i) out.push_back(std::make_unique<LocalCommunicator>(r, i));
  return out;
}

}  // namespace ds
