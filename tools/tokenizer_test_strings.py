"""Deterministic test strings for the tokenizer fixtures (see make_tokenizer_fixtures.py).

make_strings() returns the same list on every run: a seeded random generator picks from fixed
samples of many scripts, code, whitespace runs, numbers, contractions, emoji, special-token text
and random codepoints (valid UTF-8 only: no surrogates).
"""
import random

LANGUAGES = {
    "en": [
        "The quick brown fox jumps over the lazy dog.",
        "Hello, world! How are you doing today?",
        "Tokenizers split text into pieces before merging bytes into tokens.",
        "It was the best of times, it was the worst of times.",
        "Please send the report by 5 p.m. on Friday, March 3rd.",
        "She sells sea-shells by the sea-shore; the shells she sells are surely seashells.",
        "A neural network with 135M parameters can run on a laptop.",
        "e-mail me at someone@example.com or visit https://example.org/path?q=1&r=2",
    ],
    "fr": [
        "Le cœur a ses raisons que la raison ne connaît point.",
        "Où est la bibliothèque ? Je voudrais emprunter un livre.",
        "L'été dernier, nous sommes allés à Montréal en août.",
        "Ça va très bien, merci beaucoup ! Et vous ?",
    ],
    "de": [
        "Größenwahn und Übermut führen selten zum Glück.",
        "Die Straße ist heute wegen Bauarbeiten gesperrt.",
        "Donaudampfschifffahrtsgesellschaftskapitän ist ein langes Wort.",
        "Könnten Sie mir bitte die Speisekarte bringen?",
    ],
    "ru": [
        "Съешь же ещё этих мягких французских булок, да выпей чаю.",
        "Москва — столица России, крупнейший город страны.",
        "Я люблю программировать на языке C++ по вечерам.",
    ],
    "el": [
        "Ξεσκεπάζω την ψυχοφθόρα βδελυγμία.",
        "Η γλώσσα μου έδωσαν ελληνική· το σπίτι φτωχικό.",
        "Καλημέρα σας! Τι κάνετε σήμερα;",
    ],
    "ar": [
        "مرحبا بالعالم، كيف حالك اليوم؟",
        "اللغة العربية من أكثر اللغات انتشاراً في العالم.",
        "الرقم ١٢٣٤٥ مكتوب بالأرقام العربية الهندية.",
    ],
    "he": [
        "שלום עולם! מה שלומך היום?",
        "עברית נכתבת מימין לשמאל.",
        "ירושלים היא עיר עתיקה ויפה.",
    ],
    "hi": [
        "नमस्ते दुनिया! आप कैसे हैं?",
        "हिन्दी भारत की राजभाषा है।",
        "मेरा फ़ोन नंबर १२३४५६७८९० है।",
    ],
    "zh": [
        "你好，世界！今天天气很好。",
        "机器学习是人工智能的一个分支。",
        "我们在北京大学学习中文，已经三年了。",
        "繁體中文與簡體中文有許多不同之處。",
    ],
    "ja": [
        "こんにちは、世界！今日はいい天気ですね。",
        "東京タワーは日本の有名な観光地です。",
        "カタカナとひらがなと漢字を混ぜて書きます。",
        "ｶﾀｶﾅ（半角）も使われることがあります。",
    ],
    "ko": [
        "안녕하세요, 세계! 오늘 날씨가 좋네요.",
        "한국어는 한글로 쓰는 언어입니다.",
        "서울특별시는 대한민국의 수도이다.",
    ],
    "th": [
        "สวัสดีชาวโลก วันนี้อากาศดีมาก",
        "ภาษาไทยไม่มีการเว้นวรรคระหว่างคำ",
        "กรุงเทพมหานครเป็นเมืองหลวงของประเทศไทย",
    ],
}

EMOJI = [
    "😀", "😂", "🥲", "🤖", "🚀", "❤️", "✨", "🔥", "👍", "👍🏻", "👍🏽", "👍🏿", "👋🏼",
    "👨‍👩‍👧‍👦", "👩‍💻", "🧑🏾‍🚀", "🏳️‍🌈", "🏴‍☠️", "❤️‍🔥", "🇫🇷", "🇯🇵", "🇺🇸", "1️⃣", "#️⃣",
    "🤷‍♀️", "🙇🏻‍♂️", "🫠", "🪿", "©️", "™", "☕", "⌛",
]

CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "for i in range(10):\n\tprint(f\"{i:03d}\", end='')\n",
    "class Foo(Base):\n    \"\"\"Docstring.\"\"\"\n    x: int = 0\n\n    def __init__(self):\n        super().__init__()\n",
    "#include <vector>\n\nint main() {\n  std::vector<int> v{1, 2, 3};\n  for (auto& x : v) x *= 2;\n  return 0;\n}\n",
    "template <typename T>\nT max(T a, T b) { return a > b ? a : b; }\n",
    "if (ptr != nullptr && ptr->next) { ptr = ptr->next; } // advance\n",
    '{"name": "deepserve", "version": [0, 1, 0], "tags": ["llm", "c++"], "ok": true, "n": null}',
    '{\n  "a": 1,\n  "b": {\n    "c": [1.5e-3, -2, "x\\ny"]\n  }\n}',
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC;",
    "x = [i**2 for i in range(100) if i % 3 == 0]  # squares",
    "std::unique_ptr<Tokenizer> tok = Tokenizer::from_gguf(file);",
    "    return a && b || !c;\r\n}\r\n",
]

CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d"]
CONTRACTION_WORDS = ["it", "don", "they", "we", "I", "you", "she", "he", "can", "won", "John"]

PUNCT = list("!\"#$%&'()*+,-./:;<=>?@[\\]^_`{|}~") + [
    "…", "—", "–", "«", "»", "¿", "¡", "“", "”", "‘", "’", "·", "•", "§", "¶", "†", "‰", "。", "、",
    "！", "？", "【", "】", "«", "‹", "›",
]

SPECIAL_TEXT = [
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<filename>",
    "<gh_stars>", "<jupyter_code>", "<empty_output>", "<|im_start", "|im_end|>", "<|im_start|",
    "<|eot_id|>", "<s>", "</s>", "<|begin_of_text|>", "<｜end▁of▁sentence｜>",
]

SPACES = [" ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2009", "\u200b", "\u2028", "\x0b", "\x0c"]

# Codepoint ranges assigned in Unicode 15.0 / 15.1 (checks the category tables' version).
NEW_RANGES = [(0x11F00, 0x11F59), (0x1E4D0, 0x1E4F9), (0x31350, 0x323AF), (0x2EBF0, 0x2EE5D),
              (0x1F6DC, 0x1F6DC), (0x0CF3, 0x0CF3), (0x1D2C0, 0x1D2D3)]


def _random_codepoint(rng: random.Random) -> str:
    r = rng.random()
    if r < 0.35:
        cp = rng.randrange(0x20, 0x3000)
    elif r < 0.6:
        cp = rng.randrange(0x3000, 0x10000)
    elif r < 0.75:
        lo, hi = rng.choice(NEW_RANGES)
        cp = rng.randint(lo, hi)
    else:
        cp = rng.randrange(0x10000, 0x110000)
    if 0xD800 <= cp <= 0xDFFF:
        cp = 0xFFFD
    return chr(cp)


