#!/usr/bin/env python3
"""deepserve vs llama.cpp on the same GGUF files (issue 14's accuracy table, GGUF row).

1. Makes Q4_K_M, Q6_K and Q8_0 GGUF files of SmolLM2-135M-Instruct from its Q4_1 file with
   llama.cpp's own quantizer (llama_cpp.llama_model_quantize, allow_requantize) in --workdir;
   the Q4_1 file itself is compared too.
2. For each file and prompt, llama.cpp (llama-cpp-python, F32 KV cache, flash attention off)
   continues the prompt greedily by --gen tokens (one token per eval), then evaluates prompt +
   continuation in one batch with logits_all: the reference logits at every position.
3. deepserve's CPU forward (tools/dump_logits.cpp: one prefill per sequence) runs on the
   same token ids with the same file, for each --precision (f32, q8) and KV cache dtype
   (f32, fp8).
4. Per file and configuration: top-1 agreement (argmax equal to llama.cpp's), the largest
   |logit difference|, the largest and the median of (row's max |diff|) / (row's llama.cpp
   logit range), and each disagreement with llama.cpp's top-2 margin there. Writes JSON.

Run with the reference venv (tools/setup_reference.sh) and a build dir holding the static
libraries (a CPU-only or a CUDA build; the deepserve target must be built):

  $(tools/setup_reference.sh) tools/accuracy_vs_llamacpp.py --build build \\
      --output bench/results/2026-12-02-accuracy-gguf-vs-llamacpp.json
"""
import argparse
import datetime
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections import Counter

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import make_llamacpp_fixtures as fx  # noqa: E402  (prompts, chat template, model path)

PROMPTS = ["en", "long_en", "code_python", "code_c", "math", "whitespace_numbers",
           "chat_capital", "chat_haiku"]
FILE_TYPES = ["Q4_1", "Q4_K_M", "Q6_K", "Q8_0"]  # Q4_1 is the source file itself
CONFIGS = [("f32", "f32"), ("q8", "f32"), ("f32", "fp8"), ("q8", "fp8")]  # precision, KV


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def quantize(src, dst, ftype):
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, "LLAMA_FTYPE_MOSTLY_" + ftype)
    p.allow_requantize = True  # the source is already Q4_1: dequantized, then quantized again
    p.nthread = 2
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), p)
    if rc != 0:
        sys.exit(f"llama_model_quantize({ftype}) failed: {rc}")


def tensor_types(path):
    """{'ffn_down': {'Q4_K': 16, 'Q6_K': 14}, ...}: which GGML type each weight group got."""
    import gguf

    c = {}
    for t in gguf.GGUFReader(path).tensors:
        group = t.name.split(".")[-2] if t.name.startswith("blk.") else t.name
        c.setdefault(group, Counter())[t.tensor_type.name] += 1
    return {g: dict(sorted(v.items())) for g, v in sorted(c.items())}


def llama_reference(path, names, gen):
    """Per prompt: ids, llama.cpp's greedy continuation and teacher-forced logits [T, vocab]."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, n_ctx=1024, n_batch=1024, n_ubatch=1024,
                          logits_all=True, n_threads=2, seed=0, type_k=0, type_v=0,
                          flash_attn=False, verbose=False)  # type 0 = GGML_TYPE_F32
    raw, chat = dict(fx.RAW_PROMPTS), dict(fx.CHAT_QUESTIONS)
    texts = [(n, raw[n] if n in raw else fx.render_chat(llm, chat[n])) for n in names]
    out = []
    for name, text in texts:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        llm.reset()
        llm.eval(ids)
        last, generated = llm.scores[len(ids) - 1], []
        for step in range(gen):
            generated.append(int(np.argmax(last)))  # lowest id on ties
            if step + 1 < gen:
                llm.eval([generated[-1]])
                last = llm.scores[llm.n_tokens - 1]
        seq = [int(i) for i in ids] + generated
        llm.reset()
        llm.eval(seq)  # one batch: the same shape of computation as deepserve's prefill
        logits = np.array(llm.scores[: len(seq)], dtype=np.float32)
        # Self-check: the batched rows' argmax should be the token-by-token greedy tokens.
        batch_greedy = logits[len(ids) - 1:len(seq) - 1].argmax(axis=1).tolist()
        text_out = llm.detokenize(generated, special=True).decode("utf-8", errors="replace")
        out.append({"name": name, "prompt_tokens": len(ids), "seq": seq, "logits": logits,
                    "generated_text": text_out,
                    "batch_matches_stepwise": sum(int(x == y) for x, y in zip(batch_greedy, generated))})
    info = llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip()
    vocab = int(llm.n_vocab())
    del llm
    return out, vocab, info


def build_dump_logits(build, out):
    """Compiles tools/dump_logits.cpp with the link line of the build's deepserve target."""
    ninja = open(os.path.join(build, "build.ninja")).read()
    block = re.search(r"^build deepserve: .*?(?=^build )", ninja, re.S | re.M).group(0)
    libs = re.search(r"LINK_LIBRARIES = (.*)", block).group(1)
    path = re.search(r"LINK_PATH = (.*)", block)
    defines = re.search(r"DEFINES = (.*)", ninja).group(1)
    cmd = (f"c++ -std=c++20 -O2 {defines} -I {shlex.quote(os.path.join(ROOT, 'src'))} -I generated "
           f"{shlex.quote(os.path.join(ROOT, 'tools', 'dump_logits.cpp'))} {libs} "
           f"{path.group(1) if path else ''} -o {shlex.quote(out)}")
    subprocess.run(cmd, shell=True, check=True, cwd=build)


