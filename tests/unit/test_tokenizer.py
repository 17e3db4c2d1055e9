"""jinfer.tokenizer against HF transformers' golden outputs (scripts/make_tokenizer_golden.py) for the
SmolLM2 GGUF, plus synthetic vocabularies for the paths that file does not exercise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from jinfer.tokenizer import IncrementalDetokenizer, Tokenizer, _byte_alphabet
from jinfer.weights.loader import default_model_path

REPO = Path(__file__).resolve().parents[2]
GGUF = default_model_path()
GOLDEN = json.loads((REPO / "tests/data/golden/smollm2_tokenizer.json").read_text(encoding="utf-8"))
TEXTS = GOLDEN["texts"]
IDS = [f"text{i}" for i in range(len(TEXTS))]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    if not GGUF.is_file():
        pytest.skip(f"default model GGUF not found at {GGUF} (run `make install`)")
    return Tokenizer.from_pretrained(GGUF)


# ---- SmolLM2 GGUF vs HF golden ---------------------------------------------------------------------


def test_special_ids_and_vocab(tok: Tokenizer) -> None:
    assert tok.vocab_size == GOLDEN["vocab_size"] == 49152
    assert tok.bos_token_id == GOLDEN["bos_token_id"] == 1
    # eos first; <|endoftext|> is also end-of-generation (llama.cpp's EOG list)
    assert tok.eos_token_ids == (GOLDEN["eos_token_id"], 0)
    assert tok.add_bos is False
    assert tok.token_to_id("<|im_start|>") == 1 and tok.id_to_token(2) == "<|im_end|>"
    assert tok.special_token_ids == frozenset(range(17))


@pytest.mark.parametrize("case", TEXTS, ids=IDS)
def test_encode_matches_hf(tok: Tokenizer, case: dict) -> None:
    ids = tok.encode(case["text"], add_special_tokens=False)
    # ids_upstream: HF with the smollm pre-tokenizer (digits split first, as llama.cpp and SmolLM2's own
    # tokenizer.json do); transformers' GGUF loader uses plain GPT-2 splitting and differs only when a
    # run of spaces precedes a digit (pinned by the next test).
    assert ids == case["ids_upstream"]
    assert tok.encode(case["text"]) == ids  # SmolLM2 asks for no BOS


def test_known_divergence_from_transformers_gguf_loader() -> None:
    # every other text matches transformers' GGUF tokenizer exactly
    differ = [c["text"] for c in TEXTS if c["ids"] != c["ids_upstream"]]
    assert differ == ["x  1   22    333"]


@pytest.mark.parametrize("case", TEXTS, ids=IDS)
def test_decode_matches_hf(tok: Tokenizer, case: dict) -> None:
    assert tok.decode(case["ids_upstream"], skip_special_tokens=False) == case["decoded"] == case["text"]
    assert tok.decode(case["ids_upstream"]) == case["decoded_skip_special"]


@pytest.mark.parametrize("chat", GOLDEN["chats"], ids=["no_system", "with_system"])
def test_chat_template_matches_hf(tok: Tokenizer, chat: dict) -> None:
    assert tok.apply_chat_template(chat["messages"], add_generation_prompt=True) == chat["rendered"]


def test_chat_template_without_generation_prompt(tok: Tokenizer) -> None:
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert out.endswith("<|im_start|>user\nhi<|im_end|>\n")


@pytest.mark.parametrize(
    "messages, field",
    [
        ("hello", "messages"),
        ([], "messages"),
        (["hello"], "messages[0]"),
        ([{"content": "x"}], "messages[0].role"),
        ([{"role": 3, "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": "x"}, {"role": "user"}], "messages[1].content"),
        ([{"role": "user", "content": ["x"]}], "messages[0].content"),
    ],
)
def test_bad_messages_raise(tok: Tokenizer, messages: object, field: str) -> None:
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        tok.apply_chat_template(messages)  # type: ignore[arg-type]


def test_template_raise_exception_and_tojson(tok: Tokenizer) -> None:
    t = Tokenizer(
        tok.backend, bos_token_id=1, eos_token_ids=[2], chat_template="{{ tools | tojson }}{{ bos_token }}"
    )
    assert (
        t.apply_chat_template([{"role": "user", "content": "x"}], tools=[{"n": "é<>"}])
        == '[{"n": "é<>"}]<|im_start|>'
    )
    t.chat_template = "{{ raise_exception('no system role') }}"
    with pytest.raises(ValueError, match="chat template error: no system role"):
        t.apply_chat_template([{"role": "user", "content": "x"}])
    t.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "x"}])


# ---- incremental detokenization ------------------------------------------------------------------------


def _stream(tok: Tokenizer, ids: list[int], **kw) -> tuple[list[str], IncrementalDetokenizer]:
    det = IncrementalDetokenizer(tok, **kw)
    deltas = [det.add(i) for i in ids]
    deltas.append(det.flush())
    return deltas, det


@pytest.mark.parametrize("case", TEXTS, ids=IDS)
def test_incremental_equals_full_decode(tok: Tokenizer, case: dict) -> None:
    ids = case["ids_upstream"]
    for skip in (True, False):
        deltas, det = _stream(tok, ids, skip_special_tokens=skip)
        assert "".join(deltas) == det.text == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in d for d in deltas)


def test_incremental_emoji_bytes_one_at_a_time(tok: Tokenizer) -> None:
    text = "a 👨‍👩‍👧 b 🏳️‍🌈!"
    byte_ids = [tok.token_to_id(_byte_alphabet()[b]) for b in text.encode()]
    assert None not in byte_ids
    deltas, det = _stream(tok, byte_ids)
    assert det.text == text and not any("\ufffd" in d for d in deltas)
    # a 4-byte emoji appears whole on its last byte, never before
    assert deltas[2:7] == ["", "", "", "👨", ""]


def test_incremental_holds_back_then_flushes_incomplete_char(tok: Tokenizer) -> None:
    ids = tok.encode("ok ") + [tok.token_to_id(_byte_alphabet()[b]) for b in "😀".encode()[:2]]
    deltas, det = _stream(tok, ids)
    assert deltas[:-1] == ["ok", " ", "", ""] and deltas[-1] == "\ufffd"
    assert det.text == tok.decode(ids)


def test_incremental_with_prompt_context(tok: Tokenizer) -> None:
    prompt = tok.encode("<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n")
    gen = tok.encode(" Hello there, 你好 👋<|im_end|>")
    deltas, det = _stream(tok, gen, prompt_ids=prompt)
    assert det.text == tok.decode(gen) == " Hello there, 你好 👋"
    # emitted as soon as each character is complete; the special token adds nothing
    assert deltas == [" Hello", " there", ",", " ", "", "你", "", "好", "", "", " 👋", "", ""]


def test_incremental_window_stays_small(tok: Tokenizer) -> None:
    ids = tok.encode("word " * 500)
    det = IncrementalDetokenizer(tok)
    for i in ids:
        det.add(i)
        assert len(det._ids) <= 2
    assert det.text == "word " * 500


# ---- loading -------------------------------------------------------------------------------------------


def test_hf_directory_roundtrip(tok: Tokenizer, tmp_path: Path) -> None:
    tok.backend.save(str(tmp_path / "tokenizer.json"))
    cfg = {
        "chat_template": tok.chat_template,
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    t2 = Tokenizer.from_pretrained(tmp_path)
    assert (t2.bos_token_id, t2.eos_token_ids, t2.vocab_size) == (1, (2, 0), 49152)
    for case in TEXTS:
        assert t2.encode(case["text"]) == case["ids_upstream"]
    chat = GOLDEN["chats"][1]
    assert t2.apply_chat_template(chat["messages"]) == chat["rendered"]
    assert Tokenizer.from_pretrained(tmp_path / "tokenizer.json").vocab_size == 49152

    cfg.update(add_bos_token=True, chat_template=[{"name": "default", "template": "{{ bos_token }}!"}])
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t3 = Tokenizer.from_pretrained(tmp_path)
    assert t3.encode("hi") == [1, *tok.encode("hi")] and t3.encode("hi", add_special_tokens=False)[0] != 1
    assert t3.apply_chat_template([{"role": "user", "content": "x"}]) == "<|im_start|>!"


def test_from_pretrained_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="neither a directory nor a .gguf"):
        Tokenizer.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="no tokenizer.json, no tiktoken file and no .gguf file"):
        Tokenizer.from_pretrained(tmp_path)
    (tmp_path / "a.gguf").write_bytes(b"x")
    (tmp_path / "b.gguf").write_bytes(b"x")
    with pytest.raises(ValueError, match="several GGUF files"):
        Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="not a readable GGUF"):
        Tokenizer.from_pretrained(tmp_path / "a.gguf")


# ---- synthetic GGUF metadata ---------------------------------------------------------------------------


def _byte_meta(pre: str, **extra) -> dict:
    tokens = [*_byte_alphabet().values(), "<s>", "</s>", "<think>"]
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [1] * 256 + [3, 3, 4],
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 256,
        "tokenizer.ggml.eos_token_id": 257,
        **extra,
    }


@pytest.mark.parametrize(
    "pre, pieces",
    [
        ("gpt2", ["x", "Ġ", "Ġ1234567", "Ġabc"]),
        ("smollm", ["x", "ĠĠ", "1", "2", "3", "4", "5", "6", "7", "Ġabc"]),
        ("llama-bpe", ["x", "Ġ", "Ġ", "123", "456", "7", "Ġabc"]),
        ("qwen2", ["x", "Ġ", "Ġ", "1", "2", "3", "4", "5", "6", "7", "Ġabc"]),
        ("deepseek-v3", ["x", "ĠĠ", "123", "456", "7", "Ġabc"]),
        ("deepseek-coder", ["x", "ĠĠ", "1", "2", "3", "4", "5", "6", "7", "Ġabc"]),
        ("kimi-k2", ["x", "Ġ", "Ġ", "123", "456", "7", "Ġabc"]),
    ],
)
def test_gguf_pre_tokenizers(pre: str, pieces: list[str]) -> None:
    t = Tokenizer.from_gguf_metadata(_byte_meta(pre))
    assert [p for p, _ in t.backend.pre_tokenizer.pre_tokenize_str("x  1234567 abc")] == pieces
    assert t.decode(t.encode("x  1234567 abc")) == "x  1234567 abc"


def test_gguf_deepseek_splits_cjk_runs_apart() -> None:
    """DeepSeek-V3's splits: Han and kana runs apart from Latin words, a punctuation mark leading a word joins it."""
    t = Tokenizer.from_gguf_metadata(_byte_meta("deepseek-v3"))
    pieces = [p for p, _ in t.backend.pre_tokenizer.pre_tokenize_str("中文English ひらがな!abc")]
    spell = lambda text: "".join(_byte_alphabet()[b] for b in text.encode())  # noqa: E731
    assert pieces == [spell(p) for p in ("中文", "English", " ", "ひらがな", "!abc")]
    # DeepSeek-Coder's: letter runs with their space, then CJK / Hangul runs split out of them
    t = Tokenizer.from_gguf_metadata(_byte_meta("deepseek-coder"))
    pieces = [p for p, _ in t.backend.pre_tokenizer.pre_tokenize_str("f(x):\n return 中文 한국어")]
    assert pieces == [spell(p) for p in ("f", "(", "x", "):", "\n", " return", " ", "中文", " ", "한국어")]


