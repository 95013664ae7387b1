#!/usr/bin/env python3
"""`deepserve generate` on the padded-vocabulary fixture (512 model ids, 500-token tokenizer)
against transformers' greedy tokens (tests/fixtures/hf/deepseek_v2_padded_vocab_bf16): run
on the H200 by scripts/gpu_run.sh (stage padded) with --device cuda. Tokens must agree up to
the first step whose reference margin (top-1 minus top-2 over the logit range) is below
--min-margin; agreement past it is reported, not required. Exit 1 on a mismatch or a request
that did not finish whole."""
import argparse
import json
import pathlib
import subprocess
import sys
import tempfile

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "hf" / \
    "deepseek_v2_padded_vocab_bf16"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--deepserve", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--min-margin", type=float, default=0.03)
    ap.add_argument("--out")
    a = ap.parse_args()
    ref = json.loads((FIXTURE / "reference.json").read_text())
    rows, ok = [], True
    for p in ref["prompts"]:
        want = p["generated_ids"][:32]
        with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
            f.write(" ".join(map(str, p["ids"])))
        r = subprocess.run([a.deepserve, "generate", "-m", str(FIXTURE), "--device", a.device,
                            "--prompt-ids-file", f.name, "-n", str(len(want)), "--temperature",
                            "0", "--ignore-eos", "--json"], capture_output=True, text=True)
        pathlib.Path(f.name).unlink()
        if r.returncode != 0:
            print(r.stderr, file=sys.stderr)
            ok = False
            continue
        out = json.loads(r.stdout)
        got = out["tokens"]
        margins = p["generated_margin_frac"]
        must = next((i for i, m in enumerate(margins[:len(want)]) if m < a.min_margin), len(want))
        same = next((i for i, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
        whole = out["finish_reason"] == "length" and len(got) == len(want)
        row = {"prompt": p["name"], "finish_reason": out["finish_reason"], "tokens": len(got),
               "identical_prefix": same, "required_prefix": must, "all_identical": got == want,
               "past_tokenizer": sum(t >= ref["tokenizer_vocab"] for t in got)}
        rows.append(row)
        print(json.dumps(row))
        ok &= whole and same >= must
    if a.out:
        pathlib.Path(a.out).write_text(json.dumps({"device": a.device, "rows": rows, "ok": ok}, indent=1))
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
