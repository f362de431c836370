#!/usr/bin/env python3
"""Regenerates mixed_oracle.json: token ids of mixed texts from llama.cpp's own tokenizer.

Needs llama-cpp-python (pip install llama-cpp-python) and the SmolLM2 GGUF:
    python3 make_oracle.py [model.gguf]
Texts are written here; ids come from llama.cpp (vocab only, no BOS, special tokens parsed).
"ids_by_pre" holds the ids llama.cpp gives when the same vocabulary is declared with another
`tokenizer.ggml.pre` (a metadata-only copy of the GGUF), where they differ from "ids".
"""
import json
import os
import struct
import sys
import tempfile

import llama_cpp
from llama_cpp import Llama

PIECES = {
    "prose": (
        "The quick brown fox jumps over the lazy dog. It's a well-known pangram; "
        "we'll use it, they're sure, and I'M SHOUTING because DON'T and Can't matter. "
        "\u201cSmart quotes\u201d and \u2018single ones\u2019 \u2014 with an em-dash\u2026 and an ellipsis. "
        "Mr. O'Neil's dog's bowl wasn't there; y'all'd've guessed. "
        "Semicolons; colons: commas, periods. Question? Exclamation! (Parentheses) [brackets] {braces}.\n"
    ),
    "code_python": (
        "import os\n\n"
        "@dataclass\n"
        "class Point:\n"
        "    x: float = 0.0\n"
        "    y: float = 0.0\n\n"
        "def fibonacci(n: int) -> int:\n"
        "    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
        "    if n <= 1:\n"
        "        return n  # base case\n"
        "\treturn fibonacci(n - 1) + fibonacci(n - 2)\n\n"
        "print(f\"{fibonacci(10)=}\", end='\\n')\n"
        "x = [i ** 2 for i in range(10) if i % 2 != 0]\n"
    ),
    "code_rust_json": (
        "fn main() -> Result<(), Box<dyn std::error::Error>> {\n"
        "    let v: Vec<u32> = (0..1_000_000).filter(|&x| x & 0x1F == 0).collect();\n"
        "    println!(\"{:?} {}\", &v[..3], 3.14159e-10);\n"
        "    Ok(())\n"
        "}\n"
        "{\"name\": \"npu-serving\", \"version\": \"0.1.0\", \"ports\": [8080, 9090], \"ok\": true, \"null\": null}\n"
    ),
    "digits": (
        "Order #12345 shipped on 2024-11-05 at 09:30; total $1,234.56 (\u2248 \u20ac1.1k), 99.9% uptime, "
        "phone +1 (555) 010-9999. Pi is 3.14159265358979; e is 2.718281828. "
        "Fullwidth \uff11\uff12\uff13, Arabic-Indic \u0663\u0664\u0665, superscript x\u00b2 y\u00b3, "
        "fractions \u00bd \u00be, roman \u2167, 1000000000000 and 007.\n"
    ),
    "cjk": (
        "\u6211\u4eec\u4eca\u5929\u53bb\u516c\u56ed\u6563\u6b65\uff0c\u5929\u6c14\u5f88\u597d\u3002"
        "\u6771\u4eac\u306f\u65e5\u672c\u306e\u9996\u90fd\u3067\u3059\u3002\u30ab\u30bf\u30ab\u30ca\u3001\u3072\u3089\u304c\u306a\u3002"
        "\uc548\ub155\ud558\uc138\uc694, \uc138\uacc4! \u4e2d\u6587 mixed with English \u548c\u6570\u5b57 2024\u5e74\u3002\n"
    ),
    "emoji": (
        "Launch \U0001F680\U0001F680 now! \U0001F44D\U0001F3FD family: "
        "\U0001F468\u200d\U0001F469\u200d\U0001F467\u200d\U0001F466 flags \U0001F1EB\U0001F1F7\U0001F1EF\U0001F1F5 "
        "hearts \u2764\ufe0f \U0001F600\U0001F603 cat\U0001F431dog\U0001F436 \u2728done\u2728\n"
    ),
    "whitespace": (
        "a  b   c\t\td\n\n\n  e \r\n f      \n\t\n   leading and trailing   \n"
        "          ten spaces then x\n"
        "nbsp\u00a0em\u2003ideographic\u3000space\n \n  \n\n\n\n"
    ),
    "accents_scripts": (
        "Cr\u00e8me br\u00fbl\u00e9e, na\u00efve caf\u00e9, S\u00e3o Paulo, Z\u00fcrich, \u00c5ngstr\u00f6m, fa\u00e7ade; "
        "decomposed: e\u0301 a\u0308 n\u0303. Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u. "
        "\u039a\u03b1\u03bb\u03b7\u03bc\u03ad\u03c1\u03b1 \u03ba\u03cc\u03c3\u03bc\u03b5. "
        "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0401\u0436\u0438\u043a. "
        "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645. "
        "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e. "
        "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01.\n"
    ),
    "special_tokens": (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4<|im_end|> partial <|im_start and abc<|endoftext|>def <|im_end|><|im_end|>\n"
    ),
    "repetition": (
        "aaaaaaaaaaaaaaaa bbbbbbbb!!!!!!!!???? ---------- ========== ..........\n"
        "hahahahahahaha lololol zzzzzzzzzzzzzzzzzzzzzzzzz 0000000000 1111 12121212\n"
        "the the the the the, The THE tHe; ThE.\n"
    ),
    "europe_prose": (
        "Der Stra\u00dfenverkehr in M\u00fcnchen ist \u00fcberraschend ruhig, wei\u00dft du? "
        "Les \u00e9l\u00e8ves fran\u00e7ais \u00e9tudient l'histoire et la g\u00e9ographie aujourd'hui. "
        "\u00bfD\u00f3nde est\u00e1 la biblioteca? \u00a1Ma\u00f1ana ser\u00e1 otro d\u00eda! "
        "W \u0141odzi \u017c\u00f3\u0142w \u015bpi. \u00c7a va tr\u00e8s bien, merci. "
        "Il \u00e9tait une fois, dans un pays lointain, une princesse qui aimait les math\u00e9matiques.\n"
    ),
    "log_lines": (
        "2024-11-05T09:30:00.123Z INFO  [engine] step=1042 batch=16 tokens=2048 kv_blocks=311/4096 latency_ms=12.7\n"
        "2024-11-05T09:30:00.140Z WARN  [agent:0] slow step: 41.3ms > 40ms (deadline), retry=1\n"
        "ERROR: failed to open /dev/shm/npu-serving-3f9a: Permission denied (os error 13)\n"
        "    at server::shm::open (server/src/shm.rs:88:17)\n"
        "key_path=model_config.max_generate_length value=-5 allowed=1..=32768\n"
    ),
    "unicode_edges": (
        "unassigned \u0378\u0379 and \U000E0080, line sep\u2028para sep\u2029next line\u0085, "
        "vtab\x0bformfeed\x0c, ogham\u1680space, "
        "combining after space \u0301x, math \U0001D400\U0001D401 \U0001D7CE\U0001D7CF, "
        "CJK number \u3007\u4e00, circled \u2460\u2461, "
        "Devanagari digits \u0967\u0968, Thai digits \u0e51\u0e52, "
        "apostrophes \u2019s it\u2019ll 'S 'LL 'Re, "
        "  '  s, surrogates-free \U0010FFFD, trailing spaces   "
    ),
    "misc": (
        "See https://example.com/path?q=1&r=two#frag or mail me@example.org. "
        "**Markdown** _text_ `code` > quote\n- item\n1. first\n"
        "<div class=\"x\">&amp; &lt;tag&gt;</div> "
        "\u2211_{i=1}^{n} i\u00b2 = n(n+1)/2, \u00a9\u00ae\u2122 \u00a7\u00b6 \u2190\u2192 \u2264\u2265 \u221e "
        "zero\u200bwidth \ufeffbom private\ue000use tab\there.\n"
    ),
}


