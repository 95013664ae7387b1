"""tools/ab_table.py on the interleaved W3 A/B of 2026-12-04 (bench/results, 27cd7ba)."""
import importlib.util
import json
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
spec = importlib.util.spec_from_file_location("ab_table", ROOT / "tools" / "ab_table.py")
ab_table = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ab_table)

# Rounds 1-3 of each setting as gpu_run.sh abenv AB_ROUNDS=3 names them. Their TPOT p50 as
# the JSON holds them: off 2.861 / 2.855 / 2.856 ms, on 2.891 / 2.892 / 2.892 ms.
OFF = ["interleaved-1-w3-moe-one-launch-0", "interleaved-3-w3-moe-one-launch-0-moe-one-poll-ns-200",
       "interleaved-5-w3-moe-one-launch-0-mla-splits-16"]
ON = ["interleaved-2-w3-moe-one-launch-1", "interleaved-4-w3-moe-one-launch-1-moe-one-poll-ns-200",
      "interleaved-6-w3-moe-one-launch-1-mla-splits-16"]


@pytest.fixture
def rounds(tmp_path):
    for k, (off, on) in enumerate(zip(OFF, ON), start=1):
        shutil.copy(RESULTS / f"2026-12-04-h200-27cd7ba-{off}.json", tmp_path / f"bench-default-w3-r{k}.json")
        shutil.copy(RESULTS / f"2026-12-04-h200-27cd7ba-{on}.json",
                    tmp_path / f"bench-deepserve-moe-one-launch-1-w3-r{k}.json")
    return tmp_path


def test_medians_over_rounds_and_change_against_default(rounds, capsys):
    assert ab_table.main([str(rounds), "--json"]) == 0
    rows = {r["setting"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"default", "deepserve-moe-one-launch-1"}
    off, on = rows["default"], rows["deepserve-moe-one-launch-1"]
    assert off["rounds"] == on["rounds"] == 3
    assert off["workload"] == "w3" and off["scenario"] == "c1_in1024_out128"
    assert off["tpot_median"] == pytest.approx(2.856, abs=0.001)
    assert on["tpot_median"] == pytest.approx(2.892, abs=0.001)
    assert sorted(off["tpot_p50_ms"]) == pytest.approx([2.855, 2.856, 2.861], abs=0.001)
    assert on["tpot_vs_default"] == pytest.approx(on["tpot_median"] / off["tpot_median"] - 1)
    assert 0.005 < on["tpot_vs_default"] < 0.02
    assert on["tok_s_vs_default"] < 0 and off["tpot_vs_default"] == 0


def test_markdown_table_and_unrounded_names(rounds, capsys):
    # A file without a round suffix is round 1; bench-<workload>.json is the default.
    shutil.copy(RESULTS / "2026-12-04-h200-27cd7ba-w1.json", rounds / "bench-w1.json")
    assert ab_table.main([str(rounds)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("| setting |") and len(lines) == 2 + 3
    w1 = [l for l in lines if "| w1 |" in l]
    assert len(w1) == 1 and w1[0].startswith("| default | w1 | c8_in1024_out512 | 1 | 6.36 ")


def test_baseline_names_the_setting_to_compare_against(tmp_path, capsys):
    # gpu_run.sh abtree writes bench-{this,base}-<w>-r<k>.json: no `default` setting there.
    for k, (off, on) in enumerate(zip(OFF, ON), start=1):
        shutil.copy(RESULTS / f"2026-12-04-h200-27cd7ba-{off}.json", tmp_path / f"bench-base-w3-r{k}.json")
        shutil.copy(RESULTS / f"2026-12-04-h200-27cd7ba-{on}.json", tmp_path / f"bench-this-w3-r{k}.json")
    assert ab_table.main([str(tmp_path), "--json", "--baseline", "base"]) == 0
    rows = {r["setting"]: r for r in json.loads(capsys.readouterr().out)}
    assert set(rows) == {"base", "this"}
    assert rows["base"]["tpot_vs_default"] == 0
    assert rows["this"]["tpot_vs_default"] == pytest.approx(
        rows["this"]["tpot_median"] / rows["base"]["tpot_median"] - 1)
    assert ab_table.main([str(tmp_path)]) == 0  # against `default`, which is absent: no change
    lines = capsys.readouterr().out.splitlines()
    assert all(l.split("|")[6].strip() == "" for l in lines[2:])
    assert ab_table.main([str(tmp_path), "--baseline", "base"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "vs base" in lines[0]
    assert [l.split("|")[6].strip() for l in lines[2:]] == ["+0.0%", "+1.2%"]


def test_rejects_files_that_are_not_bench_results(tmp_path):
    bad = tmp_path / "bench-x-w3.json"
    bad.write_text('{"gpu": "NVIDIA H200"}')
    with pytest.raises(ValueError, match="not a deepserve bench result"):
        ab_table.main([str(bad)])
