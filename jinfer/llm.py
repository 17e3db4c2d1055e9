"""Offline batched generation, with vLLM's interface: `from jinfer import LLM, SamplingParams`.

    llm = LLM()                                   # the embedded default model
    outs = llm.generate(["Hello", {"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=64))
    outs[0].outputs[0].text
    LLM("Qwen3-Embedding-0.6B").embed(["a text"])[0].outputs.embedding   # an embedding model: its vectors

It drives the same EngineCore the server uses, in-process: all prompts are queued at once and the
scheduler batches them continuously. `data_parallel_size=N` builds N engines on disjoint devices (each
`tensor_parallel_size` of them); the prompts are shared out by length and the engines step in their
own threads (JAX releases the GIL while a device works).
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from jinfer.config.engine import EngineConfig
from jinfer.engine.args import VLLM_ARGS, compilation_cache_dir_from_env, vllm_engine_args
from jinfer.engine.core import EngineCore
from jinfer.outputs import CompletionOutput, EmbeddingOutput, EmbeddingRequestOutput, RequestOutput
from jinfer.pooling_params import PoolingParams
from jinfer.sampling_params import SamplingParams
from jinfer.tokenizer import Tokenizer

PromptType = str | dict[str, Any] | list[int]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: Any):
        """`model`: a Hugging Face ID, a directory, a .gguf file or dummy:<shape>; `engine_args`: EngineConfig's
        fields and vLLM's names for them (`jinfer.engine.args.vllm_engine_args`: enforce_eager, block_size...)."""
        known = {f.name for f in dataclasses.fields(EngineConfig)} | set(VLLM_ARGS)
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; known: {sorted(known - {'model'})}")
        config = EngineConfig(model=model, **compilation_cache_dir_from_env(vllm_engine_args(engine_args)))
        if config.distributed_executor_backend == "mp" and config.tensor_parallel_size > 1:
            raise ValueError("distributed_executor_backend='mp': LLM drives its GPUs from this process ('uni'); "
                             "one process per GPU is `jinfer serve`'s (or --nnodes groups started by hand)")
        self.engines = [EngineCore(dataclasses.replace(config, data_parallel_rank=i))
                        for i in range(config.data_parallel_size)]
        self.engine = self.engines[0]
        self._ids = itertools.count()

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the model's generation_config.json defaults (`generation_config=`, vLLM's)."""
        return SamplingParams(**self.engine.generation_defaults)

    def get_tokenizer(self) -> Tokenizer | None:
        return self.engine.tokenizer

    def _prompt_ids(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tok = self._require_tokenizer()
            return prompt, tok.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                return self._prompt_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        raise ValueError(f"prompt of type {type(prompt).__name__} must be a str, a list of token ids or a dict")

    def _require_tokenizer(self) -> Tokenizer:
        if self.engine.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompts as {'prompt_token_ids': [...]}")
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        results: dict[str, RequestOutput] = {}
        order, engine_of = [], {}
        load = [0] * len(self.engines)  # prompt tokens x samples given to each engine
        try:
            for prompt, sp in zip(prompts, params):
                text, ids = self._prompt_ids(prompt)
                rid = str(next(self._ids))
                e = min(range(len(self.engines)), key=load.__getitem__)
                self.engines[e].add_request(rid, ids, sp)
                load[e] += (len(ids) + (sp.max_tokens or 16)) * sp.n
                results[rid] = RequestOutput(rid, text, ids, [CompletionOutput(i) for i in range(sp.n)])
                order.append(rid)
                engine_of[rid] = e
            with tqdm(total=len(order), desc="generating", unit="req", disable=not use_tqdm or len(order) < 2,
                      leave=False) as bar:
                lock = threading.Lock()

                def drive(engine: EngineCore) -> None:
                    while engine.has_unfinished_requests():
                        deltas = engine.step()
                        with lock:
                            for delta in deltas:
                                out = results[delta.request_id]
                                out.add(delta, engine.tokenizer)  # (decodes the Logprobs' tokens)
                                if out.finished:
                                    bar.update(1)
                    engine.idle()  # as the server's loop: the host tier's waiting write-backs go out now

                busy = [e for e in self.engines if e.has_unfinished_requests()]
                if len(busy) <= 1:
                    for engine in busy:
                        drive(engine)
                else:
                    self._drive_threads(drive, busy)
        finally:
            for rid in order:
                if not results[rid].finished:
                    self.engines[engine_of[rid]].abort(rid)
        return [results[rid] for rid in order]

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[EmbeddingRequestOutput]:
        """vLLM's `LLM.embed` (an embedding model): each prompt's vector, `outputs.embedding`, in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = pooling_params or PoolingParams()
        results: dict[str, EmbeddingRequestOutput] = {}
        engine_of: dict[str, EngineCore] = {}
        try:
            for i, prompt in enumerate(prompts):
                ids = self._prompt_ids(prompt)[1]
                rid, engine = str(next(self._ids)), self.engines[i % len(self.engines)]
                engine.add_request(rid, ids, params)
                results[rid], engine_of[rid] = EmbeddingRequestOutput(rid, EmbeddingOutput([]), ids, False), engine
            with tqdm(total=len(results), desc="embedding", unit="req", disable=not use_tqdm or len(results) < 2,
                      leave=False) as bar:
                def drive(engine: EngineCore) -> None:
                    while engine.has_unfinished_requests():
                        for d in engine.step():
                            if d.embedding is None:
                                raise RuntimeError(f"embedding request {d.request_id} failed: {d.error}")
                            out = results[d.request_id]
                            out.outputs.embedding, out.finished = d.embedding_list(), True
                            bar.update(1)

                busy = [e for e in self.engines if e.has_unfinished_requests()]
                if len(busy) == 1:
                    drive(busy[0])
                elif busy:
                    self._drive_threads(drive, busy)
        finally:
            for rid, out in results.items():
                if not out.finished:
                    engine_of[rid].abort(rid)
        return list(results.values())

    @staticmethod
    def _drive_threads(drive, engines: list[EngineCore]) -> None:
        """Run `drive(engine)` for each engine in its own thread; re-raise the first failure."""
        errors: list[BaseException] = []

        def run(engine):
            try:
                drive(engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(e,), name=f"jinfer-dp{i}", daemon=True)
                   for i, e in enumerate(engines)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Chat completion for one conversation (a list of messages) or several."""
        tok = self._require_tokenizer()
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            text = tok.apply_chat_template(conv, add_generation_prompt=add_generation_prompt)
            prompts.append({"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)
