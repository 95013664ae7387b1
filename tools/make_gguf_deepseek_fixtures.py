#!/usr/bin/env python3
"""DeepSeek-V2 GGUF fixtures made by llama.cpp's own converter, plus llama.cpp's logits.

Converts tiny Hugging Face DeepSeek-V2 checkpoints from tests/fixtures/hf/ with the
convert_hf_to_gguf.py that llama-cpp-python's sdist vendors (llama.cpp's `deepseek2`
architecture: split attn_k_b / attn_v_b, stacked ffn_*_exps, ffn_*_shexp) and writes
tests/fixtures/gguf_deepseek/<name>.gguf. Then, where llama.cpp accepts the shapes, it runs
the GGUF in llama-cpp-python and writes <name>.llamacpp.json: the prompt's token ids, the
prefill logits of every position and a greedy continuation (argmax, one eval per token).
For the F16 conversion of an F32 checkpoint it also writes <name>.transformers.json:
transformers' logits and greedy continuations on the weights rounded as the GGUF holds them.
llama.cpp runs an F32 conversion of the same checkpoint (written to --scratch, not kept):
its CPU matmuls round activations to BF16 when the weights are BF16, which would cost the
reference a digit.

The fixtures' tokenizers are tiny byte-level BPEs whose pre-tokenizer hash llama.cpp does not
know; they use GPT-2's split regex, so the converter is told "gpt-2" (what its hash table
would say for that regex).

  # both steps (each re-runs this script in the right venv):
  python3 tools/make_gguf_deepseek_fixtures.py --llama-cpp /tmp/lcp/.../vendor/llama.cpp
  # or one at a time:
  $HFPY  tools/make_gguf_deepseek_fixtures.py convert   --llama-cpp DIR
  $REFPY tools/make_gguf_deepseek_fixtures.py reference

HFPY: a venv with torch + transformers + gguf (pip install DIR/gguf-py);
REFPY: a venv with llama-cpp-python (tools/setup_reference.sh). Getting the vendored
llama.cpp: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36, untar.
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HF_DIR = REPO / "tests" / "fixtures" / "hf"
OUT_DIR = REPO / "tests" / "fixtures" / "gguf_deepseek"
SCRATCH = Path("/tmp/gguf_deepseek_ref")
HFPY = "/root/.cache/deepserve/hfvenv/bin/python"
REFPY = "/root/.cache/deepserve/refvenv/bin/python"

# name -> (hf fixture, converter outtype). The BF16 checkpoint converts losslessly to BF16;
# the F32 one goes to F16 to keep the fixtures small (the test allows for that rounding).
FIXTURES = {
    "deepseek_v2_qlora_bf16": ("deepseek_v2_qlora_bf16", "bf16"),
    "deepseek_v2_yarn_grouped_f16": ("deepseek_v2_yarn_grouped_f32", "f16"),
}
# llama.cpp's deepseek2 loader needs q_lora_rank unless the model has V2-Lite's 26/27 layers,
# so the checkpoint without q LoRA only gets the safetensors comparison.
LLAMACPP_REFERENCE = ["deepseek_v2_qlora_bf16"]
PROMPT_TEXT_IDS = [17, 301, 44, 250, 99, 7, 408, 120, 65, 333, 12, 201]  # any ids < vocab - 3
GEN_TOKENS = 16


def convert(llama_cpp: Path, scratch: Path) -> None:
    sys.path.insert(0, str(llama_cpp / "gguf-py"))
    sys.path.insert(0, str(llama_cpp))
    import convert_hf_to_gguf  # noqa: E402  (the vendored converter)
    from conversion import base  # noqa: E402

    base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    scratch.mkdir(parents=True, exist_ok=True)
    jobs = [(OUT_DIR / f"{name}.gguf", src, outtype) for name, (src, outtype) in FIXTURES.items()]
    jobs += [(scratch / f"{name}.f32.gguf", FIXTURES[name][0], "f32") for name in LLAMACPP_REFERENCE]
    for out, src, outtype in jobs:
        sys.argv = ["convert_hf_to_gguf.py", str(HF_DIR / src), "--outtype", outtype,
                    "--outfile", str(out)]
        convert_hf_to_gguf.main()
        print(f"wrote {out} ({out.stat().st_size} bytes)")
    for name, (src, outtype) in FIXTURES.items():
        if outtype == "f16":
            rounded_reference(name, src)


def rounded_reference(name: str, src: str) -> None:
    """transformers on the weights the F16 GGUF holds: every matrix rounded to F16 except the
    router (mlp.gate), which the converter keeps in F32 like the 1-D norms."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(HF_DIR / src, dtype=torch.float32).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() >= 2 and not pname.endswith("mlp.gate.weight"):
                p.copy_(p.to(torch.float16).to(torch.float32))
    ref = json.loads((HF_DIR / src / "reference.json").read_text())
    prompts = []
    with torch.no_grad():
        for pr in ref["prompts"]:
            ids = list(pr["ids"])
            logits = model(torch.tensor([ids])).logits[0].double()
            seq, generated = list(ids), []
            for _ in range(GEN_TOKENS):  # full forward per step, argmax (lowest id on ties)
                last = model(torch.tensor([seq])).logits[0, -1]
                tok = int(torch.argmax(last))
                generated.append(tok)
                seq.append(tok)
            prompts.append({
                "ids": ids,
                "logits": [[round(float(v), 5) for v in row] for row in logits],
                "generated_ids": generated,
            })
    doc = {
        "gguf": f"{name}.gguf",
        "reference": "transformers float32 forward of the Hugging Face checkpoint with its "
                     "matrices rounded to F16 as the GGUF stores them (router and norms F32)",
        "prompts": prompts,
    }
    out = OUT_DIR / f"{name}.transformers.json"
    out.write_text(json.dumps(doc) + "\n")
    print(f"wrote {out}")


