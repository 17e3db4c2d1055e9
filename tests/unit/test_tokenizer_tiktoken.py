"""A model directory whose tokenizer is a tiktoken BPE file and a remote-code tokenization module (Kimi-K2's layout):
jinfer's rebuilt tokenizer against tiktoken itself (the independent reference) on a vocabulary tiktoken's own BPE
trainer learned, with Kimi's split pattern and special tokens."""

from __future__ import annotations

import base64
import json
from functools import cache

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jinfer.tokenizer import Tokenizer
from jinfer.tokenizer_tiktoken import read_ranks, split_pattern

tiktoken = pytest.importorskip("tiktoken")

# tokenization_kimi.py's pattern: Han runs split from the letter runs (class intersections), case-insensitive
# contractions, digits in threes.
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"""
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
# A module as transformers would import it; jinfer only parses it (running it raises)
MODULE = f'''raise RuntimeError("jinfer must not run a model's tokenization module")


class TikTokenTokenizer:
    num_reserved_special_tokens = 256
    pat_str = "|".join({json.dumps(KIMI_PATTERN.split("|"))})
'''
SPECIAL = ["[BOS]", "[EOS]", "<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>"]
CORPUS = ("The capital of France is Paris, and the capital of Italy is Rome. I'll say they're right; WE'VE done it, "
          "it's fine. She doesn't know what they've seen there. Quick brown foxes jump over the lazy dogs again and "
          "again, then rest under the tall trees near the river. 中文和English混合的句子。"
          "今天天气很好，我们去北京市看看。"
          "他们在学校学习数学和物理。 Numbers: 12345 678 9 1000000, 3.14159 and 2718281828. def f(x):\n    return x * 2"
          "  # comment\n\n  indented\ttabs\r\n café naïve über 🚀🎉 encoding decoding tokenizer tokenizers ")
TEXTS = [
    "The capital of France is Paris.",
    "I'll say they're right; WE'VE done it. It's fine.",
    "12345 678 9 1000000",
    "你好，世界。今天天气很好。",
    "中文English混合 北京市 Pascal",
    "a  b\n\n  c\t d   \n",
    "café naïve 🚀🎉 über zebra quartz",
    "def f(x):\n    return x*2  # comment\n",
    "<|im_user|>user<|im_middle|>Hello<|im_end|>[EOS]",
    "",
]


@cache
def learned_ranks() -> dict[bytes, int]:
    from tiktoken._educational import bpe_train

    # (trained on cl100k's split: the trainer's Python `regex` reads Kimi's `&&` as literal characters)
    cl100k = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
              r"|\s+(?!\S)|\s+")
    return bpe_train(CORPUS, 256 + 150, cl100k, visualise=None)


def kimi_dir(tmp_path, ranks=None, module=MODULE, special=SPECIAL):
    ranks = learned_ranks() if ranks is None else ranks
    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in sorted(ranks.items(), key=lambda kv: kv[1])]
    (tmp_path / "tiktoken.model").write_text("\n".join(lines) + "\n")
    n = len(ranks)
    config = {"auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
              "added_tokens_decoder": {str(n + i): {"content": t, "special": True} for i, t in enumerate(special)},
              "bos_token": "[BOS]", "eos_token": "[EOS]", "add_bos_token": False,
              "chat_template": "{% for m in messages %}<|im_{{ m.role }}|>{{ m.content }}<|im_end|>{% endfor %}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    if module is not None:
        (tmp_path / "tokenization_kimi.py").write_text(module)
    return tmp_path


def reference(ranks) -> tiktoken.Encoding:
    """tiktoken with Kimi's special tokens: the named ones, then `<|reserved_token_{id}|>` up to 256 of them."""
    n = len(ranks)
    specials = {SPECIAL[i] if i < len(SPECIAL) else f"<|reserved_token_{n + i}|>": n + i for i in range(256)}
    return tiktoken.Encoding("kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    return Tokenizer.from_pretrained(kimi_dir(tmp_path_factory.mktemp("kimi"))), reference(learned_ranks())


def test_encodes_as_tiktoken(kimi):
    tok, ref = kimi
    assert tok.vocab_size == len(learned_ranks()) + 256
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, allowed_special="all"), text
        assert tok.decode(ids, skip_special_tokens=False) == text
    # the specials: BOS / EOS from tokenizer_config.json, skipped by decode, the reserved ids named as Kimi names them
    n = len(learned_ranks())
    assert (tok.bos_token_id, tok.eos_token_ids[0]) == (n, n + 1)
    assert tok.decode(tok.encode("[BOS]hi[EOS]", add_special_tokens=False)) == "hi"
    assert tok.encode(f"a<|reserved_token_{n + 10}|>", add_special_tokens=False) == [ref.encode("a")[0], n + 10]
    assert tok.apply_chat_template([{"role": "user", "content": "你好"}], add_generation_prompt=False) == \
        "<|im_user|>你好<|im_end|>"


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.sampled_from(sorted(set(CORPUS)) + list("QZé中文\u0301 \n\t'")), max_size=40))
def test_any_text_encodes_as_tiktoken(kimi, text):
    tok, ref = kimi
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == ref.encode(text, disallowed_special=()), repr(text)
    assert tok.decode(ids) == text


def test_split_pattern_is_parsed_not_run(tmp_path):
    d = kimi_dir(tmp_path)
    config = json.loads((d / "tokenizer_config.json").read_text())
    assert split_pattern(d, config) == KIMI_PATTERN  # (the module raises if run)
    assert Tokenizer.found_in(d)


