"""`SamplingParams.bad_words` (vLLM's semantics): words the output must never contain.

Each word is tokenized twice, as it is and with one leading space (the same word at the start of the text and in
the middle of it are different tokens in most vocabularies); the spaced variant is kept only when it is a
different word token of the same length (vLLM's rule: it skips a variant that only adds a space token). A word of
one token is banned at every step; a longer word bans its last token at a step whose output so far ends with the
word's other tokens. The banned ids go to the sampler as -inf logit biases (`SamplingTensors.bias_ids`), after
the raw logprobs, as vLLM applies them.

A multi-token word's ban depends on the output's last tokens, so with async scheduling its sequence waits for the
step in flight to be read back before its sampler inputs are built, as a grammar's does (engine/core.py).
"""

from __future__ import annotations

from collections.abc import Sequence

from jinfer.errors import InvalidParam


def tokenize_bad_words(words: Sequence[str], tokenizer, vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """The token ids of each word's variants; InvalidParam("bad_words") without a tokenizer or outside the vocab."""
    if not words:
        return ()
    if tokenizer is None:
        raise InvalidParam("bad_words", "bad_words need the model's tokenizer; this model has none")
    out: list[tuple[int, ...]] = []
    for word in words:
        plain = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out.append(plain)
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    if any(t >= vocab_size for ids in out for t in ids):
        raise InvalidParam("bad_words", f"bad_words= tokenize to ids outside the model's vocabulary of {vocab_size}")
    return tuple(dict.fromkeys(out))


def needs_output_tokens(bad_words: tuple[tuple[int, ...], ...]) -> bool:
    """Whether some word's ban depends on the output so far (it has more than one token)."""
    return any(len(ids) > 1 for ids in bad_words)


def banned_tokens(bad_words: tuple[tuple[int, ...], ...], output_ids: Sequence[int]) -> list[int]:
    """The ids the next token may not be, given the output so far (every id of `output_ids` known: no pending
    markers)."""
    banned = []
    n = len(output_ids)
    for ids in bad_words:
        k = len(ids) - 1
        if k == 0 or (k <= n and tuple(output_ids[n - k:]) == ids[:k]):
            banned.append(ids[-1])
    return banned
