"""`deepserve bench` on the embedded model: offline (in-process) and online (against a real
`deepserve serve`), with small numbers. Schema: docs/BENCH.md."""
import importlib.util
import json
import signal
import socket
import subprocess
import time

import pytest
import requests

KEY = "bench-key"
SUMMARY = ("mean", "p50", "p90", "p99", "max")
SCENARIO_FIELDS = (
    "name", "concurrency", "input_len", "output_len", "num_prompts", "completed", "failed",
    "output_tokens_per_s", "total_tokens_per_s", "requests_per_s", "ttft_ms", "tpot_ms",
    "itl_ms", "e2e_ms", "step_time_ms", "peak_gpu_memory_gb", "peak_rss_gb", "kv_usage_peak",
    "kv_fragmentation", "prefix_cache_hit_rate", "roofline_fraction",
    "usd_per_million_output_tokens", "output_tokens", "client_output_tokens",
    "usage_output_tokens", "samples",
)
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def write_config(tmp_path, name, text):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def check_schema(doc, mode):
    assert doc["mode"] == mode
    for k in ("gpu", "driver", "cpu", "commit", "command"):
        assert k in doc["system"], k
    assert doc["system"]["cpu"]
    assert "bench" in doc["system"]["command"]
    for s in doc["scenarios"]:
        for k in SCENARIO_FIELDS:
            assert k in s, k
        for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for q in SUMMARY:
                assert isinstance(s[k][q], float), (k, q, s[k])
            assert s[k]["p50"] <= s[k]["p99"] <= s[k]["max"] + 1e-9
        assert isinstance(s["step_time_ms"]["mean"], float)
        assert isinstance(s["step_time_ms"]["std"], float)
        assert s["failed"] == 0, s["errors"]
        assert s["completed"] == s["num_prompts"]
        assert len(s["samples"]["e2e_ms"]) == s["num_prompts"]
        assert s["output_tokens_per_s"] > 0
        assert s["total_tokens_per_s"] > s["output_tokens_per_s"]


def test_offline_embedded_model(run, tmp_path):
    cfg = write_config(tmp_path, "tiny", """
threads: 2
concurrency: [1, 2]
input_len: 16
output_len: 8
warmup: 1
bandwidth_gbps: 19.4
engine:
  kv_cache_tokens: 512
""")
    out = tmp_path / "r.json"
    args = ["bench", "--config", cfg, "--output", out, "--gpu-hour-price", "2.5"]
    if HAVE_MPL:
        args += ["--plots", tmp_path / "plots"]
    p = run(*args, timeout=120)
    assert "c2_in16_out8" in p.stdout  # the table
    doc = json.loads(out.read_text())
    check_schema(doc, "offline")
    # The embedded model's weights as bound: mostly Q4_1 blocks, the format recorded.
    assert doc["config"]["quantize"] == "q4_1", doc["config"]
    assert "Q4_1" in doc["config"]["weights"] and "Q8_0" in doc["config"]["weights"]
    # 30 layers x K and V x 3 KV heads x 64 dims x 4 bytes (the CPU's F32 cache).
    assert doc["config"]["kv_cache"] == {"capacity_tokens": 512, "bytes_per_token": 46080,
                                         "tokens_that_fit": None}
    assert [s["concurrency"] for s in doc["scenarios"]] == [1, 2]
    for s in doc["scenarios"]:
        n = s["num_prompts"]
        # EOS ignored: every request runs to its length; the engine's usage agrees with the
        # token events the client counted.
        assert s["finish_reasons"] == {"length": n}
        assert s["client_output_tokens"] == s["usage_output_tokens"] == s["output_tokens"] == 8 * n
        assert s["prompt_tokens"] == 16 * n
        assert s["peak_rss_gb"] > 0.05  # the model's weights alone are ~0.1 GB
        assert s["peak_gpu_memory_gb"] is None
        assert 0 <= s["kv_fragmentation"] < 1
        assert s["prefix_cache_hit_rate"] == 0  # random prompts share no prefix
        assert s["step_time_ms"]["source"].startswith("engine_token_timestamps")
        assert s["roofline_fraction"] == pytest.approx(s["roofline"]["achieved_gbps"] / 19.4)
        assert s["roofline_fraction"] > 0
        # A decode step reads at least the quantized weights (~0.1 GB for SmolLM2-135M Q4_1).
        assert 0.05 < s["roofline"]["bytes_per_step_gb"] < 0.3
        assert s["usd_per_million_output_tokens"] == pytest.approx(
            2.5 / 3600 / s["output_tokens_per_s"] * 1e6, rel=1e-9)
        # Each request's decode spans (tokens - 1) steps.
        assert s["tpot_ms"]["mean"] * 7 <= s["e2e_ms"]["max"]
    if HAVE_MPL:
        for name in ("throughput_vs_concurrency.png", "cdf_ttft.png", "cdf_tpot.png", "cdf_e2e.png"):
            png = tmp_path / "plots" / name
            assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name


