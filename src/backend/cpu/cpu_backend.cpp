// The CPU backend: reference-quality ops with multi-threaded, ISA-dispatched matmul.
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/attention.h"
#include "backend/cpu/matmul.h"
#include "backend/cpu/mla_attention.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/sample.h"
#include "backend/kv_fp8.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace ds {
namespace {

class HostBuffer final : public Buffer {
 public:
  explicit HostBuffer(size_t bytes) : size_(bytes) {
    const size_t rounded = (std::max<size_t>(bytes, 1) + 63) / 64 * 64;
    data_ = std::aligned_alloc(64, rounded);
    if (!data_) throw Error("out of host memory allocating " + std::to_string(bytes) + " bytes");
  }
  ~HostBuffer() override { std::free(data_); }
  void* data() override { return data_; }
  size_t size() const override { return size_; }
  Device device() const override { return {}; }

 private:
  void* data_;
  size_t size_;
};

int default_threads() {
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : int(n);
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(const BackendOptions& o)
      : pool_(o.threads > 0 ? o.threads : default_threads()),
        isa_(cpu::select_isa(o.isa)),
        precision_(o.precision) {}

  Device device() const override { return {}; }
  std::string name() const override {
    return "cpu (" + std::string(cpu::isa_name(isa_)) + ", " + std::to_string(pool_.size()) +
           " threads, " + (precision_ == ActivationPrecision::F32 ? "f32" : "q8") + " activations)";
  }
  bool supports(Op op, DType t) const override {
    switch (op) {
      case Op::MatMul:
        return cpu::matmul_supports(t, act());
      case Op::Embed:
        return t == DType::F32 || cpu::matmul_supports(t);
      case Op::StoreKv:
      case Op::Attention:
      case Op::MlaAttention:
        return t == DType::F32 || t == DType::F16 || t == DType::BF16 || t == DType::F8_E4M3;
      case Op::BatchedMatMul:
        return t == DType::F32 || t == DType::F16 || t == DType::BF16;
      case Op::MoeFfn:
        return cpu::matmul_supports(t, act());
      default:
        return t == DType::F32;
    }
  }

  std::unique_ptr<Buffer> alloc(size_t bytes) override {
    return std::make_unique<HostBuffer>(bytes);
  }
  void upload(const TensorView& dst, const void* host, size_t bytes) override {
    std::memcpy(dst.data, host, bytes);
  }
  void download(void* host, const TensorView& src, size_t bytes) override {
    std::memcpy(host, src.data, bytes);
  }
  void synchronize() override {}

  void embed(const TensorView& table, const int32_t* ids, int n, TensorView out) override {
    const int64_t vocab = table.shape[0], dim = table.cols();
    for (int t = 0; t < n; ++t) {
      if (ids[t] < 0 || ids[t] >= vocab)
        throw Error("token id " + std::to_string(ids[t]) + " is outside the vocabulary of " +
                    std::to_string(vocab));
      float* dst = reinterpret_cast<float*>(out.row(t));
      if (table.dtype == DType::F32)
        std::memcpy(dst, table.row(ids[t]), size_t(dim) * 4);
      else
        cpu::dequantize_row(table.dtype, table.row(ids[t]), dst, dim);
    }
  }

  void rms_norm(const TensorView& x, const TensorView& w, float eps, TensorView out) override {
    const int64_t rows = x.rows(), n = x.cols();
    const float* wp = w.ptr<float>();
    parallel_rows(rows, [&](int64_t r) {
      const float* xr = reinterpret_cast<const float*>(x.row(r));
      float* o = reinterpret_cast<float*>(out.row(r));
      double ss = 0;
      for (int64_t i = 0; i < n; ++i) ss += double(xr[i]) * xr[i];
      const float s = float(1.0 / std::sqrt(ss / double(n) + double(eps)));
      for (int64_t i = 0; i < n; ++i) o[i] = xr[i] * s * wp[i];
    });
  }

  void matmul(const TensorView& x, const TensorView& w, TensorView out) override {
    DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32, "matmul takes F32 activations");
    DS_CHECK(x.cols() == w.cols() && out.cols() == w.rows() && out.rows() == x.rows(),
             "matmul shapes " + x.shape_str() + " x " + w.shape_str() + " -> " + out.shape_str());
    cpu::MatmulArgs a;
    a.x = x.ptr<float>();
    a.M = x.rows();
    a.K = x.cols();
    a.ldx = x.row_stride() / 4;
    a.w = w.data;
    a.wtype = w.dtype;
    a.N = w.rows();
    a.w_row_bytes = size_t(w.row_stride());
    a.out = out.ptr<float>();
    a.ldo = out.row_stride() / 4;
    a.act = act();
    cpu::matmul(a, pool_, isa_);
  }

