#!/usr/bin/env python3
"""Tiny random 4-bit GPTQ and AWQ checkpoints (packed int32 qweight / qzeros, F16 scales, as
AutoGPTQ / gptqmodel and AutoAWQ write them) with transformers' outputs on the dequantized
weights, for deepserve's GPTQ / AWQ loading tests (tests/unit/lib/test_hf_gptq.cpp).

Both are llamas built by transformers' own classes with the sharp init of make_hf_fixtures.py
(randn * 0.6 / sqrt(fan_in), norms 1 + 0.1 randn): hidden 256, intermediate 512, 2 layers,
4 heads of 64, 2 KV heads, vocab 96. Every q/k/v/o/gate/up/down weight is quantized with
round-to-nearest in groups of 128 along K (input features):

- `llama_gptq_sym`: GPTQ, sym, desc_act false, checkpoint_format "gptq" (v1). qweight int32
  [K/8, N] (element (k, n) at bits 4*(k%8) of qweight[k/8, n]), qzeros int32 [K/128, N/8]
  (column n at bits 4*(n%8)) holding zero - 1 = 7, scales F16 [K/128, N], g_idx int32 [K]
  (k / 128). scale = absmax / 7 rounded to a BF16-representable F16, so deepserve's W4A16
  (BF16 scales, code - 8) holds these weights exactly.
- `llama_awq`: AWQ GEMM, asymmetric (zero_point true). qweight int32 [K, N/8] packed along N
  in AutoAWQ's order (nibble i of int32 c holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]),
  qzeros int32 [K/128, N/8] packed the same way (zeros as is), scales F16 [K/128, N];
  element = (q - zero) * scale. Scales keep 4 significant bits, so every dequantized weight
  is exact in BF16 (deepserve's default binding of a format without a W4A16 equivalent).

The reference runs transformers (float32, eager) on the dequantized weights written as a plain
F32 checkpoint (no GPTQ/AWQ kernel package needed); outputs go to reference.safetensors in
make_hf_differential.py's schema, plus index.json.

  $HFPY tools/make_gptq_fixture.py [--out tests/fixtures/hf_gptq]
"""

import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_hf_differential as diff  # noqa: E402
import make_hf_fixtures as base  # noqa: E402

REPO = base.REPO
GROUP = 128
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
MIN_MARGIN = 1e-4
HF = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
          head_dim=64, intermediate_size=512, tie_word_embeddings=False,
          max_position_embeddings=256, rms_norm_eps=1e-5,
          rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
# DeepSeek-V2 with every quantized K a multiple of 128 (o_proj: 2 heads x v 64), 4 routed
# experts top-2 + 1 shared, the first layer dense: experts, shared experts and MLA projections
# in GPTQ form (kv_b_proj too, which deepserve dequantizes to F32; the router stays BF16).
HF_DS = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
             q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=16, qk_rope_head_dim=8,
             v_head_dim=64, first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2,
             n_shared_experts=1, moe_intermediate_size=128, topk_method="greedy", n_group=1,
             topk_group=1, norm_topk_prob=False, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
             max_position_embeddings=256,
             rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
SPECS = [dict(name="llama_gptq_sym", arch="llama", fmt="gptq", seed=9101, hf=HF),
         dict(name="llama_awq", arch="llama", fmt="awq", seed=9202, hf=HF),
         dict(name="deepseek_v2_gptq_sym", arch="deepseek_v2", fmt="gptq", seed=9303, hf=HF_DS)]
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
             "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")


def quantized(name):
    parts = name.split(".")
    return (name.startswith("model.layers.") and parts[-1] == "weight"
            and parts[-2] in QUANTIZED)


def round_mantissa(x, bits):
    """x rounded to `bits` explicit mantissa bits (float32 math), as float32."""
    m, e = np.frexp(x.astype(np.float64))
    return np.ldexp(np.round(m * 2.0 ** (bits + 1)) / 2.0 ** (bits + 1), e).astype(np.float32)


