#!/usr/bin/env python3
"""Where the register-Q MLA decode's CTAs spend their time (DEEPSERVE_MLA_PHASES's table).

Each row of the table is one CTA: its sequence, split, tile count, SM, head chunk, the global
timer at its entry and end (ns) and its SM clock at the kernel's nine phases (c0 entry .. c8
end; attention_mla_decode_tiles.cuh, PhaseLog). This prints, per tile count, the median and
90th percentile of each phase's length in microseconds (clock cycles turned into time with
each CTA's own ns per cycle, from its entry-to-end span), and per launch of the kernel (CTAs
whose spans overlap) how far apart its CTAs started and how long the launch took.

  python3 tools/mla_phase_table.py phases.tsv [--skip-launches N]
"""
import argparse
import statistics
import sys

PHASES = [
    ("slots", "block-table lookups, barrier"),
    ("issue0", "tile 0's copies issued"),
    ("wait", "the dependent-launch wait"),
    ("q", "Q loaded and split into registers"),
    ("tile0", "until tile 0's rows are in shared memory"),
    ("compute0", "tile 0's scores, softmax and P.V"),
    ("rest", "the other tiles, the row statistics"),
    ("merge", "the in-cluster merge or the partial stores"),
]


def read(path):
    rows = []
    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        for line in f:
            v = line.rstrip("\n").split("\t")
            if len(v) != len(header):
                continue
            rows.append(dict(zip(header, (int(x) for x in v))))
    return rows


def launches(rows):
    """CTAs grouped into launches: a launch goes on while a CTA starts before its latest end."""
    out = []
    for r in sorted(rows, key=lambda r: r["start_ns"]):
        if out and r["start_ns"] <= out[-1]["end"]:
            out[-1]["ctas"].append(r)
            out[-1]["end"] = max(out[-1]["end"], r["end_ns"])
        else:
            out.append({"ctas": [r], "end": r["end_ns"]})
    return out


def pct(values, q):
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def table(rows, skip_launches=0):
    lines = []
    groups = launches(rows)[skip_launches:]
    kept = [r for g in groups for r in g["ctas"]]
    if not kept:
        return "no records\n"
    by_tiles = {}
    for r in kept:
        by_tiles.setdefault(r["tiles"], []).append(r)
    lines.append(f"{len(kept)} CTAs in {len(groups)} launches")
    for tiles in sorted(by_tiles):
        rs = by_tiles[tiles]
        lines.append(f"\nCTAs with {tiles} tile(s): {len(rs)}")
        lines.append(f"  {'phase':<10}{'median us':>10}{'p90 us':>9}  what")
        per = {name: [] for name, _ in PHASES}
        total = []
        for r in rs:
            cyc = r["c8"] - r["c0"]
            ns = r["end_ns"] - r["start_ns"]
            if cyc <= 0:
                continue
            k = ns / cyc / 1000.0  # us per cycle
            total.append(cyc * k)
            for i, (name, _) in enumerate(PHASES):
                a, b = r[f"c{i}"], r[f"c{i + 1}"]
                # A phase a CTA never reached (no keys) keeps 0: counted as nothing.
                per[name].append(max(0, b - a) * k if a and b else 0.0)
        for name, what in PHASES:
            v = per[name]
            lines.append(f"  {name:<10}{statistics.median(v):>10.2f}{pct(v, 0.9):>9.2f}  {what}")
        lines.append(f"  {'total':<10}{statistics.median(total):>10.2f}{pct(total, 0.9):>9.2f}")
    spread = [(max(r["start_ns"] for r in g["ctas"]) - min(r["start_ns"] for r in g["ctas"])) / 1e3
              for g in groups]
    span = [(g["end"] - min(r["start_ns"] for r in g["ctas"])) / 1e3 for g in groups]
    lines.append(f"\nper launch: CTA start spread median {statistics.median(spread):.2f} us "
                 f"(p90 {pct(spread, 0.9):.2f}), first start to last end median "
                 f"{statistics.median(span):.2f} us (p90 {pct(span, 0.9):.2f})")
    return "\n".join(lines) + "\n"


def cli(summarize, doc, argv=None):
    """A device-log table's command line: the table's path, --skip-launches; prints summarize."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("table")
    ap.add_argument("--skip-launches", type=int, default=0,
                    help="leave out the first N launches (warm-up)")
    a = ap.parse_args(argv)
    sys.stdout.write(summarize(read(a.table), a.skip_launches))


def main(argv=None):
    cli(table, __doc__, argv)


if __name__ == "__main__":
    main()
