#!/usr/bin/env python
"""Golden tokenizer outputs for SmolLM2-135M-Instruct, from HF transformers reading the same GGUF.

Run with the PyTorch reference environment, NOT the jinfer one:

    /tmp/torchenv/bin/python scripts/make_tokenizer_golden.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Writes tests/data/golden/smollm2_tokenizer.json, read by tests/unit/test_tokenizer.py.

Two id references are recorded per text:
  ids           `AutoTokenizer.from_pretrained(dir, gguf_file=...)` exactly as transformers builds it.
  ids_upstream  the same HF tokenizer with the pre-tokenizer that the GGUF's `tokenizer.ggml.pre`
                ("smollm") names: digits split one by one, then the GPT-2 split. This is what llama.cpp
                runs and what SmolLM2's own tokenizer.json has (Digits(individual) + ByteLevel);
                transformers' GGUF converter has no entry for "smollm" and falls back to plain GPT-2,
                which differs only where a run of spaces precedes a digit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import tokenizers
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "tests" / "data" / "golden" / "smollm2_tokenizer.json"
DEFAULT_GGUF = REPO / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "The quick brown fox jumps over the lazy dog.",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "class A:\n\tdef f(self):\n\t\tpass  # tabs\n",
    "你好，世界！今天天气很好。",
    "日本語のテキストと한국어 텍스트",
    "Emoji: 😀 🎉 👍🏽",
    "Family: 👨‍👩‍👧‍👦 and flag 🏳️‍🌈 and 🇫🇷",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnew\n\nlines\r\n  mixed \t \n",
    "Numbers: 1234567, 3.14159, -42, 1e10 and 2024-01-01.",
    "x  1   22    333",
    "I don't think I'll go; we're sure they've been, she'd say it's John's.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after special<repo_name>",
    "Ünïcödé àccents: café, naïve, résumé, Straße, Ångström",
    "Math: ∑ᵢ xᵢ² ≤ ∞ and arrows → ⇒ ↔",
    "URL https://example.com/path?q=1&r=two#frag and email a.b@c.de",
    "MixedCASE camelCase snake_case SCREAMING_CASE kebab-case",
    "",
    " ",
    "\n\n\n",
    'JSON: {"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Tell me a joke about 2 cats."},
    ],
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("gguf", nargs="?", default=str(DEFAULT_GGUF))
    args = ap.parse_args()
    gguf = Path(args.gguf)
    if not gguf.is_file():
        sys.exit(f"GGUF not found: {gguf} (run `make install` first)")

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    upstream = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    upstream.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )

    texts = []
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        ids_upstream = upstream.encode(text, add_special_tokens=False)
        texts.append(
            {
                "text": text,
                "ids": ids,
                "ids_upstream": ids_upstream,
                "decoded": tok.decode(ids, skip_special_tokens=False),
                "decoded_skip_special": tok.decode(ids, skip_special_tokens=True),
            }
        )
        if ids != ids_upstream:
            print(f"transformers' GGUF tokenizer differs from the smollm pre-tokenizer on {text!r}")

    chats = [
        {
            "messages": conv,
            "add_generation_prompt": True,
            "rendered": tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True),
        }
        for conv in CONVERSATIONS
    ]
    golden = {
        "meta": {
            "source": "scripts/make_tokenizer_golden.py",
            "gguf": gguf.name,
            "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__,
            "python": sys.version.split()[0],
        },
        "vocab_size": len(tok),
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
        "texts": texts,
        "chats": chats,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(golden, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {OUT.relative_to(REPO)}: {len(texts)} texts, {len(chats)} chats")


if __name__ == "__main__":
    main()
