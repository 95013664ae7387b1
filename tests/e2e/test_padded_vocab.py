"""A padded vocabulary (512 model ids, a 500-token tokenizer.json; fixture made by
transformers, tools/make_hf_fixtures.py): ids past the tokenizer are ordinary outputs, through
the CLI and the server."""
import concurrent.futures
import json
import pathlib

import requests

from test_server import start_server, stop_server

FIXTURE = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf" / \
    "deepseek_v2_padded_vocab_bf16"


def reference():
    return json.loads((FIXTURE / "reference.json").read_text())


def test_generate_gives_transformers_tokens_past_the_tokenizer(run, tmp_path):
    ref = reference()
    assert ref["vocab"] > ref["tokenizer_vocab"]
    past = 0
    for p in ref["prompts"]:
        ids_file = tmp_path / f"{p['name']}.txt"
        ids_file.write_text(" ".join(map(str, p["ids"])))
        want = p["generated_ids"][:32]
        out = json.loads(run("generate", "-m", FIXTURE, "--device", "cpu", "--prompt-ids-file",
                             ids_file, "-n", len(want), "--temperature", "0", "--ignore-eos",
                             "--json", "--threads", "2").stdout)
        assert out["finish_reason"] == "length", out
        assert "error" not in out, out
        assert out["tokens"] == want, (p["name"], out["tokens"], want)
        assert out["usage"]["completion_tokens"] == len(want)
        assert isinstance(out["text"], str)
        past += sum(t >= ref["tokenizer_vocab"] for t in want)
    assert past > 0, "the fixture's greedy tokens must include ids past the tokenizer"


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
