#include "backend/cpu/matmul.h"

#include <algorithm>
#include <cstdlib>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/matmul_kernels.h"
#include "backend/cpu/quants.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace ds::cpu {
namespace {

using detail::FloatJob;
using detail::Kernels;
using detail::KJob;
using detail::Q8Job;
using detail::Q8Layout;

// A growable 64-byte aligned buffer. One per thread (thread_local below): no malloc once
// it has grown to the largest shape, and callers on different threads never share one.
class Scratch {
 public:
  Scratch() = default;
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  ~Scratch() { std::free(data_); }
  uint8_t* get(size_t bytes) {
    if (bytes > cap_) {
      std::free(data_);
      cap_ = (std::max(bytes, cap_ + cap_ / 2) + 63) / 64 * 64;
      data_ = static_cast<uint8_t*>(std::aligned_alloc(64, cap_));
      if (!data_) {
        cap_ = 0;
        throw Error("out of memory for " + std::to_string(bytes) + " bytes of matmul scratch");
      }
    }
    return data_;
  }

 private:
  uint8_t* data_ = nullptr;
  size_t cap_ = 0;
};

thread_local Scratch t_activations;  // the calling thread's quantized activations
thread_local Scratch t_kernel;       // each pool thread's kernel scratch

// ---- scalar kernels: the reference every SIMD path is tested against ----

Q8Layout scalar_q8_layout(int64_t K) {
  Q8Layout l;
  l.nb = K / kQk;
  l.row_bytes = (size_t(l.nb) * sizeof(ActBlock) + 63) / 64 * 64;
  return l;
}

void scalar_quantize_q8(const float* x, int64_t K, DType, uint8_t* row) {
  quantize_row_act(x, reinterpret_cast<ActBlock*>(row), K);
}

size_t scalar_scratch_bytes(int64_t) {
  return 0;
}

void scalar_matmul_q8(const Q8Job& j, int64_t n0, int64_t n1, uint8_t*) {
  const int64_t nb = j.K / kQk;
  for (int64_t m = 0; m < j.M; ++m) {
    const auto* x = reinterpret_cast<const ActBlock*>(j.xq + size_t(m) * j.lay.row_bytes);
    float* out = j.out + m * j.ldo;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = j.w + size_t(n) * j.w_row_bytes;
      switch (j.wtype) {
        case DType::Q4_0:
          out[n] = vec_dot_q4_0(reinterpret_cast<const BlockQ4_0*>(w), x, nb);
          break;
        case DType::Q4_1:
          out[n] = vec_dot_q4_1(reinterpret_cast<const BlockQ4_1*>(w), x, nb);
          break;
        default:
          out[n] = vec_dot_q8_0(reinterpret_cast<const BlockQ8_0*>(w), x, nb);
          break;
      }
    }
  }
}

void scalar_matmul_float(const FloatJob& j, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < j.M; ++m) {
    const float* x = j.x + m * j.ldx;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = j.w + size_t(n) * j.w_row_bytes;
      float& o = j.out[m * j.ldo + n];
      switch (j.wtype) {
        case DType::F32:
          o = vec_dot_f32(reinterpret_cast<const float*>(w), x, j.K);
          break;
        case DType::F16:
          o = vec_dot_f16(reinterpret_cast<const uint16_t*>(w), x, j.K);
          break;
        default:
          o = vec_dot_bf16(reinterpret_cast<const uint16_t*>(w), x, j.K);
          break;
      }
    }
  }
}

void scalar_matmul_k(const KJob& j, int64_t n0, int64_t n1) {
  const int64_t nb = j.K / kQkK;
  for (int64_t m = 0; m < j.M; ++m) {
    const BlockQ8_K* x = j.xq + m * nb;
    for (int64_t n = n0; n < n1; ++n) {
      const uint8_t* w = j.w + size_t(n) * j.w_row_bytes;
      j.out[m * j.ldo + n] = j.wtype == DType::Q4_K
                                 ? vec_dot_q4_k(reinterpret_cast<const BlockQ4_K*>(w), x, nb)
                                 : vec_dot_q6_k(reinterpret_cast<const BlockQ6_K*>(w), x, nb);
    }
  }
}

