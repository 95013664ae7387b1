#!/usr/bin/env python3
"""CPU engine benchmark (issue 3): aggregate throughput at 1, 4 and 16 concurrent requests,
and KV-cache fragmentation in dynamic (paged) versus static (reserve-the-maximum) mode.

Runs `deepserve generate --prompts-file ... --json --stats` (all prompts submitted at once;
the engine batches them) and reads the per-request JSON lines and the engine statistics.

  python3 tools/bench_engine.py [--deepserve build/deepserve] [--threads 2] [--output FILE]
"""
import argparse
import datetime
import json
import os
import platform
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a ten-year-old in a few sentences.",
    "List three uses of a paperclip.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in one sentence.",
    "What is 12 times 12?",
    "Give me a short story about a robot who learns to paint, with a happy ending.",
    "Translate 'good morning' into Spanish.",
    "Why is the sky blue?",
    "Name the planets of the solar system in order from the sun.",
    "What is the boiling point of water at sea level?",
    "Write a limerick about a programmer who loves coffee.",
    "Summarize the plot of Cinderella in two sentences.",
    "How do I make a cup of tea?",
    "What are the primary colors?",
]


def run(cmd):
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - t0
    results = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    stats = json.loads([line for line in p.stderr.splitlines() if line.startswith("{")][-1])
    return wall, results, stats


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deepserve", default=os.path.join(REPO, "build", "deepserve"))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", default=os.path.join(
        REPO, "bench", "results", f"{datetime.date.today().isoformat()}-engine-cpu.json"))
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="ds-bench-")
    base = [args.deepserve, "generate", "--json", "--stats", "--chat", "--temperature", "0",
            "--threads", str(args.threads)]

    throughput = []
    for n in (1, 4, 16):
        path = os.path.join(tmp, f"p{n}.txt")
        with open(path, "w") as f:
            f.write("\n".join(QUESTIONS[:n]) + "\n")
        cmd = base + ["--prompts-file", path, "-n", "64", "--ignore-eos"]
        run(cmd)  # warm-up
        wall, results, stats = run(cmd)
        gen = sum(r["usage"]["completion_tokens"] for r in results)
        # From submission (all at once) to the last request's end: model loading excluded.
        busy = max(r["timings"]["total_ms"] for r in results) / 1e3
        throughput.append({"concurrency": n, "duration_s": busy, "process_wall_s": wall,
                           "generated_tokens": gen, "output_tokens_per_s": gen / busy,
                           "engine_steps": stats["steps"],
                           "mean_ttft_ms": sum(r["timings"]["ttft_ms"] for r in results) / n})
        print(f"concurrency {n:2d}: {gen / busy:7.1f} output tok/s ({gen} tokens in {busy:.2f} s)")

    # Mixed lengths: replies end at EOS (different lengths), up to 256 tokens each.
    path = os.path.join(tmp, "mixed.txt")
    with open(path, "w") as f:
        f.write("\n".join(QUESTIONS) + "\n")
    frag = {}
    for mode in ("dynamic", "static"):
        wall, results, stats = run(base + ["--prompts-file", path, "-n", "256", "--kv-mode", mode,
                                           "--no-prefix-cache"])
        frag[mode] = {"mean_kv_fragmentation": stats["mean_kv_fragmentation"],
                      "peak_kv_usage": stats["peak_kv_usage"], "steps": stats["steps"],
                      "output_lengths": [r["usage"]["completion_tokens"] for r in results]}
        print(f"{mode:8s}: mean fragmentation {stats['mean_kv_fragmentation']:.3f}, "
              f"peak KV usage {stats['peak_kv_usage']:.3f}")

    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")),
               platform.processor())
    report = {"system": {"cpu": cpu, "cores": os.cpu_count(), "threads": args.threads,
                         "commit": commit, "command": " ".join(["tools/bench_engine.py"] + os.sys.argv[1:])},
              "model": "SmolLM2-135M-Instruct Q4_1 (default)", "throughput": throughput,
              "fragmentation": frag}
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