  void rope(TensorView x, const int32_t* positions, const RopeParams& p) override {
    DS_CHECK(x.ndim == 3 && x.dtype == DType::F32 && x.stride[2] == 4,
             "rope takes an F32 [tokens, heads, head_dim] view");
    const int64_t T = x.shape[0], H = x.shape[1];
    const int half = p.rotary_dim / 2;
    DS_CHECK(p.rotary_dim % 2 == 0 && p.rotary_dim <= x.shape[2] && half <= 512,
             "rope: rotary_dim " + std::to_string(p.rotary_dim) + " for head_dim " +
                 std::to_string(x.shape[2]));
    if (T == 0 || half == 0) return;
    const std::vector<float>& inv_freq = rope_frequencies(p);
    // Only the leading rotary_dim dims of each head move; strided views (a slice of each
    // head) work since heads are addressed through the strides.
    parallel_rows(T, [&](int64_t t) {
      float cs[512], sn[512];
      for (int i = 0; i < half; ++i) {
        const float a = float(positions[t]) * inv_freq[size_t(i)];
        cs[i] = std::cos(a) * p.attn_factor;
        sn[i] = std::sin(a) * p.attn_factor;
      }
      for (int64_t h = 0; h < H; ++h) {
        float* v = reinterpret_cast<float*>(static_cast<uint8_t*>(x.data) + t * x.stride[0] +
                                            h * x.stride[1]);
        for (int i = 0; i < half; ++i) {
          const int a = p.style == RopeStyle::Adjacent ? 2 * i : i;
          const int b = p.style == RopeStyle::Adjacent ? 2 * i + 1 : i + half;
          const float x0 = v[a], x1 = v[b];
          v[a] = x0 * cs[i] - x1 * sn[i];
          v[b] = x0 * sn[i] + x1 * cs[i];
        }
      }
    });
  }

  void store_kv(const TensorView& k, const TensorView& v, const PagedKv& kv,
                const AttentionMeta& meta) override {
    const int64_t es = int64_t(dtype_info(kv.dtype).type_size);
    const int64_t capacity = int64_t(kv.num_blocks) * kv.block_size;
    // A latent (MLA) cache has no V: only k ([T, 1, R + P]) is written.
    const bool latent = kv.v == nullptr;
    for (const TensorView* src : {&k, &v}) {
      if (latent && src == &v) break;
      DS_CHECK(src->dtype == DType::F32 && src->ndim == 3 && src->shape[0] >= meta.num_tokens &&
                   src->shape[1] == kv.kv_heads && src->shape[2] == kv.head_dim,
               "store_kv: " + src->shape_str() + " does not fit a cache of " +
                   std::to_string(kv.kv_heads) + " x " + std::to_string(kv.head_dim));
    }
    DS_CHECK(!kv.fp8() || (kv.k_scale && (latent || kv.v_scale)),
             "store_kv: FP8 cache without scales");
    const cpu::KvStoreKernel store = cpu::kv_store_kernel(isa_);
    for (int t = 0; t < meta.num_tokens; ++t) {
      const int64_t slot = meta.slot_mapping[t];
      if (slot == -1) continue;  // a padding token
      DS_CHECK(slot >= 0 && slot < capacity, "KV slot out of range");
      for (const auto& [src, dst] : {std::pair{&k, kv.k}, std::pair{&v, kv.v}}) {
        if (dst == nullptr) continue;
        uint8_t* d = static_cast<uint8_t*>(dst) + slot * kv.slot_stride() * es;
        for (int64_t h = 0; h < kv.kv_heads; ++h) {
          const float* s = reinterpret_cast<const float*>(static_cast<const uint8_t*>(src->data) +
                                                          t * src->stride[0] + h * src->stride[1]);
          if (!kv.fp8()) {
            store(s, kv.head_dim, kv.dtype, d + h * kv.head_dim * es);
          } else if (src == &k) {
            kvfp8::quantize_head(s, kv.head_dim, kv.rope_split, d + h * kv.head_dim,
                                 kv.k_scale + kv.k_scale_index(slot, int(h), 0));
          } else {
            kvfp8::quantize_head(s, kv.head_dim, 0, d + h * kv.head_dim,
                                 kv.v_scale + slot * kv.kv_heads + h);
          }
        }
      }
    }
  }

