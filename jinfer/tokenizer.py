"""Tokenizer (a `tokenizers.Tokenizer` built from tokenizer.json, a tiktoken file or GGUF metadata), chat templates,
and the incremental detokenizer used for streaming.

A GGUF carries no tokenizer.json, only llama.cpp's description of one (tokens, merges, token types,
the name of a pre-tokenizer). `Tokenizer.from_gguf_metadata` rebuilds it as a `tokenizers` object so
that encoding runs in Rust either way, splitting text with the same regexes llama.cpp uses.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

# llama.cpp token types (tokenizer.ggml.token_type)
_CONTROL, _USER_DEFINED = 3, 4

# Pre-tokenizer regexes, as llama.cpp's llm_tokenizer_bpe applies them: each regex splits the pieces the
# previous one produced, keeping unmatched text as pieces of its own (= tokenizers' Split "isolated").
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = _LLAMA3.replace(r"\p{N}{1,3}", r"\p{N}")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
# DeepSeek-V3 / R1 (tokenizer.json's three splits): digits in threes, CJK and kana runs, then words and punctuation
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+",
    r"""[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"""
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# DeepSeek-Coder (V1 / V2: tokenizer.json's five splits): line breaks, letter runs, punctuation runs, CJK / Hangul runs,
# single digits
_DEEPSEEK_CODER = (
    r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+", r"\p{N}",
)
# Kimi-K2 / Moonlight (tokenization_kimi.py's pat_str): Han runs apart from the other letters (class intersection)
_KIMI_K2 = "|".join((
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}", r" ?[^\s\p{L}\p{N}]+[\r\n]*", r"\s*[\r\n]+", r"\s+(?!\S)", r"\s+",
))
_PRE_TOKENIZERS: dict[str, tuple[str, ...]] = {
    "default": _DEFAULT,
    **dict.fromkeys(("gpt2", "mpt", "olmo"), (_GPT2,)),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell"), (r"\p{N}", _GPT2)),
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "dbrx", "smaug-bpe"), (_LLAMA3,)
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "stablelm2", "megrez"), (_QWEN2,)),
    "deepseek-v3": _DEEPSEEK3,
    "deepseek-coder": _DEEPSEEK_CODER,
    "kimi-k2": (_KIMI_K2,),
}
# llama.cpp matches whole vocabulary words before merging for the llama3 family (tokenizer.json's
# "ignore_merges": true) and Kimi-K2 (tiktoken's way: jinfer/tokenizer_tiktoken.py).
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "kimi-k2"}
# Tokens that end generation besides the GGUF's eos/eot/eom ids (llama.cpp's end-of-generation list).
_EOG_TEXTS = set(
    "<|eot_id|> <|im_end|> <|end|> <end_of_turn> <|endoftext|> <|eom_id|> <EOT> <|end_of_text|> <|return|> "
    "<|call|>".split()
)


@lru_cache(maxsize=1)
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character map that byte-level vocabularies are spelled in."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)  # printable bytes keep their code point; the others move to 256, 257, ...
    moved = [b for b in range(256) if b not in bs]
    bs += moved
    cs += range(256, 256 + len(moved))
    return dict(zip(bs, map(chr, cs), strict=True))


def _bpe_from_gguf(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise ValueError(f"unsupported GGUF pre-tokenizer {pre=}; supported: {sorted(_PRE_TOKENIZERS)} (or give the "
                         "model's own tokenizer: --tokenizer / tokenizer= a Hub ID or directory)")
    alphabet = set(_byte_alphabet().values())
    byte_map = _byte_alphabet()
    vocab: dict[str, int] = {}
    for i, (tok, ty) in enumerate(zip(tokens, types, strict=True)):
        # Added tokens are matched in raw text and keep their spelling; a normal token outside the byte
        # alphabet (rare converter quirk) is respelled from its UTF-8 bytes, as transformers does.
        if ty not in (_CONTROL, _USER_DEFINED) and not set(tok) <= alphabet:
            tok = "".join(byte_map[b] for b in tok.encode())
        vocab.setdefault(tok, i)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tk = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=pre in _IGNORE_MERGES))
    splits = [pre_tokenizers.Split(Regex(rx), behavior="isolated") for rx in _PRE_TOKENIZERS[pre]]
    tk.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    tk.decoder = decoders.ByteLevel()
    return tk


def _spm_from_gguf(meta: Mapping[str, Any], tokens: list[str], types: list[int]) -> HFTokenizer:
    """SentencePiece-style BPE (tokenizer.ggml.model == "llama"), the way transformers' LlamaTokenizer
    builds it; merges come from the file or are recovered from the token scores."""
    vocab = {tok: i for i, tok in reversed(list(enumerate(tokens)))}
    if "tokenizer.ggml.merges" in meta:
        merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    else:  # every split of a piece into two vocabulary pieces is a merge, best score first
        scores = meta.get("tokenizer.ggml.scores") or [0.0] * len(tokens)
        scored = []
        for piece, score in dict(zip(tokens, scores, strict=True)).items():
            local = [(piece[:k], piece[k:], score) for k in range(1, len(piece))]
            local = [m for m in local if m[0] in vocab and m[1] in vocab]
            scored += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
        scored.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
        merges = [(a, b) for a, b, _ in scored]
    unk = meta.get("tokenizer.ggml.unknown_token_id")
    unk_token = tokens[unk] if unk is not None else None
    tk = HFTokenizer(models.BPE(vocab, merges, unk_token=unk_token, fuse_unk=True, byte_fallback=True))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tk.pre_tokenizer = pre_tokenizers.Metaspace(
        "▁", prepend_scheme="first" if prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tk.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if prefix else []))
    return tk


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells a token as a string or as {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


class Tokenizer:
    """Text <-> token ids, plus the model's chat template. Build with `from_pretrained`."""

    def __init__(
        self,
        backend: HFTokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: Sequence[int],
        chat_template: str | None = None,
        add_bos: bool = False,
    ):
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = tuple(dict.fromkeys(eos_token_ids))
        self.chat_template = chat_template
        # Prepend BOS in encode() when the model asks for it and the backend's post-processor did not.
        self.add_bos = add_bos and bos_token_id is not None
        added = backend.get_added_tokens_decoder()
        self.special_token_ids = frozenset(i for i, t in added.items() if t.special)

    # ---- construction ----------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: str | Path) -> Tokenizer:
        """From a directory with tokenizer.json (HF layout) or a tiktoken BPE file (Kimi-K2's: tokenizer_tiktoken.py), a
        .gguf file, or a directory holding one GGUF."""
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            from jinfer.weights.gguf_meta import read_metadata

            return cls.from_gguf_metadata(read_metadata(p))
        if p.is_file() and p.name == "tokenizer.json":
            p = p.parent
        if not p.is_dir():
            raise ValueError(f"tokenizer path {str(p)!r} is neither a directory nor a .gguf file")
        if (p / "tokenizer.json").is_file():
            return cls._from_hf_dir(p)
        from jinfer.tokenizer_tiktoken import find_file

        if (tiktoken_file := find_file(p)) is not None:
            return cls._from_hf_dir(p, tiktoken_file)
        ggufs = sorted(p.glob("*.gguf"))
        first_shards = [g for g in ggufs if re.search(r"-0*1-of-\d+\.gguf$", g.name)]
        if len(ggufs) > 1 and len(first_shards) == 1:  # split GGUF: the metadata is in the first part
            ggufs = first_shards
        if len(ggufs) == 1:
            return cls.from_pretrained(ggufs[0])
        found = f"several GGUF files ({', '.join(g.name for g in ggufs)})" if ggufs else "no .gguf file"
        raise ValueError(f"no usable tokenizer in {str(p)!r}: no tokenizer.json, no tiktoken file and {found}")

    @staticmethod
    def found_in(path: str | Path) -> bool:
        """Whether `from_pretrained(path)` has a tokenizer to read: a GGUF, tokenizer.json or a tiktoken file."""
        from jinfer.tokenizer_tiktoken import find_file

        p = Path(path)
        return p.is_file() or (p / "tokenizer.json").is_file() or (p.is_dir() and find_file(p) is not None)

    @classmethod
    def _from_hf_dir(cls, d: Path, tiktoken_file: Path | None = None) -> Tokenizer:
        """An HF directory's tokenizer: tokenizer.json, or a tiktoken BPE file (tokenizer_tiktoken.py)."""
        cfg = _read_json(d / "tokenizer_config.json")
        if tiktoken_file is None:
            backend = HFTokenizer.from_file(str(d / "tokenizer.json"))
        else:
            from jinfer.tokenizer_tiktoken import build

            backend = build(d, tiktoken_file, cfg, _byte_alphabet())
        model_cfg, gen_cfg = _read_json(d / "config.json"), _read_json(d / "generation_config.json")

        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default", next(iter(named.values()), None))
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if template is None:
            template = _read_json(d / "chat_template.json").get("chat_template")

        def tid(name: str) -> int | None:
            content = _token_content(cfg.get(name))
            return backend.token_to_id(content) if content else None

        bos = tid("bos_token")
        if bos is None:
            bos = model_cfg.get("bos_token_id") if isinstance(model_cfg.get("bos_token_id"), int) else None
        eos: list[int] = []
        for value in (tid("eos_token"), gen_cfg.get("eos_token_id"), model_cfg.get("eos_token_id")):
            eos += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=eos,
            chat_template=template,
            add_bos=bool(cfg.get("add_bos_token", False)),
        )

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Rebuild the tokenizer a GGUF describes (metadata as `gguf_meta.read_metadata` returns it)."""
        kind = meta.get("tokenizer.ggml.model")
        if "tokenizer.ggml.tokens" not in meta:
            raise ValueError("GGUF metadata has no tokenizer.ggml.tokens: the file carries no tokenizer")
        tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
        types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
        if kind == "gpt2":
            backend = _bpe_from_gguf(meta, tokens, types)
        elif kind == "llama":
            backend = _spm_from_gguf(meta, tokens, types)
        else:
            raise ValueError(
                f"unsupported GGUF tokenizer {kind=}: jinfer supports 'gpt2' (byte-level BPE) "
                "and 'llama' (SentencePiece BPE)"
            )
        # CONTROL tokens are special (skipped by decode); USER_DEFINED ones are added but decode as text.
        typed = list(zip(tokens, types, strict=True))
        backend.add_special_tokens(
            [AddedToken(t, special=True, normalized=False) for t, ty in typed if ty == _CONTROL]
        )
        backend.add_tokens(
            [AddedToken(t, special=False, normalized=False) for t, ty in typed if ty == _USER_DEFINED]
        )

        bos = meta.get("tokenizer.ggml.bos_token_id")
        eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        eos += [i for i, t in enumerate(tokens) if t in _EOG_TEXTS]
        add_bos = meta.get("tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp's default
        return cls(
            backend,
            bos_token_id=bos,
            eos_token_ids=[e for e in eos if e is not None],
            chat_template=meta.get("tokenizer.chat_template"),
            add_bos=bool(add_bos),
        )

    # ---- encode / decode -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special-token text (e.g. "<|im_start|>") maps to its id. With
        add_special_tokens, BOS is prepended only if the model asks for it. Encode a rendered chat
        template with add_special_tokens=False: templates write their own BOS."""
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    # ---- chat ----------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation to the prompt text, the way transformers' apply_chat_template does.
        Bad messages and errors raised by the template become ValueError."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        _validate_messages(messages)
        special = {
            name: self.id_to_token(i) if i is not None else None
            for name, i in (
                ("bos_token", self.bos_token_id),
                ("eos_token", (self.eos_token_ids or (None,))[0]),
            )
        }
        try:
            return _compile_template(self.chat_template).render(
                messages=[dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools is not None else None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **{**special, **kwargs},
            )
        except jinja2.TemplateError as e:  # e.g. the template's raise_exception("roles must alternate")
            raise ValueError(f"chat template error: {e}") from e


def _validate_messages(messages: Any) -> None:
    if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
        raise ValueError(f"messages must be a non-empty list of dicts, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(m).__name__}")
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role must be a string, got {m.get('role')!r}")
        content = m.get("content")
        # An assistant turn that only calls tools may have no content (OpenAI allows null there).
        if not isinstance(content, str) and not (content is None and m.get("tool_calls")):
            raise ValueError(f"messages[{i}].content must be a string, got {type(content).__name__}")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON (same override as transformers).
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


@lru_cache(maxsize=16)
def _compile_template(source: str) -> jinja2.Template:
    # Templates come from model repos: untrusted code, hence the immutable sandbox.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas whose concatenation (plus `flush()`)
    equals `tokenizer.decode(all_ids)`.

    vLLM's prefix/read offsets: the window holds the ids emitted last (whose text is already out) and
    the ids not yet emitted; each step decodes the window and emits what goes past the emitted part.
    Decoding from a token before the new ones keeps leading spaces right for decoders that strip the
    first one, and text ending in U+FFFD (an incomplete UTF-8 sequence, e.g. half an emoji) is held back.
    Work and memory per token stay constant.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()
    ):
        self._tok = tokenizer
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # A few prompt ids give the first generated token its left context (decoders that strip the first
        # space must not strip the space of a generated word).
        # (from the end: a 32k-token prompt must not cost a pass over all of it on the first token's path)
        window = []
        for i in reversed(prompt_ids):
            if i not in self._skip:
                window.append(i)
                if len(window) == 4:
                    break
        self._ids = window[::-1]  # the window
        self._read = len(self._ids)  # window ids before this are emitted ...
        self._prefix_text = self._decode(self._ids)  # ... as this text
        self._chunks: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self._tok.backend.decode(ids, skip_special_tokens=False) if ids else ""

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return "".join(self._chunks)

    def add(self, token_id: int) -> str:
        """Feed one generated id; returns the new text ("" while a character is incomplete)."""
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        new_text = self._decode(self._ids)
        if len(new_text) <= len(self._prefix_text) or new_text.endswith("\ufffd"):
            return ""
        return self._emit(new_text)

    def flush(self) -> str:
        """At the end of the stream: emit what is held back, even an incomplete character (as U+FFFD)."""
        if self._read == len(self._ids):
            return ""
        return self._emit(self._decode(self._ids))

    def _emit(self, new_text: str) -> str:
        delta = new_text[len(self._prefix_text) :]
        del self._ids[: self._read]  # the ids just emitted are the next step's left context
        self._read = len(self._ids)
        self._prefix_text = self._decode(self._ids)
        self._chunks.append(delta)
        return delta
