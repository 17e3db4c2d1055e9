"""`jinfer serve`: start the engine process, then the HTTP server in this process; stop both cleanly.

    jinfer serve [MODEL] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [engine options]
    python -m server.launcher ...   (the same)

SIGINT / SIGTERM: uvicorn drains the open requests, then the engine is told to shut down (exit 0).
If the engine process dies, in-flight requests fail at once, /health turns 503 for a moment, and the
launcher exits with status 1 instead of hanging.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import signal
import sys
import threading

from jinfer import __version__
from jinfer.config.engine import EngineConfig
from jinfer.engine.args import (
    SERVE_EXECUTABLE_KEEP_ALIVE_S,
    SERVE_WARMUP_FIRST_TOKENS,
    HelpFormatter,
    add_engine_arguments,
    engine_config_kwargs,
)
from jinfer.engine.spawn import default_address, discard_engine_process, start_engine_process
from server.reasoning import REASONING_PARSERS
from server.tools import TOOL_PARSERS

# uvicorn, the app, ZeroMQ and numpy are imported once the engine process is started (`run_serve`): its
# start-up is the long one, and these imports then overlap it instead of delaying it.

log = logging.getLogger("jinfer.server")

DEATH_EXIT_DELAY_S = 2.0  # keep answering (/health 503, errors) briefly before exiting
# How the engine process reports options it refuses (jinfer/engine/core_proc.py); exit status 2 like argparse.
_INVALID_CONFIG = re.compile(r"engine start-up failed: (ValueError|TypeError):")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="Hugging Face model ID (ORG/NAME), model directory, .gguf file or dummy:<shape> "
                             "(default: the embedded SmolLM2-135M)")
    parser.add_argument("--model", default=None, help="the same as MODEL (vLLM takes either)")
    parser.add_argument("--version", action="version", version=f"jinfer {__version__}")
    s = parser.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="HTTP port")
    s.add_argument("--api-key", default=os.environ.get("JINFER_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $JINFER_API_KEY, else none)")
    s.add_argument("--served-model-name", nargs="+", default=None,
                   help="model names accepted in requests (default: MODEL as given)")
    s.add_argument("--max-queued-requests", type=int, default=None,
                   help="sequences allowed to wait beyond --max-num-seqs before 503 (default 4 x max-num-seqs)")
    s.add_argument("--engine-address", default=None,
                   help="ZeroMQ address for the engine process (default: a private ipc:// socket)")
    s.add_argument("--startup-timeout", type=float, default=1800.0,
                   help="seconds to wait for the engine (downloading the model included)")
    s.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                   help="jinfer's log level")
    s.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug",
                                                                 "trace"],
                   help="uvicorn's log level (default: --log-level)")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="no access line per request (logger jinfer.access)")
    s.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine replicas, each on its own tensor-parallel-size devices, behind this server")
    s.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": read the model\'s tool calls with --tool-call-parser')
    s.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls: hermes (alias qwen: Qwen 2.5/3, Hermes), llama3_json "
                   "(Llama 3.x), mistral ([TOOL_CALLS]) or pythonic ([f(a=1)]: Llama 3.2/4)")
    s.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                   help="split <think>...</think> into reasoning_content: qwen3 (the output opens it) or deepseek_r1 "
                   "(the chat template opens it: DeepSeek-R1, QwQ, Qwen3 Thinking-2507) (default: none)")
    s.add_argument("--core-factory", default=None, help=argparse.SUPPRESS)  # tests: a fake engine core
    s.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help='publish KV-cache events over ZeroMQ as vLLM does, for cache-aware routers: '
                        '\'{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", '
                        '"replay_endpoint": "tcp://*:5558", "topic": ""}\' (default: off)')
    add_engine_arguments(parser)


def _server(config):
    """A uvicorn server that hands signals back: uvicorn re-raises the signal it caught once it is done,
    and we still have the engine to stop."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server(config)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _start_engine(args: argparse.Namespace, config: dict, dp: int):
    """Start the engine process(es) and wait until they are ready. One engine is started before anything
    heavy is imported here (uvicorn, the app, ZeroMQ, numpy): those imports then overlap its start-up."""
    core_factory = getattr(args, "core_factory", None)
    if dp > 1:
        from jinfer.parallel.replicas import ReplicaClient

        return ReplicaClient.spawn(config, dp, name="server", startup_timeout=args.startup_timeout,
                                   core_factory=core_factory)
    address = args.engine_address or default_address()
    ipc_dir = None if args.engine_address else os.path.dirname(address.removeprefix("ipc://"))
    proc = start_engine_process(config, address, core_factory=core_factory, owned_ipc_dir=ipc_dir)
    try:
        import server.app  # noqa: F401  (needed once the engine is ready)
        from jinfer.client import EngineClient
    except BaseException:  # SIGTERM / Ctrl-C / a broken install while importing: no engine left behind
        discard_engine_process(proc, ipc_dir)
        raise
    return EngineClient(address, process=proc, startup_timeout=args.startup_timeout, name="server", ipc_dir=ipc_dir)


