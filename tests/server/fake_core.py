"""A deterministic EngineCore stand-in (no model): tests of the engine process, the ZMQ client and the HTTP
server that do not need a real model. Sample i of a request emits tokens last_prompt_token + 1 + i, +2, ...
(mod vocab) with text " <id>", until max_tokens; prompt token FAIL_TOKEN makes step() raise (JINFER_FAKE_FAIL_TOKEN=-1:
never, for fuzzers whose prompts may hold any id). With
prompt_logprobs k, the first delta has prompt token j's logprob -j/1000 and top k ids prompt[j] + 1.. (logprob
-0.1 i)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

from jinfer.engine.input_processor import check_request
from jinfer.errors import InvalidParam
from jinfer.outputs import EngineOutput
from jinfer.sampling_params import SamplingParams
from jinfer.weights.loader import default_model_path

FAIL_TOKEN = 999
VOCAB = 49152  # the default model's, so that its tokenizer can stand beside the fake


class FakeCore:
    def __init__(self, config: dict[str, Any]):
        self.config = SimpleNamespace(max_num_seqs=config.get("max_num_seqs", 8), model=None)
        self.model_name = "fake-model"
        self.max_model_len = config.get("max_model_len", 64)
        self.model_config = SimpleNamespace(vocab_size=VOCAB)
        self.tokenizer = None
        self.tokenizer_path = str(default_model_path()) if default_model_path().is_file() else None
        self.eos_token_ids = (0,)
        self.step_delay = config.get("step_delay", float(os.environ.get("JINFER_FAKE_STEP_DELAY", "0")))
        self.fail_token = int(os.environ.get("JINFER_FAKE_FAIL_TOKEN", FAIL_TOKEN))
        self.num_pages = 100
        self.seqs: dict[tuple[str, int], dict[str, Any]] = {}
        self.num_prompt_tokens = self.num_generation_tokens = 0  # running totals, as the real core's stats

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if any(rid == request_id for rid, _ in self.seqs):
            raise InvalidParam("request_id", f"request_id={request_id!r} is already in use")
        prompt_token_ids = check_request(prompt_token_ids, params, VOCAB, self.max_model_len)  # the engine's checks
        max_tokens = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        self.num_prompt_tokens += len(prompt_token_ids) * params.n
        for i in range(params.n):
            self.seqs[(request_id, i)] = dict(next=prompt_token_ids[-1] + 1 + i, left=max_tokens,
                                              prompt=len(prompt_token_ids), params=params,
                                              fail=self.fail_token in prompt_token_ids,
                                              prompt_ids=list(prompt_token_ids))

    def abort(self, request_id: str) -> None:
        for key in [k for k in self.seqs if k[0] == request_id]:
            del self.seqs[key]

    def has_unfinished_requests(self) -> bool:
        return bool(self.seqs)

    def step(self) -> list[EngineOutput]:
        time.sleep(self.step_delay)
        if any(s["fail"] for s in self.seqs.values()):
            raise RuntimeError("injected failure")
        outs = []
        for (rid, i), s in list(self.seqs.items()):
            tok = s["next"] % VOCAB
            s["next"] += 1
            s["left"] -= 1
            self.num_generation_tokens += 1
            lps = None
            if s["params"].logprobs is not None:
                lps = [{tok: -0.5, **{(tok + k) % VOCAB: -1.0 - k for k in range(1, s["params"].logprobs + 1)}}]
            done = s["left"] == 0
            plp, k = None, s["params"].prompt_logprobs
            if k is not None and "plp_sent" not in s:
                s["plp_sent"] = True
                plp = [None] + [{t: -j / 1000, **{(t + m) % VOCAB: -0.1 * m for m in range(1, k + 1)}}
                                for j, t in enumerate(s["prompt_ids"][1:], 1)]
            outs.append(EngineOutput(rid, i, [tok], f" {tok}", finished=done,
                                     finish_reason="length" if done else None, new_logprobs=lps,
                                     num_prompt_tokens=s["prompt"], prompt_logprobs=plp))
            if done:
                del self.seqs[(rid, i)]
        return outs

    def stats(self) -> dict[str, float]:
        used = len(self.seqs)
        return {"num_running": used, "num_waiting": 0, "kv_usage": used / self.num_pages,
                "num_pages": self.num_pages, "num_free_pages": self.num_pages - used,
                "prefix_cache_hit_rate": 0.0, "prompt_tokens_total": self.num_prompt_tokens,
                "generation_tokens_total": self.num_generation_tokens,
                "prefix_cache_queries": self.num_prompt_tokens, "prefix_cache_hits": 0, "num_preemptions_total": 0}


def make_fake_core(config: dict[str, Any]) -> FakeCore:
    return FakeCore(config)


def broken_core(config: dict[str, Any]) -> FakeCore:
    raise RuntimeError("no such model")


def slow_core(config: dict[str, Any]) -> FakeCore:
    """A fake core whose 'model load' takes 30 s (start-up paths that must not wait for it)."""
    import time

    time.sleep(30)
    return make_fake_core(config)


def compiling_core(config: dict[str, Any]) -> FakeCore:
    """A fake core that, like a staged warm-up, leaves a 'compile' of 60 s running in a pool thread named as
    the model runner's are (interpreter exit would wait for it)."""
    import time
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jinfer-warmup")
    pool.submit(time.sleep, 60)
    core = make_fake_core(config)
    core.background = pool  # type: ignore[attr-defined]
    return core


def deaf_slow_core(config: dict[str, Any]) -> FakeCore:
    """A 30 s 'model load' that ignores SIGTERM meanwhile, as a process does once `jax.distributed.initialize`
    has installed XLA's preemption notifier."""
    import signal
    import time

    signal.signal(signal.SIGTERM, lambda *_: None)
    time.sleep(30)
    return make_fake_core(config)
