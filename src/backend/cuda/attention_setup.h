// Host side of the paged attention launchers, shared with the host simulator: argument checks,
// the kernel parameter block built from the Backend-level parameters, and the work plan.
// Everything in the plan derives from host-known sizes only (num_seqs, num_tokens, heads,
// max_blocks_per_seq, the SM count), never from the step's contents, so a CUDA graph captured
// for one step replays correctly for the next.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>

#include "backend/backend.h"
#include "backend/cuda/attention_common.cuh"
#include "core/error.h"

namespace ds::cuda {

struct PlanInput {
  int group = 1;  // query heads per kv head (MLA: all heads)
  int kv_heads = 1;
  int dv = 0;         // value dims
  int rows = 16;      // query rows per CTA
  int max_dvc = 512;  // value dims one CTA can hold
  int key_tile = 32;  // keys per shared-memory tile
  int num_seqs = 0, num_tokens = 0;
  int64_t capacity = 0;   // max_blocks_per_seq * block_size: the longest possible context
  int target_ctas = 264;  // enough CTAs to fill the GPU
};

struct WorkPlan {
  int hc = 1, nhc = 1, tq = 1;  // heads per chunk, head chunks per group, tokens per tile
  int dvc = 0, ndv = 1;         // value dims per CTA, value chunks
  int splits = 1;               // context splits (split-K)
  unsigned tiles = 0;           // grid.x: an upper bound on the query tiles of all sequences
};

inline WorkPlan plan_work(const PlanInput& in) {
  auto cdiv = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
  WorkPlan w;
  w.nhc = int(cdiv(in.group, in.rows));
  w.hc = int(cdiv(in.group, w.nhc));
  // One token per tile when every sequence has one query (decode), so tiles map to tokens by
  // a binary search; otherwise as many tokens as the rows hold.
  w.tq = in.num_tokens == in.num_seqs ? 1 : std::max(1, in.rows / w.hc);
  w.ndv = int(cdiv(in.dv, in.max_dvc));
  w.dvc = w.ndv == 1 ? in.dv : int(cdiv(cdiv(in.dv, w.ndv), 32) * 32);
  w.ndv = int(cdiv(in.dv, w.dvc));
  // sum over sequences of ceil(n_s / tq) <= (num_tokens + num_seqs * (tq - 1)) / tq.
  const int64_t tiles = w.tq == 1
                            ? in.num_tokens
                            : (int64_t(in.num_tokens) + int64_t(in.num_seqs) * (w.tq - 1)) / w.tq;
  w.tiles = unsigned(tiles);
  const int64_t base = tiles * in.kv_heads * w.nhc * w.ndv;
  if (base < in.target_ctas) {
    const int64_t by_capacity = std::max<int64_t>(1, cdiv(in.capacity, 2 * in.key_tile));
    w.splits = int(std::min<int64_t>({cdiv(in.target_ctas, base), by_capacity, 64}));
  }
  return w;
}

inline WorkPlan plan_for(const kern::AttnParams& a, int rows, int key_tile, int sm_count) {
  PlanInput in;
  in.group = a.group;
  in.kv_heads = a.kv_heads;
  in.dv = a.dv;
  in.rows = rows;
  in.max_dvc = 512;
  in.key_tile = key_tile;
  in.num_seqs = a.num_seqs;
  in.num_tokens = a.num_tokens;
  in.capacity = int64_t(a.max_blocks_per_seq) * a.block_size;
  in.target_ctas = 2 * sm_count;
  return plan_work(in);
}

inline void apply_plan(const WorkPlan& w, kern::AttnParams& a) {
  a.hc = w.hc;
  a.nhc = w.nhc;
  a.tq = w.tq;
  a.dvc = w.dvc;
  a.ndv = w.ndv;
  a.splits = w.splits;
}

inline int kernel_cache_type(DType t) {
  switch (t) {
    case DType::F32:
      return kern::kCacheF32;
    case DType::F16:
      return kern::kCacheF16;
    case DType::BF16:
      return kern::kCacheBF16;
    case DType::F8_E4M3:
      return kern::kCacheFP8;
    default:
      throw UnsupportedError("cuda attention: cache dtype " + std::string(dtype_name(t)));
  }
}

inline void check_rows(const TensorView& v, int64_t tokens, int64_t heads, int64_t dims,
                       const char* what) {
  DS_CHECK(v.dtype == DType::F32 && v.ndim == 3,
           std::string("cuda attention: ") + what + " must be a 3-D F32 view");
  DS_CHECK(v.shape[0] >= tokens && v.shape[1] == heads && v.shape[2] == dims,
           std::string("cuda attention: ") + what + " is " + v.shape_str() + ", want [" +
               std::to_string(tokens) + ", " + std::to_string(heads) + ", " + std::to_string(dims) +
               "]");
  DS_CHECK(v.stride[2] == 4 && v.stride[0] % 4 == 0 && v.stride[1] % 4 == 0,
           std::string("cuda attention: ") + what + " must have dense rows of floats");
}

// The cache-side fields, and whether 4-element loads of cache rows are aligned.
inline void set_cache(kern::AttnParams& a, const PagedKv& kv) {
  DS_CHECK(kv.k != nullptr && kv.kv_heads > 0 && kv.block_size > 0 && kv.head_dim > 0,
           "cuda attention: empty cache");
  const int es = int(dtype_info(kv.dtype).type_size);
  a.k = static_cast<const uint8_t*>(kv.k);
  a.v = static_cast<const uint8_t*>(kv.v);
  a.cache_type = kernel_cache_type(kv.dtype);
  a.slot_bytes = kv.slot_stride() * es;
  a.head_bytes = int64_t(kv.head_dim) * es;
  a.block_size = kv.block_size;
  if (kv.fp8()) {
    DS_CHECK(kv.k_scale != nullptr && (kv.v == nullptr || kv.v_scale != nullptr),
             "cuda attention: an FP8 cache needs its scales");
    a.k_scale = kv.k_scale;
    a.v_scale = kv.v_scale;
    a.k_scale_parts = kv.k_scale_parts();
    a.rope_split = kv.rope_split;
  }
  const int64_t align = 4 * es;
  auto aligned = [&](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % align == 0; };
  a.vec_ok = aligned(kv.k) && (!kv.v || aligned(kv.v)) && a.slot_bytes % align == 0 &&
             a.head_bytes % align == 0;
}

inline void set_meta(kern::AttnParams& a, const AttentionMeta& meta) {
  a.query_start = meta.query_start;
  a.context_lens = meta.context_lens;
  a.block_tables = meta.block_tables;
  a.max_blocks_per_seq = meta.max_blocks_per_seq;
  a.num_seqs = meta.num_seqs;
  a.num_tokens = meta.num_tokens;
}

// Backend::attention's parameters as a kernel parameter block (plan not yet applied).
inline kern::AttnParams gqa_params(const AttentionParams& p, const AttentionMeta& meta) {
  const PagedKv& kv = p.kv;
  DS_CHECK(kv.v != nullptr, "cuda attention: a K/V cache needs both k and v");
  DS_CHECK(kv.kv_heads > 0, "cuda attention: no kv heads");
  const int heads = int(p.q.shape[1]), hd = kv.head_dim;
  DS_CHECK(heads % kv.kv_heads == 0, "cuda attention: heads " + std::to_string(heads) +
                                         " not a multiple of kv heads " +
                                         std::to_string(kv.kv_heads));
  DS_CHECK(hd >= 1 && hd <= 256,
           "cuda attention: head_dim " + std::to_string(hd) + " outside [1, 256]");
  DS_CHECK(!kv.fp8() || kv.rope_split == 0, "cuda attention: a K/V cache has one scale per head");
  check_rows(p.q, meta.num_tokens, heads, hd, "q");
  check_rows(p.out, meta.num_tokens, heads, hd, "out");
  kern::AttnParams a;
  a.q = static_cast<const uint8_t*>(p.q.data);
  a.q_ts = p.q.stride[0];
  a.q_hs = p.q.stride[1];
  a.q_dims = hd;
  a.out = static_cast<uint8_t*>(p.out.data);
  a.out_ts = p.out.stride[0];
  a.out_hs = p.out.stride[1];
  set_cache(a, kv);
  a.dim = hd;
  a.dv = hd;
  a.heads = heads;
  a.kv_heads = kv.kv_heads;
  a.group = heads / kv.kv_heads;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.causal = p.causal ? 1 : 0;
  set_meta(a, meta);
  return a;
}

// Backend::mla_attention's parameters as a kernel parameter block (plan not yet applied).
inline kern::AttnParams mla_params(const MlaAttentionParams& p, const AttentionMeta& meta) {
  const PagedKv& kv = p.cache;
  const int R = p.kv_lora_rank, heads = int(p.q_latent.shape[1]);
  const int P = kv.head_dim - R;
  DS_CHECK(kv.v == nullptr && kv.kv_heads == 1, "cuda mla_attention: the cache must be latent");
  DS_CHECK(R > 0 && R % 8 == 0 && R <= 1024, "cuda mla_attention: kv_lora_rank " +
                                                 std::to_string(R) +
                                                 " must be a multiple of 8 up to 1024");
  DS_CHECK(P >= 0 && P <= 128, "cuda mla_attention: rope dims " + std::to_string(P) +
                                   " (cache head_dim - kv_lora_rank) outside [0, 128]");
  DS_CHECK(!kv.fp8() || kv.rope_split == R,
           "cuda mla_attention: an FP8 latent cache must split its scales at kv_lora_rank");
  check_rows(p.q_latent, meta.num_tokens, heads, R, "q_latent");
  check_rows(p.out, meta.num_tokens, heads, R, "out");
  if (P > 0) check_rows(p.q_rope, meta.num_tokens, heads, P, "q_rope");
  kern::AttnParams a;
  a.q = static_cast<const uint8_t*>(p.q_latent.data);
  a.q_ts = p.q_latent.stride[0];
  a.q_hs = p.q_latent.stride[1];
  a.q2 = P > 0 ? static_cast<const uint8_t*>(p.q_rope.data) : nullptr;
  a.q2_ts = P > 0 ? p.q_rope.stride[0] : 0;
  a.q2_hs = P > 0 ? p.q_rope.stride[1] : 0;
  a.q_dims = R;
  a.out = static_cast<uint8_t*>(p.out.data);
  a.out_ts = p.out.stride[0];
  a.out_hs = p.out.stride[1];
  set_cache(a, kv);
  a.dim = R + P;
  a.dv = R;
  a.heads = heads;
  a.kv_heads = 1;
  a.group = heads;
  a.scale_log2 = p.scale * 1.4426950408889634f;
  a.causal = p.causal ? 1 : 0;
  a.early_cache = p.cache_settled ? 1 : 0;
  set_meta(a, meta);
  return a;
}

// Where the split partials go: [splits, num_tokens, heads, dv] outputs, then (max, sum) pairs.
inline size_t split_scratch_bytes(const kern::AttnParams& a) {
  if (a.splits <= 1) return 0;
  const size_t rows = size_t(a.splits) * size_t(a.num_tokens) * size_t(a.heads);
  return rows * size_t(a.dv + 2) * sizeof(float);
}
inline void bind_split_scratch(kern::AttnParams& a, void* scratch) {
  if (a.splits <= 1) return;
  const size_t rows = size_t(a.splits) * size_t(a.num_tokens) * size_t(a.heads);
  a.part_o = static_cast<float*>(scratch);
  a.part_ml = a.part_o + rows * size_t(a.dv);
}

inline kern::MergeParams merge_params(const kern::AttnParams& a) {
  kern::MergeParams m;
  m.part_o = a.part_o;
  m.part_ml = a.part_ml;
  m.out = a.out;
  m.out_ts = a.out_ts;
  m.out_hs = a.out_hs;
  m.num_tokens = a.num_tokens;
  m.heads = a.heads;
  m.dv = a.dv;
  m.splits = a.splits;
  return m;
}

}  // namespace ds::cuda
