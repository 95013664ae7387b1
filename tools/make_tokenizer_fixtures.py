#!/usr/bin/env python3
"""Makes the tokenizer fixtures in tests/fixtures/tokenizer/ (committed; the C++ tests read them).

  smollm2_llamacpp.jsonl      llama.cpp's ids (llama-cpp-python) for ~2,100 strings on
                              SmolLM2's GGUF, parse_special on for all and off for a subset
  smollm2_pre_llamacpp.jsonl  llama.cpp's ids for a subset with SmolLM2's vocab but other
                              tokenizer.ggml.pre values (gpt-2, llama-bpe, qwen2, deepseek-*, default)
  smollm2_hf.jsonl            HF `tokenizers` ids for the same strings from a tokenizer.json built
                              from the GGUF's vocab and merges (a second, independent reference)
  tiny_bpe/                   a byte-level BPE (vocab 500) trained here with HF `tokenizers`,
                              its tokenizer_config.json, and tiny_bpe_hf.jsonl: its ids for ~300 strings
  chat_templates.jsonl        chat templates rendered with jinja2

Usage (from the repo root):
  /tmp/venvtest/bin/python tools/make_tokenizer_fixtures.py \
      --gguf /path/to/SmolLM2-135M-Instruct.Q4_1.gguf \
      --llamacpp-python /root/.cache/deepserve/refvenv/bin/python [--hf-json-out /tmp/smollm2_tokenizer.json]
The running python needs tokenizers, jinja2 and gguf; the --llamacpp-python one needs llama-cpp-python.
Everything is deterministic: the strings come from tools/tokenizer_test_strings.py (seeded).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT = os.path.join(ROOT, "tests", "fixtures", "tokenizer")
sys.path.insert(0, HERE)

PRE_VARIANTS = ["gpt-2", "llama-bpe", "qwen2", "deepseek-llm", "deepseek-coder", "default"]


def write_jsonl(path, header, rows):
    with open(path, "w", encoding="utf-8") as f:
        if header is not None:
            f.write(json.dumps(header, ensure_ascii=False) + "\n")
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False, separators=(",", ":")) + "\n")
    print(f"wrote {os.path.relpath(path, ROOT)}: {len(rows)} rows, {os.path.getsize(path)} bytes")


# ---- llama.cpp worker (runs under the llama-cpp-python venv) ---------------------------------

def worker(requests_path, results_path):
    import llama_cpp

    with open(requests_path, encoding="utf-8") as f:
        jobs = json.load(f)
    results = {"llama_cpp_python": llama_cpp.__version__, "jobs": []}
    for job in jobs:
        llm = llama_cpp.Llama(model_path=job["model"], vocab_only=True, verbose=False)
        ids = []
        for text, special in job["items"]:
            ids.append(llm.tokenize(text.encode("utf-8"), add_bos=False, special=special) if text else [])
        results["jobs"].append(ids)
        del llm
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


def run_llamacpp(python, jobs):
    with tempfile.TemporaryDirectory() as tmp:
        req = os.path.join(tmp, "req.json")
        res = os.path.join(tmp, "res.json")
        with open(req, "w", encoding="utf-8") as f:
            json.dump(jobs, f)
        subprocess.run([python, os.path.abspath(__file__), "--worker", req, res], check=True)
        with open(res, encoding="utf-8") as f:
            return json.load(f)


# ---- GGUF helpers -----------------------------------------------------------------------------

def read_gguf_vocab(path):
    import gguf

    r = gguf.GGUFReader(path)
    f = r.fields
    return {
        "tokens": list(f["tokenizer.ggml.tokens"].contents()),
        "types": list(f["tokenizer.ggml.token_type"].contents()),
        "merges": list(f["tokenizer.ggml.merges"].contents()),
        "reader": r,
    }


def write_vocab_only_gguf(reader, out_path, pre):
    """Copies every metadata key of `reader` but tokenizer.ggml.pre; no tensors."""
    import gguf

    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(out_path, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        val = pre if name == "tokenizer.ggml.pre" else field.contents()
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, val, vtype, sub)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


# ---- HF tokenizers references -----------------------------------------------------------------

def build_hf_smollm2(vocab):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    v = {t: i for i, t in enumerate(vocab["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in vocab["merges"]]
    tok = Tokenizer(models.BPE(vocab=v, merges=merges))
    # SmolLM2's tokenizer.json: individual digits, then the GPT-2 byte-level regex.
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(vocab["tokens"], vocab["types"]) if ty == 3])
    return tok


TINY_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def build_tiny(strings):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(TINY_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=500, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [s for s in strings if s] * 2
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.add_tokens([AddedToken("[[note]]", special=False, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    return tok


# ---- chat templates ---------------------------------------------------------------------------

DEEPSEEK_V2 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'User: ' + message['content'] + '\\n\\n' }}{% elif message['role'] == 'assistant' %}"
    "{{ 'Assistant: ' + message['content'] + eos_token }}{% elif message['role'] == 'system' %}"
    "{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

DEEPSEEK_V3 = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{% set ns = namespace(system_prompt='', is_first_sp=true) %}{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"
    "{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"
    "{%- else %}{% set ns.system_prompt = ns.system_prompt + '\\n\\n' + message['content'] %}{%- endif %}"
    "{%- endif %}{%- endfor %}{{ bos_token }}{{ ns.system_prompt }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{ '<｜User｜>' + message['content'] }}{%- endif %}"
    "{%- if message['role'] == 'assistant' %}{{ '<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>' }}"
    "{%- endif %}{%- endfor %}{% if add_generation_prompt %}{{ '<｜Assistant｜>' }}{% endif %}")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")

QWEN_LIKE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}{%- for message in messages %}"
    "{%- if not (message.role == 'system' and loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- endif %}{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

CHATML_PLAIN = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the gold?"}],
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"},
     {"role": "user", "content": "And 3+3?\nExplain."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  spaced  "},
     {"role": "assistant", "content": "Ok.\n"}, {"role": "user", "content": "Привет, 世界 👋"}],
    [{"role": "system", "content": "Rule one."}, {"role": "system", "content": "Rule two."},
     {"role": "user", "content": "\t tabs and trailing\n\n"}],
]


def render_chat_templates(smollm2_template):
    import jinja2

    env = jinja2.Environment(trim_blocks=False, lstrip_blocks=False)
    templates = [
        ("smollm2", smollm2_template, "llama", "", "", "ChatML"),
        ("qwen_like", QWEN_LIKE, "qwen2", "", "", "ChatML"),
        ("chatml_plain", CHATML_PLAIN, "llama", "", "", "ChatML"),
        ("deepseek_v2", DEEPSEEK_V2, "deepseek2", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "DeepSeek"),
        ("deepseek_v3", DEEPSEEK_V3, "deepseek2", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "DeepSeek3"),
        ("llama3", LLAMA3, "llama", "<|begin_of_text|>", "<|eot_id|>", "Llama3"),
    ]
    rows = []
    for name, src, arch, bos, eos, kind in templates:
        t = env.from_string(src)
        for conv in CONVERSATIONS:
            for gen in (True, False):
                rendered = t.render(messages=conv, add_generation_prompt=gen, bos_token=bos, eos_token=eos)
                rows.append({"name": name, "template": src, "arch": arch, "bos": bos, "eos": eos,
                             "kind": kind, "messages": conv, "add_generation_prompt": gen,
                             "rendered": rendered})
    return rows


# ---- main -------------------------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--llamacpp-python", default="/root/.cache/deepserve/refvenv/bin/python")
    ap.add_argument("--hf-json-out", default="/tmp/smollm2_tokenizer.json",
                    help="where to save the (uncommitted, ~2 MB) SmolLM2 tokenizer.json")
    args = ap.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if not args.gguf:
        ap.error("--gguf is required")

    from tokenizer_test_strings import make_strings

    strings = make_strings()
    os.makedirs(OUT, exist_ok=True)
    vocab = read_gguf_vocab(args.gguf)
    model_name = os.path.basename(args.gguf)

    # llama.cpp on the real GGUF, and on vocab-only copies with other pre-tokenizers.
    no_special = [s for i, s in enumerate(strings) if "<" in s or i % 5 == 0]
    items = [[s, True] for s in strings] + [[s, False] for s in no_special]
    pre_subset = [s for i, s in enumerate(strings) if i % 7 == 0]
    with tempfile.TemporaryDirectory() as tmp:
        jobs = [{"model": args.gguf, "items": items}]
        for pre in PRE_VARIANTS:
            path = os.path.join(tmp, f"vocab-{pre}.gguf")
            write_vocab_only_gguf(vocab["reader"], path, pre)
            jobs.append({"model": path, "items": [[s, True] for s in pre_subset]})
        res = run_llamacpp(args.llamacpp_python, jobs)
    version = res["llama_cpp_python"]
    header = {"reference": "llama-cpp-python", "llama_cpp_python": version, "model": model_name,
              "add_bos": False}
    write_jsonl(os.path.join(OUT, "smollm2_llamacpp.jsonl"), header,
                [{"text": t, "special": sp, "ids": ids} for (t, sp), ids in zip(items, res["jobs"][0])])
    rows = []
    for pre, ids_list in zip(PRE_VARIANTS, res["jobs"][1:]):
        rows += [{"pre": pre, "text": t, "ids": ids} for t, ids in zip(pre_subset, ids_list)]
    write_jsonl(os.path.join(OUT, "smollm2_pre_llamacpp.jsonl"), header, rows)

    # HF tokenizers on a tokenizer.json rebuilt from the same vocab and merges.
    import tokenizers

    hf = build_hf_smollm2(vocab)
    hf.save(args.hf_json_out)
    print(f"saved {args.hf_json_out} (not committed)")
    hf_ids = [e.ids for e in hf.encode_batch(strings, add_special_tokens=False)]
    llama_special = res["jobs"][0][:len(strings)]
    # Where the two references disagree (HF's regex engine has older Unicode tables), the row
    # says so and the C++ test follows llama.cpp.
    write_jsonl(os.path.join(OUT, "smollm2_hf.jsonl"),
                {"reference": "tokenizers", "tokenizers": tokenizers.__version__, "model": model_name},
                [{"text": t, "special": True, "ids": ids, "agrees_with_llamacpp": ids == ll}
                 for t, ids, ll in zip(strings, hf_ids, llama_special)])
    diff = [s for s, a, b in zip(strings, llama_special, hf_ids) if a != b]
    print(f"llama.cpp vs HF tokenizers: {len(strings) - len(diff)}/{len(strings)} identical")
    for s in diff[:10]:
        print("  differs:", repr(s))

    # A tiny trained tokenizer.json, committed with its reference ids.
    tiny = build_tiny(strings)
    tiny_dir = os.path.join(OUT, "tiny_bpe")
    os.makedirs(tiny_dir, exist_ok=True)
    tiny.save(os.path.join(tiny_dir, "tokenizer.json"))
    config = {"add_bos_token": True, "bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
              "chat_template": CHATML_PLAIN}
    with open(os.path.join(tiny_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    tiny_strings = [s for i, s in enumerate(strings) if i % 7 == 3] + ["hello [[note]] world", "a[[note]]b"]
    rows = []
    for s in tiny_strings:
        rows.append({"text": s, "special": True, "ids": tiny.encode(s, add_special_tokens=False).ids})
    rows.append({"text": "Hi there", "special": True, "add_bos": True,
                 "ids": tiny.encode("Hi there", add_special_tokens=True).ids})
    write_jsonl(os.path.join(OUT, "tiny_bpe_hf.jsonl"),
                {"reference": "tokenizers", "tokenizers": tokenizers.__version__}, rows)

    # Chat templates rendered by jinja2.
    chat = render_chat_templates(vocab["reader"].fields["tokenizer.chat_template"].contents())
    write_jsonl(os.path.join(OUT, "chat_templates.jsonl"), None, chat)


if __name__ == "__main__":
    main()
