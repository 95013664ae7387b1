#!/usr/bin/env python3
"""Many tiny random Hugging Face checkpoints with transformers' outputs, for differential tests.

Draws N configurations from a seeded generator (DeepSeek-V2 mostly, some Llama): head counts,
v_head_dim equal to or different from qk_nope_head_dim, q_lora on/off, expert counts, top-k,
greedy / group_limited_greedy with n_group/topk_group, routed_scaling_factor,
first_k_dense_replace, 1-2 shared experts, YaRN on/off with mscale != mscale_all_dim, F32 /
BF16 / F16 weights, and both config.json layouts (published: top-level rope_theta +
rope_scaling; transformers 5: rope_parameters). Each model is built by transformers 5.17's own
classes with the sharp init of make_hf_fixtures.py (randn * 0.6 / sqrt(fan_in), norms
1 + 0.1 randn), saved, read back in float32 and run on 5 token-id prompts of varied length.

Writes tests/fixtures/hf_diff/cNN/ (config.json, model.safetensors, reference.safetensors) and
tests/fixtures/hf_diff/index.json (per config: what it draws, seed, margins). The reference
file holds, for prompt i: p{i}.ids I32 [n], p{i}.logits F32 [n, vocab] (every prompt
position), p{i}.generated I32 [32] (greedy, full forward per step, lowest id on ties, EOS not
special-cased), p{i}.margin_frac F32 [32] (top-2 margin / logit range at each step) and
p{i}.route_gap F32 [32] (the smallest router-logit gap between the last chosen and first
rejected expert/group in that step's forward, i.e. over every token so far; inf for Llama).
No tokenizer: the models take token ids.

  $HFPY tools/make_hf_differential.py [--out tests/fixtures/hf_diff] [--count 40] [--seed 7]
"""

import argparse
import json
import math
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_hf_fixtures as base  # noqa: E402

REPO = base.REPO
VOCAB = 96
BOS, EOS, PAD = 1, 2, 0
PROMPT_LENGTHS = [(1, 1), (2, 4), (5, 9), (10, 16), (17, 24)]
GEN_TOKENS = base.GEN_TOKENS
MIN_ROUTE_GAP = 1e-4  # router-logit gap below which float rounding could flip an expert


def hidden_size(rng, heads):
    """Small (the set stays ~3 MB) and a multiple of the head count (transformers checks)."""
    return rng.choice([h for h in (24, 32, 32, 36) if h % heads == 0])


