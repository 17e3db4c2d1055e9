"""EngineClient: the low-latency way to call an engine process over ZeroMQ (no HTTP).

    client = EngineClient.spawn(EngineConfig(...))        # start an engine process and own it
    client = EngineClient.connect("ipc:///tmp/x/engine.sock")   # or share a running one
    out = client.generate("Hello", SamplingParams(max_tokens=8))         # sync -> RequestOutput
    async for delta in client.stream([1, 2, 3], params): ...            # asyncio -> EngineOutput deltas
    client.abort(request_id); client.stats(); client.is_alive; client.close()

One background thread owns the DEALER socket (ZeroMQ sockets are single-threaded): callers from any
thread or event loop hand it frames through a queue and a wake-up pipe, and it routes each engine
delta to its request's queue (one `call_soon_threadsafe` per event loop per engine message). It also
watches liveness every LIVENESS_POLL_S: an owned process that exits, a dropped connection or an
EngineError fails every in-flight request with `EngineDeadError` within a second.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from jinfer.engine import protocol as proto
from jinfer.engine.spawn import default_address, start_engine_process
from jinfer.errors import invalid_param
from jinfer.outputs import CompletionOutput, EngineOutput, RequestOutput
from jinfer.pooling_params import PoolingParams
from jinfer.sampling_params import SamplingParams

log = logging.getLogger("jinfer.client")

LIVENESS_POLL_S = 0.1
Prompt = str | Sequence[int]


class EngineDeadError(RuntimeError):
    """The engine process is gone (or the client is closed): in-flight requests are lost."""


class RequestError(RuntimeError):
    """The engine finished a request with an error (the engine itself goes on)."""


_DONE = object()  # queue item: the request has no more deltas


@dataclass
class _Pending:
    tag: int  # which prompt of a batch
    queue: Any  # queue.SimpleQueue (sync) or asyncio.Queue (async)
    loop: asyncio.AbstractEventLoop | None
    open_seqs: set[int] = field(default_factory=set)


class EngineClient:
    def __init__(self, address: str, *, process: subprocess.Popen | None = None, startup_timeout: float = 900.0,
                 name: str = "client", ipc_dir: str | None = None):
        self.address, self.process, self._ipc_dir = address, process, ipc_dir
        self.info: proto.EngineReady | None = None
        self.latest_stats: dict[str, float] = {}
        self._dead: str | None = None
        self._closing = False
        self._pending: dict[str, _Pending] = {}
        self._stats_waiters: dict[int, Callable[[Any], None]] = {}
        self._tokens = itertools.count(1)
        self._lock = threading.Lock()
        self._outbox: deque[bytes] = deque()
        self._death_callbacks: list[Callable[[str], None]] = []
        self._ready = threading.Event()
        self._tokenizer = None
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        for option in (zmq.LINGER, zmq.SNDHWM, zmq.RCVHWM):  # no limits: the engine's deltas must never drop
            self._sock.setsockopt(option, 0)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._wake_lock = threading.Lock()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock.connect(address)
        self._thread = threading.Thread(target=self._io_loop, name=f"jinfer-{name}-io", daemon=True)
        self._thread.start()
        self._send(proto.Hello(client_name=name))
        deadline = time.monotonic() + startup_timeout
        try:
            while not self._ready.wait(0.1):
                if self._dead or time.monotonic() > deadline:
                    reason = self._dead or f"no answer from the engine at {address} within {startup_timeout:.0f} s"
                    raise EngineDeadError(f"engine did not start: {reason}")
        except BaseException:  # also Ctrl-C while the model loads: never leave the process behind
            self.close()
            raise

    @classmethod
    def spawn(cls, config: Any = None, *, address: str | None = None, core_factory: str | None = None,
              startup_timeout: float = 900.0, name: str = "client") -> EngineClient:
        """Start an engine process for `config` (an EngineConfig; None = defaults) and connect to it."""
        ipc_dir = None
        if address is None:
            address = default_address()
            ipc_dir = os.path.dirname(address.removeprefix("ipc://"))
        proc = start_engine_process(config if config is not None else {}, address, core_factory=core_factory,
                                    owned_ipc_dir=ipc_dir)
        return cls(address, process=proc, startup_timeout=startup_timeout, name=name, ipc_dir=ipc_dir)

    @classmethod
    def connect(cls, address: str, *, startup_timeout: float = 60.0, name: str = "client") -> EngineClient:
        """Share an engine process somebody else started."""
        return cls(address, startup_timeout=startup_timeout, name=name)

    # ---- state ---------------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._dead is None and not self._closing

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def replicas(self) -> list[EngineClient]:
        """The engines behind this client (one; `jinfer.parallel.replicas.ReplicaClient` has several)."""
        return [self]

    def add_death_callback(self, fn: Callable[[str], None]) -> None:
        """`fn(reason)` runs on the client's I/O thread once, when the engine is found dead."""
        self._death_callbacks.append(fn)

    @property
    def tokenizer(self):
        """The engine's tokenizer, loaded in this process on first use (same host); None if it has none."""
        if self._tokenizer is None:
            from jinfer.tokenizer import Tokenizer

            path = self.info.tokenizer_path if self.info else None
            if path is None:
                return None
            self._tokenizer = Tokenizer.from_pretrained(path)
            if self.info.chat_template is not None:  # the engine's --chat-template
                self._tokenizer.chat_template = self.info.chat_template
            gguf_meta = sys.modules.get("jinfer.weights.gguf_meta")
            if gguf_meta is not None:  # a GGUF's tokenizer: drop the file's mapping and tensor list
                gguf_meta.open_gguf.cache_clear()
        return self._tokenizer

    def _logprob_tokenizer(self, delta: EngineOutput):
        """The tokenizer for a delta's logprobs' decoded tokens (loaded only when a delta has logprobs)."""
        return self.tokenizer if delta.new_logprobs is not None or delta.prompt_logprobs is not None else None

    def close(self) -> None:
        """Disconnect; an owned engine process is shut down (Shutdown, then SIGTERM, then SIGKILL)."""
        if self._closing:
            return
        if self.process is not None and self._dead is None and self._ready.is_set():
            self._send(proto.Shutdown())
        self._closing = True
        self._fail_all("the engine client was closed")
        if threading.current_thread() is not self._thread:
            self._wake()
            self._thread.join(2.0)
            with self._wake_lock:  # never write to a closed (maybe reused) descriptor
                os.close(self._wake_w)
                self._wake_w = -1
        if self.process is not None:
            # Before EngineReady the engine is loading and reads no messages: SIGTERM at once.
            steps = [(None, 10.0)] if self._ready.is_set() else []
            for action, wait in steps + [(self.process.terminate, 5.0), (self.process.kill, 5.0)]:
                if action is not None:
                    action()
                try:
                    self.process.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    log.warning("engine process %d did not exit in %.0f s", self.process.pid, wait)
        if self._ipc_dir:
            shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- requests ------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("the engine has no tokenizer: send token ids, not text")
            return self.tokenizer.encode(prompt)
        return list(map(int, prompt))

    def _add(self, request_id: str, ids: list[int], params: SamplingParams | PoolingParams, tag: int, q: Any,
             loop: asyncio.AbstractEventLoop | None) -> None:
        with self._lock:
            if not self.is_alive:
                raise EngineDeadError(self._dead or "the engine client is closed")
            if request_id in self._pending:
                raise ValueError(f"request_id={request_id!r} is already in use")
            self._pending[request_id] = _Pending(tag, q, loop, set(range(params.n)))
        if isinstance(params, PoolingParams):  # an embedding request
            self._send(proto.AddRequest(request_id, ids, {}, pooling=params.to_dict()))
        else:
            self._send(proto.AddRequest(request_id, ids, params.to_dict()))

    def abort(self, request_id: str) -> None:
        """Stop a request: its unfinished samples end with finish_reason "abort"; the engine frees its pages."""
        with self._lock:
            p = self._pending.pop(request_id, None)
        if p is None:
            return
        finals = [EngineOutput(request_id, i, [], "", finished=True, finish_reason="abort")
                  for i in sorted(p.open_seqs)]
        self._deliver([(p, [(p.tag, o) for o in finals] + [(p.tag, _DONE)])])
        if self.is_alive:
            self._send(proto.Abort([request_id]))

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                 timeout: float | None = None) -> RequestOutput:
        """Run one request to the end (blocking). ValueError if the engine refuses it."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        rid = request_id or uuid.uuid4().hex
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._add(rid, ids, params, 0, q, None)
        result = RequestOutput(rid, prompt if isinstance(prompt, str) else None, ids,
                               [CompletionOutput(i) for i in range(params.n)])
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                wait = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    batch = q.get(timeout=wait)
                except queue.Empty:
                    raise TimeoutError(f"request {rid!r} did not finish within {timeout} s") from None
                for _, item in batch:
                    if item is _DONE:
                        return result
                    _check(item)
                    result.add(item, self._logprob_tokenizer(item))
        finally:
            if rid in self._pending:
                self.abort(rid)

    async def stream(self, prompt: Prompt, params: SamplingParams | None = None,
                     request_id: str | None = None) -> AsyncIterator[EngineOutput]:
        """Deltas of one request as they come. Closing the iterator early aborts the request."""
        async for chunk in self.stream_batch([prompt], params, request_id, suffix=False):
            for _, delta in chunk:
                yield delta

    async def stream_batch(self, prompts: Sequence[Prompt], params: SamplingParams | PoolingParams | None = None,
                           request_id: str | None = None, *, suffix: bool = True
                           ) -> AsyncIterator[list[tuple[int, EngineOutput]]]:
        """Several prompts with the same params as engine requests `{request_id}-{i}`; yields lists of (prompt index,
        delta), each all that came since the last (a backlog at once). PoolingParams: embeddings, one finished delta
        each. ValueError if the engine refuses one (the others are aborted), EngineDeadError, RequestError."""
        params = params or SamplingParams()
        base = request_id or uuid.uuid4().hex
        rids = [f"{base}-{i}" if suffix else base for i in range(len(prompts))]
        if len(set(rids)) != len(rids):
            raise ValueError("several prompts need suffix=True")
        ids = [self._prompt_ids(p) for p in prompts]
        q, loop, added, open_prompts = asyncio.Queue(), asyncio.get_running_loop(), [], len(rids)
        try:
            for i, (rid, prompt_ids) in enumerate(zip(rids, ids, strict=True)):
                self._add(rid, prompt_ids, params, i, q, loop)
                added.append(rid)
            while open_prompts:
                items, chunk = await q.get(), []
                while not q.empty():  # everything that arrived meanwhile
                    items += q.get_nowait()
                for tag, item in items:
                    if item is _DONE:
                        open_prompts -= 1
                        continue
                    if chunk and (isinstance(item, BaseException) or item.finish_reason == "error"):
                        yield chunk  # the deltas before a failure first (which _check raises)
                    _check(item)
                    chunk.append((tag, item))
                if chunk:
                    yield chunk
        finally:
            for rid in added:  # early exit, error or cancellation (e.g. the HTTP client went away)
                if rid in self._pending:
                    self.abort(rid)

    async def generate_async(self, prompt: Prompt, params: SamplingParams | None = None,
                             request_id: str | None = None) -> RequestOutput:
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        result = RequestOutput(request_id or uuid.uuid4().hex, prompt if isinstance(prompt, str) else None, ids,
                               [CompletionOutput(i) for i in range(params.n)])
        async for delta in self.stream(ids, params, result.request_id):
            result.add(delta, self._logprob_tokenizer(delta))
        return result

    # ---- stats ---------------------------------------------------------------------------------

    def stats(self, timeout: float = 5.0) -> dict[str, float]:
        """Fresh `EngineCore.stats()` from the engine (one round trip, answered between steps)."""
        q: queue.SimpleQueue = queue.SimpleQueue()
        token = self._ask_stats(q.put)
        try:
            result = q.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"no stats from the engine within {timeout} s") from None
        finally:
            self._stats_waiters.pop(token, None)
        if isinstance(result, BaseException):
            raise result
        return result

    async def stats_async(self, timeout: float = 5.0) -> dict[str, float]:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        token = self._ask_stats(lambda r: loop.call_soon_threadsafe(_resolve, fut, r))
        try:
            result = await asyncio.wait_for(fut, timeout)
        finally:
            self._stats_waiters.pop(token, None)
        if isinstance(result, BaseException):
            raise result
        return result

    def _ask_stats(self, callback: Callable[[Any], None]) -> int:
        if not self.is_alive:
            raise EngineDeadError(self._dead or "the engine client is closed")
        token = next(self._tokens)
        self._stats_waiters[token] = callback
        self._send(proto.StatsRequest(token))
        return token

    # ---- the I/O thread ------------------------------------------------------------------------

    def _send(self, msg: proto.Message) -> None:
        self._outbox.append(proto.encode(msg))
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                try:
                    os.write(self._wake_w, b"x")
                except BlockingIOError:  # pipe full: a wake-up is pending anyway
                    pass
                except BrokenPipeError:  # the I/O thread has exited and closed its end: none to wake
                    pass

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._closing:
                events = dict(poller.poll(int(LIVENESS_POLL_S * 1000)))
                if self._wake_r in events:
                    try:
                        os.read(self._wake_r, 65536)
                    except BlockingIOError:
                        pass
                while self._outbox:
                    self._sock.send(self._outbox.popleft(), zmq.NOBLOCK)
                if self._sock in events:
                    while self._sock.poll(0, zmq.POLLIN):
                        self._on_frame(self._sock.recv(zmq.NOBLOCK))
                if self._monitor in events:
                    self._on_monitor_event(recv_monitor_message(self._monitor))
                if self.process is not None and self._dead is None and self.process.poll() is not None:
                    self._on_dead(f"the engine process exited with code {self.process.returncode}")
        except Exception as e:  # never leave requests hanging on a broken I/O thread
            log.exception("engine client I/O thread failed")
            self._on_dead(f"engine client I/O failed: {type(e).__name__}: {e}")
        finally:
            try:
                while self._outbox:  # e.g. the Shutdown that close() just queued
                    self._sock.send(self._outbox.popleft(), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            self._sock.disable_monitor()
            self._monitor.close(0)
            self._sock.close(linger=500)
            os.close(self._wake_r)
            self._ctx.term()

    def _on_monitor_event(self, event: dict[str, Any]) -> None:
        if event["event"] == zmq.EVENT_DISCONNECTED and self._ready.is_set():
            self._on_dead(f"lost the connection to the engine at {self.address}")

    def _on_frame(self, frame: bytes) -> None:
        try:
            msg = proto.decode(frame)
        except proto.ProtocolError as e:
            log.warning("dropped an invalid message from the engine: %s", e)
            return
        if isinstance(msg, proto.Outputs):
            self._on_outputs(msg.outputs)
        elif isinstance(msg, proto.Stats):
            self.latest_stats = msg.stats
            waiter = self._stats_waiters.pop(msg.token, None) if msg.token else None
            if waiter is not None:
                waiter(msg.stats)
        elif isinstance(msg, proto.Rejected):
            with self._lock:
                p = self._pending.pop(msg.request_id, None)
            if p is not None:
                self._deliver([(p, [(p.tag, invalid_param(msg.param, msg.message, msg.code)), (p.tag, _DONE)])])
        elif isinstance(msg, proto.EngineReady):
            if msg.protocol_version != proto.PROTOCOL_VERSION:
                self._on_dead(f"the engine speaks protocol {msg.protocol_version}, "
                              f"this client {proto.PROTOCOL_VERSION}")
                return
            self.info = msg
            self._ready.set()
        elif isinstance(msg, proto.EngineError):
            self._on_dead(msg.message)
        else:
            log.warning("dropped an unexpected %s message from the engine", type(msg).__name__)

    def _on_outputs(self, outputs: list[EngineOutput]) -> None:
        batches: dict[str, tuple[_Pending, list]] = {}
        with self._lock:
            for out in outputs:
                p = self._pending.get(out.request_id)
                if p is None:
                    continue  # aborted here meanwhile
                items = batches.setdefault(out.request_id, (p, []))[1]
                items.append((p.tag, out))
                if out.finished:
                    p.open_seqs.discard(out.index)
                    if not p.open_seqs:
                        del self._pending[out.request_id]
                        items.append((p.tag, _DONE))
        self._deliver(list(batches.values()))

    def _deliver(self, batches: list[tuple[_Pending, list]]) -> None:
        per_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for p, items in batches:
            if p.loop is None:
                p.queue.put(items)
            else:
                per_loop.setdefault(p.loop, []).append((p.queue, items))
        for loop, pairs in per_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, pairs)
            except RuntimeError:  # that event loop is closed: nobody is listening
                pass

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
            waiters, self._stats_waiters = self._stats_waiters, {}
        self._deliver([(p, [(p.tag, EngineDeadError(reason)), (p.tag, _DONE)]) for p in pending.values()])
        for waiter in waiters.values():
            waiter(EngineDeadError(reason))

    def _on_dead(self, reason: str) -> None:
        if self._dead is not None or self._closing:
            return
        self._dead = reason
        log.error("engine is dead: %s", reason)
        self._fail_all(f"engine is dead: {reason}")
        for fn in self._death_callbacks:
            try:
                fn(reason)
            except Exception:
                log.exception("engine death callback failed")


def _check(item: Any) -> None:
    if isinstance(item, BaseException):
        raise item
    if item.finish_reason == "error":
        raise RequestError(item.error or "the engine failed this request")


def _put_all(pairs: list[tuple[asyncio.Queue, list]]) -> None:
    for q, items in pairs:
        q.put_nowait(items)


def _resolve(fut: asyncio.Future, result: Any) -> None:
    if not fut.done():
        fut.set_result(result)
