#!/usr/bin/env python3
"""Writes tests/fixtures/quants/*.json: GGML blocks with their values decoded by gguf-py.

An independent reference for deepserve's block formats (src/backend/cpu/quants.cpp):
  - every type: random blocks and gguf.quants.dequantize of them (F32),
  - types gguf-py can quantize (Q4_0, Q4_1, Q8_0, BF16): the F32 source row and the bytes
    gguf.quants.quantize makes of it.
Byte strings are hex (little-endian), F32 arrays hex of their IEEE bits: exact round trips.

With --ggml-cpu PATH (llama.cpp's libggml-cpu.so, e.g. from the reference venv that
tools/setup_reference.sh builds natively on an AVX-512 x86 machine) it also writes
llamacpp_q8_dots.json: activation rows, the Q8_0 / Q8_1 blocks llama.cpp's own
quantize_row_q8_0 / q8_1 make of them, and its vec_dot results against Q4_0 / Q4_1 / Q8_0
weight rows. deepserve's Q8 activation mode must reproduce those bits.

Usage: python tools/make_quant_fixtures.py [--out tests/fixtures/quants] [--ggml-cpu PATH]
"""
import argparse
import ctypes
import json
import pathlib

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants
from gguf.constants import GGML_QUANT_SIZES

# Offsets of the fp16 scale fields in each block: random bytes there could be inf/NaN.
FP16_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
QUANTIZABLE = [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.BF16]


def hexf(a: np.ndarray) -> str:
    return np.ascontiguousarray(a, dtype="<f4").tobytes().hex()


def random_blocks(rng: np.random.Generator, t: Q, n_blocks: int) -> np.ndarray:
    block, size = GGML_QUANT_SIZES[t]
    raw = rng.integers(0, 256, size=(n_blocks, size), dtype=np.uint8)
    for off in FP16_FIELDS[t]:
        scale = rng.uniform(-0.05, 0.05, size=n_blocks).astype(np.float16)
        raw[:, off:off + 2] = scale.view(np.uint8).reshape(n_blocks, 2)
    return raw


def source_row(rng: np.random.Generator, n: int) -> np.ndarray:
    x = rng.normal(0, 1, size=n).astype(np.float32)
    x[:32] = 0.0                                   # an all-zero block (d = 0)
    x[32:64] = np.linspace(-4, 4, 32)              # exact ties after scaling
    x[64:96] = -np.abs(x[64:96])                   # all negative
    x[96:128] *= 1e-6                              # tiny values
    x[128] = 1000.0                                # one outlier in a block
    return x


def llamacpp_dots(lib_path: str, rng: np.random.Generator) -> dict:
    """Runs llama.cpp's CPU quantizers and dot products through ctypes."""
    lib = ctypes.CDLL(lib_path)
    lib.ggml_cpu_init()  # fills the fp16 tables the dot products read
    k, m, n = 576, 4, 6
    x = rng.normal(0, 1, size=(m, k)).astype(np.float32)
    x[0, :32] = 0.0                                             # an all-zero block
    x[0, 32:64] = np.arange(32, dtype=np.float32) - 15.5        # amax 127 below: exact ties
    x[0, 32] = 127.0
    x[1] *= 0.01
    x[2, 100] = 40.0                                            # an outlier
    x = np.ascontiguousarray(x)
    vp = ctypes.c_void_p
    case = {"k": k, "m": m, "n": n, "x": hexf(x.reshape(-1)), "types": []}
    for act, quantize in ((Q.Q8_0, lib.quantize_row_q8_0), (Q.Q8_1, lib.quantize_row_q8_1)):
        quantize.argtypes = [vp, vp, ctypes.c_int64]
        rows = []
        for i in range(m):
            buf = np.zeros(k // 32 * GGML_QUANT_SIZES[act][1], dtype=np.uint8)
            quantize(x[i].ctypes.data, buf.ctypes.data, k)
            rows.append(buf)
        case[act.name.lower()] = [r.tobytes().hex() for r in rows]
        if act == Q.Q8_0:
            q8_0_rows = rows
        else:
            q8_1_rows = rows
    for t in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        w = quants.quantize(rng.normal(0, 0.05, size=(n, k)).astype(np.float32), t)
        act_rows = q8_1_rows if t == Q.Q4_1 else q8_0_rows
        dot = getattr(lib, f"ggml_vec_dot_{t.name.lower()}_{'q8_1' if t == Q.Q4_1 else 'q8_0'}")
        dot.argtypes = [ctypes.c_int, vp, ctypes.c_size_t, vp, ctypes.c_size_t, vp,
                        ctypes.c_size_t, ctypes.c_int]
        out = np.zeros((m, n), dtype=np.float32)
        for i in range(m):
            for j in range(n):
                wr = np.ascontiguousarray(w[j])
                res = ctypes.c_float()
                dot(k, ctypes.byref(res), 0, wr.ctypes.data, 0, act_rows[i].ctypes.data, 0, 1)
                out[i, j] = res.value
        case["types"].append({"type": t.name, "weights": w.tobytes().hex(),
                              "dots": hexf(out.reshape(-1))})
    return case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(pathlib.Path(__file__).resolve().parent.parent /
                                         "tests/fixtures/quants"))
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--ggml-cpu", help="llama.cpp's libggml-cpu.so for llamacpp_q8_dots.json")
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)

    for t, blocks in FP16_FIELDS.items():
        block, _ = GGML_QUANT_SIZES[t]
        n_blocks = 8 if block == 32 else 3
        raw = random_blocks(rng, t, n_blocks)
        deq = quants.dequantize(raw.reshape(1, -1), t).reshape(-1)
        case = {"type": t.name, "n": int(n_blocks * block), "blocks": raw.tobytes().hex(),
                "dequantized": hexf(deq)}
        (out / f"{t.name.lower()}.json").write_text(json.dumps(case, indent=1) + "\n")

    for t in QUANTIZABLE:
        n = 256
        x = source_row(rng, n)
        q = quants.quantize(x.reshape(1, -1), t).reshape(-1)
        deq = quants.dequantize(q.reshape(1, -1), t).reshape(-1)
        case = {"type": t.name, "n": n, "source": hexf(x), "quantized": q.tobytes().hex(),
                "dequantized": hexf(deq)}
        (out / f"{t.name.lower()}_quantize.json").write_text(json.dumps(case, indent=1) + "\n")
    if args.ggml_cpu:
        case = llamacpp_dots(args.ggml_cpu, np.random.default_rng(args.seed + 1))
        (out / "llamacpp_q8_dots.json").write_text(json.dumps(case, indent=1) + "\n")
    print(f"wrote fixtures to {out}")


if __name__ == "__main__":
    main()
