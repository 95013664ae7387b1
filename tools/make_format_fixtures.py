#!/usr/bin/env python3
"""Writes the small GGUF / safetensors fixtures and fuzz seeds with independent writers.

The files come from gguf-py (llama.cpp's Python writer) and the `safetensors` package, so the
C++ readers are tested against files they did not write themselves. Reruns give the same files
except that `safetensors` may order __metadata__ keys differently.

Usage: python tools/make_format_fixtures.py [--model SmolLM2.gguf]
Needs: pip install gguf numpy safetensors
With --model it also writes tests/fixtures/formats/smollm2_tensors.json, the tensor table of
the real model as gguf-py reads it.
"""
import argparse
import json
import os
import struct
from pathlib import Path

import numpy as np
import gguf
from gguf import GGUFValueType as VT
from safetensors.numpy import save_file

ROOT = Path(__file__).resolve().parent.parent
FIX = ROOT / "tests" / "fixtures" / "formats"
CORPUS = ROOT / "tests" / "fuzz" / "corpus"


def write_gguf(path, build, alignment=None):
    w = gguf.GGUFWriter(str(path), arch="test")
    if alignment is not None:
        w.add_custom_alignment(alignment)
    build(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def q8_0_rows(rows):
    """Q8_0 blocks: fp16 scale then 32 int8 quants; row r has scale r+1 and quants 0..31 - 16."""
    out = bytearray()
    for r in range(rows):
        out += np.float16(r + 1).tobytes()
        out += (np.arange(32, dtype=np.int8) - 16).tobytes()
    return np.frombuffer(bytes(out), dtype=np.uint8).reshape(rows, 34)


def all_types(w):
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -100)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "h\u00e9llo")
    w.add_uint64("t.u64", 2**63 + 5)
    w.add_int64("t.i64", -(2**62))
    w.add_float64("t.f64", -2.25e300)
    w.add_key_value("t.arr_u8", [1, 2, 255], VT.ARRAY, sub_type=VT.UINT8)
    w.add_key_value("t.arr_i16", [-1, 2, -3], VT.ARRAY, sub_type=VT.INT16)
    w.add_key_value("t.arr_u64", [2**64 - 1, 0], VT.ARRAY, sub_type=VT.UINT64)
    w.add_key_value("t.arr_f64", [0.5, -1.0], VT.ARRAY, sub_type=VT.FLOAT64)
    w.add_array("t.arr_i32", [7, -8, 9])
    w.add_array("t.arr_f32", [0.25, 4.0])
    w.add_array("t.arr_bool", [True, False, True])
    w.add_array("t.arr_str", ["a", "", "ccc"])
    w.add_array("t.arr_nested", [[1, 2], [3]])
    w.add_tensor("f32.weight", np.arange(6, dtype=np.float32).reshape(2, 3))
    w.add_tensor("f16.weight", np.array([1.0, -2.0, 0.5, 65504.0], dtype=np.float16))
    w.add_tensor("q8.weight", q8_0_rows(2), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("i32.t", np.array([[1, -2, 3]], dtype=np.int32))


def tiny(w):
    w.add_uint32("tiny.n", 3)
    w.add_string("tiny.s", "ab")
    w.add_array("tiny.a", ["x", "yz"])
    w.add_tensor("a", np.array([1.0, 2.0], dtype=np.float32))
    w.add_tensor("b", np.array([[1, 2], [3, 4]], dtype=np.int8))


def tiny_quant(w):
    w.add_array("nest", [[1], [2, 3]])
    w.add_bool("flag", False)
    w.add_tensor("q", q8_0_rows(1), raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def as_v2(path):
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    path.write_bytes(bytes(data))


def write_safetensors_fixtures():
    tensors = {
        "f32": np.arange(6, dtype=np.float32).reshape(2, 3),
        "f16": np.array([1.0, -2.0, 0.5, 65504.0], dtype=np.float16),
        "f64": np.array([3.25], dtype=np.float64),
        "i64": np.array([-5, 2**40], dtype=np.int64),
        "i32": np.array([[1], [2]], dtype=np.int32),
        "i16": np.array([-7], dtype=np.int16),
        "i8": np.array([-1, 1], dtype=np.int8),
        "u8": np.array([0, 128, 255], dtype=np.uint8),
        "bool": np.array([True, False, True]),
        "scalar": np.array(2.5, dtype=np.float32),
        "empty": np.zeros((0, 4), dtype=np.float32),
        "cube": np.arange(24, dtype=np.float32).reshape(2, 3, 4),
    }
    save_file(tensors, str(FIX / "numpy.safetensors"), metadata={"format": "np", "note": "fixture"})

    shard_dir = FIX / "sharded"
    shard_dir.mkdir(parents=True, exist_ok=True)
    parts = {
        "model-00001-of-00002.safetensors": {"a.weight": np.ones((2, 2), dtype=np.float32)},
        "model-00002-of-00002.safetensors": {
            "b.weight": np.full((3,), 2.0, dtype=np.float16),
            "c.bias": np.array([9], dtype=np.int64),
        },
    }
    weight_map = {}
    total = 0
    for shard, ts in parts.items():
        save_file(ts, str(shard_dir / shard))
        for name, t in ts.items():
            weight_map[name] = shard
            total += t.nbytes
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")

    out = CORPUS / "safetensors"
    out.mkdir(parents=True, exist_ok=True)
    save_file({"x": np.array([1, 2], dtype=np.int8)}, str(out / "tiny.safetensors"))
    save_file({"w": np.ones((2, 2), dtype=np.float16), "b": np.zeros((2,), dtype=np.float32)},
              str(out / "two.safetensors"), metadata={"format": "pt"})
    save_file({"s": np.array(1.0, dtype=np.float64), "e": np.zeros((0,), dtype=np.uint8)},
              str(out / "scalar_empty.safetensors"))
    header = b"{}"
    (out / "empty.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)


def write_smollm2_table(model):
    r = gguf.GGUFReader(model)
    table = {
        "version": 3,
        "tensor_count": len(r.tensors),
        "kv_count": len(r.fields) - 3,  # GGUFReader also lists the header fields
        "alignment": r.alignment,
        "data_offset": r.data_offset,
        "tensors": [
            {"name": t.name, "ggml_type": int(t.tensor_type), "ne": [int(x) for x in t.shape],
             "offset": int(t.data_offset), "nbytes": int(t.n_bytes)}
            for t in r.tensors
        ],
    }
    (FIX / "smollm2_tensors.json").write_text(json.dumps(table, separators=(",", ":")) + "\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="SmolLM2-135M-Instruct.Q4_1.gguf, for smollm2_tensors.json")
    args = ap.parse_args()
    FIX.mkdir(parents=True, exist_ok=True)
    write_gguf(FIX / "gguf_py_all_types.gguf", all_types, alignment=64)

    out = CORPUS / "gguf"
    out.mkdir(parents=True, exist_ok=True)
    write_gguf(out / "tiny_v3.gguf", tiny)
    write_gguf(out / "tiny_v2.gguf", tiny)
    as_v2(out / "tiny_v2.gguf")
    write_gguf(out / "tiny_align8.gguf", tiny_quant, alignment=8)
    write_gguf(out / "no_tensors.gguf", lambda w: w.add_string("general.name", "n"))

    write_safetensors_fixtures()
    if args.model:
        write_smollm2_table(args.model)
    for p in sorted(list(FIX.rglob("*")) + list(CORPUS.rglob("*"))):
        if p.is_file():
            print(f"{p.relative_to(ROOT)}: {p.stat().st_size} bytes")


if __name__ == "__main__":
    main()
