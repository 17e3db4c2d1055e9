"""Serving benchmark against a running `jinfer serve` (or any OpenAI-compatible server), with the
metrics and definitions of `vllm bench serve`, so results compare directly.

    jinfer serve dummy:qwen3-4b --port 8000 &
    python -m benchmarks.bench_serving --base-url http://127.0.0.1:8000 --num-prompts 200 \
        --input-len 1024 --output-len 128 --request-rate 16

Requests arrive as a Poisson process at `--request-rate` (inf: all at once), optionally capped at
`--max-concurrency` in flight. Prompts are random token ids (`--input-len` each, or uniform in
[input_len*(1-range), input_len*(1+range)] with `--range-ratio`), streamed via /v1/completions with
ignore_eos so every request produces exactly its output length.
- TTFT: request sent -> first streamed token.  TPOT: (latency - TTFT) / (output tokens - 1).
- ITL: gaps between consecutive streamed chunks.  E2EL: request sent -> last token.

Requests are spread over several httpx clients of at most CONNECTIONS_PER_CLIENT connections each: httpx's pool
scans all its connections, twice over, whenever a request starts or ends, and with 512 connections in one pool
that scan was most of the client's CPU time (its p99 TTFT then measured the client).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import time

import httpx
import numpy as np

from benchmarks.common import write_result

CONNECTIONS_PER_CLIENT = 32


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: list[int], out_len: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": out_len, "temperature": 0.0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, last, itl, n_out, error = None, t0, [], 0, None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                return {"ok": False, "error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    n_out = chunk["usage"]["completion_tokens"]
                choice = chunk["choices"][0] if chunk.get("choices") else None
                if choice is not None and choice.get("finish_reason") is None:  # a token chunk
                    if ttft is None:
                        ttft = now - t0
                    else:
                        itl.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        error = repr(e)
    if error or ttft is None:
        return {"ok": False, "error": error or "no token received"}
    latency = last - t0
    return {"ok": True, "ttft": ttft, "latency": latency, "itl": itl, "output_len": n_out, "input_len": len(prompt),
            "tpot": (latency - ttft) / (n_out - 1) if n_out > 1 else 0.0}


def percentiles(values, name: str, scale: float = 1e3) -> dict:
    v = np.asarray(values, np.float64) * scale
    if not len(v):
        return {}
    return {f"mean_{name}_ms": float(v.mean()), f"median_{name}_ms": float(np.median(v)),
            f"p99_{name}_ms": float(np.percentile(v, 99))}


async def run(args) -> dict:
    rng = np.random.default_rng(args.seed)
    lo = max(1, int(args.input_len * (1 - args.range_ratio)))
    hi = int(args.input_len * (1 + args.range_ratio))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    ssl_context = httpx.create_ssl_context()  # (one for all the clients: each takes ~40 ms to build)
    concurrency = args.max_concurrency or args.num_prompts
    async with contextlib.AsyncExitStack() as stack:
        clients = [await stack.enter_async_context(httpx.AsyncClient(timeout=httpx.Timeout(args.timeout),
                                                                     limits=limits, verify=ssl_context))
                   for _ in range(-(-concurrency // CONNECTIONS_PER_CLIENT))]
        models = (await clients[0].get(f"{args.base_url}/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        vocab = args.vocab_size
        prompts = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.num_prompts)]
        gaps = (np.zeros(args.num_prompts) if args.request_rate == float("inf")
                else rng.exponential(1.0 / args.request_rate, args.num_prompts))
        sem = asyncio.Semaphore(concurrency)
        url = f"{args.base_url}/v1/completions"
        turn = itertools.count()

        async def limited(p):
            async with sem:
                return await one_request(clients[next(turn) % len(clients)], url, model, p, args.output_len)

        if args.warmup:
            await asyncio.gather(*(limited(p) for p in prompts[:args.warmup]))
        t0 = time.perf_counter()
        tasks = []
        for p, gap in zip(prompts, gaps):
            tasks.append(asyncio.create_task(limited(p)))
            await asyncio.sleep(gap)
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    out_tokens = sum(r["output_len"] for r in ok)
    in_tokens = sum(r["input_len"] for r in ok)
    metrics = {
        "completed": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
        "request_throughput": len(ok) / duration, "output_throughput": out_tokens / duration,
        "total_token_throughput": (in_tokens + out_tokens) / duration,
        **percentiles([r["ttft"] for r in ok], "ttft"), **percentiles([r["tpot"] for r in ok], "tpot"),
        **percentiles([x for r in ok for x in r["itl"]], "itl"), **percentiles([r["latency"] for r in ok], "e2el"),
        "errors": sorted({r["error"] for r in results if not r["ok"]})[:5],
    }
    return {"model": model, **metrics}


def server_gauge(base_url: str, name: str) -> float | None:
    """A gauge from the server's Prometheus /metrics, summed over its labels (replicas); None if the server does not
    export it."""
    try:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    values = [float(line.split()[-1]) for line in text.splitlines()
              if line.startswith(name + " ") or line.startswith(name + "{")]
    return sum(values) if values else None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.0)
    ap.add_argument("--request-rate", type=float, default=float("inf"))
    ap.add_argument("--max-concurrency", type=int)
    ap.add_argument("--vocab-size", type=int, default=32000, help="random prompt ids are drawn below this")
    ap.add_argument("--warmup", type=int, default=0, help="requests sent (untimed) before the run")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="unknown", help="recorded in the JSON (the server's GPU)")
    ap.add_argument("--out")
    args = ap.parse_args()
    metrics = asyncio.run(run(args))
    metrics["server_compiles_after_warmup"] = server_gauge(args.base_url, "jinfer_compiles_after_warmup")
    from benchmarks.common import environment
    env = environment()
    env["device"] = args.device  # the client process may run on CPU; the server's device is what counts
    result = {"benchmark": "serving", **env, "shape": metrics.pop("model"), "num_prompts": args.num_prompts,
              "input_len": args.input_len, "output_len": args.output_len, "request_rate": args.request_rate,
              "max_concurrency": args.max_concurrency, **metrics}
    write_result(result, args.out)
    print(f"serving: {result['request_throughput']:.2f} req/s, {result['output_throughput']:.0f} out tok/s, "
          f"TTFT p99 {result.get('p99_ttft_ms', float('nan')):.0f} ms, TPOT median "
          f"{result.get('median_tpot_ms', float('nan')):.1f} ms, failed {result['failed']}")


if __name__ == "__main__":
    main()
