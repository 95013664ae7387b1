// MLA prefill in the expanded form (Backend::mla_prefill): the step's cached latents are
// gathered from the paged cache, up-projected per head by kv_b_proj (cuBLAS, BF16), and a
// flash-attention kernel (mma.sync m16n8k16, BF16 operands, F32 accumulators, online softmax,
// cp.async double buffering) runs with key dims nope + P = 192 and value dims 128.
//
// Index math shared by the kernels and the host simulation test (tests/gpu/*_sim.cpp) is
// plain host/device code here; the launcher lives in mla_prefill.cu.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "backend/cuda/context.cuh"

#if defined(__CUDACC__)
#define DS_MP_HD __host__ __device__ __forceinline__
#else
#define DS_MP_HD inline
#endif

namespace ds::cuda {

class CublasGemm;

namespace mla_prefill_detail {

constexpr int kNope = 128, kRope = 64, kQk = kNope + kRope, kV = 128;
constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kBlockM = 16 * kWarps;  // query rows of one CTA (one head)
constexpr int kBlockN = 64;           // keys per shared-memory tile
constexpr int kKTileBytes = kBlockN * kQk * 2;
constexpr int kVTileBytes = kBlockN * kV * 2;
constexpr int kSmemBytes = 2 * (kKTileBytes + kVTileBytes);  // two stages

// Byte offset of 16-byte chunk c of row r in a tile whose rows hold `chunks` chunks (a
// multiple of 8): the chunk's low 3 bits are XORed with the row's, so the 8 rows one ldmatrix
// phase reads land in 8 distinct bank groups.
DS_MP_HD int swizzle(int r, int c, int chunks) {
  return (r * chunks + ((c & ~7) | ((c ^ r) & 7))) * 16;
}

// Query tile qt of a sequence with nq queries and ctx cached tokens (the queries are its last
// nq positions): rows [q_begin, q_end) of the sequence, and the keys [0, n_keys) they see.
struct QueryTile {
  int q_begin = 0, q_end = 0;  // query indices within the sequence
  int pos0 = 0;                // position of query q_begin
  int n_keys = 0;              // keys the tile's rows see (causal: up to the last row's position)
  int n_tiles = 0;             // key tiles of kBlockN
  int first_masked = 0;        // key tiles from here on need a per-element mask
};

DS_MP_HD QueryTile query_tile(int qt, int nq, int ctx, bool causal) {
  QueryTile t;
  t.q_begin = qt * kBlockM;
  t.q_end = t.q_begin + kBlockM < nq ? t.q_begin + kBlockM : nq;
  t.pos0 = ctx - nq + t.q_begin;
  if (t.q_begin >= nq) return t;  // an empty tile (grid sized for the longest sequence)
  t.n_keys = causal ? t.pos0 + (t.q_end - t.q_begin) : ctx;
  t.n_tiles = (t.n_keys + kBlockN - 1) / kBlockN;
  // Tile k needs no mask when all its keys are < ctx and (causal) <= the first row's position.
  const int clean = causal ? (t.pos0 + 1 < ctx ? t.pos0 + 1 : ctx) : ctx;
  t.first_masked = clean / kBlockN;
  return t;
}

// Row of the gathered (padded) latent / K / V buffers holding position j of sequence s.
DS_MP_HD int64_t gathered_row(int s, int j, int max_context_len) {
  return int64_t(s) * max_context_len + j;
}

}  // namespace mla_prefill_detail

// Whether the expanded path serves this step: DeepSeek-V2 head dims (nope 128, rope 64,
// v 128), BF16 kv_b, prefill-sized queries, and a padded gather that is not mostly waste.
bool mla_prefill_wanted(const MlaPrefillParams& p, const AttentionMeta& meta);

// Runs the expanded path (mla_prefill_wanted must hold). Not graph-capturable: it sizes
// launches and scratch from meta.max_query_len / max_context_len.
void mla_prefill(const Context& ctx, CublasGemm& gemm, const MlaPrefillParams& p,
                 const AttentionMeta& meta);

}  // namespace ds::cuda