def deepserve_logits(binary, path, seqs, precision, kv, vocab, threads):
    with tempfile.TemporaryDirectory() as d:
        ids_file, out = os.path.join(d, "ids.txt"), os.path.join(d, "logits.f32")
        with open(ids_file, "w") as f:
            f.writelines(" ".join(map(str, s)) + "\n" for s in seqs)
        res = subprocess.run([binary, path, "--out", out, "--precision", precision,
                              "--kv-cache-dtype", kv, "--threads", str(threads), "--ids-file",
                              ids_file], capture_output=True, text=True)
        if res.returncode != 0:  # e.g. a weight type this precision has no kernel for
            lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
            return None, lines[-1].strip() if lines else f"exit status {res.returncode}"
        flat = np.fromfile(out, dtype="<f4").reshape(-1, vocab)
    chunks, at = [], 0
    for s in seqs:
        chunks.append(flat[at:at + len(s)])
        at += len(s)
    assert at == flat.shape[0], "row count differs"
    return chunks, None


def compare(refs, outs):
    """Stats of deepserve's rows (outs) against llama.cpp's (refs), all prompts together."""
    rel, agree, max_abs, max_top16, disagreements, per_prompt = [], 0, 0.0, 0.0, [], {}
    for r, o in zip(refs, outs):
        a, b = r["logits"].astype(np.float64), o.astype(np.float64)
        diff = np.abs(a - b).max(axis=1)
        spread = a.max(axis=1) - a.min(axis=1)
        ta, tb = a.argmax(axis=1), b.argmax(axis=1)
        top16 = np.argsort(-a, axis=1, kind="stable")[:, :16]
        max_top16 = max(max_top16, float(np.abs(np.take_along_axis(a - b, top16, axis=1)).max()))
        for i in np.nonzero(ta != tb)[0]:
            top2 = np.sort(a[i])[-2:]
            disagreements.append({"prompt": r["name"], "position": int(i),
                                  "in_continuation": bool(i >= r["prompt_tokens"] - 1),
                                  "llama_top1": int(ta[i]), "deepserve_top1": int(tb[i]),
                                  "llama_top2_margin": round(float(top2[1] - top2[0]), 5)})
        agree += int((ta == tb).sum())
        max_abs = max(max_abs, float(diff.max()))
        rel.extend((diff / spread).tolist())
        per_prompt[r["name"]] = {"positions": len(ta), "top1_agreement": round(float((ta == tb).mean()), 5),
                                 "max_abs_logit_diff": round(float(diff.max()), 5)}
    return {"positions": len(rel), "top1_agreement": round(agree / len(rel), 5),
            "max_abs_logit_diff": round(max_abs, 5),
            "max_abs_logit_diff_top16": round(max_top16, 5),
            "max_diff_over_range": round(float(np.max(rel)), 6),
            "median_diff_over_range": round(float(np.median(rel)), 6),
            "disagreements": disagreements, "per_prompt": per_prompt}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=fx.default_model_path(), help="the Q4_1 source GGUF")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "ds-accuracy-gguf"),
                    help="where the quantized files go (not committed)")
    ap.add_argument("--build", help="build dir with the static libraries and build.ninja")
    ap.add_argument("--dump-logits", help="an already compiled tools/dump_logits.cpp")
    ap.add_argument("--types", nargs="+", default=FILE_TYPES)
    ap.add_argument("--prompts", nargs="+", default=PROMPTS)
    ap.add_argument("--gen", type=int, default=32, help="greedy tokens after each prompt")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", help="JSON file (default: stdout only)")
    a = ap.parse_args()
    if not a.model or not os.path.isfile(a.model):
        sys.exit(f"model not found: {a.model!r}")
    os.makedirs(a.workdir, exist_ok=True)
    binary = a.dump_logits
    if not binary:
        if not a.build:
            sys.exit("pass --build DIR or --dump-logits BINARY")
        binary = os.path.join(a.workdir, "dump_logits")
        build_dump_logits(os.path.abspath(a.build), binary)

    files, table = [], []
    for ftype in a.types:
        path = a.model
        if ftype != "Q4_1":
            path = os.path.join(a.workdir, f"SmolLM2-135M-Instruct.{ftype}.gguf")
            if not os.path.isfile(path):
                quantize(a.model, path, ftype)
        refs, vocab, sysinfo = llama_reference(path, a.prompts, a.gen)
        entry = {"type": ftype, "file": os.path.basename(path), "sha256": sha256_file(path),
                 "bytes": os.path.getsize(path), "tensor_types": tensor_types(path),
                 "llama_greedy_text": {r["name"]: r["generated_text"] for r in refs},
                 "llama_batch_rows_matching_stepwise_greedy": sum(r["batch_matches_stepwise"] for r in refs),
                 "llama_greedy_tokens": len(refs) * a.gen,
                 "results": []}
        f32kv = {}
        for precision, kv in CONFIGS:
            outs, error = deepserve_logits(binary, path, [r["seq"] for r in refs], precision, kv,
                                           vocab, a.threads)
            if outs is None:
                entry["results"].append({"precision": precision, "kv_cache_dtype": kv,
                                         "unsupported": error})
                table.append({"type": ftype, "precision": precision, "kv_cache_dtype": kv,
                              "unsupported": error})
                print(f"{ftype:7s} {precision:3s} kv={kv:3s} unsupported: {error}", file=sys.stderr)
                continue
            s = compare(refs, outs)
            row = {"precision": precision, "kv_cache_dtype": kv, **s}
            if kv == "f32":
                f32kv[precision] = outs
            elif precision in f32kv:  # FP8 KV against deepserve's own F32 KV, same precision
                same = sum(int((x.argmax(1) == y.argmax(1)).sum()) for x, y in zip(outs, f32kv[precision]))
                row["top1_agreement_vs_deepserve_f32_kv"] = round(same / s["positions"], 5)
            entry["results"].append(row)
            table.append({k: row[k] for k in ("precision", "kv_cache_dtype", "positions", "top1_agreement",
                                              "max_abs_logit_diff", "max_abs_logit_diff_top16",
                                              "max_diff_over_range",
                                              "median_diff_over_range")} | {"type": ftype})
            print(f"{ftype:7s} {precision:3s} kv={kv:3s} top1 {s['top1_agreement']:.4f} "
                  f"({s['positions']} pos) max|d| {s['max_abs_logit_diff']:.4f} "
                  f"max d/range {s['max_diff_over_range']:.2e} median {s['median_diff_over_range']:.2e}",
                  file=sys.stderr)
        files.append(entry)

    import llama_cpp

    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    lib_commit = None
    if a.build and os.path.isfile(os.path.join(a.build, "generated", "build_commit.cpp")):
        m = re.search(r'return "([0-9a-f]+)"', open(os.path.join(a.build, "generated", "build_commit.cpp")).read())
        lib_commit = m.group(1) if m else None
    data = {
        "generator": "tools/accuracy_vs_llamacpp.py",
        "date": datetime.date.today().isoformat(),
        "deepserve_commit": commit,
        "deepserve_libraries_build_commit": lib_commit,
        "device": "cpu",
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": sysinfo,
        "source_model": os.path.basename(a.model),
        "source_sha256": sha256_file(a.model),
        "settings": {
            "prompts": a.prompts, "greedy_tokens": a.gen, "threads": a.threads,
            "tokenize": "llama.cpp, add_bos=False, special=True; chat prompts rendered by the GGUF's template",
            "reference": "llama.cpp, F32 KV cache, flash attention off; greedy continuation token by token, "
                         "then prompt + continuation evaluated in one batch with logits_all",
            "deepserve": "CPU backend, one prefill of prompt + llama.cpp's continuation (tools/dump_logits.cpp)",
            "metrics": "top1_agreement: fraction of rows whose argmax equals llama.cpp's; "
                       "max_abs_logit_diff: largest |deepserve - llama.cpp| logit; *_diff_over_range: "
                       "(row's max |diff|) / (row's llama.cpp max - min logit), max and median over rows; "
                       "max_abs_logit_diff_top16: the same over llama.cpp's 16 largest logits of each row "
                       "(what tests/unit/lib/test_llama_golden.cpp bounds)",
        },
        "notes": [
            "CPU measurements (the GPU budget is spent): both engines on the CPU, same file, same token ids.",
            "The K-quant files are llama.cpp requantizations of the Q4_1 file (allow_requantize), so they "
            "measure engine agreement on a file, not quantization quality against the original weights.",
            "SmolLM2-135M's hidden size 576 is not a multiple of 256, so llama.cpp falls back from K-quants "
            "for most tensors (see tensor_types): in the Q4_K_M file only ffn_down is Q4_K/Q6_K; the "
            "rest is Q5_0/Q8_0.",
            "llama.cpp has no FP8 KV cache; the kv_cache_dtype=fp8 rows compare deepserve's FP8 (e4m3) "
            "KV cache against llama.cpp's F32 KV cache.",
        ],
        "table": table,
        "files": files,
    }
    text = json.dumps(data, indent=1, ensure_ascii=False)
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    print(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
