// Paged attention on tensor cores (mma.sync m16n8k16, BF16 operands, F32 accumulators): the
// MLA decode/prefill kernel, and GQA prefill with separate values. 8 warps own 16 query rows
// (the heads of one token, or tokens x heads) and stream the split's keys 32 at a time:
//   scores S[16, 32] = Q K^T: warp w takes k-steps [w kpw, (w+1) kpw) of all 4 key n-tiles,
//     so each Q fragment feeds 4 MMAs; the 8 partial tiles are summed in shared memory;
//   online softmax: warp w owns rows 2w, 2w+1 (lane = key), probabilities to shared;
//   O[16, dvc] += P V: warp w owns value n-tiles w + 8 i (i < 8), its fragments stay in
//     registers across tiles; V comes from the key tile itself for MLA (the latent).
// Accuracy: each F32 operand x is split x = hi + lo into two BF16 values (lo = x - hi, exact
// for F16 and BF16 inputs), and products are summed as hi*hi + lo*hi (+ hi*lo when the cache
// is not BF16; an FP8 cache row dequantizes to F32 on load, so it takes the lo part too), so
// results match F32 arithmetic to ~1e-5 relative rather than BF16's ~1e-3.
#pragma once

#include "backend/cuda/attention_common.cuh"

namespace ds::cuda::kern {

constexpr int kMmaThreads = 256;
constexpr int kMmaWarps = 8;
constexpr int kMmaRows = 16;
constexpr int kMmaKeys = 32;
constexpr int kMmaValueTiles = 8;          // value n-tiles per warp: dvc <= 8 * 8 * 8 = 512
constexpr int kMmaPStride = kMmaKeys + 8;  // probability row stride: conflict-free fragments
static_assert(kMmaRows <= kMaxRows && 2 + kMmaKeys <= 64, "CTA header too small");

// Shared memory of the tensor-core kernel (bytes from the dynamic base). Row strides are
// 8 elements past a multiple of 16 so the 8 rows a fragment load touches hit distinct banks.
struct MmaLayout {
  int dk = 0, ks = 0;   // score dims rounded to 16; Q / K row stride (elements)
  int dvk = 0, vs = 0;  // separate V: value dims rounded to 16; V row stride
  int q_hi = 0, q_lo = 0, k_hi = 0, k_lo = 0, v_hi = 0, v_lo = 0;
  int s_part = 0, p_hi = 0, p_lo = 0, stats = 0, bytes = 0;
};

DS_KHD MmaLayout mma_layout(int dim, int dvc, bool lo, bool separate_v) {
  MmaLayout l;
  l.dk = (dim + 15) / 16 * 16;
  l.ks = l.dk + 8;
  l.dvk = separate_v ? (dvc + 15) / 16 * 16 : 0;
  l.vs = separate_v ? l.dvk + 8 : 0;
  int off = kHeaderBytes;
  l.q_hi = off;
  off += kMmaRows * l.ks * 2;
  l.q_lo = off;
  off += kMmaRows * l.ks * 2;
  l.k_hi = off;
  off += kMmaKeys * l.ks * 2;
  l.k_lo = off;
  if (lo) off += kMmaKeys * l.ks * 2;
  l.v_hi = off;
  off += kMmaKeys * l.vs * 2;
  l.v_lo = off;
  if (lo) off += kMmaKeys * l.vs * 2;
  l.s_part = off;  // [warps, rows, keys] F32
  off += kMmaWarps * kMmaRows * kMmaKeys * 4;
  l.p_hi = off;  // [rows, kMmaPStride] BF16
  off += kMmaRows * kMmaPStride * 2;
  l.p_lo = off;
  off += kMmaRows * kMmaPStride * 2;
  l.stats = off;  // alpha, max, sum: [3, rows] F32
  off += 3 * kMmaRows * 4;
  l.bytes = off;
  return l;
}

DS_KDEV uint32_t ld_pair(const uint16_t* p) {
  check_aligned(p, 4);
  return *reinterpret_cast<const uint32_t*>(p);
}

// x = hi + lo in BF16; lo is only kept when the caller has a buffer for it.
DS_KDEV void split_bf16(float x, uint16_t& hi, uint16_t& lo) {
  hi = float_to_bf16_bits(x);
  lo = float_to_bf16_bits(x - bf16_bits_to_float(hi));
}

DS_KDEV void store_split4(const float (&x)[4], uint16_t* hi, uint16_t* lo) {
  Vec4h h, l;
  DS_UNROLL for (int e = 0; e < 4; ++e) split_bf16(x[e], h.x[e], l.x[e]);
  check_aligned(hi, 8);
  *reinterpret_cast<Vec4h*>(hi) = h;
  if (lo) *reinterpret_cast<Vec4h*>(lo) = l;
}

// kLo: the cache is F16 or F32, whose values need a BF16 lo part too. kSepV: values come
// from a separate cache (GQA) rather than the key rows' first dv dims (MLA).
template <bool kLo, bool kSepV>
DS_KDEV void mma_attention(const AttnParams& p, const Thread& th, uint8_t* smem) {
  const Header hdr = header(smem);
  Tile t;
  if (!find_tile(p, th, hdr.ints, kMmaKeys, t)) return;
  if (t.key_begin >= t.key_end) {
    write_empty_split(p, th, t, kMmaRows);
    return;
  }
  const MmaLayout L = mma_layout(p.dim, p.dvc, kLo, kSepV);
  uint16_t* q_hi = reinterpret_cast<uint16_t*>(smem + L.q_hi);  // [rows, ks]
  uint16_t* q_lo = reinterpret_cast<uint16_t*>(smem + L.q_lo);
  uint16_t* k_hi = reinterpret_cast<uint16_t*>(smem + L.k_hi);  // [keys, ks]
  uint16_t* k_lo = reinterpret_cast<uint16_t*>(smem + L.k_lo);
  uint16_t* v_hi = reinterpret_cast<uint16_t*>(smem + L.v_hi);  // [keys, vs]
  uint16_t* v_lo = reinterpret_cast<uint16_t*>(smem + L.v_lo);
  float* s_part = reinterpret_cast<float*>(smem + L.s_part);    // [warps, rows, keys]
  uint16_t* p_hi = reinterpret_cast<uint16_t*>(smem + L.p_hi);  // [rows, kMmaPStride]
  uint16_t* p_lo = reinterpret_cast<uint16_t*>(smem + L.p_lo);
  float* alpha_s = reinterpret_cast<float*>(smem + L.stats);  // [rows]
  float* m_s = alpha_s + kMmaRows;
  float* l_s = m_s + kMmaRows;
  int* slots = hdr.ints + 2;
  const int g = th.lane >> 2, tg = th.lane & 3;  // fragment row group, thread in group

  set_query_rows(p, th, t, kMmaRows, hdr);
  sync_block();
  batched_copy<8, 1>(
      kMmaRows * L.dk, th,
      [&](int u, float(&x)[1]) { x[0] = query_elem(p, hdr, u / L.dk, u % L.dk); },
      [&](int u, const float(&x)[1]) {
        const int i = (u / L.dk) * L.ks + u % L.dk;
        split_bf16(x[0], q_hi[i], q_lo[i]);
      });

  // Softmax rows of this warp, and its share of the score k-steps.
  RowInfo own[2];
  float m_own[2] = {-INFINITY, -INFINITY}, l_own[2] = {0.0f, 0.0f};
  DS_UNROLL for (int i = 0; i < 2; ++i) own[i] = row_info(p, t, 2 * th.warp + i);
  const int ksteps = L.dk / 16;
  const int kpw = ceil_div_int(ksteps, kMmaWarps);
  const int ks_begin = th.warp * kpw;
  const int ks_end = ks_begin + kpw < ksteps ? ks_begin + kpw : ksteps;
  const int n_active = ceil_div_int(ksteps, kpw);  // warps with score work

  float o[kMmaValueTiles][4];
  DS_UNROLL for (int i = 0; i < kMmaValueTiles; ++i) {
    DS_UNROLL for (int e = 0; e < 4; ++e) o[i][e] = 0.0f;
  }

  const uint16_t* vh = kSepV ? v_hi : k_hi + t.dv0;  // value column 0 of this chunk
  const uint16_t* vl = kSepV ? v_lo : k_lo + t.dv0;
  const int vstride = kSepV ? L.vs : L.ks;

  for (int k0 = t.key_begin; k0 < t.key_end; k0 += kMmaKeys) {
    if (th.tid < kMmaKeys) {
      const int j = k0 + th.tid;
      slots[th.tid] = j < t.key_end ? int(slot_of(p, t.seq, j)) : -1;
    }
    sync_block();
    const int ku = L.dk / 4;
    batched_copy<8, 4>(
        kMmaKeys * ku, th,
        [&](int u, float(&x)[4]) {
          const int j = u / ku, c = u % ku;
          load_key4(p, t.kvh, slots[j], 4 * c, x);
        },
        [&](int u, const float(&x)[4]) {
          const int i = (u / ku) * L.ks + 4 * (u % ku);
          store_split4(x, k_hi + i, kLo ? k_lo + i : nullptr);
        });
    if (kSepV) {
      const int vu = L.dvk / 4;
      batched_copy<8, 4>(
          kMmaKeys * vu, th,
          [&](int u, float(&x)[4]) {
            const int j = u / vu, c = u % vu;
            load_value4(p, t.kvh, slots[j], t.dv0, 4 * c, t.nv, x);
          },
          [&](int u, const float(&x)[4]) {
            const int i = (u / vu) * L.vs + 4 * (u % vu);
            store_split4(x, v_hi + i, kLo ? v_lo + i : nullptr);
          });
    }
    sync_block();

    // Partial scores over this warp's k-steps: acc[n] is key n-tile n (keys 8n .. 8n + 7).
    if (ks_begin < ks_end) {
      float acc[4][4];
      DS_UNROLL for (int n = 0; n < 4; ++n) {
        DS_UNROLL for (int e = 0; e < 4; ++e) acc[n][e] = 0.0f;
      }
      for (int ks = ks_begin; ks < ks_end; ++ks) {
        const int kc = ks * 16 + 2 * tg;
        const uint32_t ah[4] = {ld_pair(q_hi + g * L.ks + kc), ld_pair(q_hi + (g + 8) * L.ks + kc),
                                ld_pair(q_hi + g * L.ks + kc + 8),
                                ld_pair(q_hi + (g + 8) * L.ks + kc + 8)};
        const uint32_t al[4] = {ld_pair(q_lo + g * L.ks + kc), ld_pair(q_lo + (g + 8) * L.ks + kc),
                                ld_pair(q_lo + g * L.ks + kc + 8),
                                ld_pair(q_lo + (g + 8) * L.ks + kc + 8)};
        DS_UNROLL for (int n = 0; n < 4; ++n) {
          const uint16_t* kr = k_hi + (n * 8 + g) * L.ks + kc;  // B[k][n] = K[key n][dim k]
          const uint32_t b[2] = {ld_pair(kr), ld_pair(kr + 8)};
          mma_bf16_16816(acc[n], ah, b);
          mma_bf16_16816(acc[n], al, b);
          if (kLo) {
            const uint16_t* krl = k_lo + (n * 8 + g) * L.ks + kc;
            const uint32_t bl[2] = {ld_pair(krl), ld_pair(krl + 8)};
            mma_bf16_16816(acc[n], ah, bl);
          }
        }
      }
      float* sp = s_part + th.warp * kMmaRows * kMmaKeys;
      DS_UNROLL for (int n = 0; n < 4; ++n) {
        const int key = n * 8 + 2 * tg;
        sp[g * kMmaKeys + key] = acc[n][0];
        sp[g * kMmaKeys + key + 1] = acc[n][1];
        sp[(g + 8) * kMmaKeys + key] = acc[n][2];
        sp[(g + 8) * kMmaKeys + key + 1] = acc[n][3];
      }
    }
    sync_block();

    // Online softmax (base 2) of the warp's two rows; lane = key.
    const int key = k0 + th.lane;
    DS_UNROLL for (int i = 0; i < 2; ++i) {
      const int r = 2 * th.warp + i;
      float s = 0.0f;
      for (int w = 0; w < n_active; ++w) s += s_part[(w * kMmaRows + r) * kMmaKeys + th.lane];
      const bool vis = key < t.key_end && key < own[i].n_keys;
      const float sc = vis ? s * p.scale_log2 : -INFINITY;
      const float mn = fmaxf(m_own[i], warp_max(sc));
      float pr = 0.0f, alpha = 1.0f;
      if (mn != -INFINITY) {
        pr = vis ? exp2_approx(sc - mn) : 0.0f;
        alpha = exp2_approx(m_own[i] - mn);
      }
      l_own[i] = l_own[i] * alpha + warp_sum(pr);
      m_own[i] = mn;
      split_bf16(pr, p_hi[r * kMmaPStride + th.lane], p_lo[r * kMmaPStride + th.lane]);
      if (th.lane == 0) alpha_s[r] = alpha;
    }
    sync_block();

    // O = O * alpha + P V over the tile's two 16-key k-steps.
    const float a0 = alpha_s[g], a1 = alpha_s[g + 8];
    DS_UNROLL for (int i = 0; i < kMmaValueTiles; ++i) {
      o[i][0] *= a0;
      o[i][1] *= a0;
      o[i][2] *= a1;
      o[i][3] *= a1;
    }
    DS_UNROLL for (int kk = 0; kk < kMmaKeys / 16; ++kk) {
      const int kc = kk * 16 + 2 * tg;
      const uint32_t ph[4] = {
          ld_pair(p_hi + g * kMmaPStride + kc), ld_pair(p_hi + (g + 8) * kMmaPStride + kc),
          ld_pair(p_hi + g * kMmaPStride + kc + 8), ld_pair(p_hi + (g + 8) * kMmaPStride + kc + 8)};
      const uint32_t pl[4] = {
          ld_pair(p_lo + g * kMmaPStride + kc), ld_pair(p_lo + (g + 8) * kMmaPStride + kc),
          ld_pair(p_lo + g * kMmaPStride + kc + 8), ld_pair(p_lo + (g + 8) * kMmaPStride + kc + 8)};
      DS_UNROLL for (int i = 0; i < kMmaValueTiles; ++i) {
        const int col = (th.warp + kMmaWarps * i) * 8;
        if (col >= t.nv) continue;
        // B[k][n] = V[key k][dim n]: two keys of one value column per register.
        const uint16_t* v0 = vh + kc * vstride + col + g;
        const uint32_t b[2] = {pack_bf16(v0[0], v0[vstride]),
                               pack_bf16(v0[8 * vstride], v0[9 * vstride])};
        mma_bf16_16816(o[i], ph, b);
        mma_bf16_16816(o[i], pl, b);
        if (kLo) {
          const uint16_t* w0 = vl + kc * vstride + col + g;
          const uint32_t bl[2] = {pack_bf16(w0[0], w0[vstride]),
                                  pack_bf16(w0[8 * vstride], w0[9 * vstride])};
          mma_bf16_16816(o[i], ph, bl);
        }
      }
    }
    sync_block();  // slots, tiles, partial scores and probabilities are rewritten next
  }

  if (th.lane == 0) {
    DS_UNROLL for (int i = 0; i < 2; ++i) {
      m_s[2 * th.warp + i] = m_own[i];
      l_s[2 * th.warp + i] = l_own[i];
    }
  }
  sync_block();

  DS_UNROLL for (int half = 0; half < 2; ++half) {
    const int r = g + 8 * half;
    const RowInfo ri = row_info(p, t, r);
    if (!ri.valid) continue;
    if (p.splits == 1) {
      float* out =
          reinterpret_cast<float*>(p.out + ri.token * p.out_ts + ri.head * p.out_hs) + t.dv0;
      const float inv = 1.0f / l_s[r];
      DS_UNROLL for (int i = 0; i < kMmaValueTiles; ++i) {
        const int d = (th.warp + kMmaWarps * i) * 8 + 2 * tg;
        if (d < t.nv) out[d] = o[i][2 * half] * inv;
        if (d + 1 < t.nv) out[d + 1] = o[i][2 * half + 1] * inv;
      }
    } else {
      const int64_t pr = part_row(p, t.split, ri.token, ri.head);
      float* po = p.part_o + pr * p.dv + t.dv0;
      DS_UNROLL for (int i = 0; i < kMmaValueTiles; ++i) {
        const int d = (th.warp + kMmaWarps * i) * 8 + 2 * tg;
        if (d < t.nv) po[d] = o[i][2 * half];
        if (d + 1 < t.nv) po[d + 1] = o[i][2 * half + 1];
      }
      if (th.warp == 0 && tg == 0 && t.dvi == 0) {
        p.part_ml[pr * 2] = m_s[r];
        p.part_ml[pr * 2 + 1] = l_s[r];
      }
    }
  }
}

}  // namespace ds::cuda::kern
