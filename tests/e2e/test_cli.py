"""The CLI on the real embedded default model (SmolLM2-135M-Instruct Q4_1)."""
import json
import os
import shutil

import pytest


def test_default_model_answers_paris(run):
    p = run("generate", "--chat", "-p", "What is the capital of France?", "-n", "32",
            "--temperature", "0", "--threads", "2")
    assert "Paris" in p.stdout, p.stdout
    assert "tok/s" in p.stderr


def test_generate_json_fields_and_determinism(run):
    args = ("generate", "--json", "-p", "The quick brown fox", "-p", "Bonjour, je m'appelle",
            "-n", "8", "--temperature", "0", "--ignore-eos", "--threads", "2")
    out1 = [json.loads(l) for l in run(*args).stdout.splitlines()]
    out2 = [json.loads(l) for l in run(*args).stdout.splitlines()]
    assert [o["index"] for o in out1] == [0, 1]
    for o in out1:
        assert set(o) >= {"index", "prompt", "text", "tokens", "finish_reason", "usage", "timings"}
        assert len(o["tokens"]) == 8 and o["finish_reason"] == "length"
        assert o["usage"]["completion_tokens"] == 8
        assert o["usage"]["total_tokens"] == o["usage"]["prompt_tokens"] + 8
        assert o["timings"]["prompt_tokens_per_s"] > 0 and o["timings"]["decode_tokens_per_s"] > 0
    assert [o["tokens"] for o in out1] == [o["tokens"] for o in out2]


def test_seeded_sampling_is_reproducible(run):
    def sample(seed):
        return json.loads(run("generate", "--json", "-p", "Once upon a time", "-n", "16",
                              "--temperature", "1.0", "--top-k", "50", "--top-p", "0.9",
                              "--seed", seed, "--ignore-eos", "--threads", "2").stdout)["tokens"]
    a = sample(1234)
    assert sample(1234) == a
    assert sample(99) != a


def test_stop_string_cuts_text(run):
    p = run("generate", "--json", "-p", "1, 2, 3, 4, 5,", "-n", "24", "--temperature", "0",
            "--stop", "8", "--threads", "2")
    o = json.loads(p.stdout)
    assert o["finish_reason"] == "stop"
    assert "8" not in o["text"]
    assert "6" in o["text"]


def test_prompt_ids_file(run, tmp_path):
    ids = tmp_path / "ids.txt"
    ids.write_text("504 2365 6354 16438")  # arbitrary valid ids
    o = json.loads(run("generate", "--json", "--prompt-ids-file", ids, "-n", "4",
                       "--temperature", "0", "--ignore-eos", "--threads", "2").stdout)
    assert o["usage"]["prompt_tokens"] == 4 and len(o["tokens"]) == 4
    ids.write_text("1 2 banana")
    p = run("generate", "--prompt-ids-file", ids, check=False)
    assert p.returncode == 1 and "banana" in p.stderr and "not a token id" in p.stderr
    ids.write_text("99999999")
    p = run("generate", "--prompt-ids-file", ids, check=False)
    assert p.returncode == 1 and "outside the vocabulary" in p.stderr


def test_inspect_default_model(run):
    from conftest import ROOT  # noqa
    path = os.environ.get("DS_SMOLLM2_GGUF")
    if not path:
        pytest.skip("DS_SMOLLM2_GGUF not set")
    j = json.loads(run("inspect", path, "--json").stdout)
    assert j["architecture"] == "llama"
    assert j["hyperparameters"]["layers"] == 30 and j["hyperparameters"]["hidden"] == 576
    assert j["hyperparameters"]["kv_heads"] == 3
    assert len(j["tensors"]) == 272
    emb = next(t for t in j["tensors"] if t["name"] == "token_embd.weight")
    assert emb["dtype"] == "Q8_0" and emb["shape"] == [49152, 576]
    text = run("inspect", path).stdout
    assert "blk.29.ffn_down.weight" in text and "Q4_1" in text