size_t scalar_precise_scratch_bytes(int64_t K) {
  return size_t(K) * 4;
}

// Each weight row dequantized once (dequantize_row's values), then k-ordered F32 dots.
void scalar_matmul_precise(const FloatJob& j, int64_t n0, int64_t n1, uint8_t* scratch) {
  auto* w = reinterpret_cast<float*>(scratch);  // [K]
  for (int64_t n = n0; n < n1; ++n) {
    dequantize_row_ref(j.wtype, j.w + size_t(n) * j.w_row_bytes, w, j.K);
    for (int64_t m = 0; m < j.M; ++m) j.out[m * j.ldo + n] = vec_dot_f32(w, j.x + m * j.ldx, j.K);
  }
}

constexpr Kernels kScalar = {
    scalar_q8_layout,    scalar_quantize_q8, scalar_scratch_bytes,         scalar_matmul_q8,
    scalar_matmul_float, scalar_matmul_k,    scalar_precise_scratch_bytes, scalar_matmul_precise};

const Kernels& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::Scalar:
      return kScalar;
    case Isa::Avx2:
      return detail::kernels_avx2();
    case Isa::Avx512Vnni:
    case Isa::Amx:
      return detail::kernels_avx512();
  }
  return kScalar;
}

// Below this many multiply-adds a job runs on the calling thread alone.
constexpr int64_t kMinParallelWork = 1 << 16;
// Threads split N in chunks of this many weight rows (a multiple of every kernel's tile).
constexpr int64_t kNChunk = 16;
// Tasks per pool thread in a parallel matmul.
constexpr int64_t kTasksPerThread = 4;

// Runs fn(m0, m1, n0, n1) over the output, split across the pool: over N when there are
// enough weight rows to go round, else over M. The split never changes any element's
// arithmetic, only which thread computes it. (The pool jobs capture one reference, so
// std::function stores them without allocating.)
template <typename Fn>
void parallel_for_output(ThreadPool& pool, int64_t M, int64_t N, int64_t K, const Fn& fn) {
  const int nth = pool.size();
  if (nth == 1 || M * N * K < kMinParallelWork) {
    fn(0, M, 0, N);
    return;
  }
  struct Ctx {
    const Fn& fn;
    int64_t M, N, chunks, tiles;
  } ctx{fn, M, N, (N + kNChunk - 1) / kNChunk, (M + 3) / 4};
  // A few tasks per thread, so a thread that starts late (or is descheduled) leaves its
  // share to the others.
  const int64_t max_tasks = kTasksPerThread * nth;
  if (ctx.chunks >= nth || M < 2 * nth) {
    pool.run(
        [&ctx](int task, int tasks) {
          const auto [c0, c1] = ThreadPool::split(ctx.chunks, task, tasks);
          const int64_t n0 = std::min(ctx.N, c0 * kNChunk), n1 = std::min(ctx.N, c1 * kNChunk);
          if (n0 < n1) ctx.fn(0, ctx.M, n0, n1);
        },
        int(std::min(ctx.chunks, max_tasks)));
  } else {
    pool.run(
        [&ctx](int task, int tasks) {
          const auto [t0, t1] = ThreadPool::split(ctx.tiles, task, tasks);
          const int64_t m0 = std::min(ctx.M, t0 * 4), m1 = std::min(ctx.M, t1 * 4);
          if (m0 < m1) ctx.fn(m0, m1, 0, ctx.N);
        },
        int(std::min(ctx.tiles, max_tasks)));
  }
}

// Calls fn(m) for every row of x, on the pool when there are several.
template <typename Fn>
void parallel_rows(ThreadPool& pool, int64_t M, int64_t K, const Fn& fn) {
  if (pool.size() == 1 || M * K < kMinParallelWork) {
    for (int64_t m = 0; m < M; ++m) fn(m);
    return;
  }
  struct Ctx {
    const Fn& fn;
    int64_t M;
  } ctx{fn, M};
  pool.run([&ctx](int ith, int nth) {
    const auto [r0, r1] = ThreadPool::split(ctx.M, ith, nth);
    for (int64_t m = r0; m < r1; ++m) ctx.fn(m);
  });
}

