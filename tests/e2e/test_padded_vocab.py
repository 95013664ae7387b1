"""A padded vocabulary (512 model ids, a 500-token tokenizer.json; fixture made by
transformers, tools/make_hf_fixtures.py): ids past the tokenizer are ordinary outputs, through
the CLI and the server."""
import concurrent.futures
import json
import pathlib
import subprocess
import sys

import requests

from test_server import start_server, stop_server

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf" / \
    "deepseek_v2_padded_vocab_bf16"


def reference():
    return json.loads((FIXTURE / "reference.json").read_text())


def test_generate_gives_transformers_tokens_past_the_tokenizer(deepserve, tmp_path):
    # The same check the GPU job runs on CUDA (tools/check_padded_generate.py); on the CPU
    # every one of the 32 tokens must match (no margin excuses a difference).
    tool = pathlib.Path(__file__).resolve().parents[2] / "tools" / "check_padded_generate.py"
    out = tmp_path / "padded.json"
    p = subprocess.run([sys.executable, str(tool), "--deepserve", str(deepserve), "--device",
                        "cpu", "--min-margin", "0", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == len(reference()["prompts"])
    assert all(r["all_identical"] and r["tokens"] == 32 for r in rows), rows
    assert sum(r["past_tokenizer"] for r in rows) > 0, "the fixture must produce ids past it"


def test_serve_sampled_requests_all_finish_whole(deepserve, tmp_path):
    ref = reference()
    proc, base = start_server(deepserve, tmp_path / "server.log", "-m", str(FIXTURE),
                              "--device", "cpu")
    try:
        def one(i):
            body = {"prompt": "The quick brown fox", "max_tokens": 32, "ignore_eos": True,
                    "temperature": 1.5, "seed": i, "return_token_ids": True,
                    "logprobs": 2, "stream": i % 2 == 1}
            r = requests.post(base + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            if not body["stream"]:
                c = r.json()["choices"][0]
                return c["finish_reason"], c["token_ids"], r.json()["usage"]["completion_tokens"]
            # split("\n"), not splitlines(): the text may hold U+0085 or U+2028, which JSON keeps raw
            events = [l[6:] for l in r.text.split("\n") if l.startswith("data: ")]
            assert events[-1] == "[DONE]"
            chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
            ids = [t for c in chunks for t in c.get("token_ids", [])]
            return chunks[-1]["finish_reason"], ids, len(ids)

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(one, range(16)))
        for reason, ids, n in results:
            assert reason == "length" and n == 32 and len(ids) == 32, (reason, n, ids)
        past = sum(t >= ref["tokenizer_vocab"] for _, ids, _ in results for t in ids)
        assert past > 0, "sampling at temperature 1.5 should reach ids past the tokenizer"
    finally:
        assert stop_server(proc) == 0