LLAMA_DECODE_OPS = {"embed", "rms_norm", "add_rms_norm", "matmul", "rope", "store_kv",
                    "attention", "silu_mul", "add"}


def test_offline_profile_ops(run, tmp_path):
    cfg = write_config(tmp_path, "prof", """
threads: 2
concurrency: 2
input_len: 16
output_len: 8
warmup: 1
engine:
  kv_cache_tokens: 512
""")
    out = tmp_path / "r.json"
    p = run("bench", "--config", cfg, "--output", out, "--profile-ops", timeout=120)
    assert "op profile" in p.stdout and "matmul [2,576]x" in p.stdout  # the per-op table
    doc = json.loads(out.read_text())
    check_schema(doc, "offline")
    assert doc["config"]["profile_ops"] is True
    prof = doc["scenarios"][0]["op_profile"]
    assert prof["steps"] == sum(g["steps"] for g in prof["groups"])
    step = prof["step"]
    # Both requests decode together: the most common step is two sequences, one token each.
    assert step["decode"] is True and step["tokens"] == 2 and step["seqs"] == 2
    assert step["steps"] >= 5
    assert 0 < step["op_ms"] <= step["wall_ms"]
    kinds = {k["kind"]: k for k in step["kinds"]}
    assert LLAMA_DECODE_OPS <= set(kinds), set(kinds)
    # SmolLM2-135M: 30 layers, each with two norms, q and k rotations and two residual adds;
    # every add but the last is fused with the norm after it.
    assert kinds["embed"]["calls"] == 1
    assert kinds["attention"]["calls"] == 30
    assert kinds["rms_norm"]["calls"] == 2  # the first input norm and the output norm
    assert kinds["add_rms_norm"]["calls"] == 59
    assert kinds["rope"]["calls"] == 60
    assert kinds["add"]["calls"] == 1
    assert sum(k["share"] for k in step["kinds"]) == pytest.approx(1.0)
    assert sum(o["us"] for o in step["ops"]) == pytest.approx(step["op_ms"] * 1e3)
    for o in step["ops"]:
        assert o["kind"] in kinds and o["us"] >= 0 and o["calls"] > 0, o
    assert any(o["label"].startswith("attention [2,9,64] kv[3,64]") for o in step["ops"])
    # Without the flag there is no profile.
    plain = tmp_path / "plain.json"
    run("bench", "--config", cfg, "--output", plain, timeout=120)
    doc = json.loads(plain.read_text())
    assert doc["config"]["profile_ops"] is False
    assert doc["scenarios"][0]["op_profile"] is None


