"""The serving path's host side without a model: what the HTTP server, the engine protocol and the router carry.

    python -m benchmarks.bench_host_path [--dp 1] [--num-prompts 512] [--output-len 128] [--runs 3] [--out F]
    python -m benchmarks.bench_host_path --client-only      # the bench_serving client against a trivial server

The real `jinfer serve` (server/launcher.py, `-dp N`) runs with `--core-factory` set to `StubCore` below: the real
engine process loop (engine/core_proc.py) and wire protocol around a core whose step costs nothing but a sleep
to the next step time (`JINFER_STUB_STEP_MS`, default 20 ms: up to max_num_seqs x 50 tokens/s per replica). It
emits what dummy:qwen3-4b's engine emits (no tokenizer: token ids, empty text), one token per running sequence per
step, admitting up to max_num_seqs. The client is benchmarks/bench_serving's `run` in this process (streaming,
every request at once, ignore_eos).

`--client-only` serves the same SSE bytes from a minimal asyncio HTTP server (a few microseconds per request and
chunk), so what it measures is the client alone.

Per run: output tok/s (wall), and for each process (server, engine(s), client) its CPU seconds over the run and
tokens per CPU second, i.e. what that piece would carry on one core of its own. Medians of `--runs` runs. On a
2-core machine the pieces share the cores, so the wall figure is bounded by their sum; the per-piece figures are
the ones that transfer to a GPU host with idle cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from jinfer.outputs import EngineOutput

ROOT = Path(__file__).resolve().parents[1]
STUB = "benchmarks.bench_host_path:StubCore"
VOCAB = 151936  # Qwen3's
SERVE_ARGS = ["--max-model-len", "2048", "--max-num-seqs", "256", "--max-num-batched-tokens", "2048",
              "--log-level", "warning"]  # as benchmarks/run_gpu_parallel.sh's dp part


class StubCore:
    """An EngineCore stand-in for the host path: FIFO admission up to max_num_seqs, one token per running sequence
    per step, a step every JINFER_STUB_STEP_MS (the time left to it slept, as a device step would be waited for)."""

    def __init__(self, config: dict[str, Any]):
        self.config = SimpleNamespace(max_num_seqs=config.get("max_num_seqs") or 256, chat_template=None)
        self.model_name, self.max_model_len = "stub", config.get("max_model_len") or 2048
        self.model_config = SimpleNamespace(vocab_size=VOCAB, hidden_size=0, pooling=False)
        self.tokenizer_path = None  # as dummy:<shape>: token ids only, empty text
        self.step_s = float(os.environ.get("JINFER_STUB_STEP_MS", "20")) / 1e3
        self.waiting: deque[list] = deque()
        self.running: dict[tuple[str, int], list] = {}  # (request id, sample) -> [next token, left, prompt len]
        self.next_step = 0.0
        self.generated = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int], params) -> None:
        left = params.max_tokens or self.max_model_len - len(prompt_token_ids)
        for i in range(params.n):
            self.waiting.append([(request_id, i), [prompt_token_ids[-1], left, len(prompt_token_ids)]])

    def abort(self, request_id: str) -> None:
        self.waiting = deque(w for w in self.waiting if w[0][0] != request_id)
        for key in [k for k in self.running if k[0] == request_id]:
            del self.running[key]

    def has_unfinished_requests(self) -> bool:
        return bool(self.running or self.waiting)

    def step(self) -> list[EngineOutput]:
        now = time.perf_counter()
        if now < self.next_step:
            time.sleep(self.next_step - now)
        self.next_step = max(now, self.next_step) + self.step_s
        while self.waiting and len(self.running) < self.config.max_num_seqs:
            key, seq = self.waiting.popleft()
            self.running[key] = seq
        outs = []
        for (rid, i), seq in list(self.running.items()):
            seq[0] = (seq[0] + 1) % VOCAB
            seq[1] -= 1
            done = seq[1] <= 0
            outs.append(EngineOutput(rid, i, [seq[0]], "", finished=done, finish_reason="length" if done else None,
                                     num_prompt_tokens=seq[2]))
            if done:
                del self.running[(rid, i)]
        self.generated += len(outs)
        return outs

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "generation_tokens_total": self.generated}


# ---- a trivial streaming server (--client-only) -------------------------------------------------------------

def _chunk(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


def _sse_events(output_len: int) -> list[bytes]:
    """The SSE events of one streamed completion as jinfer sends them (no text, usage last)."""
    head = b'{"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion","created":1700000000,' \
           b'"model":"stub","choices":'
    token = b'data: ' + head + b'[{"index":0,"text":"","logprobs":null,"finish_reason":null}],"usage":null}\n\n'
    finish = b'data: ' + head + b'[{"index":0,"text":"","logprobs":null,"finish_reason":"length",' \
                                b'"stop_reason":null}],"usage":null}\n\n'
    usage = b'data: ' + head + b'[],"usage":{"prompt_tokens":1024,"total_tokens":%d,"completion_tokens":%d}}\n\n' % (
        1024 + output_len, output_len)
    return [token] * output_len + [finish, usage, b"data: [DONE]\n\n"]


class _TrivialHTTP(asyncio.Protocol):
    """HTTP/1.1 keep-alive: GET /v1/models and POST (any path: a streamed completion of `output_len` chunks, one
    event loop turn apart, as a server sending each engine step's chunk)."""

    def __init__(self, output_len: int):
        self.events, self.buf = [_chunk(e) for e in _sse_events(output_len)], b""

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while b"\r\n\r\n" in self.buf:
            head, _, rest = self.buf.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), 0)
            if len(rest) < length:
                return
            self.buf = rest[length:]
            if head.startswith(b"GET"):
                body = b'{"object":"list","data":[{"id":"stub","object":"model"}]}'
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
                                     b"\r\n%s" % (len(body), body))
            else:
                self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                                     b"transfer-encoding: chunked\r\n\r\n")
                asyncio.get_running_loop().create_task(self._stream())

    async def _stream(self) -> None:
        for event in self.events:
            await asyncio.sleep(0)
            self.transport.write(event)
        self.transport.write(b"0\r\n\r\n")


