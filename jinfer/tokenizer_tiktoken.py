"""Tokenizers that HF model directories ship as a tiktoken BPE file (Kimi-K2, Moonlight: `tiktoken.model` with a
`tokenization_*.py` that transformers runs as remote code, and no tokenizer.json), rebuilt as a `tokenizers.Tokenizer`
so that encoding runs in Rust like every other tokenizer jinfer loads.

Nothing from the directory runs. The file holds one line per token: its bytes in base64 and its rank (= its id). The
split regex is the tokenization file's `pat_str` literal, read by parsing the file (a string, or `"|".join` of a list
of strings). The special tokens fill the ids after the ranks (`RESERVED_SPECIAL_TOKENS` of them, more where
tokenizer_config.json names higher ids), named by its `added_tokens_decoder`, `<|reserved_token_{id}|>` otherwise, as
Kimi's tokenizer does.

tiktoken's encoding, mirrored: the text is split by the regex, each piece that is a vocabulary entry is that token
(`ignore_merges`), others are merged byte pair by byte pair, lowest rank first. The merges a BPE model needs are
recovered from the ranks: each token's bytes merged by rank until two parts remain. A token that no such replay
reaches (Llama-3's `.:.:`: tiktoken makes it only as a whole piece) gets no merge, and is made as a whole piece too.
"""

from __future__ import annotations

import ast
import base64
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

RESERVED_SPECIAL_TOKENS = 256  # Kimi's num_reserved_special_tokens (Llama-3's too)
FILE_NAMES = ("tiktoken.model", "tokenizer.model")


def find_file(d: Path) -> Path | None:
    """The directory's tiktoken BPE file (`tiktoken.model`, a `tokenizer.model` in that format, or one
    `*.tiktoken`), or None."""
    for name in FILE_NAMES:
        p = d / name
        if p.is_file() and _is_tiktoken(p):
            return p
    found = sorted(d.glob("*.tiktoken"))
    return found[0] if len(found) == 1 else None


def _is_tiktoken(p: Path) -> bool:
    """A base64 token and an integer rank on the first line (a SentencePiece `tokenizer.model` is a protobuf)."""
    with open(p, "rb") as f:
        parts = f.readline().split()
    try:
        return len(parts) == 2 and bool(base64.b64decode(parts[0], validate=True)) and parts[1].isdigit()
    except ValueError:
        return False


def read_ranks(p: Path) -> dict[bytes, int]:
    """{token bytes: rank} from a tiktoken BPE file; ranks must be the ids 0 .. n - 1."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(p.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError:
            raise ValueError(f"{p.name} line {n}: not '<base64 token> <rank>'") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{p.name}: the ranks are not the ids 0 .. {len(ranks) - 1} (a token repeated, an id skipped)")
    return ranks


def split_pattern(d: Path, config: dict[str, Any]) -> str:
    """The `pat_str` literal of the tokenization module tokenizer_config.json's auto_map names, else of the directory's
    one `tokenization_*.py` (parsed, never run)."""
    auto = (config.get("auto_map") or {}).get("AutoTokenizer")
    ref = auto[0] if isinstance(auto, list | tuple) and auto else auto
    module = ref.split("--")[-1].rsplit(".", 1)[0] if isinstance(ref, str) else None
    path = d / (module.replace(".", "/") + ".py") if module else None
    if path is None or not path.is_file():
        found = sorted(d.glob("tokenization_*.py"))
        path = found[0] if len(found) == 1 else None
    if path is None:
        raise ValueError(f"{d}: a tiktoken tokenizer needs its split pattern: tokenizer_config.json's auto_map names "
                         f"no tokenization module here ({ref!r}), and there is not one tokenization_*.py")
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (SyntaxError, UnicodeDecodeError) as e:
        raise ValueError(f"{path.name} does not parse as Python, so its split pattern cannot be read: {e}") from None
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) \
            else []
        if any(isinstance(t, ast.Name) and t.id == "pat_str" for t in targets) and node.value is not None:
            pattern = _string_value(node.value)
            if pattern is not None:
                return pattern
    raise ValueError(f"{path.name}: no `pat_str = <string literal>` (or '|'.join of literals) to split text with")


def _string_value(node: ast.AST) -> str | None:
    """A string literal, or `"sep".join([literals])`, else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join" \
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str) \
            and len(node.args) == 1 and isinstance(node.args[0], ast.List | ast.Tuple):
        parts = [_string_value(e) for e in node.args[0].elts]
        if all(p is not None for p in parts):
            return node.func.value.value.join(parts)
    return None


def _merge_parts(ranks: dict[bytes, int], token: bytes) -> list[bytes]:
    """token's bytes merged pair by pair, lowest rank first, until two parts remain (or no pair is a token)."""
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best, best_rank = None, None
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best is None:
            break
        parts[best:best + 2] = [parts[best] + parts[best + 1]]
    return parts


def build(d: Path, path: Path, config: dict[str, Any], alphabet: dict[int, str]) -> HFTokenizer:
    """The tokenizer of directory `d` from its tiktoken file `path` and tokenizer_config.json `config`; `alphabet`:
    GPT-2's byte -> character map that byte-level vocabularies are spelled in."""
    ranks = read_ranks(path)
    spell = lambda b: "".join(alphabet[x] for x in b)  # noqa: E731
    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = []
    for token in sorted(ranks, key=ranks.get):  # (merges in rank order: their priority)
        if len(token) < 2:
            continue
        parts = _merge_parts(ranks, token)
        if len(parts) == 2:  # (else only ever a whole piece: ignore_merges)
            merges.append((spell(parts[0]), spell(parts[1])))
    tk = HFTokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split_pattern(d, config)), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tk.decoder = decoders.ByteLevel()
    n = len(ranks)
    named = {int(i): t for i, t in (config.get("added_tokens_decoder") or {}).items() if str(i).isdigit()}
    below = sorted(i for i in named if i < n)
    if below:
        raise ValueError(f"tokenizer_config.json: added tokens {below[:4]} take ids of {path.name}'s ranks (< {n})")
    end = max([n + RESERVED_SPECIAL_TOKENS - 1, *named]) + 1
    for i in range(n, end):  # (added in id order: each takes the next id, n, n + 1, ...)
        t = named.get(i, {})
        t = t if isinstance(t, dict) else {"content": t}
        content = t.get("content") or f"<|reserved_token_{i}|>"
        if (have := tk.token_to_id(content)) is not None:
            raise ValueError(f"tokenizer_config.json: added token {i} {content!r} is already token {have}")
        # (special ones are skipped by decode; Kimi's <think> and tool-call markers are not special: they decode)
        token = AddedToken(content, special=bool(t.get("special", True)), normalized=False,
                           **{k: bool(t[k]) for k in ("lstrip", "rstrip", "single_word") if k in t})
        (tk.add_special_tokens if token.special else tk.add_tokens)([token])
    assert tk.get_vocab_size(with_added_tokens=True) == end
    return tk

