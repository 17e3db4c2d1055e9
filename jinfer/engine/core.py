"""EngineCore: one scheduler, one model runner, and the per-request text state between them.

The offline `LLM` drives it in-process; the ZeroMQ engine process (core_proc.py) wraps it. Per step:
schedule -> execute (launch the batch on the runner) -> update the scheduler with the sampled tokens -> emit
one `EngineOutput` delta per sequence that produced text or finished; plus `add_request` and `abort`.
Start-up is builder.py's; checking a request and fanning it out into its n sequences input_processor.py's;
detokenizing, stop strings and logprobs output_processor.py's.
"""

from __future__ import annotations

import time

from jinfer.cache.kv_events import make_publisher
from jinfer.config.engine import EngineConfig
from jinfer.engine.builder import build_engine, release_at_exit
from jinfer.engine.expert_load import expert_load_recorder
from jinfer.engine.grammar import GrammarEngine
from jinfer.engine.input_processor import InputProcessor, SequenceState, prompt_logprobs_wanted, step_rows
from jinfer.engine.output_processor import emit, record_prompt_logprobs, token_logprobs
from jinfer.engine.pooling import embedding_output, pooling_request
from jinfer.engine.request import FinishReason
from jinfer.engine.runner import Launched
from jinfer.engine.sampling_tensors import num_logprobs_for
from jinfer.errors import InvalidParam
from jinfer.outputs import EngineOutput
from jinfer.pooling_params import PoolingParams
from jinfer.sampling_params import SamplingParams
from jinfer.spec.decoding import SpecDecoding, grammar_masks
from jinfer.spec.proposer import Proposer
from jinfer.tokenizer import Tokenizer