def test_profile_step_tokens_chooses_the_steps(run, tmp_path):
    # --profile-step-tokens N reports the steps of N tokens (a prefill chunk) instead of the
    # most common decode step; --max-num-batched-tokens sets the chunk.
    cfg = write_config(tmp_path, "prof", """
threads: 2
concurrency: 2
input_len: 16
output_len: 4
warmup: 0
engine:
  kv_cache_tokens: 512
  max_num_seqs: 4
""")
    out = tmp_path / "r.json"
    run("bench", "--config", cfg, "--output", out, "--profile-ops", timeout=120)
    groups = json.loads(out.read_text())["scenarios"][0]["op_profile"]["groups"]
    prefill = max((g for g in groups if not g["decode"]), key=lambda g: g["tokens"])
    assert prefill["tokens"] >= 16, groups
    chosen = tmp_path / "chosen.json"
    p = run("bench", "--config", cfg, "--output", chosen, "--profile-ops",
            "--profile-step-tokens", str(prefill["tokens"]), timeout=120)
    step = json.loads(chosen.read_text())["scenarios"][0]["op_profile"]["step"]
    assert step["decode"] is False and step["tokens"] == prefill["tokens"], step
    assert f"step(s) of {prefill['tokens']} tokens" in p.stdout
    # A count no step had: the report names the ones there were, and there is no step.
    none = tmp_path / "none.json"
    p = run("bench", "--config", cfg, "--output", none, "--profile-ops",
            "--profile-step-tokens", "777", timeout=120)
    assert "no step of the requested token count" in p.stdout, p.stdout
    assert json.loads(none.read_text())["scenarios"][0]["op_profile"]["step"] is None
    # Without --profile-ops the option is an error, not silently ignored.
    p = run("bench", "--config", cfg, "--profile-step-tokens", "16", check=False)
    assert p.returncode == 1 and "add --profile-ops" in p.stderr, p.stderr
    # --max-num-batched-tokens overrides the YAML's engine setting: no step takes more tokens.
    small = tmp_path / "small.json"
    run("bench", "--config", cfg, "--output", small, "--profile-ops",
        "--max-num-batched-tokens", "8", timeout=120)
    doc = json.loads(small.read_text())
    assert doc["config"]["engine"]["max_num_batched_tokens"] == 8
    sizes = [g["tokens"] for g in doc["scenarios"][0]["op_profile"]["groups"]]
    assert max(sizes) == 8, sizes


def test_profile_ops_is_offline_only(run, tmp_path):
    cfg = write_config(tmp_path, "online", "input_len: 16\noutput_len: 8\n")
    p = run("bench", "--config", cfg, "--url", "http://127.0.0.1:9", "--profile-ops",
            check=False)
    assert p.returncode == 1
    assert "--profile-ops" in p.stderr and "offline mode only" in p.stderr


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(deepserve, tmp_path_factory):
    log_path = tmp_path_factory.mktemp("bench-server") / "server.log"
    port = free_port()
    with open(log_path, "w") as log:
        proc = subprocess.Popen([str(deepserve), "serve", "--threads", "2", "--port", str(port),
                                 "--api-key", KEY], stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"server exited:\n{log_path.read_text()}")
        try:
            if requests.get(base + "/health", timeout=1).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        if time.time() > deadline:
            proc.kill()
            raise AssertionError("server did not start:\n" + log_path.read_text())
        time.sleep(0.2)
    yield base
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=40) == 0, log_path.read_text()