def pack_rows(q):
    """[K, N] codes -> int32 [K/8, N]: code (k, n) at bits 4*(k%8) of word (k/8, n)."""
    k, n = q.shape
    w = np.zeros((k // 8, n), dtype=np.uint32)
    for i in range(8):
        w |= q[i::8, :].astype(np.uint32) << np.uint32(4 * i)
    return w.view(np.int32)


def pack_cols(q, order):
    """[R, N] codes -> int32 [R, N/8]: nibble i of word (r, c) holds column 8c + order[i]."""
    r, n = q.shape
    w = np.zeros((r, n // 8), dtype=np.uint32)
    for i in range(8):
        w |= q[:, order[i]::8].astype(np.uint32) << np.uint32(4 * i)
    return w.view(np.int32)


def quantize(w, fmt):
    """w float32 [N, K] -> (tensors by suffix, dequantized float32 [N, K])."""
    n, k = w.shape
    g = w.reshape(n, k // GROUP, GROUP)
    if fmt == "gptq":  # symmetric, zero 8 (stored as 7 in v1)
        amax = np.abs(g).max(axis=2)
        s = round_mantissa(amax / 7.0, 7).astype(np.float16).astype(np.float32)
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        z = np.full_like(s, 8, dtype=np.int64)
    else:  # asymmetric min/max, 4 significant bits in the scale
        lo, hi = g.min(axis=2), g.max(axis=2)
        s = round_mantissa((hi - lo) / 15.0, 3).astype(np.float16).astype(np.float32)
        s = np.where(s > 0, s, 1.0).astype(np.float32)
        z = np.clip(np.round(-lo / s), 0, 15).astype(np.int64)
    q = np.clip(np.round(g / s[:, :, None]) + z[:, :, None], 0, 15).astype(np.int64)
    deq = ((q - z[:, :, None]).astype(np.float32) * s[:, :, None]).reshape(n, k)
    qt = q.reshape(n, k).T  # [K, N]
    scales = torch.from_numpy(s.T.astype(np.float16).copy())  # [K/128, N]
    if fmt == "gptq":
        t = {"qweight": pack_rows(qt), "qzeros": pack_cols(z.T - 1, list(range(8))),
             "g_idx": (np.arange(k) // GROUP).astype(np.int32)}
    else:
        t = {"qweight": pack_cols(qt, AWQ_ORDER), "qzeros": pack_cols(z.T, AWQ_ORDER)}
    out = {key: torch.from_numpy(np.ascontiguousarray(v)) for key, v in t.items()}
    out["scales"] = scales
    return out, torch.from_numpy(deq)


def checkpoint(plain, fmt):
    packed, deq = {}, {}
    for name, t in plain.items():
        w = t.float()
        if quantized(name):
            stem = name[: -len("weight")]
            tensors, d = quantize(w.numpy(), fmt)
            for suffix, v in tensors.items():
                packed[stem + suffix] = v
            deq[name] = d
        else:
            packed[name] = t.contiguous()
            deq[name] = w
    return packed, deq


def quant_config(fmt):
    if fmt == "gptq":  # as AutoGPTQ / gptqmodel write it
        return {"bits": 4, "checkpoint_format": "gptq", "damp_percent": 0.01, "desc_act": False,
                "group_size": GROUP, "model_file_base_name": None, "quant_method": "gptq",
                "static_groups": False, "sym": True, "true_sequential": True}
    return {"bits": 4, "group_size": GROUP, "modules_to_not_convert": None,  # AutoAWQ
            "quant_method": "awq", "version": "gemm", "zero_point": True}


def make_one(spec, out_root):
    found = diff.quantized_reference(spec, out_root, lambda sd: checkpoint(sd, spec["fmt"]),
                                     MIN_MARGIN)
    return diff.save_quantized(spec, out_root, found, "float16", quant_config(spec["fmt"]),
                               dtype=spec["fmt"])


def main():
    diff.build_quantized_set(__doc__, REPO / "tests" / "fixtures" / "hf_gptq", SPECS, make_one,
                             "(q - zero) * scale")


if __name__ == "__main__":
    main()