  void attention(const AttentionParams& p, const AttentionMeta& meta) override {
    const int heads = int(p.q.shape[1]), kv_heads = p.kv.kv_heads;
    const int group = heads / kv_heads;
    DS_CHECK(!p.kv.fp8() || (p.kv.k_scale && p.kv.v_scale && p.kv.rope_split == 0),
             "attention: an FP8 cache needs K and V scales");
    std::vector<int>& seq_of = seq_of_;
    seq_of.resize(size_t(meta.num_tokens));
    for (int s = 0; s < meta.num_seqs; ++s)
      for (int t = meta.query_start[s]; t < meta.query_start[s + 1]; ++t) seq_of[size_t(t)] = s;
    // A work item is a whole kv group (each K/V row is loaded and widened once for all its
    // query heads) unless that leaves a thread idle; a head's result is the same either way.
    const int per_item = int64_t(meta.num_tokens) * kv_heads >= pool_.size() ? group : 1;
    const int chunks = group / per_item;
    const int64_t per_token = int64_t(kv_heads) * chunks;
    const int64_t items = meta.num_tokens * per_token;
    const cpu::AttentionKernel kernel = cpu::attention_kernel(isa_);
    // A few tasks per thread (each with its own scratch), claimed by whichever thread is free.
    const int tasks = int(std::min<int64_t>(items, 4 * pool_.size()));
    if (attn_scratch_.size() < size_t(tasks)) attn_scratch_.resize(size_t(tasks));
    pool_.run(
        [&](int task, int n) {
          auto [begin, end] = ThreadPool::split(items, task, n);
          for (int64_t i = begin; i < end; ++i) {
            const int t = int(i / per_token), r = int(i % per_token);
            const int kvh = r / chunks, h0 = kvh * group + r % chunks * per_item;
            kernel(p, meta, {t, seq_of[size_t(t)], kvh, h0, h0 + per_item},
                   attn_scratch_[size_t(task)]);
          }
        },
        tasks);
  }