OTHER_PRES = ["gpt-2", "default", "llama-bpe", "qwen2"]
SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}


def read_metadata(path):
    """(key, type, value) of every metadata entry of a GGUF file."""
    with open(path, "rb") as f:
        data = f.read(64 << 20)
    pos = 0

    def take(fmt):
        nonlocal pos
        v = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return v[0]

    def string():
        nonlocal pos
        n = take("Q")
        pos += n
        return data[pos - n:pos]

    def value(t):
        if t == 8:
            return string()
        if t == 9:
            et = take("I")
            return (et, [value(et) for _ in range(take("Q"))])
        return take(SCALARS[t])

    assert data[:4] == b"GGUF"
    pos = 4
    take("I")
    take("Q")
    out = []
    for _ in range(take("Q")):
        key = string().decode()
        t = take("I")
        out.append((key, t, value(t)))
    return out


def encode_value(t, v):
    if t == 8:
        return struct.pack("<Q", len(v)) + v
    if t == 9:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(encode_value(et, x) for x in items)
    return struct.pack("<" + SCALARS[t], v)


def write_metadata_only(path, metadata, pre):
    """A GGUF with the same metadata (tokenizer.ggml.pre replaced) and no tensors."""
    parts = [b"GGUF", struct.pack("<IQQ", 3, 0, len(metadata))]
    for key, t, v in metadata:
        if key == "tokenizer.ggml.pre":
            v = pre.encode()
        kb = key.encode()
        parts.append(struct.pack("<Q", len(kb)) + kb + struct.pack("<I", t) + encode_value(t, v))
    with open(path, "wb") as f:
        f.write(b"".join(parts))


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser(
        "~/.cache/npu-serving/models/SmolLM2-135M-Instruct.Q4_1.gguf")
    llm = Llama(model_path=model, vocab_only=True, verbose=False)
    cases = []
    for name, text in PIECES.items():
        data = text.encode("utf-8")
        case = {
            "name": name,
            "text": text,
            "ids": llm.tokenize(data, add_bos=False, special=True),
        }
        if "<|" in text:
            case["ids_no_special"] = llm.tokenize(data, add_bos=False, special=False)
        case["ids_by_pre"] = {}
        cases.append(case)
    metadata = read_metadata(model)
    with tempfile.TemporaryDirectory() as tmp:
        for pre in OTHER_PRES:
            variant = os.path.join(tmp, pre + ".gguf")
            write_metadata_only(variant, metadata, pre)
            other = Llama(model_path=variant, vocab_only=True, verbose=False)
            for case in cases:
                ids = other.tokenize(case["text"].encode("utf-8"), add_bos=False, special=True)
                if ids != case["ids"]:
                    case["ids_by_pre"][pre] = ids
            del other
    out = {
        "source": "llama.cpp tokenizer via llama-cpp-python %s, vocab_only, add_bos=False"
                  % llama_cpp.__version__,
        "model": os.path.basename(model),
        "other_pres": OTHER_PRES,
        "cases": cases,
    }
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mixed_oracle.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True, indent=None, separators=(",", ":"))
        f.write("\n")
    total = sum(len(p.encode()) for p in PIECES.values())
    print("wrote", path, "pieces:", len(cases), "text bytes:", total)


if __name__ == "__main__":
    main()
