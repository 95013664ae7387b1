"""tools/kernel_trace_table.py on a kernel trace written here, whose answer is worked out by hand."""
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEAD = ("start_ns\tend_ns\tcorrelation\tgraph_id\tgraph_node\tgrid\tblock\tcluster\tdynamic_smem"
        "\tregisters\tname\n")
EMBED = "void ds::cuda::embed_kernel(ds::cuda::EmbedArgs)"
NORM = "void ds::cuda::rms_norm_kernel<1>(float const*, float const*, float, float*, int)"
GEMM = "void ds::cuda::(anonymous namespace)::skinny_kernel<2>(ds::cuda::SkinnyArgs)"
TAIL = "void ds::cuda::merge_kernel(float*)"
LAST = "void ds::cuda::argmax_kernel(float const*, int*)"


def row(start, end, corr, graph, name, grid="1,1,1", node=0):
    return (f"{start}\t{end}\t{corr}\t{graph}\t{node}\t{grid}\t128,1,1\t1,1,1\t0\t32"
            f"\t{name}\n")


def step(base, corr, norm_end=6000, nodes=True, corr_each=False):
    """One launch of graph 5: six kernels, the later ones started early (dependent launch).
    nodes: each kernel carries its graph node id (else 0, as where CUPTI gives none);
    corr_each: each kernel its own correlation id rather than the launch's."""
    spec = [(0, 2000, EMBED, "1,1,1"), (1500, norm_end, NORM, "1,1,1"),
            (5000, 15000, GEMM, "64,1,1"), (14000, 20000, GEMM, "64,1,1"),
            (16000, 19000, TAIL, "1,1,1"),  # ends inside the GEMM: adds 0
            (19500, 21000, LAST, "1,1,1")]  # adds 1 us past the GEMM's end
    return [row(base + s, base + e, corr * 10 + i if corr_each else corr, 5, name, grid,
                100 + i if nodes else 0)
            for i, (s, e, name, grid) in enumerate(spec)]


def write_trace(path, **kw):
    lines = [HEAD, row(0, 50_000, 1, 0, GEMM, "8,1,1")]  # an eager launch (prefill): no graph
    lines += step(100_000, 10, **kw) + step(200_000, 11, **kw)
    lines += step(300_000, 12, norm_end=7000, **kw)
    lines += step(400_000, 13, **kw)[:2]  # cut by the trace's window: not a complete launch
    lines += [row(500_000, 501_000, 14, 9, EMBED, node=7)]  # another graph, launched once
    path.write_text("".join(lines))
    return path


@pytest.fixture
def trace(tmp_path):
    return write_trace(tmp_path / "trace.tsv")


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / "kernel_trace_table.py"), *args],
                          capture_output=True, text=True, check=False)


def test_each_kernel_adds_what_it_extends_the_step_by(trace):
    p = run(str(trace), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["graph"] == 5 and doc["steps"] == 3 and doc["kernels_per_step"] == 6
    # Spans 21 us each; between launches the device idles 79 us (100 - 21).
    assert doc["span_us"] == pytest.approx(21.0) and doc["host_gap_us"] == pytest.approx(79.0)
    rows = {(r["kernel"], r["grid"]): r for r in doc["kernels"]}
    assert set(rows) == {("embed_kernel", "(1, 1, 1)"), ("rms_norm_kernel<1>", "(1, 1, 1)"),
                         ("skinny_kernel<2>", "(64, 1, 1)"), ("merge_kernel", "(1, 1, 1)"),
                         ("argmax_kernel", "(1, 1, 1)")}
    norm = rows[("rms_norm_kernel<1>", "(1, 1, 1)")]
    # Started 0.5 us before the embedding ended; adds 4 us (5 in the third step: median 4).
    assert norm["us_lead"] == pytest.approx(-0.5) and norm["us_added_each"] == pytest.approx(4.0)
    assert norm["us_each"] == pytest.approx(4.5)
    gemm = rows[("skinny_kernel<2>", "(64, 1, 1)")]
    # Two launches a step: 9 + 5 us added (8 + 5 where the norm ended 1 us later).
    assert gemm["per_step"] == 2 and gemm["us_added_per_step"] == pytest.approx(14.0)
    tail = rows[("merge_kernel", "(1, 1, 1)")]
    assert tail["us_added_each"] == 0 and tail["us_lead"] == pytest.approx(-4.0)
    # After it, the latest end is still the GEMM's, not the merge's.
    last = rows[("argmax_kernel", "(1, 1, 1)")]
    assert last["us_added_each"] == pytest.approx(1.0) and last["us_lead"] == pytest.approx(-0.5)
    totals = [r["us_added_per_step"] for r in doc["kernels"]]
    assert totals == sorted(totals, reverse=True)
    # The additions of each step sum to its span.
    assert sum(totals) == pytest.approx(2.0 + 4.0 + 14.0 + 0.0 + 1.0)


def test_text_table_and_timeline(trace):
    p = run(str(trace), "--timeline", "1:4")
    assert p.returncode == 0, p.stderr
    out = p.stdout.splitlines()
    assert out[0] == ("graph 5: 3 complete launch(es) of 6 kernels; median span 21.0 us, "
                      "median gap between launches 79.0 us")
    assert out[2].split()[:5] == ["skinny_kernel<2>", "(64,", "1,", "1)", "2"]
    i = out.index(next(l for l in out if l.startswith("the median step")))
    timeline = [l.split() for l in out[i + 2:]]
    assert [t[0] for t in timeline] == ["1", "2", "3"]
    assert timeline[0][1] == "rms_norm_kernel<1>" and timeline[0][-3:] == ["1.50", "6.00", "4.00"]
    assert timeline[2][-3:] == ["14.00", "20.00", "5.00"]


@pytest.mark.parametrize("kw", [{"nodes": False}, {"corr_each": True}])
def test_launches_found_by_correlation_or_by_node(tmp_path, kw):
    # Without node ids the launch's shared correlation id groups a step; with node ids a node
    # seen again starts the next launch, whatever the correlation ids say.
    p = run(str(write_trace(tmp_path / "t.tsv", **kw)), "--json")
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["steps"] == 3 and doc["kernels_per_step"] == 6
    assert doc["span_us"] == pytest.approx(21.0)


def test_choosing_another_graph_and_errors(trace, tmp_path):
    p = run(str(trace), "--graph", "9", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["steps"] == 1
    eager = tmp_path / "eager.tsv"
    eager.write_text(HEAD + row(0, 10, 1, 0, GEMM))
    p = run(str(eager))
    assert p.returncode != 0 and "no kernel ran inside a graph" in p.stderr
    bad = tmp_path / "bad.tsv"
    bad.write_text("ID\tname\n1\tx\n")
    p = run(str(bad))
    assert p.returncode != 0 and "not a kernel trace" in p.stderr
