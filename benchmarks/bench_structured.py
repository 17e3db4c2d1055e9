"""Structured outputs: the host cost of the grammar masks per step, and TPOT with and without a schema.

    # once, where the default GGUF is: its tokenizer as tokenizer.json (+ --vocab-size to grow it to a
    # Qwen-sized vocabulary by merging pairs of its tokens), a directory the GPU run can carry
    python -m benchmarks.bench_structured export-tokenizer --out build/tokenizer-bench --vocab-size 151643
    # then (GPU): both parts, one JSON
    python -m benchmarks.bench_structured run --tokenizer build/tokenizer-bench --shape qwen3-4b \
        --batch-sizes 1 32 256 --out $OUT/structured_qwen3-4b_h100.json

`masks`: B llguidance matchers on a JSON schema (nested objects, arrays, enums, bounded strings and
integers) walk random allowed tokens; per step we time `GrammarEngine.fill_masks` (all B masks, on
llguidance's thread pool, into the u32[B, ceil(V/32)] buffer the sampler takes) and `advance` (B tokens
consumed), which is what the engine adds to a step on the host.

`tpot`: EngineCore on dummy weights of a real shape with that tokenizer; a batch of B requests, greedy,
`output_len` tokens each, once free and once under a schema that cannot complete within them (so both
runs decode the same number of steps). TPOT is the mean time per decode step, as in bench_latency, and
the engine's own host time in the grammar calls is recorded per step. Each configuration runs twice and
the second run is timed (no compile in a figure).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ITEM = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 16},
    "qty": {"type": "integer", "minimum": 0, "maximum": 1000},
    "tags": {"type": "array", "items": {"enum": ["new", "sale", "used", "rare"]}, "maxItems": 3},
    "dims": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 99},
                                              "h": {"type": "integer", "minimum": 1, "maximum": 99}},
             "required": ["w", "h"], "additionalProperties": False},
    "note": {"anyOf": [{"type": "string", "maxLength": 24}, {"type": "null"}]}},
    "required": ["name", "qty", "tags", "dims", "note"], "additionalProperties": False}
# Long enough that no request completes it within the benchmark's output length.
SCHEMA = {"type": "object", "properties": {"order": {"type": "integer", "minimum": 1, "maximum": 99999},
                                           "items": {"type": "array", "items": ITEM, "minItems": 200}},
          "required": ["order", "items"], "additionalProperties": False}
# The same without minItems (which unrolls 200 copies of ITEM into the grammar): what a typical response
# schema looks like; it can complete (the mask walk then starts over), so only `masks` uses it.
TYPICAL = {**SCHEMA, "properties": {**SCHEMA["properties"], "items": {"type": "array", "items": ITEM}}}
SCHEMAS = {"stress": SCHEMA, "typical": TYPICAL}


# ---- export-tokenizer -----------------------------------------------------------------------------------


def export_tokenizer(gguf: str | None, out: str, vocab_size: int | None, seed: int = 0) -> dict:
    """Write the GGUF's tokenizer as tokenizer.json + tokenizer_config.json. With `vocab_size`, first add
    tokens a+b (pairs of existing tokens; b a plain word piece, no leading space) with their merges until
    the vocabulary has that many tokens: a stand-in for a Qwen-sized vocabulary (151,643 tokens)."""
    from jinfer.tokenizer import Tokenizer
    from jinfer.weights.loader import default_model_path

    tok = Tokenizer.from_pretrained(gguf or default_model_path())
    data = json.loads(tok.backend.to_str())
    vocab, merges = data["model"]["vocab"], data["model"]["merges"]
    added = len({a["content"] for a in data.get("added_tokens", [])} - set(vocab))  # not in the model's vocab
    if vocab_size is not None and vocab_size > len(vocab) + added:
        rng = np.random.default_rng(seed)
        words = [t for t in vocab if t.isalpha() and t.isascii()]
        heads = [t for t in vocab if t.isascii() and t.replace("Ġ", "").isalpha()]
        next_id = max(max(vocab.values()), max((a["id"] for a in data.get("added_tokens", [])), default=0)) + 1
        while len(vocab) + added < vocab_size:
            a, b = heads[rng.integers(len(heads))], words[rng.integers(len(words))]
            if a + b in vocab:
                continue
            vocab[a + b] = next_id
            merges.append([a, b] if merges and isinstance(merges[0], list) else f"{a} {b}")
            next_id += 1
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    eos = tok.id_to_token(tok.eos_token_ids[0])
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos, "bos_token": None}))
    return {"tokens": len(vocab) + added, "eos": eos, "dir": str(path)}


# ---- masks ---------------------------------------------------------------------------------------------


def _pick(masks: np.ndarray, rows: int, rng: np.random.Generator) -> list[int]:
    bits = np.unpackbits(masks[:rows].view(np.uint8), axis=1, bitorder="little")
    return [int(rng.choice(np.flatnonzero(row))) for row in bits]


def bench_masks(tokenizer, vocab_size: int, batch_sizes: list[int], steps: int, schema: str = "stress",
                independent: bool = False) -> list[dict]:
    from llguidance.numpy import fill_next_token_bitmask

    from jinfer.engine.grammar import GrammarEngine
    from jinfer.engine.sampling_tensors import mask_words
    from jinfer.structured_outputs import StructuredOutputsParams

    rng = np.random.default_rng(0)
    rows = []
    for B in batch_sizes:
        grammar = GrammarEngine(tokenizer, vocab_size, tokenizer.eos_token_ids)
        so = StructuredOutputsParams(json=SCHEMAS[schema])
        t0 = time.perf_counter()
        grammar.matcher(so)
        compile_ms = (time.perf_counter() - t0) * 1e3  # includes the tokenizer's one-time set-up
        t0 = time.perf_counter()
        if independent:  # each its own compile: no state shared between the copies
            import llguidance

            grammar_str = so.to_grammar()
            matchers = [llguidance.LLMatcher(grammar.ll_tokenizer, grammar_str, log_level=0) for _ in range(B)]
        else:
            matchers = [grammar.matcher(so) for _ in range(B)]
        copy_us = (time.perf_counter() - t0) / B * 1e6
        fill, advance, serial, worst_row = [], [], [], []
        for _ in range(steps):
            # the same masks one row at a time on this thread, on copies (a matcher caches the mask of its
            # state, so the pool below computes them afresh): the pool's speed-up and the slowest row
            scratch, per_row = np.empty((B, mask_words(vocab_size)), np.int32), []
            for b, m in enumerate([m.deep_copy() for m in matchers]):
                t0 = time.perf_counter()
                fill_next_token_bitmask(m, scratch, b)
                per_row.append(time.perf_counter() - t0)
            serial.append(sum(per_row))
            worst_row.append(max(per_row))
            t0 = time.perf_counter()
            masks = grammar.fill_masks([(m, b) for b, m in enumerate(matchers)], B)
            fill.append(time.perf_counter() - t0)
            tokens = _pick(masks, B, rng)
            t0 = time.perf_counter()
            for m, t in zip(matchers, tokens, strict=True):
                if grammar.advance(m, t):
                    m.reset()
            advance.append(time.perf_counter() - t0)
        f, a = np.asarray(fill[2:]) * 1e3, np.asarray(advance[2:]) * 1e3
        ser, worst = np.asarray(serial[2:]) * 1e3, np.asarray(worst_row[2:]) * 1e3
        row = {"batch_size": B, "schema": schema, "independent_matchers": independent, "fill_masks_ms": float(f.mean()),
               "fill_masks_p50_ms": float(np.median(f)), "serial_fill_ms": float(ser.mean()),
               "pool_speedup": float(ser.mean() / f.mean()), "slowest_row_ms": float(worst.mean()),
               "fill_masks_p99_ms": float(np.percentile(f, 99)), "advance_ms": float(a.mean()),
               "host_ms_per_step": float(f.mean() + a.mean()),
               "per_row_us": float((f.mean() + a.mean()) / B * 1e3), "compile_ms": compile_ms,
               "matcher_copy_us": copy_us, "mask_bytes_per_step": int(masks.nbytes)}
        rows.append(row)
        tag = schema + (" independent" if independent else "")
        print(f"masks {tag} B={B}: fill {row['fill_masks_ms']:.3f} ms (p99 {row['fill_masks_p99_ms']:.3f}; "
              f"serial {row['serial_fill_ms']:.3f}, slowest row {row['slowest_row_ms']:.3f}), advance "
              f"{row['advance_ms']:.3f} ms, {row['per_row_us']:.1f} us/row; compile {compile_ms:.0f} ms")
    return rows


# ---- tpot ----------------------------------------------------------------------------------------------


class _HostTimer:
    """Wraps GrammarEngine.fill_masks / advance to sum the engine's host time in them."""

    def __init__(self, grammar):
        self.total = 0.0
        for name in ("fill_masks", "advance"):
            fn = getattr(grammar, name)
            setattr(grammar, name, self._timed(fn))

    def _timed(self, fn):
        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total += time.perf_counter() - t0
        return wrapper


