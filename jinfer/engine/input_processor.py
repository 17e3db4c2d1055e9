"""A request on its way in: checked once, fanned out into its n sequences, and what each step asks of the runner.

`InputProcessor.process` is the one place that checks a request against the model (prompt ids in the vocabulary,
prompt + max_tokens within the context, logit_bias and allowed_token_ids ids, bad_words' tokens), raising
`InvalidParam` naming the field; SamplingParams checked everything else when it was built. It then builds the
request's sequences: n > 1 becomes n scheduler requests sharing the prompt (and its cached prefix pages), or, on
models with a per-sequence state, n - 1 forks of the first; each sequence gets its detokenizer, its grammar
matcher (structured outputs), its allowed-token set and bad words' ids and, if asked, the slots of its prompt
logprobs. Per step, `step_rows` and `prompt_logprobs_wanted` turn the scheduled sequences into the runner's
sampling rows and prompt-logprob request.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

import numpy as np

from jinfer.engine.bad_words import needs_output_tokens, tokenize_bad_words
from jinfer.engine.grammar import GrammarEngine
from jinfer.engine.request import Request
from jinfer.engine.runner import StepRow
from jinfer.engine.sampling_tensors import pack_token_mask
from jinfer.errors import ContextLengthExceeded, InvalidParam
from jinfer.sampling_params import MAX_LOGPROBS, SamplingParams
from jinfer.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class SequenceState:
    """Text-side state of one sequence (one of a request's n samples)."""

    parent_id: str
    index: int
    params: SamplingParams
    seed: int
    detok: IncrementalDetokenizer | None
    prompt_mask: object = None  # packed prompt token set, only for repetition penalty
    text: str = ""  # all text decoded so far (stop strings are searched here)
    emitted: int = 0  # chars of `text` already sent
    num_prompt_tokens: int = 0
    min_tokens_ids: tuple[int, ...] = ()  # masked (EOS, stop ids) while fewer than min_tokens tokens exist
    # prompt_logprobs: the prompt's ids and one entry per prompt token (the first None), filled as the
    # prefill's chunks are read back and sent with the first delta; None when not asked for.
    prompt_ids: list[int] | None = None
    prompt_lps: list[dict[int, float] | None] | None = None
    prompt_ranks: list[int | None] | None = None  # each prompt token's rank (the first None)
    matcher: object = None  # structured outputs: this sequence's llguidance matcher (jinfer/engine/grammar.py)
    allowed_mask: object = None  # allowed_token_ids as a packed token set (sampling_tensors.pack_token_mask)
    bad_words: tuple[tuple[int, ...], ...] = ()  # bad_words' token ids (jinfer/engine/bad_words.py)
    # Its sampler inputs need the previous step's tokens on the host (a grammar's mask, a multi-token bad word):
    # with async scheduling the step in flight is read back first (EngineCore._launch_guided).
    needs_tokens: bool = False
    held: list[int] = field(default_factory=list)  # token ids whose text is not sent yet


@dataclass
class NewSequence:
    """One sequence of an incoming request, for the scheduler (`request`, `fork_of`) and the core (`state`)."""

    request: Request
    state: SequenceState
    fork_of: str | None = None  # the leading sequence it forks from once that has computed the prompt


def check_prompt(prompt_token_ids, vocab_size: int) -> list[int]:
    """The prompt's ids as a list of ints in [0, vocab_size); InvalidParam("prompt") otherwise."""
    # One C pass checks the ids are integers (a 32k-token prompt: 1.4 ms instead of 3.7 for list(map(int))
    # and min / max in Python, paid before its first token)
    if isinstance(prompt_token_ids, str | bytes | bytearray | memoryview):  # array("q", b) reads raw bytes
        raise InvalidParam("prompt", f"prompt token ids must be integers, not {type(prompt_token_ids).__name__}")
    try:
        packed = array("q", prompt_token_ids)
    except (TypeError, OverflowError) as e:
        raise InvalidParam("prompt", f"prompt token ids must be integers ({e})") from None
    if not packed:
        raise InvalidParam("prompt", "prompt must not be empty")
    view = np.frombuffer(packed, np.int64)
    if view.min() < 0 or view.max() >= vocab_size:
        raise InvalidParam("prompt", f"prompt token ids must be integers in [0, {vocab_size})")
    return packed.tolist()


def check_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """The prompt must leave room for a token, and for max_tokens of them when given."""
    if num_prompt_tokens >= max_model_len:
        raise ContextLengthExceeded("prompt", f"This model's maximum context length is {max_model_len} tokens, "
                                              f"but the prompt has {num_prompt_tokens} tokens")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthExceeded("max_tokens", f"This model's maximum context length is {max_model_len} "
                                                  f"tokens; the prompt ({num_prompt_tokens} tokens) + max_tokens "
                                                  f"({max_tokens}) exceeds it")


def check_request(prompt_token_ids, params: SamplingParams, vocab_size: int, max_model_len: int,
                  max_logprobs: int = MAX_LOGPROBS) -> list[int]:
    """A request's checks against the model and the engine's options (what SamplingParams cannot know); the
    prompt's ids as a list."""
    ids = check_prompt(prompt_token_ids, vocab_size)
    check_length(len(ids), params.max_tokens, max_model_len)
    for name in ("logprobs", "prompt_logprobs"):
        if (n := getattr(params, name)) is not None and n > max_logprobs:
            raise InvalidParam(name, f"{name}={n} is more than this server's max_logprobs={max_logprobs}")
    if params.logit_bias and params.logit_bias[-1][0] >= vocab_size:  # sorted by id
        raise InvalidParam("logit_bias", f"logit_bias= keys must be token ids in [0, {vocab_size})")
    if params.allowed_token_ids is not None and max(params.allowed_token_ids) >= vocab_size:
        raise InvalidParam("allowed_token_ids", f"allowed_token_ids= must be token ids in [0, {vocab_size})")
    return ids


class InputProcessor:
    def __init__(self, *, vocab_size: int, max_model_len: int, tokenizer: Tokenizer | None,
                 eos_token_ids: tuple[int, ...], grammar: GrammarEngine, can_fork: bool, seed: int,
                 max_logprobs: int = MAX_LOGPROBS):
        """`can_fork`: n > 1 may fork the first sample's state (a model with per-sequence states, one process)."""
        self.vocab_size, self.max_model_len, self.max_logprobs = vocab_size, max_model_len, max_logprobs
        self.tokenizer, self.eos_token_ids, self.grammar = tokenizer, eos_token_ids, grammar
        self.can_fork = can_fork
        self._rng = np.random.default_rng(seed)

    def process(self, request_id: str, prompt_token_ids, params: SamplingParams) -> list[NewSequence]:
        """Check a request and build its sequences; InvalidParam, naming the field, if it can never run."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidParam("request_id", f"request_id={request_id!r} must be a non-empty string")
        ids = check_request(prompt_token_ids, params, self.vocab_size, self.max_model_len, self.max_logprobs)
        seq_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        mask = pack_token_mask(ids, self.vocab_size) if params.repetition_penalty != 1.0 else None
        allowed = (None if params.allowed_token_ids is None
                   else pack_token_mask(params.allowed_token_ids, self.vocab_size))
        bad_words = tokenize_bad_words(params.bad_words, self.tokenizer, self.vocab_size)
        # n > 1 on a model with per-sequence states (no prefix cache to share the prompt): the other samples fork
        # from the first once it has computed all but the prompt's last token (scheduler.py). Not with prompt
        # logprobs (every sample scores the whole prompt) nor in a multi-process group (whose other processes
        # replay steps, not the fork's copies).
        fork = self.can_fork and params.n > 1 and params.prompt_logprobs is None and len(ids) > 1
        new = []
        for i, sid in enumerate(seq_ids):
            seed = params.seed + i if params.seed is not None else int(self._rng.integers(0, 2**31))
            request = Request(sid, ids, params, self.eos_token_ids)
            detok = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=params.skip_special_tokens,
                                           prompt_ids=ids) if self.tokenizer else None
            state = SequenceState(request_id, i, params, seed, detok, mask, num_prompt_tokens=len(ids),
                                  min_tokens_ids=request.stop_token_ids_while_min_tokens() if params.min_tokens
                                  else (), matcher=self._matcher(params), allowed_mask=allowed, bad_words=bad_words)
            state.needs_tokens = state.matcher is not None or needs_output_tokens(bad_words)
            if params.prompt_logprobs is not None:
                state.prompt_ids, state.prompt_lps, state.prompt_ranks = ids, [None] * len(ids), [None] * len(ids)
            new.append(NewSequence(request, state, seq_ids[0] if fork and i else None))
        return new

    def _matcher(self, params: SamplingParams):
        """Structured outputs: the sequence's matcher (its grammar compiles, or comes from the cache, now)."""
        if not params.structured_outputs:
            return None
        try:
            return self.grammar.matcher(params.structured_outputs)
        except InvalidParam:
            raise
        except ValueError as e:
            raise InvalidParam("structured_outputs", str(e)) from None


def step_rows(out, seqs: dict[str, SequenceState]) -> list[StepRow | None]:
    """The sampling inputs of each scheduled sequence that samples this step (None for the others)."""
    rows = []
    for s in out.scheduled:
        seq, r = seqs[s.request_id], s.request
        rows.append(StepRow(seq.params, r.output_token_ids, seq.prompt_mask, seq.seed,
                            r.num_output_tokens + r.num_pending_tokens - 1, seq.min_tokens_ids, seq.allowed_mask,
                            seq.bad_words, seq.matcher is not None)
                    if s.needs_sample else None)
    return rows


def prompt_logprobs_wanted(out, seqs: dict[str, SequenceState]) -> tuple[int, list[bool]] | None:
    """(top k, which scheduled sequences) for the prompt logprobs of this step's prefill chunks."""
    wants = []
    for s in out.scheduled:
        seq = seqs[s.request_id]
        wants.append(seq.prompt_lps is not None and s.start < seq.num_prompt_tokens - 1)
    if not any(wants):
        return None
    k = max(seqs[s.request_id].params.prompt_logprobs for s, w in zip(out.scheduled, wants) if w)
    return k, wants
