"""A step's tokens on their way out: detokenized, searched for stop strings, with their logprobs, as the
`EngineOutput` delta of each sequence.

Text that may be the start of a stop string is held back, so it is never sent and then retracted; the text of the
token that stopped the sequence (an EOS or one of `stop_token_ids`) is part of the output only with
`include_stop_str_in_output` (vLLM's detokenizer; the id stays in the token ids); no stop string counts before
`min_tokens` tokens (as vLLM). Logprobs carry the chosen token's rank beside them (`EngineOutput.new_logprob_ranks`:
its place in the top N if it is there, else its rank among all tokens, as vLLM). Prompt logprobs are filled in as a
prefill's chunks are read back and go out with the sequence's first delta, with the time the scheduler first ran
it. The scheduler is not touched here: `emit` says which stop string it found, and the core finishes the request.
"""

from __future__ import annotations

from jinfer.engine.input_processor import SequenceState
from jinfer.engine.request import FinishReason, Request
from jinfer.outputs import EngineOutput
from jinfer.sampling_params import SamplingParams


def _entry(top_ids, top_lps, token: int, logprob: float, rank: int) -> tuple[dict[int, float], int]:
    """{top ids best first: logprob, then the token unless among them: its logprob}, and the token's rank: its place
    in the top N when there (vLLM's), else the device's count over the vocabulary."""
    top = top_ids.tolist()
    lp = dict(zip(top, top_lps.tolist()))
    if token in lp:
        return lp, top.index(token) + 1
    lp[token] = logprob
    return lp, rank


def token_logprobs(result, first: int, tokens: list[int], params: SamplingParams
                   ) -> tuple[list[dict[int, float]], list[int]] | None:
    """The logprob and top `params.logprobs` of each token sampled at rows first, first + 1, ... (a sequence's
    accepted tokens), and each token's rank; None when not asked for."""
    if params.logprobs is None:
        return None
    n = params.logprobs
    lps, ranks = [], []
    for b, token in enumerate(tokens, first):
        lp, rank = _entry(result.top_ids[b][:n], result.top_logprobs[b][:n], token, float(result.logprobs[b]),
                          int(result.ranks[b]))
        lps.append(lp)
        ranks.append(rank)
    return lps, ranks


def record_prompt_logprobs(plp, prompt_rows, seqs: dict[str, SequenceState]) -> None:
    """Store the prompt logprobs a step read back (`plp`: the runner's, one row per (sequence, position))."""
    if plp is None:
        return
    for i, (sid, pos) in enumerate(prompt_rows):
        seq = seqs.get(sid)
        if seq is None or seq.prompt_lps is None:  # aborted, or sent already (a recompute after preemption)
            continue
        k = seq.params.prompt_logprobs
        seq.prompt_lps[pos], seq.prompt_ranks[pos] = _entry(plp.top_ids[i][:k], plp.top_logprobs[i][:k],
                                                            seq.prompt_ids[pos], float(plp.logprobs[i]),
                                                            int(plp.ranks[i]))


def _stop_token(fin: Request | None, token: int) -> bool:
    """Whether `token` ended the request as a stop token: an EOS, or one of its `stop_token_ids` (a grammar that
    completes also finishes with reason "stop", on a token of its own text)."""
    if fin is None or fin.finish_reason != FinishReason.STOP:
        return False
    return token in fin.eos_token_ids if fin.stop_reason is None else fin.stop_reason == token


def emit(request: Request, seq: SequenceState, tokens: list[int], lps: tuple[list, list] | None,
         finished: Request | None, num_before: int) -> tuple[EngineOutput, str | None]:
    """Detokenize a step's accepted tokens in order (`num_before`: the sequence's outputs before them; `finished`: the
    request if the scheduler finished it at the last of them), apply stop strings after each, and build the delta to
    send; also the stop string hit (None if none), which finishes the request: the tokens after it are dropped.
    `lps`: the tokens' (logprobs, ranks) from `token_logprobs`."""
    sp = seq.params
    stop_hit = None
    kept = len(tokens)
    for j, token in enumerate(tokens):
        fin = finished if j == kept - 1 else None
        if seq.detok is not None:
            if sp.include_stop_str_in_output or not _stop_token(fin, token):
                seq.text += seq.detok.add(token)
            if fin is not None:
                seq.text += seq.detok.flush()
            if sp.stop and num_before + j + 1 >= sp.min_tokens:  # as vLLM: no stop string before min_tokens
                stop_hit = find_stop(seq, sp)
        seq.held.append(token)
        if stop_hit is not None:
            kept = j + 1
            break
    ranks = None
    if lps is not None:
        lps, ranks = lps[0][:kept], lps[1][:kept]
    done = finished is not None or stop_hit is not None
    # Hold back text that may be the start of a stop string, so it is never sent then retracted.
    hold = 0 if done or not sp.stop else max(len(s) for s in sp.stop) - 1
    upto = max(seq.emitted, len(seq.text) - hold)
    new_text = seq.text[seq.emitted:upto]
    seq.emitted = upto
    ids, seq.held = seq.held, []
    delta = EngineOutput(seq.parent_id, seq.index, ids, new_text, finished=done,
                         new_logprobs=lps, num_prompt_tokens=seq.num_prompt_tokens,
                         num_cached_tokens=request.num_cached_tokens, prompt_logprobs=seq.prompt_lps,
                         new_logprob_ranks=ranks, prompt_logprob_ranks=seq.prompt_ranks if seq.prompt_lps else None)
    if not num_before:  # the sequence's first delta
        delta.first_scheduled_time = request.first_scheduled_time
    seq.prompt_lps = seq.prompt_ranks = None  # sent with the first delta
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