def test_missing_and_corrupt_model_files(run, tmp_path):
    p = run("generate", "-m", tmp_path / "nope.gguf", "-p", "hi", check=False)
    assert p.returncode == 1 and "no such file" in p.stderr
    path = os.environ.get("DS_SMOLLM2_GGUF")
    if not path:
        pytest.skip("DS_SMOLLM2_GGUF not set")
    bad = tmp_path / "truncated.gguf"
    with open(path, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    p = run("generate", "-m", bad, "-p", "hi", check=False)
    assert p.returncode == 1 and "truncated.gguf" in p.stderr and "offset" in p.stderr, p.stderr
    p = run("inspect", bad, check=False)
    assert p.returncode == 1 and "offset" in p.stderr


def test_chat_session_over_stdin(run):
    p = run("chat", "--temperature", "0", "-n", "24", "--threads", "2",
            input="What is the capital of France?\nAnd of Germany?\n/exit\n")
    assert "Paris" in p.stdout
    assert "Berlin" in p.stdout


def test_prompts_file_runs_concurrently_in_input_order(run, tmp_path):
    prompts = ["The capital of Italy is", "Water boils at", "My favourite colour is",
               "Once upon a time", "def add(a, b):"]
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n")
    p = run("generate", "--prompts-file", f, "--json", "-n", "6", "--temperature", "0",
            "--ignore-eos", "--threads", "2", "--stats")
    out = [json.loads(l) for l in p.stdout.splitlines()]
    assert [o["index"] for o in out] == list(range(5))
    assert [o["prompt"] for o in out] == prompts
    stats = json.loads(p.stderr.strip().splitlines()[-1])
    assert stats["tokens_generated"] == 30
    assert stats["steps"] < 30  # requests shared steps
    # Each alone gives the same tokens.
    for o in out[:2]:
        alone = json.loads(run("generate", "--json", "-p", o["prompt"], "-n", "6",
                               "--temperature", "0", "--ignore-eos", "--threads", "2").stdout)
        assert alone["tokens"] == o["tokens"]
    s = run("generate", "--prompts-file", f, "--json", "-n", "6", "--temperature", "0",
            "--ignore-eos", "--threads", "2", "--kv-mode", "static")
    assert [json.loads(l)["tokens"] for l in s.stdout.splitlines()] == [o["tokens"] for o in out]


def test_inspect_deepseek_gguf_and_safetensors_agree(run):
    from conftest import ROOT  # noqa
    fx = ROOT / "tests" / "fixtures"
    gguf = fx / "gguf_deepseek" / "deepseek_v2_yarn_grouped_f16.gguf"
    hf = fx / "hf" / "deepseek_v2_yarn_grouped_f32"
    g = json.loads(run("inspect", gguf, "--json").stdout)
    h = json.loads(run("inspect", hf, "--json").stdout)
    assert g["architecture"] == h["architecture"] == "deepseek_v2"
    for key in ("mla", "moe", "yarn"):
        assert g[key] == h[key], key
    assert g["moe"]["topk_method"] == "group_limited_greedy" and g["moe"]["shared_experts"] == 2
    text = run("inspect", gguf).stdout
    assert "mla:" in text and "moe:" in text and "yarn:" in text


def test_version_names_the_commit_built(run):
    # The commit is compiled in (cmake/build_commit.cmake), not looked up when the binary runs.
    import subprocess
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    out = run("--version").stdout.strip()
    assert out.startswith("deepserve "), out
    if head:
        assert f"(commit {head}" in out, (out, head)


DUMMY = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dummy", "deepseek_v2_w4")


def test_dummy_load_format_and_w4a16_generate(run, tmp_path):
    """--load-format dummy from a folder with only config.json, plain and --quantize w4a16."""
    folder = tmp_path / "model"
    folder.mkdir()
    shutil.copy(os.path.join(DUMMY, "config.json"), folder / "config.json")
    ids = tmp_path / "ids.txt"
    ids.write_text("5 17 300 42 99 7 250 11")
    outs = {}
    for quant in ("none", "w4a16"):
        p = run("generate", "-m", folder, "--load-format", "dummy", "--quantize", quant,
                "--device", "cpu", "--prompt-ids-file", ids, "-n", "6", "--temperature", "0",
                "--ignore-eos", "--json", "--threads", "2")
        o = json.loads(p.stdout)
        assert len(o["tokens"]) == 6
        assert "weights: " in p.stderr and ("W4A16" in p.stderr) == (quant == "w4a16"), p.stderr
        outs[quant] = o["tokens"]
    # The same dummy model twice gives the same tokens (the seed is fixed).
    p = run("generate", "-m", folder / "config.json", "--load-format", "dummy", "--device", "cpu",
            "--prompt-ids-file", ids, "-n", "6", "--temperature", "0", "--ignore-eos", "--json",
            "--threads", "2")
    assert json.loads(p.stdout)["tokens"] == outs["none"]


def test_inspect_reports_bound_formats(run):
    p = run("inspect", "--load-format", "dummy", "--quantize", "w4a16", "--json",
            os.path.join(DUMMY, "config.json"))
    j = json.loads(p.stdout)
    bound = j["bound_formats"]
    assert set(bound) >= {"W4A16", "BF16", "F32"}
    assert 0.515 <= bound["W4A16"]["bytes_per_param"] < 0.6
    assert bound["BF16"]["bytes_per_param"] == 2


FP8 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "hf_fp8")