// A job of type Job with the fields every job type shares filled from a.
template <class Job>
Job job_for(const MatmulArgs& a) {
  Job j;
  j.wtype = a.wtype;
  j.M = a.M;
  j.K = a.K;
  j.w = static_cast<const uint8_t*>(a.w);
  j.w_row_bytes = a.w_row_bytes;
  j.out = a.out;
  j.ldo = a.ldo;
  return j;
}

void matmul_q8(const MatmulArgs& a, ThreadPool& pool, const Kernels& k) {
  Q8Job j = job_for<Q8Job>(a);
  j.lay = k.q8_layout(a.K);
  uint8_t* xq = t_activations.get(size_t(a.M) * j.lay.row_bytes);
  j.xq = xq;
  parallel_rows(pool, a.M, a.K, [&](int64_t m) {
    k.quantize_q8(a.x + m * a.ldx, a.K, a.wtype, xq + size_t(m) * j.lay.row_bytes);
  });
  const size_t scratch = k.scratch_bytes(a.K);
  parallel_for_output(pool, a.M, a.N, a.K, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    Q8Job sub = j;
    sub.xq = j.xq + size_t(m0) * j.lay.row_bytes;
    sub.out = j.out + m0 * j.ldo;
    sub.M = m1 - m0;
    k.matmul_q8(sub, n0, n1, t_kernel.get(scratch));
  });
}

void matmul_k(const MatmulArgs& a, ThreadPool& pool, const Kernels& k) {
  if (a.K % kQkK != 0)
    throw Error("matmul: K = " + std::to_string(a.K) + " is not a multiple of 256 for " +
                std::string(dtype_name(a.wtype)));
  const int64_t nb = a.K / kQkK;
  auto* xq = reinterpret_cast<BlockQ8_K*>(t_activations.get(size_t(a.M * nb) * sizeof(BlockQ8_K)));
  parallel_rows(pool, a.M, a.K, [&](int64_t m) {
    quantize_row_ref(DType::Q8_K, a.x + m * a.ldx, xq + m * nb, a.K);
  });
  KJob j = job_for<KJob>(a);
  j.xq = xq;
  parallel_for_output(pool, a.M, a.N, a.K, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    KJob sub = j;
    sub.xq = j.xq + m0 * nb;
    sub.out = j.out + m0 * j.ldo;
    sub.M = m1 - m0;
    k.matmul_k(sub, n0, n1);
  });
}

FloatJob float_job(const MatmulArgs& a) {
  FloatJob j = job_for<FloatJob>(a);
  j.x = a.x;
  j.ldx = a.ldx;
  return j;
}

// The part of j that computes output rows [m0, m1).
FloatJob float_rows(const FloatJob& j, int64_t m0, int64_t m1) {
  FloatJob sub = j;
  sub.x = j.x + m0 * j.ldx;
  sub.out = j.out + m0 * j.ldo;
  sub.M = m1 - m0;
  return sub;
}

void matmul_float(const MatmulArgs& a, ThreadPool& pool, const Kernels& k) {
  const FloatJob j = float_job(a);
  parallel_for_output(pool, a.M, a.N, a.K, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    k.matmul_float(float_rows(j, m0, m1), n0, n1);
  });
}

void matmul_precise(const MatmulArgs& a, ThreadPool& pool, const Kernels& k) {
  const int64_t bs = dtype_info(a.wtype).block_size;
  if (a.K % bs != 0)
    throw Error("matmul: K = " + std::to_string(a.K) + " is not a multiple of the " +
                std::string(dtype_name(a.wtype)) + " block size");
  const FloatJob j = float_job(a);
  const size_t scratch = k.precise_scratch_bytes(a.K);
  parallel_for_output(pool, a.M, a.N, a.K, [&](int64_t m0, int64_t m1, int64_t n0, int64_t n1) {
    k.matmul_precise(float_rows(j, m0, m1), n0, n1, t_kernel.get(scratch));
  });
}

// W4A16 (the reference path, not a fast kernel): panels of weight rows dequantized to F32,
// then the F32 kernels. Each output element is still one fixed-order sum over its row.
constexpr int64_t kW4PanelRows = 64;
thread_local std::vector<float> t_w4_panel;

