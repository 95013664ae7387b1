#!/usr/bin/env python3
"""Exact-arithmetic reference forward of a llama GGUF model, in numpy.

Dequantizes every weight with gguf-py (independent of deepserve and of llama.cpp's
kernels) and runs the forward in float64 with no activation quantization. It shows what
the quantized model computes when nothing else is rounded: useful to tell an engine's
rounding apart from the model's own behaviour where two candidates are close.

  python tools/reference_forward.py MODEL.gguf --ids 1 2 3 [--greedy 16]
  python tools/reference_forward.py MODEL.gguf --fixture   # writes tests/fixtures/exact/

The fixture mode takes prompts (token ids) from the llama.cpp fixture and records, in the
same schema, the exact top-16 logits at every position and a greedy continuation.
"""
import argparse
import json

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


def load(path):
    r = GGUFReader(path)
    meta = {}
    for k, f in r.fields.items():
        if k.startswith("llama.") or k in ("general.architecture",):
            meta[k] = f.contents()
    w = {}
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float64)
        w[t.name] = a.reshape([int(d) for d in reversed(t.shape)]) if a.ndim == 1 and len(t.shape) > 1 else a
    return meta, w


def rope_adjacent(x, pos, theta):
    # x: [T, H, D]; pairs (2i, 2i+1)
    d = x.shape[-1]
    inv = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.outer(pos, inv)[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def forward(meta, w, ids):
    H = meta["llama.attention.head_count"]
    KV = meta["llama.attention.head_count_kv"]
    L = meta["llama.block_count"]
    eps = meta["llama.attention.layer_norm_rms_epsilon"]
    theta = meta.get("llama.rope.freq_base", 10000.0)
    emb = w["token_embd.weight"]
    x = emb[ids]
    T, D = x.shape
    hd = D // H
    pos = np.arange(T)

    def norm(v, g):
        return v / np.sqrt((v * v).mean(-1, keepdims=True) + eps) * g

    mask = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        p = f"blk.{l}."
        h = norm(x, w[p + "attn_norm.weight"])
        q = (h @ w[p + "attn_q.weight"].T).reshape(T, H, hd)
        k = (h @ w[p + "attn_k.weight"].T).reshape(T, KV, hd)
        v = (h @ w[p + "attn_v.weight"].T).reshape(T, KV, hd)
        q, k = rope_adjacent(q, pos, theta), rope_adjacent(k, pos, theta)
        k = np.repeat(k, H // KV, axis=1)
        v = np.repeat(v, H // KV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        a = np.einsum("hts,shd->thd", s, v).reshape(T, D)
        x = x + a @ w[p + "attn_output.weight"].T
        h = norm(x, w[p + "ffn_norm.weight"])
        g = h @ w[p + "ffn_gate.weight"].T
        u = h @ w[p + "ffn_up.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * u) @ w[p + "ffn_down.weight"].T
    out = w.get("output.weight", emb)
    return norm(x, w["output_norm.weight"]) @ out.T


FIXTURE_PROMPTS = ["chat_capital", "en", "zh", "code_python", "emoji"]


def make_fixture(model, meta, w, steps=16, top=16):
    import hashlib
    import os
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = json.load(open(os.path.join(root, "tests/fixtures/llamacpp/smollm2_q4_1.json")))
    out = {"generator": "tools/reference_forward.py --fixture",
           "method": "gguf-py dequantization, float64 numpy forward, no activation quantization",
           "model_sha256": hashlib.sha256(open(model, "rb").read()).hexdigest(), "prompts": []}
    for p in src["prompts"]:
        if p["name"] not in FIXTURE_PROMPTS:
            continue
        ids = list(p["ids"])
        lg = forward(meta, w, ids)
        rec = {"name": p["name"], "text": p["text"], "ids": list(ids), "positions": [],
               "generated_ids": [], "generated_top2_margin": []}
        for row in lg:
            t = np.argsort(-row)[:top]
            rec["positions"].append({"top": [[int(i), round(float(row[i]), 5)] for i in t]})
        last = lg[-1]
        for _ in range(steps):
            order = np.argsort(-last)
            rec["generated_ids"].append(int(order[0]))
            rec["generated_top2_margin"].append(round(float(last[order[0]] - last[order[1]]), 5))
            ids.append(int(order[0]))
            last = forward(meta, w, ids)[-1]
        out["prompts"].append(rec)
        print(p["name"], rec["generated_ids"])
    path = os.path.join(root, "tests/fixtures/exact/smollm2_q4_1_exact.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, separators=(",", ":"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--ids", type=int, nargs="+")
    ap.add_argument("--greedy", type=int, default=0)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--fixture", action="store_true")
    a = ap.parse_args()
    meta, w = load(a.model)
    if a.fixture:
        make_fixture(a.model, meta, w)
        return
    ids = list(a.ids)
    logits = forward(meta, w, ids)[-1]
    top = np.argsort(-logits)[: a.top]
    result = {"top": [[int(i), float(logits[i])] for i in top], "generated": []}
    for _ in range(a.greedy):
        nxt = int(np.argmax(logits))
        result["generated"].append(nxt)
        ids.append(nxt)
        logits = forward(meta, w, ids)[-1]
    print(json.dumps(result))


if __name__ == "__main__":
    main()