def _serve_trivial(port: int, output_len: int) -> None:
    async def main():
        server = await asyncio.get_running_loop().create_server(lambda: _TrivialHTTP(output_len), "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# ---- the driver ---------------------------------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, port: int) -> subprocess.Popen:
    env = {**os.environ, "JINFER_STUB_STEP_MS": str(args.step_ms), "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    if args.client_only:
        cmd = [sys.executable, "-c", f"from benchmarks.bench_host_path import _serve_trivial as s; "
                                     f"s({port}, {args.output_len})"]
    else:
        profile = ["-m", "cProfile", "-o", args.profile_server] if args.profile_server else []
        cmd = [sys.executable, *profile, "-m", "server.launcher", "--port", str(port),
               "--core-factory", STUB, "-dp", str(args.dp), *SERVE_ARGS, *args.server_args]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=sys.stderr, stderr=subprocess.STDOUT)
    from benchmarks.wait_ready import wait_ready

    if wait_ready(f"http://127.0.0.1:{port}/v1/models", timeout=120, proc=proc) is None:
        proc.kill()
        raise RuntimeError("server not ready in 120 s")
    return proc


def one_run(args, port: int, server: subprocess.Popen, seed: int) -> dict:
    from benchmarks import bench_serving

    client_args = SimpleNamespace(base_url=f"http://127.0.0.1:{port}", model=None, num_prompts=args.num_prompts,
                                  input_len=args.input_len, output_len=args.output_len, range_ratio=0.0,
                                  request_rate=float("inf"), max_concurrency=None, vocab_size=VOCAB, warmup=0,
                                  timeout=600, seed=seed)
    pids = {"server": server.pid, **{f"engine{i}": p for i, p in enumerate(children(server.pid))}}
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    c0, t0 = time.process_time(), time.perf_counter()
    metrics = asyncio.run(bench_serving.run(client_args))
    wall, client_cpu = time.perf_counter() - t0, time.process_time() - c0
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    cpu["client"] = client_cpu
    tokens = metrics["output_throughput"] * metrics["duration_s"]
    if metrics["failed"]:
        print(f"{metrics['failed']} failed: {metrics['errors']}", file=sys.stderr)
    return {"output_tok_s": metrics["output_throughput"], "wall_s": wall, "tokens": tokens,
            "median_tpot_ms": metrics.get("median_tpot_ms"), "p99_ttft_ms": metrics.get("p99_ttft_ms"),
            "cpu_s": cpu, "tok_per_cpu_s": {name: tokens / max(s, 1e-9) for name, s in cpu.items()}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dp", type=int, default=1, help="--data-parallel-size of the server")
    ap.add_argument("--client-only", action="store_true", help="the client against a trivial streaming server")
    ap.add_argument("--num-prompts", type=int, default=512)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=20.0, help="the stub engine's step time")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="more `jinfer serve` options")
    ap.add_argument("--profile-server", metavar="FILE", help="run the server under cProfile (its event loop's thread)")
    ap.add_argument("--tag", default="", help="recorded in the JSON (e.g. before / after)")
    ap.add_argument("--out")
    args = ap.parse_args()
    port = free_port()
    server = start_server(args, port)
    try:
        runs = [one_run(args, port, server, seed) for seed in range(args.runs)]
    finally:
        server.terminate()
        server.wait(30)
    med = lambda f: statistics.median(f(r) for r in runs)
    names = list(runs[0]["cpu_s"])
    result = {
        "benchmark": "host_path", "what": "CPU measurement of the serving path's host side (no GPU, no model): "
        "jinfer serve with a stub engine core behind the real engine process and protocol, the bench_serving client",
        "tag": args.tag, "target": "trivial streaming server" if args.client_only else f"jinfer serve -dp {args.dp}",
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "stub_step_ms": args.step_ms, "server_args": SERVE_ARGS + args.server_args, "runs": args.runs,
        "host": f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
        "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                 cwd=ROOT).stdout.strip(),
        "median_output_tok_s": med(lambda r: r["output_tok_s"]),
        "median_cpu_s": {n: med(lambda r, n=n: r["cpu_s"][n]) for n in names},
        "median_tok_per_cpu_s": {n: med(lambda r, n=n: r["tok_per_cpu_s"][n]) for n in names},
        "per_run": runs,
    }
    text = json.dumps(result, indent=2)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)
    per = ", ".join(f"{n} {v:,.0f}" for n, v in result["median_tok_per_cpu_s"].items())
    print(f"host path ({result['target']}): {result['median_output_tok_s']:,.0f} out tok/s; tok per CPU s: {per}",
          file=sys.stderr)


if __name__ == "__main__":
    main()