def _slice(rng: random.Random, s: str) -> str:
    if len(s) < 4 or rng.random() < 0.5:
        return s
    a = rng.randrange(0, len(s) // 2)
    b = rng.randrange(a + 1, len(s) + 1)
    return s[a:b]


def make_strings(seed: int = 20240917) -> list:
    rng = random.Random(seed)
    out = []
    all_sentences = [s for v in LANGUAGES.values() for s in v]

    # Plain sentences in every language, whole and sliced, alone and joined.
    for s in all_sentences:
        out.append(s)
    for _ in range(560):
        lang = rng.choice(list(LANGUAGES))
        parts = [_slice(rng, rng.choice(LANGUAGES[lang])) for _ in range(rng.randint(1, 3))]
        out.append(rng.choice([" ", "", "\n", "  "]).join(parts))
    # Mixed scripts.
    for _ in range(160):
        words = []
        for _ in range(rng.randint(2, 8)):
            sent = rng.choice(all_sentences).split()
            words.append(rng.choice(sent))
        out.append(" ".join(words) if rng.random() < 0.7 else "".join(words))
    # Emoji, with and without text around them.
    for _ in range(160):
        k = rng.randint(1, 6)
        em = "".join(rng.choice(EMOJI) for _ in range(k))
        form = rng.randrange(4)
        if form == 0:
            out.append(em)
        elif form == 1:
            out.append(rng.choice(all_sentences)[:20] + " " + em)
        elif form == 2:
            out.append(em + " " + rng.choice(all_sentences)[:20])
        else:
            out.append(" ".join(rng.choice(EMOJI) for _ in range(k)))
    # Code snippets.
    for s in CODE:
        out.append(s)
    for _ in range(190):
        out.append(_slice(rng, rng.choice(CODE)))
    # Whitespace runs (1..20) of spaces, tabs, newlines, between and around words.
    for n in range(1, 21):
        for ch in [" ", "\t", "\n"]:
            out.append(ch * n)
            out.append("a" + ch * n + "b")
    for _ in range(170):
        run = "".join(rng.choice(SPACES[:4] if rng.random() < 0.7 else SPACES)
                      for _ in range(rng.randint(1, 20)))
        w1 = rng.choice(rng.choice(all_sentences).split())
        w2 = rng.choice(rng.choice(all_sentences).split())
        form = rng.randrange(4)
        out.append([w1 + run + w2, run + w1, w1 + run, run + w1 + run + w2 + run][form])
    # Digits and numbers.
    for n in range(1, 41):
        out.append("".join(rng.choice("0123456789") for _ in range(n)))
    for _ in range(120):
        form = rng.randrange(7)
        if form == 0:
            out.append(f"{rng.uniform(-1e6, 1e6):.{rng.randint(0, 6)}f}")
        elif form == 1:
            out.append(f"{rng.randrange(10**9):,}")
        elif form == 2:
            out.append(f"+1 ({rng.randrange(100, 999)}) {rng.randrange(100, 999)}-{rng.randrange(1000, 9999)}")
        elif form == 3:
            out.append(f"abc{rng.randrange(10**6)}def{rng.randrange(100)}")
        elif form == 4:
            out.append("".join(chr(0x0660 + rng.randrange(10)) for _ in range(rng.randint(1, 8))))
        elif form == 5:
            out.append("".join(chr(0xFF10 + rng.randrange(10)) for _ in range(rng.randint(1, 8))))
        else:
            out.append(f"v{rng.randrange(10)}.{rng.randrange(100)}.{rng.randrange(1000)} in 2024-0{rng.randrange(1, 9)}-1{rng.randrange(10)}")
    # Contractions in various cases.
    for _ in range(160):
        w = rng.choice(CONTRACTION_WORDS)
        c = rng.choice(CONTRACTIONS)
        case = rng.randrange(4)
        if case == 1:
            c = c.upper()
        elif case == 2:
            c = c[:2].upper() + c[2:]
        elif case == 3:
            w = w.upper()
        apo = "’" if rng.random() < 0.15 else "'"
        c = c.replace("'", apo)
        tail = rng.choice(["", " going", " be", "?", ".", " a thing", "s"])
        out.append(w + c + tail)
    # Punctuation.
    for _ in range(100):
        out.append("".join(rng.choice(PUNCT) for _ in range(rng.randint(1, 12))))
    # Special-token text embedded in text.
    for _ in range(160):
        parts = []
        for _ in range(rng.randint(1, 4)):
            parts.append(rng.choice(SPECIAL_TEXT))
            if rng.random() < 0.7:
                parts.append(rng.choice(["user\n", "assistant\n", " hello", "\n", " ", "system\nYou are helpful.", "x"]))
        out.append("".join(parts))
    # Random codepoints.
    for _ in range(220):
        out.append("".join(_random_codepoint(rng) for _ in range(rng.randint(1, 16))))
    # Leading / trailing spaces around earlier strings.
    base = list(out)
    for _ in range(120):
        s = rng.choice(base)
        out.append(rng.choice([" ", "  ", "\n", "\t"]) * rng.randint(0, 2) + s +
                   rng.choice([" ", "  ", "\n"]) * rng.randint(1, 2))
    # Edge cases.
    out += ["", " ", "a", "\n", "  \n", "a" * 300, "9" * 100, "😀" * 30, "aaaa bbbb " * 20,
            "Hello" + "\u0301" * 5, "e\u0301", "ﬁ ligature", "İstanbul ıi", "ǅ ǈ ǋ"]

    seen = set()
    unique = []
    for s in out:
        if s not in seen:
            seen.add(s)
            unique.append(s)
    return unique
