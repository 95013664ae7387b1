#!/usr/bin/env python3
"""Hugging Face transformers baseline for W1 / W3 (shared/WORKLOADS.md) on a checkpoint.

Runs on the GPU machine (torch + transformers there): random prompt token ids, greedy,
no EOS stop (min_new_tokens = max_new_tokens), BF16, eager attention as the reference numbers
in WORKLOADS.md were taken. Writes JSON with output tok/s, end-to-end time and peak memory.

  python3 tools/hf_baseline.py --model DIR --out hf.json [--w1-out 512] [--w3-out 128]
"""
import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM


def run(model, batch, in_len, out_len, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, in_len), generator=g).to("cuda")
    mask = torch.ones_like(ids)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=out_len,
                         min_new_tokens=out_len, do_sample=False, pad_token_id=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    generated = (out.shape[1] - in_len) * batch
    return {"batch": batch, "input_len": in_len, "output_len": out_len, "seconds": dt,
            "output_tokens": generated, "output_tokens_per_s": generated / dt,
            "ms_per_step": 1000 * dt / out_len}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--w1-out", type=int, default=512)
    ap.add_argument("--w3-out", type=int, default=128)
    args = ap.parse_args()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16,
                                                 device_map="cuda")
    model.eval()
    load_s = time.perf_counter() - t0
    vocab = model.config.vocab_size
    result = {"tool": "transformers", "transformers_version": __import__("transformers").__version__,
              "torch_version": torch.__version__, "gpu": torch.cuda.get_device_name(0),
              "model": args.model, "load_seconds": load_s,
              "attn_implementation": model.config._attn_implementation, "runs": {}}
    with torch.no_grad():
        run(model, 1, 16, 4, vocab, 0)  # warm-up
        torch.cuda.reset_peak_memory_stats()
        result["runs"]["W3"] = run(model, 1, 1024, args.w3_out, vocab, 1)
        result["runs"]["W1"] = run(model, 8, 1024, args.w1_out, vocab, 2)
    result["peak_gpu_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
