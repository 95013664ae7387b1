// The skinny GEMM kernel (src/backend/cuda/gemm_skinny.cu) run on the host with the kernel's
// own pieces: the launcher's plan, each warp's job and unit, every lane's lane_dot, the warp
// sum as weight_stream.cuh's scatter levels with the 32 lanes in lockstep, the lane that
// writes each sum, and reduce_store per thread, with __syncthreads as phase boundaries. The
// shared-memory partials are poisoned with NaN before every pass, so a thread reading a
// partial no warp wrote shows up. On matching inputs the GPU must give the same bits.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <stdexcept>
#include <vector>

#include "backend/cuda/gemm_skinny.cuh"
#include "backend/cuda/switches.h"
#include "core/dtype.h"

namespace ds::skinny_sim {

namespace sk = ds::cuda::skinny;
namespace ws = ds::cuda::wstream;

// The warp's lanes through the scatter levels of warp_scatter_sum.
template <int N, int Total, int O = 16>
void scatter_lanes(float (&v)[32][Total]) {
  if constexpr (O > 0) {
    float send[32][Total] = {}, recv[32][Total] = {};
    for (int l = 0; l < 32; ++l) ws::scatter_pack<N, Total>(v[l], (l & O) != 0, send[l]);
    for (int l = 0; l < 32; ++l)
      for (int i = 0; i < ws::kScatterKeep<N>; ++i) recv[l][i] = send[l ^ O][i];
    for (int l = 0; l < 32; ++l) ws::scatter_add<N, Total>(v[l], (l & O) != 0, recv[l]);
    scatter_lanes<ws::kScatterKeep<N>, Total, O / 2>(v);
  }
}

template <ws::Elem E, int TM>
void run_tm(const cuda::SkinnyGemmArgs& a, const sk::Plan& p) {
  constexpr int kVals = sk::kRows * TM;
  const int64_t x_row = a.m > 1 ? a.x_row : 0, out_row = a.m > 1 ? a.out_row : 0;
  const int64_t w_row = a.n > 1 ? a.w_row : 0;
  std::vector<float> part(size_t(sk::kWarps * kVals));
  for (int64_t b = 0; b < a.batch; ++b) {
    const uint8_t* x = static_cast<const uint8_t*>(a.x) + (a.batch > 1 ? b * a.x_batch : 0);
    const uint8_t* w = static_cast<const uint8_t*>(a.w) + (a.batch > 1 ? b * a.w_batch : 0);
    uint8_t* out = static_cast<uint8_t*>(a.out) + (a.batch > 1 ? b * a.out_batch : 0);
    for (int64_t cta = 0; cta < p.ctas; ++cta) {
      for (int round = 0; round < p.rounds; ++round) {
        for (int64_t m0 = 0; m0 < a.m; m0 += TM) {
          const int nt = int(a.m - m0 < TM ? a.m - m0 : TM);
          std::fill(part.begin(), part.end(), std::numeric_limits<float>::quiet_NaN());
          for (int warp = 0; warp < sk::kWarps; ++warp) {
            const sk::WarpJob job = sk::warp_job(p, warp);
            const int64_t u = sk::unit_of(p, cta, round, job.rg);
            if (u >= p.units) continue;
            const uint8_t* rows[sk::kRows];
            sk::unit_rows(w, w_row, a.n, u, rows);
            float v[32][kVals];
            for (int lane = 0; lane < 32; ++lane)
              sk::lane_dot<E, TM>(rows, reinterpret_cast<const float*>(x + m0 * x_row), x_row, nt,
                                  job.c_begin, job.c_end, lane, v[lane]);
            scatter_lanes<kVals, kVals>(v);
            for (int lane = 0; lane < 32; ++lane)
              if (sk::lane_writes<TM>(lane))
                part[size_t(warp * kVals + ws::scatter_value_of_lane<kVals>(lane))] = v[lane][0];
          }
          for (int t = 0; t < sk::kThreads; ++t)
            sk::reduce_store<TM>(p, part.data(), t, cta, round, nt, a.n, out + m0 * out_row,
                                 out_row);
        }
      }
    }
  }
}

template <ws::Elem E>
void run_elem(const cuda::SkinnyGemmArgs& a, const sk::Plan& p) {
  switch (p.tm) {
    case 1:
      return run_tm<E, 1>(a, p);
    case 2:
      return run_tm<E, 2>(a, p);
    case 4:
      return run_tm<E, 4>(a, p);
    default:
      return run_tm<E, 8>(a, p);
  }
}

// launch_skinny_gemm(a, sm_count) on host memory.
inline void run(const cuda::SkinnyGemmArgs& a, int sm_count) {
  if (!cuda::skinny_gemm_fits(a)) throw std::invalid_argument("skinny_sim: arguments do not fit");
  const int es = int(dtype_info(a.wtype).type_size);
  const sk::Plan p =
      sk::make_plan(a.batch, a.m, a.n, a.k, es, sm_count, cuda::g_skinny_one_wave.on());
  switch (a.wtype) {
    case DType::BF16:
      return run_elem<ws::Elem::BF16>(a, p);
    case DType::F16:
      return run_elem<ws::Elem::F16>(a, p);
    default:
      return run_elem<ws::Elem::F32>(a, p);
  }
}

// ---- test problems ---------------------------------------------------------------------------

// One (batched) GEMM with awkward layouts: x, w and out rows padded, w starting w_skip rows into
// its buffer (a slice of a fused weight), and optionally the heads-first views of MLA
// (x [M, B, K] and out [M, B, N] buffers read as [B, M, *]).
struct Spec {
  DType wt = DType::BF16;
  int64_t batch = 1, m = 1, n = 1, k = 8;
  int64_t x_pad = 0, w_pad = 0, out_pad = 0, w_skip = 0;  // elements
  bool permuted = false;
};

// Host buffers of a Spec; strides in elements of the buffer's type.
struct Problem {
  Spec s;
  int64_t x_row = 0, x_batch = 0, w_row = 0, w_batch = 0, o_row = 0, o_batch = 0, w_off = 0;
  std::vector<float> x, out0;   // F32 buffers (out0: what out holds before the GEMM)
  std::vector<uint8_t> w;       // w's buffer, encoded as s.wt
  std::vector<float> w_values;  // the same, decoded