class EngineCore:
    def __init__(self, config: EngineConfig | None = None, *, tokenizer: Tokenizer | None = None,
                 proposer: Proposer | None = None):
        """`proposer`: a drafter object instead of `config.speculative_config`'s (benchmarks: jinfer/spec/replay.py)."""
        t0 = time.perf_counter()
        self.config = config = config or EngineConfig()
        parts = build_engine(config, tokenizer, speculative=proposer.k if proposer is not None else 0)
        self.group = parts.group
        self.model_config, self.model_name = parts.model_config, parts.model_name
        self.generation_defaults = parts.generation_defaults
        self.tokenizer, self.tokenizer_path = parts.tokenizer, parts.tokenizer_path
        self.dtype, self.num_state_slots, self.max_model_len = parts.dtype, parts.num_state_slots, parts.max_model_len
        self.kv, self.scheduler, self.runner = parts.kv, parts.scheduler, parts.runner
        self.eos_token_ids = parts.eos_token_ids
        proposer = proposer or parts.proposer  # (builder.py builds speculative_config's)
        self.spec = SpecDecoding(proposer) if proposer is not None else None  # (jinfer/spec/decoding.py, `_step`)
        self._async = config.async_scheduling and self.spec is None
        self._overlap = config.async_scheduling and self.group is None  # (speculative: `_step`)
        self.grammar = GrammarEngine(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.inputs = InputProcessor(vocab_size=self.model_config.vocab_size, max_model_len=self.max_model_len,
                                     tokenizer=self.tokenizer, eos_token_ids=self.eos_token_ids, grammar=self.grammar,
                                     can_fork=bool(self.num_state_slots) and self.group is None, seed=config.seed,
                                     max_logprobs=config.max_logprobs)
        self._seqs: dict[str, SequenceState] = {}  # sequence id -> state
        self._children: dict[str, list[str]] = {}  # request id -> its sequence ids
        self._pooling: dict[str, PoolingParams] = {}  # embedding request id -> its parameters
        self.num_prompt_tokens_total = self.num_generation_tokens_total = 0
        # steps read back, and the host's time blocked reading them (not all host work: a launch also blocks while the
        # device's queue is full; a whole-run profile says, docs/ARCHITECTURE.md); with no step in flight the host's
        # time from a read-back to the next forward's dispatch, in series with the device (accept, update, schedule...)
        self.num_steps_total, self.device_wait_seconds_total = 0, 0.0
        self.serial_host_seconds_total, self._read_at = 0.0, None
        self._inflight: Launched | None = None  # the launched step whose tokens are not read yet
        self.expert_load = expert_load_recorder(config, self.model_config)  # --expert-load-stats (or None)
        # KV-cache events (--kv-events-config): the cache manager records them, each step publishes its own
        self.kv_events = make_publisher(config.kv_events_config, config.data_parallel_rank)
        if self.kv_events is not None:
            self.kv.events = []
        self.startup_seconds = time.perf_counter() - t0
        release_at_exit(self)

    # ---- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams | PoolingParams | None = None) -> None:
        """Queue a request (its n samples; PoolingParams: an embedding, on an embedding model). InvalidParam (a
        ValueError), naming the field, if it can never run."""
        pooling, params = pooling_request(params, self.model_config)
        if isinstance(request_id, str) and request_id in self._children:
            raise InvalidParam("request_id", f"request_id={request_id!r} is already in use")
        new = self.inputs.process(request_id, prompt_token_ids, params)
        added = []
        try:
            for seq in new:
                self.scheduler.add_request(seq.request, fork_of=seq.fork_of)
                added.append(seq.request.request_id)
                self._seqs[seq.request.request_id] = seq.state
        except ValueError:
            for sid in added:
                self.scheduler.abort(sid)
                self._drop(sid)
            raise
        self._children[request_id] = added
        if pooling is not None:
            self._pooling[request_id] = pooling
        self.num_prompt_tokens_total += new[0].state.num_prompt_tokens * params.n

    def abort(self, request_id: str) -> None:
        """Drop a request and all its samples now; its pages go back to the pool. Unknown ids are ignored."""
        for sid in self._children.pop(request_id, ()):
            self.scheduler.abort(sid)
            self._drop(sid)

    def _drop(self, seq_id: str) -> None:
        self._seqs.pop(seq_id, None)
        self._pooling.pop(seq_id, None)

    def has_unfinished_requests(self) -> bool:
        # A step still in flight holds only finished requests once the scheduler has none: nothing to read.
        return self.scheduler.has_unfinished_requests()

    # ---- one step -----------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedule and launch one step; return the outputs of the step read back in this call.

        With `async_scheduling` the step launched here is read back by the next call (after it has
        launched the one after), so the host's scheduling, batch building and detokenizing overlap the
        device's work; the outputs returned are one step behind (penalties too: the sampler takes a
        pending output token from the previous step's samples on the device).
        A step that fails in a multi-process group ends the process: the group's collectives are out of
        step for good (jinfer/parallel/multihost.py).
        """
        try:
            return self._step() if self.group is None else self._group_step()
        finally:
            if self.kv_events is not None:  # the step's cache changes (and any made since the last step)
                self.kv_events.publish(self.kv.take_events())

    def _group_step(self) -> list[EngineOutput]:
        try:
            return self._step()
        except Exception as e:
            self.group.lost(f"a step failed ({type(e).__name__}: {e}); the group cannot go on")
            raise

    def _step(self) -> list[EngineOutput]:
        """Speculative decoding: with a model drafter whose drafts stay on the device, the next step is launched before
        the step in flight is read back (its rows as if every draft is kept, moved back on the device), as async
        scheduling does, where every request allows (`SpecDecoding.can_overlap`); else the step in flight is read
        back first (its accepted tokens decide the next drafts and schedule), its outputs (detokenizing, stop strings,
        logprobs) built once the next step is launched, so they overlap the device; a stop string found then ends its
        request one step late, and that step's tokens for it are dropped (`_read_back` skips finished requests)."""
        outputs, read, overlap = [], None, False
        if self.spec is not None:
            overlap = self._overlap and self._inflight is not None and self.spec.can_overlap(self.scheduler.running,
                                                                                               self._seqs)
            if self._inflight is not None and not overlap:
                read, self._inflight = self._read_back(self._inflight), None
            self.spec.propose(self.scheduler.running, self._seqs, overlap)
        out = self.scheduler.schedule(*self.runner.ready_limits(), past_drafts=overlap)
        if overlap:
            self.spec.shift_rows(out)
        if not out.is_empty:  # the host tier's copies now wait for read-backs
            self.runner.host_tier_hold()
        if out.kv_transfers:  # copies between the HBM and host tiers go to the device ahead of the step
            self._transfer(out.kv_transfers)
        if out.fork_pages or out.fork_slots:  # forked samples' pages and states, ahead of the step too
            self.runner.fork(out.fork_pages, out.fork_slots)
        launched = None
        if not out.is_empty:
            rows = step_rows(out, self._seqs)
            wanted = [r.params for r in rows if r is not None]
            num_logprobs = num_logprobs_for(wanted) if wanted else -1
            prompt_logprobs = prompt_logprobs_wanted(out, self._seqs)
            # (a grammar's mask, a multi-token bad word: the inputs of their sampler rows need the step in flight)
            guided = [b for b, s in enumerate(out.scheduled)
                      if s.needs_sample and self._seqs[s.request_id].needs_tokens]
            idle = self._inflight is None and self._read_at is not None
            if not guided:
                launched = self.runner.launch(out, rows, num_logprobs, self._inflight, prompt_logprobs,
                                              prepare=self.spec and self.spec.prepare)
            else:
                launched, outputs = self._launch_guided(out, rows, num_logprobs, guided, outputs, prompt_logprobs)
            if idle:
                self.serial_host_seconds_total += self.runner.forward_at - self._read_at
        if read is not None:
            outputs += self._emit(*read)
        if self._inflight is not None:
            outputs += self._complete(self._inflight)
        self._inflight = launched
        if launched is not None and not self._async and self.spec is None:
            outputs += self._complete(launched)
            self._inflight = None
        if not self.scheduler.has_unfinished_requests():  # (the time until the next request is not the host's)
            self._read_at = None
        return outputs

    def _transfer(self, transfers) -> None:
        if dropped := self.runner.transfer(transfers):
            self.kv.host.forget(dropped)

    def idle(self) -> None:
        """Work for an engine with nothing to run (its loop calls this when it goes idle): the host tier's
        write-backs still waiting are copied now, not in front of the next request's schedule (a restore
        would wait for them on PCIe)."""
        if self.kv.host is not None and (transfers := self.kv.take_transfers(flush=True)):
            self._transfer(transfers)
        self.runner.host_tier_release()

    def unload_idle(self) -> int:
        """Drop the executables no step used for `executable_keep_alive` seconds (the engine loop calls this while
        idle); returns how many buckets were dropped."""
        return self.runner.unload_idle()

    def _launch_guided(self, out, rows, num_logprobs: int, guided: list[int], outputs: list[EngineOutput],
                       prompt_logprobs=None):
        """Launch a step with rows whose sampler inputs need the step in flight: grammar masks need the grammars
        advanced by it, bad words the output's last tokens. The forward goes first, then that step is read back and
        the masks computed while the device runs the forward, then the sampler follows (async scheduling stays on).
        A multi-process group replays whole steps, so there the step in flight is read back before the launch (the
        runner calls `masks` first)."""
        prev = self._inflight

        def masks():  # called by the runner once the forward is dispatched (a group: before)
            if prev is not None:
                outputs.extend(self._complete(prev))
                self._inflight = None
            return self._grammar_masks(out, guided)

        return self.runner.launch(out, rows, num_logprobs, prev, prompt_logprobs, token_mask=masks,
                                  pending_outputs=False, prepare=self.spec and self.spec.prepare), outputs

    def _grammar_masks(self, out, guided: list[int]):
        """One mask per logits row (a sequence verifying drafts has 1 + drafts rows); padded rows allow everything."""
        first, row = [], 0
        for s in out.scheduled:
            first.append(row)
            row += max(1, s.num_logits)
        live = [(self._seqs[s.request_id].matcher, first[b], s.draft_token_ids) for b in guided
                if not (s := out.scheduled[b]).request.is_finished and self._seqs[s.request_id].matcher is not None]
        if not live:  # (bad words only: their bans are biases, built with the sampler's inputs)
            return None
        return grammar_masks(self.grammar, live, max(row, self.runner.batch_rows(out)))

    def _complete(self, launched: Launched) -> list[EngineOutput]:
        """Read a launched step's tokens back, advance the scheduler and build the deltas."""
        return self._emit(*self._read_back(launched))

    def _read_back(self, launched: Launched) -> tuple:
        """Wait for a launched step's tokens, accept them, advance the scheduler and the grammars: everything the next
        step's drafts and schedule need; `_emit` takes the rest."""
        out = launched.out
        t = time.perf_counter()
        result = self.runner.fetch(launched)
        self._read_at = time.perf_counter()
        self.device_wait_seconds_total += self._read_at - t
        self.num_steps_total += 1
        self.runner.host_tier_read_back()  # host-tier copies may go out until the next read-back is due
        if launched.expert_load is not None and self.expert_load is not None:  # (its copy came with the tokens')
            self.expert_load.record(launched.expert_load)
        record_prompt_logprobs(self.runner.fetch_prompt_logprobs(launched), launched.prompt_rows, self._seqs)
        live = [s for s in out.scheduled if s.needs_sample and not s.request.is_finished]
        rows = result.rows
        if self.spec is None:
            tokens = result.tokens.tolist()
            sampled = {s.request_id: [tokens[rows[s.request_id][0]]] for s in live}
        else:
            sampled = {s.request_id: self.spec.accept(s.request_id, s.draft_token_ids, result.tokens_of(s.request_id))
                       for s in live}
        before = [s.request.num_output_tokens for s in live]
        finished = {r.request_id: r for r in self.scheduler.update(out, sampled)}
        news = []
        for s, num_before in zip(live, before):
            rid, seq = s.request_id, self._seqs[s.request_id]
            new = s.request.output_token_ids[num_before:]  # the accepted tokens up to a stop token or the length
            if seq.matcher is not None:  # structured outputs: a grammar that can go no further ends its sequence
                for j, token in enumerate(new):
                    if self.grammar.advance(seq.matcher, token):
                        new = new[:j + 1]
                        if rid not in finished:
                            finished[rid] = self.scheduler.finish_request(rid, FinishReason.STOP)
                        break
            news.append(new)
        return result, live, before, news, finished, sampled

    def _emit(self, result, live, before, news, finished, sampled) -> list[EngineOutput]:
        """The deltas of a step read back: detokenized text, stop strings (which finish their requests), logprobs."""
        if result.pooled is not None:  # an embedding model: each finished prompt's vector (engine/pooling.py)
            return self._embeddings(live, result)
        outputs = []
        for s, num_before, new in zip(live, before, news):
            rid, request = s.request_id, s.request
            if (seq := self._seqs.get(rid)) is None:  # aborted since it was read back
                continue
            delta, stop_hit = emit(request, seq, new, token_logprobs(result, result.rows[rid][0], new, seq.params),
                                   finished.get(rid), num_before)
            self.num_generation_tokens_total += len(delta.new_token_ids)
            if s.draft_token_ids:
                delta.num_drafts, delta.num_draft_tokens = 1, len(s.draft_token_ids)
                delta.num_accepted_tokens = self.spec.record(len(s.draft_token_ids), sampled[rid])
            if stop_hit is not None and rid not in finished:
                self.scheduler.finish_request(rid, FinishReason.STOP, stop_hit)
            if delta.finished:
                self._forget(rid)
            outputs.append(delta)
        return outputs

    def _embeddings(self, live, result) -> list[EngineOutput]:
        outputs = []
        for s in live:
            rid = s.request_id
            outputs.append(embedding_output(self._seqs[rid], s.request, result.pooled[result.rows[rid][0]],
                                            self._pooling[rid]))
            self._forget(rid)
        return outputs

    def _forget(self, seq_id: str) -> None:
        seq = self._seqs[seq_id]
        self._drop(seq_id)
        children = self._children.get(seq.parent_id)
        if children is not None and all(c not in self._seqs for c in children):
            del self._children[seq.parent_id]

    # ---- stats --------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop a staged warm-up's background compiles and a multi-process group (the other processes exit)."""
        self.runner.stop_background()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.group is not None:
            self.group.close()

    def _host_tier_stats(self) -> dict:
        host, page_bytes = self.kv.host, self.runner.host_page_bytes
        if host is None:
            return {}
        return {"kv_host_pages": host.num_slots, "kv_host_used_pages": host.num_used_slots,
                "kv_host_usage": host.num_used_slots / host.num_slots,
                "kv_offload_bytes_total": host.num_offloaded_pages * page_bytes,
                "kv_restore_bytes_total": host.num_restored_pages * page_bytes,
                "kv_offload_dropped_pages": host.num_dropped_offloads}

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "kv_usage": self.kv.usage, "num_pages": self.kv.num_usable_pages,
                "num_free_pages": self.kv.num_free_pages,
                "prompt_tokens_total": self.num_prompt_tokens_total,
                "generation_tokens_total": self.num_generation_tokens_total,
                "steps_total": self.num_steps_total, "device_wait_seconds_total": self.device_wait_seconds_total,
                "serial_host_seconds_total": self.serial_host_seconds_total,
                **self._host_tier_stats(),
                "compiles_after_warmup": self.runner.compiles_after_warmup,
                "warmup_pending": self.runner.warmup_pending(),
                "executable_unloads_total": self.runner.unloads, "executable_reloads_total": self.runner.reloads,
                **(self.spec.stats() if self.spec is not None else {}),
                **(self.expert_load.stats() if self.expert_load is not None else {})}
