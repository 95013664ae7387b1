// The general paged attention kernel in plain F32 arithmetic (no tensor cores): any cache
// dtype, any score / value width, GQA and MLA (values aliasing the key rows), decode and
// prefill, causal or not, split-K. 4 warps own kRows = 16 query rows (row r -> warp r % 4),
// and stream the split's keys through shared memory 32 at a time:
//   scores: lane j of a warp computes its 4 rows' dots with key j (float4 shared loads);
//   online softmax per row in base 2 (warp max / sum), probabilities to shared;
//   P . V: lane owns value dims lane + 32 c (c < kNI) of its 4 rows.
#pragma once

#include "backend/cuda/attention_common.cuh"

namespace ds::cuda::kern {

constexpr int kSimtThreads = 128;
constexpr int kSimtWarps = 4;
constexpr int kSimtRows = 16;  // query rows per CTA
constexpr int kSimtRowsPerWarp = 4;
constexpr int kSimtKeys = 32;  // keys per shared-memory tile (one per lane)
static_assert(kSimtRows <= kMaxRows && 2 + kSimtKeys <= 64, "CTA header too small");

// Shared memory of the SIMT kernel, in bytes from the dynamic base; the same on host and
// device so the launcher can size it.
struct SimtLayout {
  int dq = 0;       // query / key row length in floats (dim rounded up to 4)
  int kstride = 0;  // key row stride in floats: dq/4 odd multiples of 16 bytes, no conflicts
  int vstride = 0;  // separate value row stride in floats (0 when values alias keys)
  int q_off = 0, k_off = 0, v_off = 0, p_off = 0, bytes = 0;
};

DS_KHD SimtLayout simt_layout(int dim, int dvc, bool separate_v) {
  SimtLayout l;
  l.dq = (dim + 3) / 4 * 4;
  l.kstride = (l.dq / 4) % 2 == 0 ? l.dq + 4 : l.dq + 8;
  l.vstride = separate_v ? (dvc + 3) / 4 * 4 : 0;
  l.q_off = kHeaderBytes;
  l.k_off = l.q_off + kSimtRows * l.dq * 4;
  l.v_off = l.k_off + kSimtKeys * l.kstride * 4;
  l.p_off = l.v_off + kSimtKeys * l.vstride * 4;
  l.bytes = l.p_off + kSimtWarps * kSimtKeys * kSimtRowsPerWarp * 4;
  return l;
}

// kNI: value dims per lane and row (p.dvc <= 32 * kNI).
template <int kNI>
DS_KDEV void simt_attention(const AttnParams& p, const Thread& th, uint8_t* smem) {
  const Header hdr = header(smem);
  Tile t;
  if (!find_tile(p, th, hdr.ints, kSimtKeys, t)) return;
  if (t.key_begin >= t.key_end) {
    write_empty_split(p, th, t, kSimtRows);
    return;
  }
  const bool separate_v = p.v != nullptr;
  const SimtLayout L = simt_layout(p.dim, p.dvc, separate_v);
  float* q_s = reinterpret_cast<float*>(smem + L.q_off);  // [kSimtRows, dq]
  float* k_s = reinterpret_cast<float*>(smem + L.k_off);  // [kSimtKeys, kstride]
  float* v_s = reinterpret_cast<float*>(smem + L.v_off);  // [kSimtKeys, vstride]
  float* p_s = reinterpret_cast<float*>(smem + L.p_off);  // [warps, kSimtKeys, rows per warp]
  int* slots = hdr.ints + 2;                              // [kSimtKeys], -1 past key_end

  // Queries, zero-padded to dq and for rows the tile does not fill.
  set_query_rows(p, th, t, kSimtRows, hdr);
  sync_block();
  batched_copy<8, 1>(
      kSimtRows * L.dq, th,
      [&](int u, float(&x)[1]) { x[0] = query_elem(p, hdr, u / L.dq, u % L.dq); },
      [&](int u, const float(&x)[1]) { q_s[u] = x[0]; });

  RowInfo rows[kSimtRowsPerWarp];
  float m[kSimtRowsPerWarp], l[kSimtRowsPerWarp], o[kSimtRowsPerWarp][kNI];
  DS_UNROLL for (int i = 0; i < kSimtRowsPerWarp; ++i) {
    rows[i] = row_info(p, t, th.warp + kSimtWarps * i);
    m[i] = -INFINITY;
    l[i] = 0.0f;
    DS_UNROLL for (int c = 0; c < kNI; ++c) o[i][c] = 0.0f;
  }

  const int kunits = L.dq / 4, vunits = L.vstride / 4;
  const float* vsrc = separate_v ? v_s : k_s + t.dv0;
  const int vs = separate_v ? L.vstride : L.kstride;

  for (int k0 = t.key_begin; k0 < t.key_end; k0 += kSimtKeys) {
    if (th.tid < kSimtKeys) {
      const int j = k0 + th.tid;
      slots[th.tid] = j < t.key_end ? int(slot_of(p, t.seq, j)) : -1;
    }
    sync_block();
    batched_copy<8, 4>(
        kSimtKeys * kunits, th,
        [&](int u, float(&x)[4]) {
          const int j = u / kunits, c = u % kunits;
          load_key4(p, t.kvh, slots[j], 4 * c, x);
        },
        [&](int u, const float(&x)[4]) {
          float* dst = k_s + (u / kunits) * L.kstride + 4 * (u % kunits);
          DS_UNROLL for (int e = 0; e < 4; ++e) dst[e] = x[e];
        });
    if (separate_v) {
      batched_copy<8, 4>(
          kSimtKeys * vunits, th,
          [&](int u, float(&x)[4]) {
            const int j = u / vunits, c = u % vunits;
            load_value4(p, t.kvh, slots[j], t.dv0, 4 * c, t.nv, x);
          },
          [&](int u, const float(&x)[4]) {
            float* dst = v_s + (u / vunits) * L.vstride + 4 * (u % vunits);
            DS_UNROLL for (int e = 0; e < 4; ++e) dst[e] = x[e];
          });
    }
    sync_block();

    // Scores of key k0 + lane against the warp's rows.
    float s[kSimtRowsPerWarp] = {};
    {
      const Vec4f* kr = reinterpret_cast<const Vec4f*>(k_s + th.lane * L.kstride);
      const Vec4f* qr[kSimtRowsPerWarp];
      check_aligned(kr, 16);
      DS_UNROLL for (int i = 0; i < kSimtRowsPerWarp; ++i) {
        qr[i] = reinterpret_cast<const Vec4f*>(q_s + (th.warp + kSimtWarps * i) * L.dq);
        check_aligned(qr[i], 16);
      }
      for (int c = 0; c < kunits; ++c) {
        const Vec4f kv = kr[c];
        DS_UNROLL for (int i = 0; i < kSimtRowsPerWarp; ++i) {
          const Vec4f qv = qr[i][c];
          s[i] = fmaf(kv.x[0], qv.x[0], s[i]);
          s[i] = fmaf(kv.x[1], qv.x[1], s[i]);
          s[i] = fmaf(kv.x[2], qv.x[2], s[i]);
          s[i] = fmaf(kv.x[3], qv.x[3], s[i]);
        }
      }
    }

    // Online softmax (base 2): rescale what the rows have so far to the new max.
    const int key = k0 + th.lane;
    float* pw = p_s + th.warp * kSimtKeys * kSimtRowsPerWarp;
    DS_UNROLL for (int i = 0; i < kSimtRowsPerWarp; ++i) {
      const bool vis = key < t.key_end && key < rows[i].n_keys;
      const float sc = vis ? s[i] * p.scale_log2 : -INFINITY;
      const float mn = fmaxf(m[i], warp_max(sc));
      float pr = 0.0f, alpha = 1.0f;
      if (mn != -INFINITY) {
        pr = vis ? exp2_approx(sc - mn) : 0.0f;
        alpha = exp2_approx(m[i] - mn);  // 0 while the row had no key yet
      }
      l[i] = l[i] * alpha + warp_sum(pr);
      m[i] = mn;
      DS_UNROLL for (int c = 0; c < kNI; ++c) o[i][c] *= alpha;
      pw[th.lane * kSimtRowsPerWarp + i] = pr;
    }
    sync_warp();

    // P . V: keys past key_end have p = 0 and zero-filled rows.
    for (int j = 0; j < kSimtKeys; ++j) {
      check_aligned(pw + j * kSimtRowsPerWarp, 16);
      const Vec4f pj = *reinterpret_cast<const Vec4f*>(pw + j * kSimtRowsPerWarp);
      const float* vr = vsrc + j * vs;
      DS_UNROLL for (int c = 0; c < kNI; ++c) {
        const int d = th.lane + 32 * c;
        if (d < t.nv) {
          const float vv = vr[d];
          DS_UNROLL for (int i = 0; i < kSimtRowsPerWarp; ++i) o[i][c] = fmaf(pj.x[i], vv, o[i][c]);
        }
      }
    }
    sync_block();  // k_s, v_s, slots and p_s are rewritten next
  }

  DS_UNROLL for (int i = 0; i < kSimtRowsPerWarp; ++i) {
    const RowInfo& ri = rows[i];
    if (!ri.valid) continue;
    if (p.splits == 1) {
      float* out =
          reinterpret_cast<float*>(p.out + ri.token * p.out_ts + ri.head * p.out_hs) + t.dv0;
      const float inv = 1.0f / l[i];
      DS_UNROLL for (int c = 0; c < kNI; ++c) {
        const int d = th.lane + 32 * c;
        if (d < t.nv) out[d] = o[i][c] * inv;
      }
    } else {
      const int64_t pr = part_row(p, t.split, ri.token, ri.head);
      float* po = p.part_o + pr * p.dv + t.dv0;
      DS_UNROLL for (int c = 0; c < kNI; ++c) {
        const int d = th.lane + 32 * c;
        if (d < t.nv) po[d] = o[i][c];
      }
      if (t.dvi == 0 && th.lane == 0) {
        p.part_ml[pr * 2] = m[i];
        p.part_ml[pr * 2 + 1] = l[i];
      }
    }
  }
}

}  // namespace ds::cuda::kern