def draw_deepseek(rng):
    experts = rng.choice([4, 6, 8, 8, 12, 16])
    heads = rng.choice([1, 2, 3, 4])
    nope = rng.choice([8, 12, 16])
    rope = rng.choice([4, 8])
    v = nope if rng.random() < 0.4 else rng.choice([d for d in (8, 12, 16) if d != nope])
    layers = rng.choice([1, 2, 2, 3])
    grouped = rng.random() < 0.5
    if grouped:
        n_group = rng.choice([d for d in (2, 3, 4) if experts % d == 0] or [2])
        if experts % n_group:
            n_group = 2
        topk_group = rng.randint(1, n_group - 1) if n_group > 1 else 1
        top_k = rng.randint(1, min(4, topk_group * (experts // n_group)))
    else:
        n_group = topk_group = 1
        top_k = rng.randint(1, min(4, experts - 1))
    hf = dict(hidden_size=hidden_size(rng, heads), num_hidden_layers=layers,
              num_attention_heads=heads, intermediate_size=rng.choice([48, 64]),
              q_lora_rank=rng.choice([None, None, 16, 24]), kv_lora_rank=rng.choice([16, 24, 32]),
              qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=v,
              first_k_dense_replace=rng.randint(0, layers - 1), n_routed_experts=experts,
              num_experts_per_tok=top_k, n_shared_experts=rng.choice([1, 2]),
              moe_intermediate_size=8,
              topk_method="group_limited_greedy" if grouped else "greedy", n_group=n_group,
              topk_group=topk_group, norm_topk_prob=False,
              routed_scaling_factor=rng.choice([1.0, 1.0, 0.5, 1.5, 2.5, 16.0]),
              rms_norm_eps=rng.choice([1e-6, 1e-5]))
    theta = rng.choice([10000.0, 50000.0, 1000000.0])
    if rng.random() < 0.5:
        factor = rng.choice([4.0, 10.0, 40.0])
        orig = rng.choice([8, 16, 32])
        mscale = rng.choice([0.707, 1.0, 0.5])
        mscale_all = rng.choice([m for m in (0.707, 1.0, 0.0) if m != mscale])
        if rng.random() < 0.3:
            mscale_all = mscale  # equal: attention_factor 1, softmax scale still scaled
        rp = {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
              "beta_fast": rng.choice([32, 32, 16]), "beta_slow": rng.choice([1, 1, 2]),
              "mscale": mscale, "mscale_all_dim": mscale_all,
              "original_max_position_embeddings": orig}
        # At least prompt + 32 generated (the engine refuses more than the context);
        # transformers' yarn takes `factor` as given, not max_position / original.
        hf["max_position_embeddings"] = max(256, int(orig * factor))
    else:
        rp = {"rope_type": "default", "rope_theta": theta}
        hf["max_position_embeddings"] = 256
    hf["rope_parameters"] = rp
    return hf


def draw_llama(rng):
    heads = rng.choice([2, 3, 4, 6])
    kv = rng.choice([d for d in range(1, heads + 1) if heads % d == 0])
    hf = dict(hidden_size=hidden_size(rng, heads), num_hidden_layers=rng.choice([1, 2, 3]),
              num_attention_heads=heads, num_key_value_heads=kv, head_dim=rng.choice([8, 12, 16]),
              intermediate_size=rng.choice([48, 64]), tie_word_embeddings=rng.random() < 0.5,
              max_position_embeddings=256, rms_norm_eps=rng.choice([1e-6, 1e-5]),
              rope_parameters={"rope_type": "default",
                               "rope_theta": rng.choice([10000.0, 500000.0])})
    return hf


def draw_configs(count, seed):
    rng = random.Random(seed)
    out = []
    for i in range(count):
        arch = "llama" if i % 5 == 4 else "deepseek_v2"  # 1 in 5 Llama
        hf = draw_deepseek(rng) if arch == "deepseek_v2" else draw_llama(rng)
        out.append(dict(name=f"c{i:02d}", arch=arch, hf=hf, vocab=VOCAB,
                        layout=rng.choice(["published", "transformers5"]),
                        dtype=rng.choice(["float32", "bfloat16", "bfloat16", "bfloat16",
                                          "float16", "float16"]),
                        seed=seed * 1000 + i))
    return out


def draw_prompts(rng):
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))]
            for lo, hi in PROMPT_LENGTHS]


def run_reference(model, prompts, watch):
    out, gaps = [], []
    with torch.no_grad():
        for ids in prompts:
            watch.take()
            logits = model(input_ids=torch.tensor([ids])).logits[0].float()
            g = watch.take()
            if g is not None:
                gaps.append(g)
            seq, gen, fracs, route = list(ids), [], [], []
            for _ in range(GEN_TOKENS):
                last = model(input_ids=torch.tensor([seq])).logits[0, -1].float()
                nxt = int(torch.argmax(last))  # first maximal index: lowest id on ties
                fracs.append(base.margin_frac(last))
                g = watch.take()  # this forward's routing: every token so far
                route.append(math.inf if g is None else g)
                gen.append(nxt)
                seq.append(nxt)
            gaps += [g for g in route if g != math.inf]
            out.append(dict(ids=ids, logits=logits, generated=gen, margin_frac=fracs,
                            route_gap=route))
    return out, (min(gaps) if gaps else None)


