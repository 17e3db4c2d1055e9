"""A step's tokens on their way out: detokenized, searched for stop strings, with their logprobs, as the
`EngineOutput` delta of each sequence.

Text that may be the start of a stop string is held back, so it is never sent and then retracted; an EOS token's
own text is never part of the output; no stop string counts before `min_tokens` tokens (as vLLM). Prompt logprobs
are filled in as a prefill's chunks are read back and go out with the sequence's first delta. The scheduler is
not touched here: `emit` says which stop string it found, and the core finishes the request.
"""

from __future__ import annotations

from jinfer.engine.input_processor import SequenceState
from jinfer.engine.request import FinishReason, Request
from jinfer.outputs import EngineOutput
from jinfer.sampling_params import SamplingParams


def token_logprobs(result, first: int, tokens: list[int], params: SamplingParams) -> list[dict[int, float]] | None:
    """The logprob and top `params.logprobs` of each token sampled at rows first, first + 1, ... (a sequence's
    accepted tokens), or None when not asked for."""
    if params.logprobs is None:
        return None
    n = params.logprobs
    out = []
    for b, token in enumerate(tokens, first):
        lp = {int(i): float(v) for i, v in zip(result.top_ids[b][:n], result.top_logprobs[b][:n])}
        lp[token] = float(result.logprobs[b])
        out.append(lp)
    return out


def record_prompt_logprobs(plp, prompt_rows, seqs: dict[str, SequenceState]) -> None:
    """Store the prompt logprobs a step read back (`plp`: the runner's, one row per (sequence, position))."""
    if plp is None:
        return
    for i, (sid, pos) in enumerate(prompt_rows):
        seq = seqs.get(sid)
        if seq is None or seq.prompt_lps is None:  # aborted, or sent already (a recompute after preemption)
            continue
        k = seq.params.prompt_logprobs
        lp = {int(t): float(v) for t, v in zip(plp.top_ids[i][:k], plp.top_logprobs[i][:k])}
        lp[seq.prompt_ids[pos]] = float(plp.logprobs[i])
        seq.prompt_lps[pos] = lp


def emit(request: Request, seq: SequenceState, tokens: list[int], lps: list | None, finished: Request | None,
         num_before: int) -> tuple[EngineOutput, str | None]:
    """Detokenize a step's accepted tokens in order (`num_before`: the sequence's outputs before them; `finished`: the
    request if the scheduler finished it at the last of them), apply stop strings after each, and build the delta to
    send; also the stop string hit (None if none), which finishes the request: the tokens after it are dropped."""
    sp = seq.params
    stop_hit = None
    kept = len(tokens)
    for j, token in enumerate(tokens):
        fin = finished if j == kept - 1 else None
        if seq.detok is not None:
            eos_finish = fin is not None and fin.finish_reason == FinishReason.STOP and \
                fin.stop_reason is None and token in request.eos_token_ids
            if not eos_finish:  # the EOS token's own text is never part of the output
                seq.text += seq.detok.add(token)
            if fin is not None:
                seq.text += seq.detok.flush()
            if sp.stop and num_before + j + 1 >= sp.min_tokens:  # as vLLM: no stop string before min_tokens
                stop_hit = find_stop(seq, sp)
        seq.held.append(token)
        if stop_hit is not None:
            kept = j + 1
            break
    if lps is not None:
        lps = lps[:kept]
    done = finished is not None or stop_hit is not None
    # Hold back text that may be the start of a stop string, so it is never sent then retracted.
    hold = 0 if done or not sp.stop else max(len(s) for s in sp.stop) - 1
    upto = max(seq.emitted, len(seq.text) - hold)
    new_text = seq.text[seq.emitted:upto]
    seq.emitted = upto
    ids, seq.held = seq.held, []
    delta = EngineOutput(seq.parent_id, seq.index, ids, new_text, finished=done,
                         new_logprobs=lps, num_prompt_tokens=seq.num_prompt_tokens,
                         num_cached_tokens=request.num_cached_tokens, prompt_logprobs=seq.prompt_lps)
    seq.prompt_lps = None  # sent with the first delta
    if done:
        delta.finish_reason = str(FinishReason.STOP if stop_hit is not None else request.finish_reason)
        delta.stop_reason = stop_hit if stop_hit is not None else request.stop_reason
    return delta, stop_hit


def find_stop(seq: SequenceState, sp: SamplingParams) -> str | None:
    """Search the not-yet-sent text for a stop string; on a hit, cut the text there."""
    longest = max(len(s) for s in sp.stop)
    start = max(0, seq.emitted - longest + 1)
    best = None
    for stop in sp.stop:
        i = seq.text.find(stop, start)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, stop)
    if best is None:
        return None
    i, stop = best
    seq.text = seq.text[:i + len(stop)] if sp.include_stop_str_in_output else seq.text[:i]
    return stop
