// Skinny GEMMs for decode: out[m, n] = sum_k x[m, k] w[n, k] with few rows of x (F32, read
// directly: no conversion pass) against 16-bit or F32 weights streamed once with 16-byte loads,
// in one launch. Every output element is one fixed-order F32 sum that depends only on its own
// row of x (deterministic and batch-invariant), no host sync, no allocation (graph-capturable).
//
// A warp owns a unit of kRows weight rows and a slice of K: each lane accumulates chunks
// lane, lane + 32, ... of the slice for every (row, token) in F32 FMAs, the warp sums its lanes
// (weight_stream.cuh's scatter sum: the xor butterfly's tree), and when K is split over
// k_groups warps of a CTA their partials are added in ascending k order through shared
// memory. The split depends on N, K, the batch and the SM count, never on M.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/norm_rows.cuh"
#include "backend/cuda/weight_stream.cuh"
#include "core/dtype.h"
#include "core/tensor.h"

namespace ds::cuda {

// Which GEMMs the backend sends to the skinny kernel (cuBLAS otherwise, and for shapes it
// rejects), from the H200 micro-benchmark (bench_cuda_gemm.cpp, DeepSeek-V2-Lite shapes): at
// M = 1 it matches or beats conversion + cuBLAS everywhere (0.9-2.3x); at M = 8 only on small
// weights (kv_a 1.5x, router 1.4x, MLA heads 1.0-1.15x), while q_proj (0.62x), o_proj and the
// MLPs lose. So: M <= kSkinnyAnyM always, M <= kSkinnyMaxM when the weights are small.
inline constexpr int64_t kSkinnyAnyM = 2;
inline constexpr int64_t kSkinnyMaxM = 8;
inline constexpr int64_t kSkinnySmallWeightBytes = int64_t(6) << 20;

// For each b < batch: out_b[m, n] = sum_k x_b[m, k] * w_b[n, k]. Strides in bytes (a stride is
// ignored where its dimension is 1).
struct SkinnyGemmArgs {
  DType wtype = DType::BF16;  // F32, F16 or BF16
  int64_t batch = 1, m = 0, n = 0, k = 0;
  const void* x = nullptr;  // [batch][m, k] F32
  int64_t x_row = 0, x_batch = 0;
  const void* w = nullptr;  // [batch][n, k] wtype
  int64_t w_row = 0, w_batch = 0;
  void* out = nullptr;  // [batch][m, n] F32
  int64_t out_row = 0, out_batch = 0;
};

// The arguments of Backend::matmul (rows of x and out flattened, as rows_uniform views) and of
// Backend::batched_matmul ([B, M, K] x [B, N, K] -> [B, M, N]) on these views.
SkinnyGemmArgs skinny_matmul_args(const TensorView& x, const TensorView& w, const TensorView& out);
SkinnyGemmArgs skinny_batched_args(const TensorView& x, const TensorView& w, const TensorView& out);

// The backend's dispatch rule: few rows, and a problem the kernel takes.
bool use_skinny_gemm(const SkinnyGemmArgs& a);

// Whether the kernel takes a: plain weight dtype, rows of whole 16-byte chunks (K * esize a
// multiple of 16), 16-byte aligned x and w rows, F32-aligned out, batch within the grid.
bool skinny_gemm_fits(const SkinnyGemmArgs& a);

// Enqueues the GEMM (throws when !skinny_gemm_fits(a)). sm_count sizes the K split.
void launch_skinny_gemm(const SkinnyGemmArgs& a, int sm_count, cudaStream_t stream);

// The norm in front of the product (Backend::norm_matmul): a.x holds the residual stream's
// rows, and every CTA first computes xn = rms_norm(x (+ y)) * g into shared memory with
// launch_rms_norm's operations in its order (its thread count, block_sum's tree), so out is
// bit for bit matmul(rms_norm's xn). The CTAs also store xn and x_out = x + y, each its share.
struct SkinnyNormArgs {
  const float* y = nullptr;  // [m, k] F32, rows y_row bytes apart; null: no residual add
  int64_t y_row = 0;
  const float* g = nullptr;  // [k] F32 norm weight
  float eps = 1e-6f;
  float* x_out = nullptr;  // [m, k] F32: x + y (with y)
  int64_t x_out_row = 0;
  float* xn = nullptr;  // [m, k] F32
  int64_t xn_row = 0;
};

// Whether the fused launch takes a: skinny_gemm_fits, one batch entry, at most kMaxTm rows (of
// x, 16-byte aligned) whose normed copies fit shared memory.
bool skinny_norm_fits(const SkinnyGemmArgs& a);

// Enqueues the norm and the GEMM as one launch (throws when !skinny_norm_fits(a)).
void launch_skinny_norm_gemm(const SkinnyGemmArgs& a, const SkinnyNormArgs& nrm, int sm_count,
                             cudaStream_t stream);

// The residual add and norm after the product (Backend::matmul_add_norm): out = x . w as
// launch_skinny_gemm's, then the last CTA to finish (post.counter) computes r_out = r + out and
// rn = rms_norm(r_out) * g over whole rows, with launch_rms_norm's operations in its order, so
// the bits are those of the product, then the norm kernel (norm_rows.cuh).
// Whether the launch with the add and norm takes a: skinny_gemm_fits, one batch entry, at most
// kMaxTm rows of out, rms_norm's threads for a row of n.
bool skinny_add_norm_fits(const SkinnyGemmArgs& a);

// Enqueues the GEMM with the add and norm after it (throws when !skinny_add_norm_fits(a)).
void launch_skinny_gemm_add_norm(const SkinnyGemmArgs& a, const AddNormArgs& post, int sm_count,
                                 cudaStream_t stream);

// ---- internals, shared with the host simulation test ----------------------------------------
namespace skinny {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 4;             // weight rows of a warp's unit (x loads are shared by them)
constexpr int kMaxTm = 8;            // tokens per pass (more are done in passes)
constexpr int kMinSliceChunks = 32;  // K is split only while every lane keeps a chunk per row

// How a problem is cut. Everything that decides the order of a sum (chunks, k_groups, slice)
// is a function of N, K, the batch and the SM count; M only changes tm and rounds.
struct Plan {
  int chunks = 0;      // 16-byte chunks per weight row: K / elements per chunk
  int k_groups = 1;    // warps splitting a unit's K: 1, 2, 4 or 8
  int row_groups = 8;  // units a CTA works on at once: kWarps / k_groups
  int slice = 0;       // chunks per k group, ceil(chunks / k_groups)
  int rounds = 1;      // units per row group, one after another
  int tm = 1;          // tokens per pass: 1, 2, 4 or 8
  int64_t units = 0;   // ceil(N / kRows)
  int64_t ctas = 0;    // CTAs per batch entry: ceil(units / (row_groups * rounds))
};

// one_wave (DEEPSERVE_SKINNY_ONE_WAVE=1): K is split only while the grid still fits one CTA an
// SM (the kernel's registers let one CTA of the one- and two-token variants reside on an SM), so
// a decode-sized product streams its weights in one wave with every lane's loads of a step in
// flight, where the default splits K until the grid holds two CTAs an SM (waves of one, each a
// few chunks a lane). Another order of sums, the same for every M.
Plan make_plan(int64_t batch, int64_t m, int64_t n, int64_t k, int elem_bytes, int sm_count,
               bool one_wave = false);

// A warp's part of the CTA: its row group and its K slice [c_begin, c_end) in chunks.
struct WarpJob {
  int rg = 0, kg = 0;
  int c_begin = 0, c_end = 0;
};

DS_KHD WarpJob warp_job(const Plan& p, int warp) {
  WarpJob j;
  j.kg = warp % p.k_groups;
  j.rg = warp / p.k_groups;
  const int b = j.kg * p.slice < p.chunks ? j.kg * p.slice : p.chunks;
  j.c_begin = b;
  j.c_end = b + p.slice < p.chunks ? b + p.slice : p.chunks;
  return j;
}

// The unit row group rg of CTA cta works on in round `round` (>= p.units: none).
DS_KHD int64_t unit_of(const Plan& p, int64_t cta, int round, int rg) {
  return (cta * p.rounds + round) * p.row_groups + rg;
}

// Byte pointers to the kRows weight rows of unit u (rows past N repeat row N - 1; their
// results are dropped).
DS_KDEV void unit_rows(const uint8_t* w, int64_t w_row, int64_t n, int64_t u,
                       const uint8_t* (&rows)[kRows]) {
  DS_UNROLL
  for (int r = 0; r < kRows; ++r) {
    const int64_t row = u * kRows + r < n ? u * kRows + r : n - 1;
    rows[r] = w + row * w_row;
  }
}

// Chunks a lane has in flight per row before it multiplies: more when few tokens need
// registers. Only how far ahead loads run; the order of every sum is the same.
template <int TM>
inline constexpr int kUnroll = TM <= 2 ? 4 : 2;

// A lane's loads of one step: chunks c0, c0 + 32, ... (kUnroll of them) of each row, zero
// past c_end.
template <int TM>
DS_KDEV void load_step(const uint8_t* const (&rows)[kRows], int c0, int c_end,
                       uint4 (&w)[kUnroll<TM>][kRows]) {
  DS_UNROLL
  for (int u = 0; u < kUnroll<TM>; ++u) {
    const int c = c0 + 32 * u;
    DS_UNROLL
    for (int r = 0; r < kRows; ++r)
      w[u][r] = c < c_end ? wstream::load_chunk(rows[r] + int64_t(c) * 16) : uint4{0, 0, 0, 0};
  }
}

// One step's FMAs: v[r * TM + j] += the elements of w's chunks (c0, c0 + 32, ... below c_end)
// times token j's, one F32 FMA per element in memory order. kSharedX: x is in shared memory.
template <wstream::Elem E, int TM, bool kSharedX>
DS_KDEV void dot_step(const uint4 (&w)[kUnroll<TM>][kRows], int c0, int c_end, const float* x,
                      int64_t x_row, int nt, float (&v)[kRows * TM]) {
  constexpr int V = wstream::kChunkElems<E>;
  DS_UNROLL
  for (int u = 0; u < kUnroll<TM>; ++u) {
    const int c = c0 + 32 * u;
    if (c >= c_end) break;
    float wf[kRows][V];
    DS_UNROLL
    for (int r = 0; r < kRows; ++r) wstream::chunk_to_float<E>(w[u][r], wf[r]);
    DS_UNROLL
    for (int j = 0; j < TM; ++j) {
      if (j >= nt) break;
      const float* xp =
          reinterpret_cast<const float*>(reinterpret_cast<const uint8_t*>(x) + j * x_row) +
          int64_t(c) * V;
      float xv[V];
      DS_UNROLL
      for (int q = 0; q < V / 4; ++q) {
        const float4 f = kSharedX ? *reinterpret_cast<const float4*>(xp + 4 * q)
                                  : wstream::load_float4(xp + 4 * q);
        xv[4 * q + 0] = f.x;
        xv[4 * q + 1] = f.y;
        xv[4 * q + 2] = f.z;
        xv[4 * q + 3] = f.w;
      }
      DS_UNROLL
      for (int r = 0; r < kRows; ++r) {
        DS_UNROLL
        for (int i = 0; i < V; ++i) v[r * TM + j] = fmaf(wf[r][i], xv[i], v[r * TM + j]);
      }
    }
  }
}

// Lane `lane`'s partial sums v[r * TM + j] = sum over its chunks c (ascending) of the
// elements of rows[r] and token j (nt tokens valid, rows x_row bytes apart) of chunk c, one
// F32 FMA per element in memory order; zero for j >= nt. kSharedX: x is in shared memory.
// With `first` (kFirst), the lane's first step was loaded ahead (load_step at c_begin + lane).
template <wstream::Elem E, int TM, bool kSharedX = false, bool kFirst = false>
DS_KDEV void lane_dot(const uint8_t* const (&rows)[kRows], const float* x, int64_t x_row, int nt,
                      int c_begin, int c_end, int lane, float (&v)[kRows * TM],
                      const uint4 (*first)[kRows] = nullptr) {
  constexpr int U = kUnroll<TM>;
  DS_UNROLL
  for (int i = 0; i < kRows * TM; ++i) v[i] = 0.0f;
  int c0 = c_begin + lane;
  if constexpr (kFirst) {
    uint4 w[U][kRows];
    DS_UNROLL
    for (int u = 0; u < U; ++u) {
      DS_UNROLL
      for (int r = 0; r < kRows; ++r) w[u][r] = first[u][r];
    }
    dot_step<E, TM, kSharedX>(w, c0, c_end, x, x_row, nt, v);
    c0 += 32 * U;
  }
  for (; c0 < c_end; c0 += 32 * U) {
    uint4 w[U][kRows];
    load_step<TM>(rows, c0, c_end, w);
    dot_step<E, TM, kSharedX>(w, c0, c_end, x, x_row, nt, v);
  }
}

// After the warp sums each value is held by a run of 32 / (kRows * TM) lanes; the first of
// the run writes it.
template <int TM>
DS_KHD bool lane_writes(int lane) {
  return lane % (32 / (kRows * TM)) == 0;
}

// Thread t's output of one (round, pass) of CTA cta: the k groups' partials of one (row,
// token) added in ascending k order. part: [kWarps][kRows * TM]; out: the pass's first output
// row, rows out_row bytes apart. Consecutive threads write consecutive n.
template <int TM>
DS_KHD void reduce_store(const Plan& p, const float* part, int t, int64_t cta, int round, int nt,
                         int64_t n, uint8_t* out, int64_t out_row) {
  const int per_token = p.row_groups * kRows;
  const int j = t / per_token;
  if (j >= nt) return;
  const int rg = (t % per_token) / kRows, r = t % kRows;
  const int64_t row = unit_of(p, cta, round, rg) * kRows + r;
  if (row >= n) return;
  const int idx = r * TM + j;
  const float* pw = part + rg * p.k_groups * (kRows * TM);
  float s = pw[idx];
  for (int kg = 1; kg < p.k_groups; ++kg) s += pw[kg * (kRows * TM) + idx];
  reinterpret_cast<float*>(out + j * out_row)[row] = s;
}

}  // namespace skinny
}  // namespace ds::cuda
