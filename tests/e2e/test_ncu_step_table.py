"""tools/ncu_step_table.py on the committed Nsight Compute stretch of W3 (82120a6)."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
CSV = ROOT / "bench" / "results" / "2026-12-04-h200-82120a6-ncu-w3-kernels.csv"


def table(*extra):
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "ncu_step_table.py"), str(CSV), *extra],
                       capture_output=True, text=True, check=False)
    return p


def test_one_w3_step_kernel_by_kernel():
    p = table()
    assert p.returncode == 0, p.stderr
    # 800 launches hold one whole step (embed to embed): 355 kernels, 3.32 ms alone.
    assert p.stdout.startswith("1 complete step(s), 800 launches; median step sum 3323.5 us")
    p = table("--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["steps"] == 1 and doc["launches"] == 800
    assert doc["step_sum_us"] == pytest.approx(3323.5, abs=0.1)
    rows = {(r["kernel"], r["grid"]): r for r in doc["kernels"]}
    # V2-Lite: 27 layers, the first dense; two norms a layer, but layer 0's input norm has no
    # residual add.
    assert rows[("rms_norm_kernel<1>", "(1, 1, 1)")]["per_step"] == 53
    assert rows[("mla_decode::mla_decode_regq_kernel<1>", "(1, 16, 1)")]["per_step"] == 27
    gu = rows[("moe::gate_up_kernel<0, 1>", "(88, 8, 1)")]
    assert gu["per_step"] == 26 and 29 < gu["us_each"] < 30.5
    assert gu["us_per_step"] == pytest.approx(772.3, abs=0.1)
    totals = [r["us_per_step"] for r in doc["kernels"]]
    assert totals == sorted(totals, reverse=True)  # largest first
    assert sum(r["per_step"] for r in doc["kernels"]) == 355


def test_a_step_kernel_that_never_ran_is_an_error():
    p = table("--step-kernel", "no_such_kernel")
    assert p.returncode != 0 and "no complete step" in p.stderr