def run_serve(args: argparse.Namespace) -> int:
    """Serve until SIGINT/SIGTERM (returns 0) or until the engine dies (returns 1)."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # The options are validated here (EngineConfig is JAX-free) and go to the engine process as its fields, where
    # the same EngineConfig is built again. This process never imports JAX (jinfer.engine.core does): it would
    # cost start-up time and host memory for nothing.
    kwargs = engine_config_kwargs(args)
    if getattr(args, "kv_events_config", None):
        kwargs["kv_events_config"] = args.kv_events_config
    if getattr(args, "warmup_first_tokens", None) is None and not args.no_warmup:
        kwargs["warmup_first_tokens"] = SERVE_WARMUP_FIRST_TOKENS  # ready sooner; the rest compiles while serving
    kwargs.setdefault("executable_keep_alive", SERVE_EXECUTABLE_KEEP_ALIVE_S)  # idle memory back
    if getattr(args, "enable_auto_tool_choice", False) and not getattr(args, "tool_call_parser", None):
        log.error("--enable-auto-tool-choice needs --tool-call-parser (one of %s)", ", ".join(sorted(TOOL_PARSERS)))
        return 2
    try:
        engine_config = EngineConfig(**kwargs)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if engine_config.node_rank > 0:
        return _run_headless(engine_config)
    config = dataclasses.asdict(engine_config)
    dp = getattr(args, "data_parallel_size", 1)
    if dp < 1 or (dp > 1 and args.engine_address):
        log.error("--data-parallel-size=%d must be >= 1, and > 1 only without --engine-address", dp)
        return 2
    previous_term = signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM during the long start-up
    try:
        client = _start_engine(args, config, dp)
    except ValueError as e:  # devices missing for the replicas
        log.error("%s", e)
        return 2
    except KeyboardInterrupt:
        log.info("interrupted while the engine was starting")
        return 130
    except Exception as e:
        client_module = sys.modules.get("jinfer.client")  # (not imported: the failure came first, not the engine's)
        if client_module is None or not isinstance(e, client_module.EngineDeadError):
            raise
        log.error("%s", e)
        return 2 if _INVALID_CONFIG.search(str(e)) else 1
    finally:
        signal.signal(signal.SIGTERM, previous_term)

    from server.app import build_app

    died, closing = threading.Event(), threading.Event()
    try:
        app = build_app(client, served_model_names=args.served_model_name, api_key=args.api_key,
                        max_queued_requests=args.max_queued_requests,
                        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                        reasoning_parser=getattr(args, "reasoning_parser", None),
                        log_requests=not args.disable_log_requests)
        import uvicorn

        server = _server(uvicorn.Config(app, host=args.host, port=args.port,
                                        log_level=getattr(args, "uvicorn_log_level", None) or args.log_level,
                                        access_log=False, timeout_graceful_shutdown=5))

        def on_engine_death(reason: str) -> None:
            if closing.is_set():  # our own shutdown stops the engine: not a death
                return
            died.set()
            log.error("engine died (%s): exiting in %.0f s", reason, DEATH_EXIT_DELAY_S)
            timer = threading.Timer(DEATH_EXIT_DELAY_S, lambda: setattr(server, "should_exit", True))
            timer.daemon = True
            timer.start()

        client.add_death_callback(on_engine_death)
        if not client.is_alive:
            on_engine_death(client.dead_reason or "unknown")
        log.info("serving %s on http://%s:%d (engine pid %s at %s)", client.info.model_name, args.host, args.port,
                 ", ".join(str(c.info.pid) for c in client.replicas), client.address)
        server.run()
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        return e.code if isinstance(e.code, int) else 1
    finally:
        closing.set()
        client.close()
    if died.is_set():
        return 1
    log.info("shut down cleanly")
    return 0


def _run_headless(engine_config: EngineConfig) -> int:
    """A process of rank > 0 of a multi-process group: no HTTP server; it follows process 0 until process 0
    stops the group (exit 0) or a process of the group is lost (exit 3, jinfer/parallel/multihost.py)."""
    from jinfer.engine.worker_proc import run_worker

    log.info("headless: process %d of %d, following process 0 at %s", engine_config.node_rank,
             engine_config.nnodes, engine_config.master_addr)
    return run_worker(engine_config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jinfer serve", description="OpenAI-compatible server for jinfer",
                                     formatter_class=HelpFormatter)
    add_serve_arguments(parser)
    return run_serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