// FP8W takes the same path (dequantize_fp8w_row).
void matmul_panels(const MatmulArgs& a, ThreadPool& pool, const Kernels& k) {
  if (a.wtype == DType::W4A16 && a.K % 128 != 0)
    throw Error("matmul: W4A16 needs K a multiple of 128");
  const auto dequantize = a.wtype == DType::W4A16 ? dequantize_w4a16_row : dequantize_fp8w_row;
  std::vector<float>& panel = t_w4_panel;
  panel.resize(size_t(kW4PanelRows * a.K));
  for (int64_t n0 = 0; n0 < a.N; n0 += kW4PanelRows) {
    const int64_t rows = std::min(kW4PanelRows, a.N - n0);
    const auto* w = static_cast<const uint8_t*>(a.w) + size_t(n0) * a.w_row_bytes;
    for (int64_t r = 0; r < rows; ++r)
      dequantize(w + size_t(r) * a.w_row_bytes, a.K, panel.data() + r * a.K);
    MatmulArgs sub = a;
    sub.w = panel.data();
    sub.wtype = DType::F32;
    sub.N = rows;
    sub.w_row_bytes = size_t(a.K) * 4;
    sub.out = a.out + n0;
    matmul_float(sub, pool, k);
  }
}

}  // namespace

namespace detail {

bool precise_supports(DType t) {
  switch (t) {
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q5_0:
    case DType::Q5_1:
    case DType::Q8_0:
    case DType::Q4_K:
    case DType::Q5_K:
    case DType::Q6_K:
      return true;
    default:
      return false;
  }
}

}  // namespace detail

bool matmul_supports(DType t, ActPrecision act) {
  switch (t) {
    case DType::F32:
    case DType::F16:
    case DType::BF16:
    case DType::W4A16:
    case DType::FP8W:
      return true;
    case DType::Q4_0:
    case DType::Q4_1:
    case DType::Q8_0:
    case DType::Q4_K:
    case DType::Q6_K:
      return true;
    default:
      return act == ActPrecision::F32 && detail::precise_supports(t);
  }
}

void matmul(const MatmulArgs& a, ThreadPool& pool, Isa isa) {
  if (!matmul_supports(a.wtype, a.act))
    throw UnsupportedError("cpu matmul does not support " + std::string(dtype_name(a.wtype)) +
                           " weights" +
                           (a.act == ActPrecision::Q8 ? " with 8-bit activations" : ""));
  if (!isa_supported(isa))
    throw Error("cpu matmul: this CPU cannot run " + std::string(isa_name(isa)) + " kernels");
  DS_CHECK(a.M >= 0 && a.N >= 0 && a.K > 0, "matmul shape");
  DS_CHECK(a.M == 0 || (a.x && a.out && a.ldx >= a.K && a.ldo >= a.N), "matmul x/out strides");
  DS_CHECK(a.N == 0 || (a.w && a.w_row_bytes >= dtype_bytes(a.wtype, a.K)),
           "matmul weight row is shorter than K");
  if (a.M == 0 || a.N == 0) return;
  const Kernels& k = kernels_for(isa);
  if (a.wtype == DType::W4A16 || a.wtype == DType::FP8W) return matmul_panels(a, pool, k);
  if (dtype_info(a.wtype).quantized && a.act == ActPrecision::F32)
    return matmul_precise(a, pool, k);
  switch (a.wtype) {
    case DType::F32:
    case DType::F16:
    case DType::BF16:
      return matmul_float(a, pool, k);
    case DType::Q4_K:
    case DType::Q6_K:
      return matmul_k(a, pool, k);
    default:
      return matmul_q8(a, pool, k);
  }
}

void dequantize_row(DType t, const void* src, float* dst, int64_t n) {
  if (t == DType::W4A16) return dequantize_w4a16_row(static_cast<const uint8_t*>(src), n, dst);
  if (t == DType::FP8W) return dequantize_fp8w_row(static_cast<const uint8_t*>(src), n, dst);
  dequantize_row_ref(t, src, dst, n);
}

void quantize_row(DType t, const float* src, void* dst, int64_t n) {
  quantize_row_ref(t, src, dst, n);
}

}  // namespace ds::cpu
