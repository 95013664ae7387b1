#!/usr/bin/env python3
"""Tiny random FP8 checkpoints (as published: F8_E4M3 weights with F32 scales beside them) with
transformers' outputs on the dequantized weights, for deepserve's FP8 loading tests.

Two models, each built by transformers 5.17's own classes with the sharp init of
make_hf_fixtures.py (randn * 0.6 / sqrt(fan_in), norms 1 + 0.1 randn), vocab 96:

- `deepseek_v2_block128`: DeepSeek-V3 layout. Every linear weight of the decoder layers
  (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj, dense and shared MLPs, experts) is
  F8_E4M3 with `<name>_scale_inv` F32 [ceil(N/128), ceil(K/128)] (element = fp8 * scale_inv
  of its 128 x 128 block, scale = block absmax / 448); embeddings, norms, the router and
  lm_head stay BF16, as in DeepSeek-V3. hidden 200, q_lora 136, kv_lora 160, intermediate 264
  and moe_intermediate 72, so N and K run into partial 128-blocks.
- `llama_channel`: per-channel scales, `<name>_scale` F32 [N, 1] (row absmax / 448), on
  q/k/v/o and the MLP; hidden 136 and intermediate 144 (partial second 128-groups along K).

config.json: transformers' published layout plus `quantization_config` ({quant_method: fp8,
fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128] or null}).

The reference is independent of the FP8 files: the dequantized weights (exact in float32) are
written as a plain F32 checkpoint to a scratch folder, read back by
`from_pretrained(dtype=float32, attn_implementation="eager")`, and run on 5 token-id prompts;
outputs go to reference.safetensors in the schema of make_hf_differential.py (p{i}.ids,
p{i}.logits, p{i}.generated, p{i}.margin_frac, p{i}.route_gap) and index.json. Seeds are
retried until every router gap >= 1e-4 and every greedy margin >= 1e-4 of the range.

  $HFPY tools/make_fp8_fixture.py [--out tests/fixtures/hf_fp8]
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_hf_differential as diff  # noqa: E402
import make_hf_fixtures as base  # noqa: E402

REPO = base.REPO
BLOCK = 128
FP8_MAX = 448.0
MIN_MARGIN = 1e-4  # 100x the measured float32 differences (~1e-6 of the range)

SPECS = [
    dict(name="deepseek_v2_block128", arch="deepseek_v2", scales="block", seed=8101,
         hf=dict(hidden_size=200, num_hidden_layers=2, num_attention_heads=2,
                 intermediate_size=264, q_lora_rank=136, kv_lora_rank=160, qk_nope_head_dim=16,
                 qk_rope_head_dim=8, v_head_dim=16, first_k_dense_replace=1,
                 n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
                 moe_intermediate_size=72, topk_method="greedy", n_group=1, topk_group=1,
                 norm_topk_prob=False, routed_scaling_factor=2.5, rms_norm_eps=1e-6,
                 max_position_embeddings=256,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
    dict(name="llama_channel", arch="llama", scales="channel", seed=8202,
         hf=dict(hidden_size=136, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=24, intermediate_size=144,
                 tie_word_embeddings=False, max_position_embeddings=256, rms_norm_eps=1e-5,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
]

# Linear weights deepserve binds from F8_E4M3 (as FP8W, or dequantized to F32 for kv_b_proj).
QUANTIZED = ("q_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "k_proj",
             "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized(name):
    parts = name.split(".")
    return (name.startswith("model.layers.") and parts[-1] == "weight"
            and parts[-2] in QUANTIZED)


def quantize_block(w):
    """128 x 128 block scales: returns (fp8 codes, scale_inv [ceil(N/128), ceil(K/128)])."""
    n, k = w.shape
    gn, gk = -(-n // BLOCK), -(-k // BLOCK)
    pad = torch.zeros(gn * BLOCK, gk * BLOCK, dtype=torch.float32)
    pad[:n, :k] = w
    amax = pad.abs().view(gn, BLOCK, gk, BLOCK).amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return (w / full).to(torch.float8_e4m3fn), scale.contiguous()


def quantize_channel(w):
    """Per-row scales: returns (fp8 codes, scale [N, 1])."""
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (w / scale).to(torch.float8_e4m3fn), scale.contiguous()


def dequantize(codes, scale, scales):
    n, k = codes.shape
    if scales == "channel":
        return codes.float() * scale
    full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:n, :k]
    return codes.float() * full


def fp8_checkpoint(plain, scales):
    """Splits a BF16 state dict into the FP8 file's tensors and the dequantized F32 ones."""
    fp8, deq = {}, {}
    for name, t in plain.items():
        w = t.float()
        if quantized(name):
            codes, s = quantize_block(w) if scales == "block" else quantize_channel(w)
            fp8[name] = codes
            fp8[name + ("_scale_inv" if scales == "block" else "_scale")] = s
            deq[name] = dequantize(codes, s, scales)
        else:
            fp8[name] = t.contiguous()
            deq[name] = w
    return fp8, deq


def make_one(spec, out_root):
    found = diff.quantized_reference(spec, out_root,
                                     lambda sd: fp8_checkpoint(sd, spec["scales"]), MIN_MARGIN)
    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": [BLOCK, BLOCK] if spec["scales"] == "block" else None}
    return diff.save_quantized(
        spec, out_root, found, "bfloat16", config, dtype="fp8", scales=spec["scales"],
        fp8_tensors=sum(1 for t in found[1].values() if t.dtype == torch.float8_e4m3fn))


def main():
    diff.build_quantized_set(__doc__, REPO / "tests" / "fixtures" / "hf_fp8", SPECS, make_one,
                             "fp8 * scale")


if __name__ == "__main__":
    main()
