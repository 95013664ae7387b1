#!/usr/bin/env python3
"""Plots of a `deepserve bench` JSON file (schema: docs/BENCH.md), as PNGs.

  tools/plot_bench.py result.json --out DIR

writes DIR/throughput_vs_concurrency.png (output and total tok/s against concurrency, one
line per input/output length and request rate) and DIR/cdf_ttft.png, cdf_tpot.png,
cdf_e2e.png (empirical CDFs of the per-request latencies, one curve per scenario).
Exit status 3 when matplotlib cannot be imported (deepserve --plots reports it).
"""

import argparse
import json
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker
except ImportError:
    print("plot_bench.py: matplotlib is not installed in " + sys.executable, file=sys.stderr)
    sys.exit(3)


def series_key(s):
    rate = s.get("request_rate")
    return (s["input_len"], s["output_len"], rate)


def series_label(key):
    inp, out, rate = key
    label = f"in {inp}, out {out}"
    return label + (f", {rate:g} req/s" if rate else "")


def plot_throughput(doc, path):
    groups = {}
    for s in doc["scenarios"]:
        groups.setdefault(series_key(s), []).append(s)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, items in sorted(groups.items(), key=lambda kv: str(kv[0])):
        items.sort(key=lambda s: s["concurrency"])
        xs = [s["concurrency"] for s in items]
        line, = ax.plot(xs, [s["output_tokens_per_s"] for s in items], marker="o",
                        label=series_label(key) + ": output")
        ax.plot(xs, [s["total_tokens_per_s"] for s in items], marker="s", linestyle="--",
                color=line.get_color(), alpha=0.6, label=series_label(key) + ": total")
    ax.set_xscale("log", base=2)
    ticks = sorted({s["concurrency"] for s in doc["scenarios"]})
    ax.set_xticks(ticks)
    ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("tokens per second")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title(f"{doc.get('name', 'bench')} ({doc.get('mode', '')}): throughput")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_cdf(doc, field, title, path):
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for s in doc["scenarios"]:
        values = sorted(s.get("samples", {}).get(field) or [])
        if not values:
            continue
        n = len(values)
        # Start at 0 so a single sample still draws its step.
        ax.step([values[0]] + values, [0.0] + [(i + 1) / n for i in range(n)], where="post",
                label=s["name"])
        drawn += 1
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.02)
    ax.grid(True, alpha=0.3)
    ax.set_title(f"{doc.get('name', 'bench')}: {title} CDF")
    if drawn:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", help="a deepserve bench result")
    ap.add_argument("--out", required=True, help="folder for the PNG files")
    args = ap.parse_args()
    with open(args.json) as f:
        doc = json.load(f)
    os.makedirs(args.out, exist_ok=True)
    written = []
    path = os.path.join(args.out, "throughput_vs_concurrency.png")
    plot_throughput(doc, path)
    written.append(path)
    for field, title, name in (("ttft_ms", "TTFT", "cdf_ttft.png"),
                               ("tpot_ms", "TPOT", "cdf_tpot.png"),
                               ("e2e_ms", "end-to-end latency", "cdf_e2e.png")):
        path = os.path.join(args.out, name)
        plot_cdf(doc, field, title, path)
        written.append(path)
    for p in written:
        print(p)


if __name__ == "__main__":
    main()
