"""The event-driven HTTP front end of `deepserve serve`: many connections at once, limits
(sizes, timeouts, open connections, the waiting queue) and token-id streaming."""
import asyncio
import json
import pathlib
import resource
import socket
import subprocess
import time

import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

from test_server import KEY, assert_alive, client, model, raw_request, server, start_server, \
    stop_server  # noqa: F401 (fixtures)


def raise_fd_limit(want):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(want, hard), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def host_port(server):
    host, port = server.removeprefix("http://").split(":")
    return host, int(port)


def test_half_open_connections_do_not_block_health(server, model):
    assert raise_fd_limit(4096) >= 1100
    host, port = host_port(server)
    socks = []
    try:
        for i in range(1000):
            s = socket.create_connection((host, port), timeout=10)
            if i % 2:  # a header that never ends; the others send nothing at all
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
            socks.append(s)
        t = time.time()
        r = requests.get(server + "/health", timeout=5)
        took = time.time() - t
        assert r.status_code == 200 and took < 1.0, took
        print(f"/health with 1000 half-open connections: {took * 1000:.1f} ms")
        fams = {f.name: f for f in text_string_to_metric_families(
            requests.get(server + "/metrics", timeout=5).text)}
        assert fams["deepserve:http_connections_open"].type == "gauge"
        assert fams["deepserve:http_connections_open"].samples[0].value >= 1000
    finally:
        for s in socks:
            s.close()
    assert_alive(server, model)


async def stream_one(host, port, body):
    """One streaming completion on its own connection; returns (status, SSE data list)."""
    reader, writer = await asyncio.open_connection(host, port)
    data = json.dumps(body).encode()
    writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}"
                 f"\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                 f"Connection: close\r\n\r\n".encode() + data)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    body_bytes = b""
    while rest:  # de-chunk
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body_bytes += rest[:size]
        rest = rest[size + 2:]
    events = [l[6:] for l in body_bytes.decode().split("\n") if l.startswith("data: ")]
    return status, events


def test_512_concurrent_streams(server, model):
    raise_fd_limit(4096)
    host, port = host_port(server)
    n = 512

    async def run_all():
        bodies = [{"model": model, "prompt": [1, 2 + i % 50, 3], "max_tokens": 8,
                   "ignore_eos": True, "stream": True, "return_token_ids": True,
                   "stream_options": {"include_usage": True}} for i in range(n)]
        return await asyncio.gather(*(stream_one(host, port, b) for b in bodies))

    t = time.time()
    results = asyncio.run(run_all())
    took = time.time() - t
    print(f"{n} concurrent streams of 8 tokens: {took:.2f} s")
    for status, events in results:
        assert status == 200
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        usage = chunks[-1]["usage"]
        assert usage["completion_tokens"] == 8 and usage["prompt_tokens"] == 3
        assert usage["total_tokens"] == 11
        # One chunk per generated token, each with its id; then the finish.
        ids = [c["choices"][0]["token_ids"] for c in chunks[:-1]]
        assert [len(x) for x in ids[:8]] == [1] * 8 and ids[8] == []
        assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert_alive(server, model)


def test_return_token_ids(client, model):
    r = client.completions.create(model=model, prompt="The quick brown fox", max_tokens=6,
                                  temperature=0, extra_body={"return_token_ids": True})
    ids = r.choices[0].model_extra["token_ids"]
    assert len(ids) == r.usage.completion_tokens and all(isinstance(i, int) for i in ids)
    chunks = list(client.completions.create(model=model, prompt="The quick brown fox",
                                            max_tokens=6, temperature=0, stream=True,
                                            extra_body={"return_token_ids": True}))
    streamed = [i for ch in chunks for i in ch.choices[0].model_extra["token_ids"]]
    assert streamed == ids
    plain = client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert "token_ids" not in (plain.choices[0].model_extra or {})


@pytest.fixture(scope="module")
def limited(deepserve, tmp_path_factory):
    log = tmp_path_factory.mktemp("limited") / "server.log"
    proc, base = start_server(deepserve, log, "--max-connections", "40", "--header-timeout", "1",
                              "--idle-timeout", "1", "--body-timeout", "1",
                              "--max-header-bytes", "4096", "--max-body-bytes", "100000",
                              "--max-num-seqs", "1", "--max-waiting-requests", "3")
    yield base
    assert stop_server(proc) == 0, open(log).read()


def read_response(sock):
    data = b""
    while True:
        try:
            got = sock.recv(65536)
        except ConnectionResetError:
            break
        if not got:
            break
        data += got
    return data


def test_limit_oversized_header_is_431(limited):
    r = requests.get(limited + "/health", headers={"X-Big": "a" * 8000}, timeout=10)
    assert r.status_code == 431
    assert r.json()["error"]["message"]
    assert requests.get(limited + "/health", timeout=10).status_code == 200