def quantized_reference(spec, out_root, convert, min_margin):
    """The seed loop of the quantized-checkpoint fixtures (FP8, GPTQ / AWQ): builds a sharp BF16
    model, converts its state dict with convert(state_dict) -> (checkpoint tensors, dequantized
    float tensors), runs transformers on the dequantized weights as a float32 checkpoint, and
    retries seeds until every greedy margin is >= min_margin of the range and no router gap is
    below MIN_ROUTE_GAP. Returns (seed, checkpoint tensors, the saved config, results, gap)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    for attempt in range(20):
        seed = spec["seed"] + 1000 * attempt
        model = base.build_model(dict(spec, vocab=VOCAB, seed=seed), BOS, EOS,
                                 PAD).to(torch.bfloat16)
        out_dir = out_root / spec["name"]
        if out_dir.exists():
            shutil.rmtree(out_dir)
        with tempfile.TemporaryDirectory() as tmp:
            saved_dir, deq_dir = Path(tmp) / "bf16", Path(tmp) / "deq"
            model.save_pretrained(saved_dir)  # per-expert names, as published
            base.check_safetensors_names(saved_dir / "model.safetensors", spec["arch"])
            packed, deq = convert(load_file(str(saved_dir / "model.safetensors")))
            saved = json.loads((saved_dir / "config.json").read_text())
            # The reference reads the dequantized weights as a plain float32 checkpoint.
            deq_dir.mkdir()
            save_file(deq, str(deq_dir / "model.safetensors"), metadata={"format": "pt"})
            (deq_dir / "config.json").write_text(json.dumps(dict(saved, dtype="float32")))
            ref = AutoModelForCausalLM.from_pretrained(deq_dir, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
            for name, p in ref.state_dict().items():  # per-expert names are fused in memory
                if name in deq:
                    assert torch.equal(p, deq[name]), name
            prompts = draw_prompts(random.Random(seed))
            results, gap = run_reference(ref, prompts, base.RouteWatch(ref))
        margin = min(f for r in results for f in r["margin_frac"])
        if (gap is None or gap >= MIN_ROUTE_GAP) and margin >= min_margin:
            return seed, packed, saved, results, gap
        print(f"{spec['name']}: seed {seed} router gap {gap}, margin {margin:.2e}; next seed",
              file=sys.stderr)
    raise SystemExit(f"{spec['name']}: no seed with robust margins and router gaps")


def save_quantized(spec, out_root, found, torch_dtype, quantization_config, **meta):
    """Writes the fixture quantized_reference found (checkpoint tensors, the published config
    with its quantization_config, the reference) and returns its index.json entry, with meta
    (dtype and format details) after the name, arch and layout."""
    from safetensors.torch import save_file

    seed, tensors, saved, results, gap = found
    out_dir = out_root / spec["name"]
    out_dir.mkdir(parents=True)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    cfg = base.published_config(saved, spec)
    cfg["torch_dtype"] = torch_dtype
    cfg["quantization_config"] = quantization_config
    (out_dir / "config.json").write_text(json.dumps(dict(sorted(cfg.items())), indent=2) + "\n")
    save_reference(out_dir, results)
    greedy = sorted(f for r in results for f in r["margin_frac"])
    return dict(name=spec["name"], arch=spec["arch"], layout="published", **meta, vocab=VOCAB,
                seed=seed, hf=spec["hf"], prompt_lengths=[len(r["ids"]) for r in results],
                router_gap=gap, greedy_margin_frac_min=round(greedy[0], 5),
                greedy_margin_frac_median=round(greedy[len(greedy) // 2], 5))


def fresh_out_dir(out):
    """Empties `out` for a fixture set and pins torch to one thread (a bitwise-reproducible
    reference on any machine); returns the start time for write_index."""
    torch.set_num_threads(1)
    t0 = time.time()
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    return t0


def build_quantized_set(description, default_out, specs, make_one, dequantized):
    """main() of a quantized fixture tool: --out (default default_out) is rewritten with one
    fixture per spec (make_one(spec, out) -> its index entry) and index.json; `dequantized`
    says how the reference's weights were made from the checkpoint's (e.g. "fp8 * scale")."""
    ap = argparse.ArgumentParser(description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=default_out)
    args = ap.parse_args()
    t0 = fresh_out_dir(args.out)
    metas = []
    for spec in specs:
        m = make_one(spec, args.out)
        metas.append(m)
        print(f"{m['name']}: router gap {m['router_gap']}, greedy margin/range min "
              f"{m['greedy_margin_frac_min']} median {m['greedy_margin_frac_median']}",
              file=sys.stderr)
    write_index(args.out, {}, "transformers eager float32 forward of the dequantized weights "
                f"({dequantized}, exact in float32) read back with from_pretrained(dtype=float32)",
                metas, t0, "models")


def make_one(spec, out_root):
    from transformers import AutoModelForCausalLM

    for attempt in range(10):
        seed = spec["seed"] + 100000 * attempt
        model = base.build_model(dict(spec, seed=seed), BOS, EOS, PAD)
        model = model.to(base.TORCH_DTYPES[spec["dtype"]])
        out_dir = out_root / spec["name"]
        if out_dir.exists():
            shutil.rmtree(out_dir)
        model.save_pretrained(out_dir)
        (out_dir / "generation_config.json").unlink(missing_ok=True)
        cfg_path = out_dir / "config.json"
        saved = json.loads(cfg_path.read_text())
        if spec["layout"] == "published":
            cfg_path.write_text(json.dumps(base.published_config(saved, spec), indent=2) + "\n")
        base.check_safetensors_names(out_dir / "model.safetensors", spec["arch"])
        ref = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32,
                                                   attn_implementation="eager").eval()
        intended = dict(model.config.rope_parameters)
        got = dict(ref.config.rope_parameters)
        if any(got.get(k) != v for k, v in intended.items()):
            raise SystemExit(f"{spec['name']}: config.json reads back rope {got}, "
                             f"wanted {intended}")
        prompts = draw_prompts(random.Random(seed))
        results, gap = run_reference(ref, prompts, base.RouteWatch(ref))
        if gap is None or gap >= MIN_ROUTE_GAP:
            break
        print(f"{spec['name']}: seed {seed} router gap {gap}; next seed", file=sys.stderr)
    else:
        raise SystemExit(f"{spec['name']}: no seed with router gaps >= {MIN_ROUTE_GAP}")
    save_reference(out_dir, results)
    prefill = [base.margin_frac(row) for r in results for row in r["logits"]]
    greedy = [f for r in results for f in r["margin_frac"]]
    meta = {k: v for k, v in spec.items() if k not in ("hf", "seed")}
    meta.update(seed=seed, hf={k: v for k, v in spec["hf"].items()},
                prompt_lengths=[len(r["ids"]) for r in results], router_gap=gap,
                prefill_margin_frac_median=round(sorted(prefill)[len(prefill) // 2], 5),
                greedy_margin_frac_median=round(sorted(greedy)[len(greedy) // 2], 5),
                greedy_steps_over_1pct_prefix=sum(
                    next((j for j, f in enumerate(r["margin_frac"]) if f <= 0.01), GEN_TOKENS)
                    for r in results))
    return meta


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=REPO / "tests" / "fixtures" / "hf_diff")
    ap.add_argument("--count", type=int, default=40)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    t0 = fresh_out_dir(args.out)
    metas = []
    for spec in draw_configs(args.count, args.seed):
        m = make_one(spec, args.out)
        metas.append(m)
        print(f"{m['name']}: {m['arch']} {m['layout']} {m['dtype']} prompt lengths "
              f"{m['prompt_lengths']} router gap {m['router_gap']} margin/range median "
              f"prefill {m['prefill_margin_frac_median']} greedy {m['greedy_margin_frac_median']}"
              f", robust greedy tokens {m['greedy_steps_over_1pct_prefix']}", file=sys.stderr)
    write_index(args.out, {"seed": args.seed, "count": args.count},
                "transformers eager float32 forward of the saved checkpoint read back "
                "with from_pretrained(dtype=float32)", metas, t0, "configs")


def save_reference(out_dir, results):
    """reference.safetensors: each prompt's ids, logits, greedy tokens, margins, router gaps."""
    from safetensors.torch import save_file
    tensors = {}
    for i, r in enumerate(results):
        tensors[f"p{i}.ids"] = torch.tensor(r["ids"], dtype=torch.int32)
        tensors[f"p{i}.logits"] = r["logits"].contiguous()
        tensors[f"p{i}.generated"] = torch.tensor(r["generated"], dtype=torch.int32)
        tensors[f"p{i}.margin_frac"] = torch.tensor(r["margin_frac"], dtype=torch.float32)
        tensors[f"p{i}.route_gap"] = torch.tensor(r["route_gap"], dtype=torch.float32)
    save_file(tensors, str(out_dir / "reference.safetensors"), metadata={"format": "pt"})


def write_index(out, generator, reference, metas, t0, what):
    """index.json of a fixture set (shared with make_fp8_fixture.py), and a one-line summary."""
    import transformers
    index = {"generator": {"torch": torch.__version__, "transformers": transformers.__version__,
                           **generator},
             "vocab": VOCAB, "bos_id": BOS, "eos_id": EOS, "gen_tokens": GEN_TOKENS,
             "reference": reference, "configs": metas}
    (out / "index.json").write_text(json.dumps(index, indent=1) + "\n")
    total = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    print(f"{out}: {len(metas)} {what}, {total / 1e6:.2f} MB, {time.time() - t0:.0f}s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