def test_gguf_added_tokens_and_bos() -> None:
    t = Tokenizer.from_gguf_metadata(_byte_meta("qwen2", **{"tokenizer.ggml.add_bos_token": True}))
    ids = t.encode("a<think>b</s>")
    assert ids == [256, t.token_to_id("a"), 258, t.token_to_id("b"), 257]
    assert t.decode(ids) == "a<think>b"  # control tokens skipped, user-defined kept
    assert t.decode(ids, skip_special_tokens=False) == "<s>a<think>b</s>"
    assert t.eos_token_ids == (257,)


def test_gguf_unsupported() -> None:
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer kind='bert'"):
        Tokenizer.from_gguf_metadata(_byte_meta("gpt2", **{"tokenizer.ggml.model": "bert"}))
    with pytest.raises(ValueError, match="unsupported GGUF pre-tokenizer pre='nope'"):
        Tokenizer.from_gguf_metadata(_byte_meta("nope"))
    with pytest.raises(ValueError, match="no tokenizer"):
        Tokenizer.from_gguf_metadata({"tokenizer.ggml.model": "gpt2"})


def test_gguf_sentencepiece() -> None:
    # merges recovered from scores: a piece is a merge of two vocabulary pieces; higher score merges first
    chars = ["▁", "h", "e", "l", "o", "w", "r", "d"]
    pieces = ["he", "ll", "llo", "hello", "▁hello", "or", "ld", "wor", "world", "▁world"]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *chars, *pieces]
    meta = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * 259
        + [-100.0] * len(chars)
        + [-float(i) for i in range(len(pieces))],
        "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * (len(chars) + len(pieces)),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    t = Tokenizer.from_gguf_metadata(meta)
    ids = t.encode("hello world!")
    assert [t.id_to_token(i) for i in ids] == ["<s>", "▁hello", "▁world", "<0x21>"]  # BOS by default
    assert t.decode(ids) == "hello world!"
    deltas, det = _stream(t, ids)
    assert det.text == "hello world!" and deltas[:3] == ["", "hello", " world"]