  // The arguments for buffers at these addresses (host or device).
  cuda::SkinnyGemmArgs args(const void* xp, const void* wp, void* op) const {
    const int64_t es = int64_t(dtype_info(s.wt).type_size);
    cuda::SkinnyGemmArgs a;
    a.wtype = s.wt;
    a.batch = s.batch;
    a.m = s.m;
    a.n = s.n;
    a.k = s.k;
    a.x = xp;
    a.x_row = x_row * 4;
    a.x_batch = x_batch * 4;
    a.w = static_cast<const uint8_t*>(wp) + w_off * es;
    a.w_row = w_row * es;
    a.w_batch = w_batch * es;
    a.out = op;
    a.out_row = o_row * 4;
    a.out_batch = o_batch * 4;
    return a;
  }
  size_t out_index(int64_t b, int64_t i, int64_t j) const {
    return size_t(b * o_batch + i * o_row + j);
  }
  double x_at(int64_t b, int64_t i, int64_t t) const {
    return x[size_t(b * x_batch + i * x_row + t)];
  }
  double w_at(int64_t b, int64_t j, int64_t t) const {
    return w_values[size_t(w_off + b * w_batch + j * w_row + t)];
  }
};

inline Problem make_problem(const Spec& s, uint32_t seed) {
  Problem p;
  p.s = s;
  const int64_t xl = s.k + s.x_pad, ol = s.n + s.out_pad, wl = s.k + s.w_pad;
  if (s.permuted) {
    p.x_row = s.batch * xl;
    p.x_batch = xl;
    p.o_row = s.batch * ol;
    p.o_batch = ol;
  } else {
    p.x_row = xl;
    p.x_batch = s.m * xl;
    p.o_row = ol;
    p.o_batch = s.m * ol;
  }
  p.w_row = wl;
  p.w_batch = (s.n + s.w_skip) * wl;
  p.w_off = s.w_skip * wl;
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  p.x.resize(size_t(s.batch * s.m * xl));
  for (float& v : p.x) v = d(rng);
  p.out0.resize(size_t(s.batch * s.m * ol));
  for (float& v : p.out0) v = 50.0f + d(rng);
  const size_t nw = size_t(s.batch * (s.n + s.w_skip) * wl);
  const size_t es = size_t(dtype_info(s.wt).type_size);
  p.w.resize(nw * es);
  p.w_values.resize(nw);
  for (size_t i = 0; i < nw; ++i) {
    const float v = d(rng);
    if (s.wt == DType::F32) {
      std::memcpy(&p.w[i * 4], &v, 4);
      p.w_values[i] = v;
    } else {
      const uint16_t h = s.wt == DType::BF16 ? f32_to_bf16(v) : f32_to_fp16(v);
      std::memcpy(&p.w[i * 2], &h, 2);
      p.w_values[i] = s.wt == DType::BF16 ? bf16_to_f32(h) : fp16_to_f32(h);
    }
  }
  return p;
}

// The exact result (float64 on the values as stored) and sum_k |x w| per output element, in
// out-buffer order (elements outside the view: out0 and 0).
struct Expected {
  std::vector<double> want, abs_sum;
};

inline Expected expected(const Problem& p) {
  Expected e;
  e.want.assign(p.out0.begin(), p.out0.end());
  e.abs_sum.assign(p.out0.size(), 0.0);
  for (int64_t b = 0; b < p.s.batch; ++b)
    for (int64_t i = 0; i < p.s.m; ++i)
      for (int64_t j = 0; j < p.s.n; ++j) {
        double acc = 0, abs = 0;
        for (int64_t t = 0; t < p.s.k; ++t) {
          const double prod = p.x_at(b, i, t) * p.w_at(b, j, t);
          acc += prod;
          abs += std::abs(prod);
        }
        e.want[p.out_index(b, i, j)] = acc;
        e.abs_sum[p.out_index(b, i, j)] = abs;
      }
  return e;
}

// Bound on |F32 result - exact| for a sum of K products: at most K FMAs per lane plus 5 warp
// and 7 k-group additions on any path (classic (n u) bound, doubled for margin).
inline double f32_bound_factor(int64_t k) {
  return 2.0 * double(k + 16) / double(1 << 24);
}

// The host simulation's output buffer for p.
inline std::vector<float> simulate(const Problem& p, int sm_count) {
  std::vector<float> out = p.out0;
  run(p.args(p.x.data(), p.w.data(), out.data()), sm_count);
  return out;
}

}  // namespace ds::skinny_sim
