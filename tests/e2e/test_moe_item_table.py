"""tools/moe_item_table.py on an item log written here, whose answer is worked out by hand."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAD = "cta\tsm\titem\tgate_up_items\titems\tstart_ns\tend_ns\tc_start\tc_wait\tc_end"


def item(cta, it, start_ns, length_ns, wait_ns=0, n_gu=2, n_all=4):
    """One item at 2 cycles a ns (SM clock = 2 x the global timer)."""
    return "\t".join(str(v) for v in [cta, cta, it, n_gu, n_all, start_ns, start_ns + length_ns,
                                      2 * start_ns, 2 * (start_ns + wait_ns),
                                      2 * (start_ns + length_ns)])


def run(tmp_path, rows, *args):
    (tmp_path / "i.tsv").write_text("\n".join([HEAD] + rows) + "\n")
    return subprocess.run([sys.executable, str(ROOT / "tools/moe_item_table.py"),
                           str(tmp_path / "i.tsv"), *args],
                          capture_output=True, text=True, check=True).stdout


def line(out, key):
    return next(l.split()[1:] for l in out.splitlines() if l.split()[:1] == [key])


def test_one_launch(tmp_path):
    # CTA 0 runs gate/up item 0 (10 us) then down item 2 (4 us, 1 us of it waiting); CTA 1
    # starts 2 us later and runs gate/up item 1 (10 us) then down item 3 (6 us, no wait).
    rows = [item(0, 0, 0, 10_000), item(0, 2, 10_000, 4_000, wait_ns=1_000),
            item(1, 1, 2_000, 10_000), item(1, 3, 12_000, 6_000)]
    out = run(tmp_path, rows)
    assert "4 items in 1 launches; 0.500 ns a cycle" in out
    # Span 0 .. 18 us; 30 us of items over 2 CTAs x 18 us = 0.833; CTA 1 started 2 us late;
    # CTA 0 ran out at 14 us: drain 4 us, idle at the end (4 + 0) / 2 = 2 us; waits 1 / 30.
    assert line(out, "span")[0] == "18.000"
    assert line(out, "busy")[0] == "0.833"
    assert line(out, "spread")[0] == "2.000"
    assert line(out, "drain")[0] == "4.000"
    assert line(out, "idle_end")[0] == "2.000"
    assert line(out, "wait_share")[0] == "0.033"
    assert line(out, "gate/up") == ["2", "10.00", "10.00", "0.00", "0.00"]
    # Down items of 4 and 6 us: the median of two is their mean, the p90 the longer.
    assert line(out, "down") == ["2", "5.00", "6.00", "0.50", "1.00"]


def test_skip_launches(tmp_path):
    rows = [item(0, 0, 0, 10_000), item(0, 0, 1_000_000, 3_000, n_gu=1, n_all=1)]
    out = run(tmp_path, rows, "--skip-launches", "1")
    assert "1 items in 1 launches" in out
    assert line(out, "span")[0] == "3.000"