def reference(scratch: Path) -> None:
    import numpy as np
    from llama_cpp import Llama

    for name in LLAMACPP_REFERENCE:
        path = scratch / f"{name}.f32.gguf"
        llm = Llama(model_path=str(path), n_ctx=64, n_batch=64, logits_all=True, n_threads=2,
                    verbose=False)
        bos = llm.token_bos()
        ids = [bos] + PROMPT_TEXT_IDS
        llm.reset()
        llm.eval(ids)
        logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
        generated = []
        last = logits[-1]
        for _ in range(GEN_TOKENS):
            tok = int(np.argmax(last))
            generated.append(tok)
            llm.eval([tok])
            last = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float64)
        top2 = np.sort(logits, axis=1)[:, -2:]
        doc = {
            "gguf": f"{name}.gguf",
            "reference": "llama-cpp-python (vendored llama.cpp) CPU on an F32 conversion of the "
                         "same checkpoint, logits_all, one eval of the prompt, then one eval per "
                         "greedy token",
            "llama_cpp_python": __import__("llama_cpp").__version__,
            "ids": ids,
            "logits": [[round(float(v), 6) for v in row] for row in logits],
            "top2_margin": [round(float(r[1] - r[0]), 6) for r in top2],
            "generated_ids": generated,
        }
        out = OUT_DIR / f"{name}.llamacpp.json"
        out.write_text(json.dumps(doc) + "\n")
        print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("step", nargs="?", choices=["convert", "reference", "all"], default="all")
    ap.add_argument("--llama-cpp", type=Path, default=os.environ.get("LLAMA_CPP_DIR"),
                    help="the vendored llama.cpp source tree (convert_hf_to_gguf.py, gguf-py)")
    ap.add_argument("--scratch", type=Path, default=SCRATCH,
                    help="where the F32 conversions for llama.cpp go")
    ap.add_argument("--hf-python", default=HFPY)
    ap.add_argument("--ref-python", default=REFPY)
    args = ap.parse_args()
    if args.step in ("convert", "all") and not args.llama_cpp:
        ap.error("--llama-cpp (or LLAMA_CPP_DIR) is needed to convert")
    if args.step == "convert":
        convert(args.llama_cpp, args.scratch)
    elif args.step == "reference":
        reference(args.scratch)
    else:
        me = str(Path(__file__).resolve())
        subprocess.run([args.hf_python, me, "convert", "--llama-cpp", str(args.llama_cpp),
                        "--scratch", str(args.scratch)], check=True)
        subprocess.run([args.ref_python, me, "reference", "--scratch", str(args.scratch)],
                       check=True)


if __name__ == "__main__":
    main()