  void silu_mul(const TensorView& gate_up, TensorView out) override {
    const int64_t n = out.cols();
    parallel_rows(out.rows(), [&](int64_t r) {
      const float* g = reinterpret_cast<const float*>(gate_up.row(r));
      const float* u = g + n;
      float* o = reinterpret_cast<float*>(out.row(r));
      for (int64_t i = 0; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
    });
  }

  void add(TensorView x, const TensorView& y) override {
    const int64_t n = x.cols();
    for (int64_t r = 0; r < x.rows(); ++r) {
      float* a = reinterpret_cast<float*>(x.row(r));
      const float* b = reinterpret_cast<const float*>(y.row(r));
      for (int64_t i = 0; i < n; ++i) a[i] += b[i];
    }
  }

  void batched_matmul(const TensorView& x, const TensorView& w, TensorView out) override {
    DS_CHECK(x.ndim == 3 && w.ndim == 3 && out.ndim == 3, "batched_matmul takes 3-D views");
    DS_CHECK(x.dtype == DType::F32 && out.dtype == DType::F32,
             "batched_matmul takes F32 activations");
    if (w.dtype != DType::F32 && w.dtype != DType::F16 && w.dtype != DType::BF16)
      throw UnsupportedError("cpu batched_matmul does not support " +
                             std::string(dtype_name(w.dtype)) + " weights");
    const int64_t B = x.shape[0], M = x.shape[1], K = x.shape[2], N = w.shape[1];
    DS_CHECK(w.shape[0] == B && w.shape[2] == K && out.shape[0] == B && out.shape[1] == M &&
                 out.shape[2] == N && K > 0,
             "batched_matmul shapes " + x.shape_str() + " x " + w.shape_str() + " -> " +
                 out.shape_str());
    if (B == 0 || M == 0 || N == 0) return;
    const int64_t ws = int64_t(dtype_info(w.dtype).type_size);
    // Matrices whose rows the kernels cannot address (element-strided innermost dim,
    // overlapping or unaligned rows) are packed into scratch first; out is then unpacked.
    const bool x_direct = rows_addressable(x, 4), w_direct = rows_addressable(w, ws);
    const bool o_direct = rows_addressable(out, 4);
    const int64_t x_bytes = x_direct ? 0 : B * M * K * 4, w_bytes = w_direct ? 0 : B * N * K * ws;
    const int64_t o_bytes = o_direct ? 0 : B * M * N * 4;
    if (bmm_scratch_.size() < size_t(x_bytes + w_bytes + o_bytes))
      bmm_scratch_.resize(size_t(x_bytes + w_bytes + o_bytes));
    uint8_t* xs = bmm_scratch_.data();
    uint8_t* wsc = xs + x_bytes;
    uint8_t* os = wsc + w_bytes;
    if (!x_direct) pack(x, 4, xs);
    if (!w_direct) pack(w, ws, wsc);
    auto args = [&](int64_t b) {
      cpu::MatmulArgs a;
      a.M = M;
      a.K = K;
      a.N = N;
      a.x = x_direct
                ? reinterpret_cast<const float*>(static_cast<uint8_t*>(x.data) + b * x.stride[0])
                : reinterpret_cast<const float*>(xs) + b * M * K;
      a.ldx = x_direct && M > 1 ? x.stride[1] / 4 : K;
      a.w = w_direct ? static_cast<const uint8_t*>(w.data) + b * w.stride[0] : wsc + b * N * K * ws;
      a.wtype = w.dtype;
      a.w_row_bytes = size_t(w_direct && N > 1 ? w.stride[1] : K * ws);
      a.out = o_direct
                  ? reinterpret_cast<float*>(static_cast<uint8_t*>(out.data) + b * out.stride[0])
                  : reinterpret_cast<float*>(os) + b * M * N;
      a.ldo = o_direct && M > 1 ? out.stride[1] / 4 : N;
      a.act = act();
      return a;
    };
    // With a batch per thread or more, whole batches go to threads (each matmul then runs
    // on a one-thread pool, which never leaves the calling thread); otherwise each matmul
    // spreads over the pool. The kernels give every element the same bits either way.
    if (B >= pool_.size() && pool_.size() > 1) {
      pool_.run([&](int ith, int nth) {
        const auto [b0, b1] = ThreadPool::split(B, ith, nth);
        for (int64_t b = b0; b < b1; ++b) cpu::matmul(args(b), serial_, isa_);
      });
    } else {
      for (int64_t b = 0; b < B; ++b) cpu::matmul(args(b), pool_, isa_);
    }
    if (!o_direct)
      for (int64_t b = 0; b < B; ++b)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t n = 0; n < N; ++n)
            std::memcpy(static_cast<uint8_t*>(out.data) + b * out.stride[0] + m * out.stride[1] +
                            n * out.stride[2],
                        os + ((b * M + m) * N + n) * 4, 4);
  }

