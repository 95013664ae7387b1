// Multi-head latent attention: the baseline-ISA kernel, per-ISA dispatch and the driver that
// checks the metadata and spreads (token, head range) items over the pool.
#include "backend/cpu/mla_attention.h"

#include <algorithm>
#include <string>

#include "backend/cpu/isa_dispatch.h"
#include "backend/cpu/mla_attention_kernel.h"
#include "core/error.h"
#include "core/thread_pool.h"

namespace ds::cpu {

namespace detail {
void mla_generic(const MlaAttentionParams& p, const AttentionMeta& meta, const MlaItem& item,
                 MlaScratch& scratch) {
  mla_body(p, meta, item, scratch);
}
}  // namespace detail

namespace {
detail::MlaKernel mla_kernel(Isa isa) {
  return by_isa<detail::MlaKernel>(isa, detail::mla_generic, detail::mla_avx2, detail::mla_avx512);
}
}  // namespace

void mla_attention(const MlaAttentionParams& p, const AttentionMeta& meta, ThreadPool& pool,
                   Isa isa, std::vector<MlaScratch>& scratch) {
  const TensorView &ql = p.q_latent, &qr = p.q_rope, &out = p.out;
  DS_CHECK(ql.ndim == 3 && qr.ndim == 3 && out.ndim == 3,
           "mla_attention takes [tokens, heads, dim] views");
  DS_CHECK(ql.dtype == DType::F32 && qr.dtype == DType::F32 && out.dtype == DType::F32,
           "mla_attention takes F32 queries and output");
  const int64_t T = ql.shape[0], H = ql.shape[1], R = p.kv_lora_rank, P = qr.shape[2];
  DS_CHECK(R > 0 && ql.shape[2] == R && qr.shape[0] == T && qr.shape[1] == H && out.shape[0] == T &&
               out.shape[1] == H && out.shape[2] == R,
           "mla_attention shapes: q_latent " + ql.shape_str() + ", q_rope " + qr.shape_str() +
               ", out " + out.shape_str() + ", kv_lora_rank " + std::to_string(R));
  DS_CHECK(ql.stride[2] == 4 && qr.stride[2] == 4 && out.stride[2] == 4,
           "mla_attention: the last dimension must be contiguous");
  const PagedKv& c = p.cache;
  DS_CHECK(c.v == nullptr && c.kv_heads == 1 && c.head_dim == R + P && c.k != nullptr,
           "mla_attention needs a latent cache (v == nullptr, 1 kv head, head_dim = R + P)");
  DS_CHECK(!c.fp8() || (c.k_scale && c.rope_split == R),
           "mla_attention: an FP8 latent cache needs scales split at kv_lora_rank");
  if (c.dtype != DType::F32 && c.dtype != DType::F16 && c.dtype != DType::BF16 && !c.fp8())
    throw UnsupportedError("cpu mla_attention does not support a " +
                           std::string(dtype_name(c.dtype)) + " cache");
  DS_CHECK(meta.num_tokens == T, "mla_attention: meta.num_tokens != q_latent tokens");
  if (T == 0 || H == 0) return;

  // Metadata is checked here: the kernel runs on pool threads, which must not throw.
  std::vector<int> seq_of(size_t(T), -1);
  for (int s = 0; s < meta.num_seqs; ++s) {
    const int q0 = meta.query_start[s], q1 = meta.query_start[s + 1], ctx = meta.context_lens[s];
    DS_CHECK(0 <= q0 && q0 <= q1 && q1 <= T && q1 - q0 <= ctx,
             "mla_attention: sequence " + std::to_string(s) + " has bad query_start/context_lens");
    const int blocks = (ctx + c.block_size - 1) / c.block_size;
    DS_CHECK(blocks <= meta.max_blocks_per_seq, "mla_attention: context exceeds its block table");
    const int32_t* table = meta.block_tables + int64_t(s) * meta.max_blocks_per_seq;
    for (int b = 0; b < blocks; ++b)
      DS_CHECK(table[b] >= 0 && table[b] < c.num_blocks, "mla_attention: block id out of range");
    for (int t = q0; t < q1; ++t) seq_of[size_t(t)] = s;
  }
  for (int s : seq_of) DS_CHECK(s >= 0, "mla_attention: a token belongs to no sequence");

  // The heads of one token share each widened cache row; they are split into chunks only
  // when there are too few tokens to occupy the pool. Results are the same either way.
  const int nth = pool.size();
  const int64_t want = nth == 1 ? 1 : std::clamp<int64_t>((4 * int64_t(nth) + T - 1) / T, 1, H);
  const int64_t per = (H + want - 1) / want, chunks = (H + per - 1) / per, items = T * chunks;
  if (scratch.size() < size_t(nth)) scratch.resize(size_t(nth));
  const detail::MlaKernel kernel = mla_kernel(isa);
  pool.run([&](int ith, int n) {
    const auto [begin, end] = ThreadPool::split(items, ith, n);
    for (int64_t i = begin; i < end; ++i) {
      const int t = int(i / chunks), h0 = int(i % chunks * per);
      kernel(p, meta, {t, seq_of[size_t(t)], h0, int(std::min(H, h0 + per))}, scratch[size_t(ith)]);
    }
  });
}

}  // namespace ds::cpu