def test_limit_oversized_body_is_413(limited):
    r = requests.post(limited + "/v1/completions", data=b'{"prompt": "' + b"a" * 200000 + b'"}',
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    # A chunked body over the limit too.
    r = requests.post(limited + "/v1/completions", data=iter([b"a" * 60000] * 3),
                      headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413
    assert requests.get(limited + "/health", timeout=10).status_code == 200


def test_limit_slow_clients_are_dropped(limited):
    host, port = host_port(limited)
    t = time.time()
    s1 = socket.create_connection((host, port), timeout=10)
    s1.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never finishes its header
    s2 = socket.create_connection((host, port), timeout=10)
    s2.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")
    assert read_response(s1) == b"" and read_response(s2) == b""  # closed by the server
    assert time.time() - t < 5
    s1.close()
    s2.close()
    # A kept-alive connection is closed once idle.
    s = requests.Session()
    assert s.get(limited + "/health", timeout=10).status_code == 200
    time.sleep(1.5)
    assert s.get(limited + "/health", timeout=10).status_code == 200  # a fresh connection


def test_limit_max_connections(limited):
    host, port = host_port(limited)
    socks = [socket.create_connection((host, port), timeout=10) for _ in range(40)]
    try:
        time.sleep(0.2)
        extra = socket.create_connection((host, port), timeout=10)
        data = read_response(extra)
        extra.close()
        assert data.startswith(b"HTTP/1.1 503"), data
        assert b"Retry-After: 1" in data and b"too many open connections" in data
    finally:
        for s in socks:
            s.close()
    deadline = time.time() + 5
    while True:  # the server notices the closed ones
        try:
            if requests.get(limited + "/health", timeout=5).status_code == 200:
                break
        except requests.ConnectionError:
            pass
        assert time.time() < deadline
        time.sleep(0.1)


def wait_for(check, timeout, what):
    deadline = time.time() + timeout
    while not check():
        assert time.time() < deadline, what
        time.sleep(0.05)


def test_limit_waiting_queue_is_503(limited):
    def metric(name):
        return requests.get(limited + "/api/v1/metrics", timeout=5).json()[name]

    long = {"prompt": "Tell me a story", "max_tokens": 2000, "ignore_eos": True}
    socks = [raw_request(limited, "/v1/completions", long)]  # runs (one sequence at most)
    try:
        wait_for(lambda: metric("num_requests_running") == 1, 20, "the first one runs")
        socks += [raw_request(limited, "/v1/completions", long) for _ in range(3)]
        wait_for(lambda: metric("num_requests_waiting") == 3, 20, "three wait")
        r = requests.post(limited + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                          timeout=10)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "queue_full"
    finally:
        for s in socks:
            s.close()
    # The hung-up requests are cancelled and the queue empties.
    wait_for(lambda: metric("num_requests_running") + metric("num_requests_waiting") == 0, 20,
             "the queue empties")
    r = requests.post(limited + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                      timeout=30)
    assert r.status_code == 200, r.text


def test_no_tokenizer_streams_token_ids(deepserve, tmp_path):
    """A checkpoint without tokenizer.json: chunks carry token ids, and bench --url times them."""
    src = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "hf" / "llama_gqa_f16"
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for f in src.iterdir():
        if not f.name.startswith("tokenizer"):
            (ckpt / f.name).symlink_to(f)
    proc, base = start_server(deepserve, tmp_path / "server.log", "-m", str(ckpt))
    try:
        r = requests.post(base + "/v1/completions", timeout=60, json={
            "prompt": [1, 2, 3], "max_tokens": 5, "ignore_eos": True, "stream": True})
        events = [l[6:] for l in r.text.splitlines() if l.startswith("data: ")]
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
        assert [len(c["token_ids"]) for c in chunks] == [1] * 5 + [0]
        assert chunks[-1]["finish_reason"] == "length"
        cfg = tmp_path / "bench.yaml"
        cfg.write_text(f"model: {ckpt}\nconcurrency: [2]\ninput_len: 8\noutput_len: 4\n"
                       "num_prompts: 4\n")
        out = tmp_path / "bench.json"
        p = subprocess.run([str(deepserve), "bench", "--config", str(cfg), "--url", base,
                            "--output", str(out)], capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        s = json.loads(out.read_text())["scenarios"][0]
        assert s["failed"] == 0 and s["client_output_tokens"] == s["usage_output_tokens"] == 16
        assert s["tpot_ms"]["p50"] > 0 and s["itl_ms"]["p50"] > 0
    finally:
        assert stop_server(proc) == 0


def test_sigterm_past_drain_timeout_cancels_and_exits(deepserve, tmp_path):
    proc, base = start_server(deepserve, tmp_path / "server.log", "--drain-timeout", "1")
    try:
        sock = raw_request(base, "/v1/completions", {"prompt": "Tell me a story",
                                                     "max_tokens": 3000, "ignore_eos": True,
                                                     "stream": True})
        sock.settimeout(20)
        got = b""
        while b"data: " not in got:  # generating
            got += sock.recv(65536)
        t = time.time()
        assert stop_server(proc, timeout=20) == 0
        assert time.time() - t < 10
        body = got
        while chunk := sock.recv(65536):
            body += chunk
        sock.close()
        assert b'"finish_reason":"cancelled"' in body and b"data: [DONE]" in body
    finally:
        if proc.poll() is None:
            proc.kill()
