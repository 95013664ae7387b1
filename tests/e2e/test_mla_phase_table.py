"""tools/mla_phase_table.py on a phase log written here, whose answer is worked out by hand."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAD = "seq\tsplit\ttiles\tsm\tchunk\tstart_ns\tend_ns\t" + "\t".join(f"c{i}" for i in range(9))


def cta(split, tiles, start_ns, cycles, scale=1):
    """One CTA at 2 cycles a ns (scale: every phase that many times longer): entry at cycle
    1000, then phases of 200, 400, 600, 800, 1000, 1200, 1400, 1600 cycles (0.1 .. 0.8 us)."""
    c = [1000]
    for d in (200, 400, 600, 800, 1000, 1200, 1400, 1600):
        c.append(c[-1] + d * scale)
    end_ns = start_ns + (c[-1] - c[0]) // 2
    return "\t".join(str(v) for v in [0, split, tiles, split, 0, start_ns, end_ns] + c)


def test_phase_medians_and_launches(tmp_path):
    rows = [HEAD]
    # Launch 1: three CTAs of two tiles starting 0, 500 and 1000 ns apart; one of them twice as
    # slow in every phase (the median stays the common CTA's). Launch 2, far later: one CTA of
    # one tile.
    rows += [cta(0, 2, 10_000, 0), cta(1, 2, 10_500, 0, scale=2), cta(2, 2, 11_000, 0)]
    rows += [cta(0, 1, 100_000, 0)]
    (tmp_path / "p.tsv").write_text("\n".join(rows) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "tools/mla_phase_table.py"),
                          str(tmp_path / "p.tsv")], capture_output=True, text=True, check=True).stdout
    assert "4 CTAs in 2 launches" in out
    two = out.split("CTAs with 2 tile(s): 3")[1].split("\n\n")[0]
    # slots = 200 cycles = 0.10 us, merge = 1600 cycles = 0.80 us; total 7200 cycles = 3.60 us.
    assert [l.split()[1] for l in two.splitlines()[2:] if l.strip()] == [
        "0.10", "0.20", "0.30", "0.40", "0.50", "0.60", "0.70", "0.80", "3.60"]
    # p90 of the three is the slow CTA: 0.20 us of slots.
    assert two.splitlines()[2].split()[2] == "0.20"
    # Launch 1: starts spread 1.0 us; first start (10.0 us) to the slow CTA's end (10.5 + 7.2).
    # Launch 2: 0 spread, 3.6 us. Medians of two values: their mean.
    assert "CTA start spread median 0.50 us (p90 1.00)" in out
    assert "first start to last end median 5.65 us (p90 7.70)" in out


def test_skip_launches(tmp_path):
    rows = [HEAD, cta(0, 2, 10_000, 0), cta(0, 1, 100_000, 0)]
    (tmp_path / "p.tsv").write_text("\n".join(rows) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "tools/mla_phase_table.py"),
                          str(tmp_path / "p.tsv"), "--skip-launches", "1"],
                         capture_output=True, text=True, check=True).stdout
    assert "1 CTAs in 1 launches" in out and "2 tile(s)" not in out