def generation_tokens(base):
    r = requests.get(base + "/api/v1/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    return r.json()["generation_tokens_total"]


def test_online_against_server(run, server, tmp_path):
    cfg = write_config(tmp_path, "online", f"""
concurrency: [1, 2]
input_len: 16
output_len: 8
warmup: 1
api_key: {KEY}
count_tokens: logprobs
""")
    out = tmp_path / "online.json"
    before = generation_tokens(server)
    run("bench", "--config", cfg, "--url", server + "/v1", "--output", out, timeout=120)
    after = generation_tokens(server)
    doc = json.loads(out.read_text())
    check_schema(doc, "online")
    assert doc["model"] == "SmolLM2-135M-Instruct.Q4_1"
    measured = 0
    for s in doc["scenarios"]:
        n = s["num_prompts"]
        # The client's count of streamed tokens equals the server's usage fields.
        assert s["client_output_tokens"] == s["usage_output_tokens"] == s["output_tokens"]
        assert s["prompt_tokens"] == 16 * n
        assert s["peak_rss_gb"] is None  # another process
        assert s["step_time_ms"]["source"] == "itl"
        assert s["kv_usage_peak"] is not None  # from GET /api/v1/metrics
        measured += s["output_tokens"]
    # And with the server's own counter (the warm-up request generated up to 8 more).
    assert measured <= after - before <= measured + 8


def e2e_counts(base):
    r = requests.get(base + "/api/v1/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    lat = r.json()["latency"]
    return {p: lat[p]["e2e_request_latency_seconds"]["count"] for p in lat}


def test_online_mixed_classes_carry_their_priority(run, server, tmp_path):
    cfg = write_config(tmp_path, "mixed", f"""
warmup: 0
api_key: {KEY}
classes:
  - name: bulk
    priority: batch
    input_len: 32
    output_len: 8
    concurrency: 2
    num_prompts: 1000
    background: true
  - name: probe
    priority: latency-critical
    input_len: 16
    output_len: 4
    num_prompts: 3
    start_s: 0.2
""")
    out = tmp_path / "mixed.json"
    before = e2e_counts(server)
    p = run("bench", "--config", cfg, "--url", server, "--output", out, timeout=120)
    after = e2e_counts(server)
    doc = json.loads(out.read_text())
    assert len(doc["scenarios"]) == 1
    s = doc["scenarios"][0]
    assert s["name"] == "mixed" and s["failed"] == 0, s["errors"]
    bulk, probe = s["classes"]
    assert (bulk["name"], bulk["priority"], bulk["background"]) == ("bulk", "batch", True)
    assert (probe["name"], probe["priority"]) == ("probe", "latency-critical")
    assert probe["completed"] == 3 and len(probe["samples"]["ttft_ms"]) == 3
    assert 0 < bulk["completed"] < 1000  # stopped with the probes
    assert s["completed"] == bulk["completed"] + 3
    for c in (bulk, probe):
        for k in ("ttft_ms", "tpot_ms", "e2e_ms"):
            assert isinstance(c[k]["p50"], float), (c["name"], k)
    # Each request reached the server with its class's priority.
    assert after["latency-critical"] - before["latency-critical"] == 3
    assert after["batch"] - before["batch"] == bulk["completed"]
    assert "probe (latency-critical)" in p.stdout


def test_bad_config_is_reported(run, tmp_path):
    cfg = write_config(tmp_path, "bad", "input_len: 16\noutput_len: 8\nconcurency: [1]\n")
    p = run("bench", "--config", cfg, check=False)
    assert p.returncode == 1
    assert "bad.yaml:3: unknown key 'concurency'" in p.stderr
    cfg = write_config(tmp_path, "bad2", "input_len: sixteen\noutput_len: 8\n")
    p = run("bench", "--config", cfg, check=False)
    assert p.returncode == 1
    assert "bad2.yaml:1: 'input_len' must be an integer" in p.stderr


def test_offline_dummy_w4a16_records_formats(run, tmp_path):
    """A dummy, 4-bit model from a config.json alone (the shape of bench/w5.yaml, tiny)."""
    import pathlib
    model = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "dummy" / "deepseek_v2_w4"
    cfg = write_config(tmp_path, "w5tiny", f"""
model: {model}
load_format: dummy
quantize: w4a16
device: cpu
threads: 2
concurrency: 2
input_len: 12
output_len: 4
warmup: 0
""")
    out = tmp_path / "r.json"
    p = run("bench", "--config", cfg, "--output", out)
    doc = json.loads(out.read_text())
    c = doc["config"]
    assert c["quantize"] == "w4a16" and c["load_format"] == "dummy"
    assert c["kv_cache_dtype"] == "f32"
    assert doc["scenarios"][0]["completed"] == 2, doc["scenarios"][0]
    assert "W4A16" in p.stderr