def test_bad_directories_name_the_problem(tmp_path):
    for sub in "abcd":
        (tmp_path / sub).mkdir()
    with pytest.raises(ValueError, match="no tokenization module"):
        Tokenizer.from_pretrained(kimi_dir(tmp_path / "a", module=None))
    with pytest.raises(ValueError, match="pat_str"):
        Tokenizer.from_pretrained(kimi_dir(tmp_path / "b", module="pat_str = make_pattern()\n"))
    d = kimi_dir(tmp_path / "c")
    (d / "tiktoken.model").write_text("YQ== 0\nYg== 0\n")
    with pytest.raises(ValueError, match="ranks are not the ids"):
        read_ranks(d / "tiktoken.model")
    assert not Tokenizer.found_in(tmp_path / "d")


def test_tokens_only_tiktoken_makes_whole_and_unspecial_markers(tmp_path):
    """A vocabulary tiktoken accepts but a merge replay cannot reach (Llama-3's `.:.:`: ranked below `:.` + `.:` would
    need), a non-special added token (Kimi's `<think>`: decoded as text), and no auto_map (the one tokenization
    module)."""
    ranks = {bytes([b]): b for b in range(256)} | {b":.": 256, b".:": 257, b".:.:": 258, b"xyz": 259}
    d = kimi_dir(tmp_path, ranks, module='pat_str = r"""[^\\s]+|\\s+"""\n')
    config = json.loads((d / "tokenizer_config.json").read_text())
    del config["auto_map"]
    config["added_tokens_decoder"]["270"] = {"content": "<think>", "special": False}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.from_pretrained(d)
    specials = {SPECIAL[i] if i < len(SPECIAL) else "<think>" if i == 14 else f"<|reserved_token_{260 + i}|>": 260 + i
                for i in range(256)}
    ref = tiktoken.Encoding("t", pat_str=r"[^\s]+|\s+", mergeable_ranks=ranks, special_tokens=specials)
    for text in (".:.:", "a.:.: xyz .:.:.:b", ":.:.", "xyzxyz"):
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text), text
    ids = tok.encode("<think>hi</think>[EOS]", add_special_tokens=False)
    assert 270 in ids and tok.decode(ids) == "<think>hi</think>"


def test_added_token_that_is_a_vocabulary_entry(tmp_path):
    d = kimi_dir(tmp_path, special=["[BOS]", "a"])
    with pytest.raises(ValueError, match="'a' is already token 97"):
        Tokenizer.from_pretrained(d)


def test_engine_serves_without_text_when_the_split_pattern_is_missing(tmp_path, caplog):
    """A snapshot with the tiktoken file but not its module (cached before modules were fetched): the engine warns
    and serves token ids, as it did before tiktoken files were read; with the module it has the tokenizer."""
    import logging

    from jinfer.config.engine import EngineConfig
    from jinfer.engine.builder import _load_tokenizer

    d = kimi_dir(tmp_path, module=None)
    with caplog.at_level(logging.WARNING, logger="jinfer.engine.builder"):
        assert _load_tokenizer(EngineConfig(model=str(d)), d, None) == (None, None)
    assert "tiktoken tokenizer does not load" in caplog.text
    (d / "tokenization_kimi.py").write_text(MODULE)
    tok, path = _load_tokenizer(EngineConfig(model=str(d)), d, None)
    assert path == str(d) and tok.decode(tok.encode("中文English混合")) == "中文English混合"


def test_kimi_gguf_encodes_as_tiktoken():
    """Kimi-K2 as llama.cpp converts it (`tokenizer.ggml.pre` "kimi-k2", byte-level tokens, merges): tiktoken's ids."""
    from jinfer.tokenizer import _byte_alphabet
    from jinfer.tokenizer_tiktoken import _merge_parts

    ranks, alphabet = learned_ranks(), _byte_alphabet()
    spell = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
    by_id = sorted(ranks, key=ranks.get)
    merges = [" ".join(map(spell, parts)) for t in by_id if len(parts := _merge_parts(ranks, t)) == 2 and len(t) > 1]
    n = len(ranks)
    specials = [SPECIAL[i] if i < len(SPECIAL) else f"<|reserved_token_{n + i}|>" for i in range(256)]
    meta = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "kimi-k2",
            "tokenizer.ggml.tokens": [spell(t) for t in by_id] + specials,
            "tokenizer.ggml.token_type": [1] * n + [3] * 256, "tokenizer.ggml.merges": merges,
            "tokenizer.ggml.bos_token_id": n, "tokenizer.ggml.eos_token_id": n + 1}
    tok, ref = Tokenizer.from_gguf_metadata(meta), reference(ranks)
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, allowed_special="all"), text
    # whole pieces first, as tiktoken (and llama.cpp for "kimi-k2"): a token no merge replay reaches
    whole = {bytes([b]): b for b in range(256)} | {b":.": 256, b".:": 257, b".:.:": 258}
    meta |= {"tokenizer.ggml.tokens": [spell(t) for t in sorted(whole, key=whole.get)], "tokenizer.ggml.merges":
             [f"{spell(b':')} {spell(b'.')}", f"{spell(b'.')} {spell(b':')}"], "tokenizer.ggml.token_type": [1] * 259,
             "tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.eos_token_id": None}
    assert Tokenizer.from_gguf_metadata(meta).encode(".:.:", add_special_tokens=False) == [258]
