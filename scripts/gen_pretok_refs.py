#!/usr/bin/env python3
"""Splits test strings with the pre-tokenizer regexes llama.cpp uses for each `tokenizer.ggml.pre`
(src/llama-vocab.cpp at 0c1e570, `llm_tokenizer_bpe`), run by Python's `regex` module, and writes
crates/tokenizer/testdata/pretok_refs.json. llama.cpp runs the same regexes (hand-written for GPT-2
and Llama 3, std::regex over category-collapsed text for the others), so the words must agree.

Usage: python3 scripts/gen_pretok_refs.py   (needs `pip install regex`; made with regex 2026.x)
Semantics as llama.cpp's `unicode_regex_split`: the regexes apply in order, each to every piece
the previous one left; both matches and the text between matches become pieces.
"""
import json
from pathlib import Path

import regex

ROOT = Path(__file__).resolve().parent.parent
CASES = ROOT / "crates/tokenizer/testdata/trained-gpt2.json"
OUT = ROOT / "crates/tokenizer/testdata/pretok_refs.json"

GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
QWEN2 = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
GPT4O = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
DEEPSEEK3 = "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"

PRE = {
    "gpt-2": [GPT2],
    "llama-bpe": [LLAMA3],
    "qwen2": [QWEN2],
    "smollm": [r"\p{N}", GPT2],
    "deepseek-v3": [r"\p{N}{1,3}", "[一-龥぀-ゟ゠-ヿ]+", DEEPSEEK3],
    "gpt-4o": [GPT4O],
    "default": [r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
}

EXTRA = [
    "I'M HERE, you'Re there; it'S",
    "3.14159 1234567 ٣٤٥ ½",
    "你好世界，日本語のテキストです。カタカナ",
    "ｆｕｌｌ－ｗｉｄｔｈ １２３",
    "hello\r\n\r\n  world\n\t\n",
    "x\u3000y\u2003z \u00a0 w",
    "a---b...c!!!?? $100 +5 <tag> ~x | y ^ z",
    "CamelCaseWord ALLCAPS mixedUP iPhone",
    "Ünïcödé ÀÉÎÕÜ straße",
    "don't\nI'll\tWE'VE",
]


def split(text, regexes):
    pieces = [text]
    for r in regexes:
        rx = regex.compile(r)
        out = []
        for piece in pieces:
            pos = 0
            for m in rx.finditer(piece):
                if m.start() > pos:
                    out.append(piece[pos:m.start()])
                if m.end() > m.start():
                    out.append(m.group())
                pos = m.end()
            if pos < len(piece):
                out.append(piece[pos:])
        pieces = out
    return pieces


def main():
    texts = [c["text"] for c in json.loads(CASES.read_text())["cases"]] + EXTRA
    refs = {pre: [{"text": t, "words": split(t, rs)} for t in texts] for pre, rs in PRE.items()}
    OUT.write_text(json.dumps({"generator": "scripts/gen_pretok_refs.py", "regex": regex.__version__, "pre": refs},
                              ensure_ascii=False, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