def read_safetensors_i32(path, name):
    """One I32 tensor of a safetensors file (header: u64 length, JSON; then the data)."""
    import struct
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        meta = json.loads(f.read(n))[name]
        assert meta["dtype"] == "I32"
        b, e = meta["data_offsets"]
        f.seek(8 + n + b)
        data = f.read(e - b)
    return list(struct.unpack(f"<{len(data) // 4}i", data))


@pytest.mark.parametrize("name", ["deepseek_v2_block128", "llama_channel"])
def test_fp8_checkpoint_generates_the_reference_tokens(run, tmp_path, name):
    """An FP8 checkpoint (F8_E4M3 + scales) through the CLI: bound as FP8W, and the greedy
    tokens of transformers on the dequantized weights (tools/make_fp8_fixture.py)."""
    folder = os.path.join(FP8, name)
    ref = os.path.join(folder, "reference.safetensors")
    ids = tmp_path / "ids.txt"
    ids.write_text(" ".join(map(str, read_safetensors_i32(ref, "p4.ids"))))
    p = run("generate", "-m", folder, "--device", "cpu", "--prompt-ids-file", ids, "-n", "32",
            "--temperature", "0", "--ignore-eos", "--json", "--threads", "2")
    assert "FP8W" in p.stderr, p.stderr
    assert json.loads(p.stdout)["tokens"] == read_safetensors_i32(ref, "p4.generated")
    assert "FP8W" in run("inspect", folder).stdout.split("bound weights")[1]


def test_accuracy_against_the_bf16_reference(run, tmp_path):
    """`deepserve accuracy` on the embedded model: its Q4_1 weights dequantized to BF16 as the
    reference; the file as stored differs from it only by BF16 rounding, FP8 weights by more."""
    out = tmp_path / "acc.json"
    run("accuracy", "--device", "cpu", "--threads", "2", "--quantize", "bf16",
        "--variant", "quantize=none", "--variant", "quantize=fp8", "-n", "8",
        "-p", "The capital of France is", "-p", "def fibonacci(n):", "-o", out, timeout=300)
    doc = json.loads(out.read_text())
    assert doc["commit"] and doc["prompts"] == 2 and doc["gen_tokens"] == 8
    assert doc["reference"]["quantize"] == "bf16" and "BF16" in doc["reference"]["weights"]
    stored, fp8 = doc["variants"]
    assert "Q4_1" in stored["weights"] and "FP8W" in fp8["weights"]
    assert stored["positions"] == fp8["positions"] > 8
    # BF16 keeps 8 bits of each dequantized weight: the argmax moves nowhere here.
    assert stored["top1_agreement"] == 1.0
    assert 0 < stored["max_logit_diff_over_range"] < 0.05
    # e4m3 keeps 4: visibly further, still mostly the same choices.
    assert fp8["max_logit_diff_over_range"] > stored["max_logit_diff_over_range"]
    assert fp8["top1_agreement"] >= 0.8


def test_accuracy_rejects_an_unknown_variant(run):
    p = run("accuracy", "--device", "cpu", "--variant", "quantize=int3", check=False)
    assert p.returncode != 0
    assert "--quantize must be none, bf16, w4a16 or fp8" in p.stderr, p.stderr