  void mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta) override {
    cpu::mla_attention(p, meta, pool_, isa_, mla_scratch_);
  }

  void moe_route(const TensorView& logits, const MoeRouteParams& p, TensorView ids,
                 TensorView weights) override {
    cpu::moe_route(logits, p, ids, weights, pool_);
  }

  void moe_ffn(const MoeFfnParams& p) override {
    cpu::moe_ffn(p, {&pool_, isa_, act()}, moe_scratch_);
  }

  // The reference itself, in place (host memory); rows spread over the pool.
  void sample(const TensorView& logits, const SampleRow* rows, TensorView ids) override {
    DS_CHECK(logits.dtype == DType::F32 && logits.ndim == 2 && logits.row_stride() % 4 == 0 &&
                 ids.dtype == DType::I32 && ids.numel() >= logits.rows(),
             "sample takes F32 logits [R, V] (rows may be strided) and I32 ids [R]");
    cpu::sample_rows(logits.ptr<float>(), logits.rows(), logits.cols(), logits.row_stride() / 4,
                     rows, ids.ptr<int32_t>(), &pool_);
  }

  void copy(const TensorView& src, TensorView dst) override {
    DS_CHECK(src.dtype == dst.dtype && src.numel() == dst.numel(), "copy shape/dtype mismatch");
    for (int64_t r = 0; r < src.rows(); ++r) std::memcpy(dst.row(r), src.row(r), src.row_bytes());
  }

 private:
  // Runs fn(row) for every row, spread over the pool when there are several rows.
  template <typename Fn>
  void parallel_rows(int64_t rows, Fn&& fn) {
    if (rows == 1) {
      fn(0);
      return;
    }
    pool_.run([&](int ith, int nth) {
      auto [b, e] = ThreadPool::split(rows, ith, nth);
      for (int64_t r = b; r < e; ++r) fn(r);
    });
  }

  // Per-pair inverse frequencies, computed once per distinct parameter set instead of on every
  // call (each layer rotates Q and K every step with the same parameters).
  const std::vector<float>& rope_frequencies(const RopeParams& p) {
    if (!inv_freq_params_ || !(*inv_freq_params_ == p)) {
      inv_freq_ = rope_inv_freq(p);
      inv_freq_params_ = p;
    }
    return inv_freq_;
  }

  // Whether the kernels can read a 3-D view's matrices in place: contiguous elements and
  // rows that are element-aligned and do not overlap (a single row may have any stride).
  static bool rows_addressable(const TensorView& v, int64_t es) {
    return v.stride[2] == es && reinterpret_cast<uintptr_t>(v.data) % uintptr_t(es) == 0 &&
           v.stride[0] % es == 0 &&
           (v.shape[1] == 1 || (v.stride[1] % es == 0 && v.stride[1] >= v.shape[2] * es));
  }
  // Copies a 3-D view of es-byte elements into dst as packed [shape0, shape1, shape2].
  static void pack(const TensorView& v, int64_t es, uint8_t* dst) {
    for (int64_t b = 0; b < v.shape[0]; ++b)
      for (int64_t r = 0; r < v.shape[1]; ++r)
        for (int64_t i = 0; i < v.shape[2]; ++i, dst += es)
          std::memcpy(dst,
                      static_cast<const uint8_t*>(v.data) + b * v.stride[0] + r * v.stride[1] +
                          i * v.stride[2],
                      size_t(es));
  }

  cpu::ActPrecision act() const {
    return precision_ == ActivationPrecision::Q8 ? cpu::ActPrecision::Q8 : cpu::ActPrecision::F32;
  }

  ThreadPool pool_;
  cpu::Isa isa_;
  std::vector<cpu::AttentionScratch> attn_scratch_;  // one per attention task
  std::vector<int> seq_of_;                          // attention: each token's sequence
  ActivationPrecision precision_;
  std::vector<float> inv_freq_;  // rope_frequencies() cache
  std::optional<RopeParams> inv_freq_params_;
  ThreadPool serial_{1};                      // batched_matmul's per-thread matmuls
  std::vector<uint8_t> bmm_scratch_;          // batched_matmul's packed operands
  std::vector<cpu::MlaScratch> mla_scratch_;  // one per pool thread
  cpu::MoeScratch moe_scratch_;
};

}  // namespace

std::unique_ptr<Backend> make_cpu_backend(const BackendOptions& opts) {
  return std::make_unique<CpuBackend>(opts);
}

}  // namespace ds
