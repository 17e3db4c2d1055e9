"""The engine process: one `EngineCore` behind a ZeroMQ ROUTER socket, in one loop.

    loop:  receive (non-blocking while requests run, up to IDLE_POLL_MS when idle)
           -> dispatch by message type (handler table)
           -> core.step() -> send each client the deltas of its own requests
           -> every STATS_INTERVAL_S: push stats to clients

A watchdog thread checks that the parent process lives from the start (model load and warm-up
included); when it is gone a serving engine stops as on SIGTERM (and exits hard if that has not ended
the process within PARENT_GONE_GRACE_S), a loading one exits at once. A process whose loop has ended
does not wait for background compiles still running (each can take seconds): it exits at once. The
executable cache writes atomically (a temp file renamed into place; a stray temp file is removed at the
next start); a JAX persistent-cache entry being written at that instant can be cut short, and JAX then
recompiles that module (warning) at each start whose executable cache misses, until its cache is cleared.

One ROUTER socket carries both directions, so several clients (the HTTP server, internal services)
can share one engine: each request's deltas go back to the client that sent it. A request the core
refuses is answered `Rejected`; a failing step finishes the requests it held with an error output and
the loop goes on. Start it with `start_engine_process` (a fresh interpreter, no pickle) or run
`python -m jinfer.engine.core_proc --address ... --config '{json}'`.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import zmq

from jinfer.engine.protocol import (
    PROTOCOL_VERSION,
    Abort,
    AddRequest,
    EngineError,
    EngineReady,
    Hello,
    Message,
    Outputs,
    ProtocolError,
    Rejected,
    Shutdown,
    Stats,
    StatsRequest,
    decode,
    encode,
)
from jinfer.engine.spawn import (  # noqa: F401 (re-exported)
    config_to_dict,
    default_address,
    set_jax_env_defaults,
    start_engine_process,
)
from jinfer.engine.stats_log import StatsLogger
from jinfer.errors import InvalidParam
from jinfer.outputs import EngineOutput
from jinfer.pooling_params import PoolingParams
from jinfer.sampling_params import SamplingParams

log = logging.getLogger("jinfer.engine")

IDLE_POLL_MS = 100
STATS_INTERVAL_S = 0.5
UNLOAD_CHECK_S = 1.0  # how often an idle engine looks for executables past their keep-alive
PARENT_POLL_S = 0.5
PARENT_GONE_GRACE_S = 5.0  # after the SIGTERM the parent's loss sends: then os._exit
MAX_MESSAGES_PER_STEP = 4096  # a flood of requests must not starve the running ones
_FOLLOWERS: list = []  # the processes this engine spawned, one per further GPU (jinfer/parallel/local_group.py)


def _start_backend() -> None:
    import jax

    try:
        jax.devices()
    except Exception:  # reported again, where EngineCore meets it
        pass


def _default_core_factory(config: dict[str, Any]) -> Any:
    from jinfer.config.engine import EngineConfig
    from jinfer.parallel import local_group

    if local_group.one_process_per_gpu(EngineConfig(**config)):  # before this process's JAX backend starts
        config, followers = local_group.spread(config)
        _FOLLOWERS.extend(followers)
    if config.get("nnodes", 1) == 1:  # (several processes join their group before anything starts JAX)
        # JAX's backend (on a GPU: the CUDA context and memory pool, ~0.7 s on an H100) starts in a thread
        # while this one imports the engine's modules. JAX itself is imported here first (~1.5 s there; the
        # engine's modules need it anyway), so the two threads never import the same modules at once.
        set_jax_env_defaults()
        import jax  # noqa: F401

        threading.Thread(target=_start_backend, name="jinfer-backend", daemon=True).start()
    from jinfer.engine.core import EngineCore

    return EngineCore(EngineConfig(**config))


def _load_factory(spec: str | None) -> Callable[[dict[str, Any]], Any]:
    if not spec:
        return _default_core_factory
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def _ready_message(core: Any) -> EngineReady:
    tok_path = getattr(core, "tokenizer_path", None)  # None: clients must send token ids
    return EngineReady(
        model_name=str(core.model_name), max_model_len=int(core.max_model_len),
        vocab_size=int(core.model_config.vocab_size), max_num_seqs=int(core.config.max_num_seqs),
        pid=os.getpid(), tokenizer_path=tok_path, chat_template=getattr(core.config, "chat_template", None),
        eos_token_ids=[int(t) for t in getattr(core, "eos_token_ids", ())],
        generation_defaults=dict(getattr(core, "generation_defaults", {})),
        embedding_size=int(core.model_config.hidden_size) if getattr(core.model_config, "pooling", False) else 0)


class EngineCoreProc:
    """The loop around one core; `run()` returns when told to shut down (Shutdown, SIGTERM, the parent gone)."""

    def __init__(self, core: Any, sock: zmq.Socket, *, stats_interval: float = STATS_INTERVAL_S):
        self.core, self.sock = core, sock
        self.stats_interval = stats_interval
        self.ready = _ready_message(core)
        self.handlers: dict[type, Callable[[bytes, Any], None]] = {
            Hello: self._on_hello, AddRequest: self._on_add, Abort: self._on_abort,
            StatsRequest: self._on_stats, Shutdown: self._on_shutdown,
        }
        self.owner: dict[str, bytes] = {}  # request id -> identity of the client that sent it
        self.open_seqs: dict[str, set[int]] = {}  # request id -> indices of its unfinished samples
        self.clients: set[bytes] = set()
        self.running = True
        self._next_tick = 0.0
        self._next_unload = 0.0
        self._last_stats: dict[str, float] | None = None
        config = getattr(core, "config", None)
        self.stats_logger = StatsLogger(float(getattr(config, "log_stats_interval", 10.0) or 0.0),
                                        int(getattr(config, "data_parallel_rank", 0) or 0))

    def run(self) -> None:
        went_idle = True
        while self.running:
            busy = self.core.has_unfinished_requests()
            self._receive(0 if busy else IDLE_POLL_MS)
            if self.running and self.core.has_unfinished_requests():
                self._step()
            if self.core.has_unfinished_requests():
                went_idle = False
            elif not went_idle:  # the last request finished or was aborted: the engine's idle work, once
                went_idle = True
                self._core_hook("idle", "the engine's idle work (the host tier's write-backs)")
            elif time.monotonic() >= self._next_unload:  # idle: drop executables unused for their keep-alive
                self._next_unload = time.monotonic() + UNLOAD_CHECK_S
                self._core_hook("unload_idle", "unloading idle executables")
            if time.monotonic() >= self._next_tick:
                self._tick()

    def _core_hook(self, name: str, what: str) -> None:
        """Call the core's optional method `name` (idle work); a failure is logged and serving goes on."""
        hook = getattr(self.core, name, None)
        if hook is None:
            return
        try:
            hook()
        except Exception:
            log.exception("%s failed: serving goes on", what)

    def close(self, reason: str) -> None:
        """Tell every client the engine is going away (their requests are lost)."""
        for identity in list(self.clients):
            self._send(identity, EngineError(reason))

    # ---- I/O -----------------------------------------------------------------------------------

    def _receive(self, timeout_ms: int) -> None:
        for _ in range(MAX_MESSAGES_PER_STEP):
            if not self.sock.poll(timeout_ms, zmq.POLLIN):
                return
            timeout_ms = 0
            frames = self.sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 2:
                log.warning("dropped a message of %d frames (expected identity + payload)", len(frames))
                continue
            identity, frame = frames
            try:
                msg = decode(frame)
            except ProtocolError as e:
                log.warning("dropped an invalid message: %s", e)
                continue
            handler = self.handlers.get(type(msg))
            if handler is None:
                log.warning("dropped a %s message: clients may not send it", type(msg).__name__)
                continue
            handler(identity, msg)

    def _send(self, identity: bytes, msg: Message) -> None:
        try:
            self.sock.send_multipart([identity, encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            self._drop_client(identity)  # ROUTER_MANDATORY: that client is gone

    def _drop_client(self, identity: bytes) -> None:
        self.clients.discard(identity)
        gone = [rid for rid, who in self.owner.items() if who == identity]
        if gone:
            log.warning("client disconnected: aborting its %d requests", len(gone))
        for rid in gone:
            self.core.abort(rid)
            self._forget(rid)

    # ---- handlers ------------------------------------------------------------------------------

    def _on_hello(self, identity: bytes, msg: Hello) -> None:
        if msg.protocol_version != PROTOCOL_VERSION:
            self._send(identity, EngineError(f"the engine speaks protocol {PROTOCOL_VERSION}, "
                                             f"client {msg.client_name!r} {msg.protocol_version}"))
            return
        self.clients.add(identity)
        self._send(identity, self.ready)

    def _on_add(self, identity: bytes, msg: AddRequest) -> None:
        rid = msg.request_id
        self.clients.add(identity)
        if rid in self.owner:
            self._send(identity, Rejected(rid, f"request_id={rid!r} is already in use"))
            return
        try:
            # checked again here: the frame came from another process
            params = SamplingParams(**msg.params) if msg.pooling is None else PoolingParams(**msg.pooling)
            self.core.add_request(rid, msg.prompt_token_ids, params)
        except InvalidParam as e:
            self._send(identity, Rejected(rid, e.message, e.param, e.code))
            return
        except (ValueError, TypeError) as e:  # TypeError: a field SamplingParams does not know
            self._send(identity, Rejected(rid, str(e)))
            return
        except Exception as e:
            log.exception("add_request(%r) failed", rid)
            self._send(identity, Rejected(rid, f"internal error: {type(e).__name__}: {e}"))
            return
        self.owner[rid] = identity
        self.open_seqs[rid] = set(range(params.n))

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        for rid in msg.request_ids:
            if self.owner.get(rid) != identity:
                continue  # unknown, finished, or another client's
            self.core.abort(rid)
            self._finish_all(rid, "abort", None)

    def _on_stats(self, identity: bytes, msg: StatsRequest) -> None:
        self._send(identity, Stats(self._stats(), msg.token))

    def _on_shutdown(self, identity: bytes, msg: Shutdown) -> None:
        log.info("shutdown requested")
        self.running = False

    # ---- steps ---------------------------------------------------------------------------------

    def _step(self) -> None:
        try:
            outputs = self.core.step()
        except Exception as e:
            log.exception("engine step failed: finishing its requests with an error")
            for rid in list(self.owner):
                self.core.abort(rid)  # if even this fails, the loop dies: the process exits non-zero
                self._finish_all(rid, "error", f"engine step failed: {type(e).__name__}: {e}")
            return
        by_client: dict[bytes, list[EngineOutput]] = defaultdict(list)
        for out in outputs:
            identity = self.owner.get(out.request_id)
            if identity is None:
                continue  # aborted meanwhile
            by_client[identity].append(out)
            if out.finished:
                seqs = self.open_seqs[out.request_id]
                seqs.discard(out.index)
                if not seqs:
                    self._forget(out.request_id)
        for identity, outs in by_client.items():
            self._send(identity, Outputs(outs))

    def _finish_all(self, rid: str, reason: str, error: str | None) -> None:
        """Send the final delta of every unfinished sample of `rid` and forget it."""
        identity = self.owner.get(rid)
        seqs = sorted(self.open_seqs.get(rid, ()))
        self._forget(rid)
        if identity is not None and seqs:
            self._send(identity, Outputs([EngineOutput(rid, i, [], "", finished=True, finish_reason=reason,
                                                       error=error) for i in seqs]))

    def _forget(self, rid: str) -> None:
        self.owner.pop(rid, None)
        self.open_seqs.pop(rid, None)

    # ---- periodic ------------------------------------------------------------------------------

    def _stats(self) -> dict[str, float]:
        return {k: v for k, v in self.core.stats().items()
                if isinstance(v, int | float) and not isinstance(v, bool)}

    def _tick(self) -> None:
        self._next_tick = time.monotonic() + self.stats_interval
        stats = self._stats()
        self.stats_logger.maybe_log(stats)
        if stats != self._last_stats:
            self._last_stats = stats
            for identity in list(self.clients):
                self._send(identity, Stats(stats))


# Set once run_engine_core has installed its SIGTERM handler (the loop then shuts down in order on SIGTERM).
# Before that a SIGTERM may not end the process: `jax.distributed.initialize` (multi-node start-up) installs
# XLA's preemption notifier, which catches SIGTERM and goes on.
_STOP_HANDLER_INSTALLED = threading.Event()


def watch_parent(parent_pid: int, owned_ipc_dir: str | None = None, *, poll_s: float = PARENT_POLL_S,
                 grace_s: float = PARENT_GONE_GRACE_S) -> None:
    """End this process when `parent_pid` is no longer its parent. Serving: SIGTERM to itself (the loop's
    handler shuts down in order), then `os._exit` if the process still lives `grace_s` later. Still loading
    (no handler yet): `os._exit` at once, as there is nothing to shut down. `owned_ipc_dir`: the socket's private
    directory, which the parent made and can no longer remove (only the socket file and the empty directory go)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        _say(f"parent process {parent_pid} is gone: exiting")
        if owned_ipc_dir:
            _remove_ipc_dir(owned_ipc_dir)
        if not _STOP_HANDLER_INSTALLED.is_set():
            _exit_now(1)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        _say(f"still running {grace_s:.0f} s after the parent was gone: exiting now")
        _exit_now(1)

    threading.Thread(target=watch, name="jinfer-parent-watch", daemon=True).start()


def _say(message: str, level: str = "WARNING") -> None:
    """A log line written straight to stderr: the exit paths must not wait on a logging handler's lock."""
    try:
        os.write(2, f"{time.strftime('%Y-%m-%d %H:%M:%S')} {level} jinfer.engine: {message}\n".encode())
    except OSError:
        pass


def _remove_ipc_dir(directory: str) -> None:
    """Remove the engine's socket file(s) and then the directory, if that leaves it empty."""
    try:
        for name in os.listdir(directory):
            if name.endswith(".sock"):
                os.unlink(os.path.join(directory, name))
        os.rmdir(directory)
    except OSError:
        pass


def _exit_now(code: int) -> None:
    """os._exit after a best-effort flush of stdout / stderr (no logging.shutdown: it takes handler locks)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _compiling_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("jinfer-warmup") and t.is_alive()]


def run_engine_core(config: Any, address: str, *,
                    core_factory: Callable[[dict[str, Any]], Any] | str | None = None) -> int:
    """Bind `address`, build the core, serve until shut down; returns the process exit code.

    The socket is bound before the (slow) model load so that clients can connect and queue their
    Hello at once; they get EngineReady when the core is built, or EngineError if that fails."""
    factory = core_factory if callable(core_factory) else _load_factory(core_factory)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.LINGER, 200)  # goodbyes to clients that may be gone already
    sock.bind(address)
    log.info("engine process %d listening on %s", os.getpid(), address)
    proc = None
    try:
        try:
            core = factory(config_to_dict(config))
        except BaseException as e:
            log.exception("engine start-up failed")
            _refuse_waiting_clients(sock, f"engine start-up failed: {type(e).__name__}: {e}")
            return 1
        proc = EngineCoreProc(core, sock)

        def stop(signum, frame):
            log.info("received signal %d: shutting down", signum)
            proc.running = False

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        _STOP_HANDLER_INSTALLED.set()
        proc.run()
        proc.close("engine shut down")
        if hasattr(core, "close"):
            core.close()  # a multi-process group: the other processes stop too
        return 0
    except Exception as e:
        log.exception("engine loop failed")
        if proc is not None:
            proc.close(f"engine failed: {type(e).__name__}: {e}")
        return 1
    finally:
        sock.close()
        ctx.term()


def _refuse_waiting_clients(sock: zmq.Socket, reason: str) -> None:
    while sock.poll(200, zmq.POLLIN):
        frames = sock.recv_multipart()
        if len(frames) == 2:
            try:
                sock.send_multipart([frames[0], encode(EngineError(reason))], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="jinfer engine process (EngineCore behind ZeroMQ)")
    parser.add_argument("--address", required=True, help="ipc:///path or tcp://127.0.0.1:PORT to bind")
    parser.add_argument("--config", default="{}", help="EngineConfig fields as JSON")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this parent process is gone")
    parser.add_argument("--owned-ipc-dir", default=None,
                        help="the socket's private directory, removed if the parent is gone (spawn's default address)")
    parser.add_argument("--core-factory", default=None, help="module:callable building the core (tests)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    set_jax_env_defaults()  # before JAX starts its backend
    if args.parent_pid is not None:
        watch_parent(args.parent_pid, args.owned_ipc_dir)
    code = 1
    try:
        code = run_engine_core(json.loads(args.config), args.address, core_factory=args.core_factory)
    finally:
        if _FOLLOWERS:  # one process per GPU (jinfer/parallel/local_group.py): a clean stop ended them already
            from jinfer.parallel import local_group

            local_group.stop(_FOLLOWERS, timeout=local_group.FOLLOWER_STOP_S if code == 0 else 5.0)
    if busy := _compiling_threads():  # interpreter exit would join them: up to a compile's length
        _say(f"exiting without waiting for {len(busy)} background compile thread(s)", "INFO")
        _exit_now(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