def run_batch(core, prompts, params, tag: str, timer: _HostTimer) -> dict:
    for i, p in enumerate(prompts):
        core.add_request(f"{tag}-{i}", p, params)
    first_seen: set[str] = set()
    step_times, host = [], []
    decode_start = None
    while core.has_unfinished_requests():
        h0, t = timer.total, time.perf_counter()
        outs = core.step()
        step_times.append(time.perf_counter() - t)
        host.append(timer.total - h0)
        first_seen.update(o.request_id for o in outs if o.new_token_ids)
        if decode_start is None and len(first_seen) == len(prompts):
            decode_start = len(step_times)
    decode = np.asarray(step_times[decode_start:]) * 1e3
    grammar_ms = np.asarray(host[decode_start:]) * 1e3
    return {"tpot_ms": float(decode.mean()), "tpot_p50_ms": float(np.median(decode)),
            "tpot_p99_ms": float(np.percentile(decode, 99)), "decode_steps": int(len(decode)),
            "grammar_host_ms_per_step": float(grammar_ms.mean())}


def bench_tpot(args, tokenizer) -> tuple[list[dict], dict]:
    from benchmarks.common import profiled
    from jinfer.config.engine import EngineConfig
    from jinfer.engine.core import EngineCore
    from jinfer.sampling_params import SamplingParams
    from jinfer.structured_outputs import StructuredOutputsParams

    model = args.shape if "/" in args.shape else f"dummy:{args.shape}"
    core = EngineCore(EngineConfig(model=model, dtype=args.dtype, max_model_len=args.input_len + args.output_len,
                                   max_num_seqs=max(args.batch_sizes), warmup=False,
                                   max_num_batched_tokens=args.max_num_batched_tokens), tokenizer=tokenizer)
    timer = _HostTimer(core.grammar)
    free = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    schema = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    rng = np.random.default_rng(0)
    rows = []
    for B in args.batch_sizes:
        make = lambda n=B: [rng.integers(0, tokenizer.vocab_size, args.input_len).tolist() for _ in range(n)]
        row = {"batch_size": B}
        for name, params in (("free", free), ("schema", schema)):
            run_batch(core, make(), params, f"warm-{name}{B}", timer)
            with profiled(args.profile and name == "schema" and f"{args.profile}/schema_b{B}"):
                r = run_batch(core, make(), params, f"{name}{B}", timer)
            row.update({f"{name}_{k}": v for k, v in r.items()})
        row["tpot_overhead_ms"] = row["schema_tpot_ms"] - row["free_tpot_ms"]
        row["tpot_ratio"] = row["schema_tpot_ms"] / row["free_tpot_ms"]
        rows.append(row)
        print(f"tpot B={B}: free {row['free_tpot_ms']:.2f} ms, schema {row['schema_tpot_ms']:.2f} ms "
              f"({row['tpot_ratio']:.3f}x; grammar host time {row['schema_grammar_host_ms_per_step']:.2f} ms/step)")
    info = {"shape": args.shape, "dtype": args.dtype, "input_len": args.input_len, "output_len": args.output_len,
            "async_scheduling": core.config.async_scheduling, "attention_backend": core.runner.ops.backend}
    return rows, info


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export-tokenizer", help="write a tokenizer directory for the run")
    ex.add_argument("--gguf", default=None, help="default: the embedded SmolLM2 GGUF")
    ex.add_argument("--out", required=True)
    ex.add_argument("--vocab-size", type=int, default=None, help="grow the vocabulary to this many tokens")
    run = sub.add_parser("run")
    run.add_argument("--tokenizer", required=True, help="a directory with tokenizer.json (export-tokenizer)")
    run.add_argument("--parts", default="masks,tpot")
    run.add_argument("--shape", default="qwen3-4b", help="named shape (dummy weights) or a model path")
    run.add_argument("--dtype", default="bfloat16")
    run.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    run.add_argument("--mask-steps", type=int, default=64)
    run.add_argument("--independent-matchers", action="store_true",
                     help="masks part: compile each row's matcher (no deep copies sharing state)")
    run.add_argument("--mask-schemas", nargs="+", default=["stress"], choices=sorted(SCHEMAS),
                     help="schemas for the masks part (tpot always uses 'stress', which cannot complete)")
    run.add_argument("--input-len", type=int, default=128)
    run.add_argument("--output-len", type=int, default=128)
    run.add_argument("--max-num-batched-tokens", type=int, default=2048)
    run.add_argument("--out")
    run.add_argument("--profile", metavar="DIR", help="a jax.profiler trace of each timed run under a schema")
    args = ap.parse_args()
    if args.cmd == "export-tokenizer":
        print(json.dumps(export_tokenizer(args.gguf, args.out, args.vocab_size)))
        return

    import llguidance

    from benchmarks.common import environment, write_result
    from jinfer.config.model import NAMED_SHAPES
    from jinfer.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(args.tokenizer)
    vocab = NAMED_SHAPES[args.shape].vocab_size if args.shape in NAMED_SHAPES else tokenizer.vocab_size
    result = {"benchmark": "structured_outputs", **environment(), "llguidance": llguidance.__version__
              if hasattr(llguidance, "__version__") else llguidance.get_version(),
              "tokenizer_tokens": tokenizer.vocab_size, "model_vocab": vocab, "schema": SCHEMA}
    import os

    result["host_cpus"] = os.cpu_count()
    if "masks" in args.parts:
        result["masks"] = [r for name in args.mask_schemas
                           for r in bench_masks(tokenizer, vocab, args.batch_sizes, args.mask_steps, name,
                                                args.independent_matchers)]
    if "tpot" in args.parts:
        result["tpot"], info = bench_tpot(args, tokenizer)
        result.update(info)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
