"""Start `python -m server.launcher` subprocesses for the HTTP tests, and read their /metrics."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]
FAKE_CORE = "tests.server.fake_core:make_fake_core"
# The default model's server for the end-to-end files (test_openai_e2e.py, test_structured_e2e.py): the same engine
# limits, so each server loads the executables the other compiled from the run's compilation cache.
SMOLLM2_ARGS = ["--dtype", "float32", "--max-model-len", "1024", "--max-num-batched-tokens", "256",
                "--max-num-seqs", "32", "--no-warmup"]


def smollm2_env() -> dict[str, str]:
    """XLA_FLAGS for those servers: tests/conftest.py's without LLVM's -O0. Their time goes to running the model's
    steps (~0.2 s each, hundreds of them), which -O0 makes ~25% slower, not to compiling (the same at either level
    for this model); both servers still share their executables (one set of flags)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    return {"XLA_FLAGS": " ".join(f for f in flags if not f.startswith("--xla_backend_optimization_level"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


def pid_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class Server:
    proc: subprocess.Popen
    url: str
    log_path: Path

    @property
    def engine_pid(self) -> int:
        kids = child_pids(self.proc.pid)
        assert len(kids) == 1, kids
        return kids[0]

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise


def start_server(args: list[str], tmp_path: Path, *, env: dict[str, str] | None = None,
                 timeout: float = 600) -> Server:
    port = free_port()
    log_path = tmp_path / f"server-{port}.log"
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), full_env.get("PYTHONPATH")) if p)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "server.launcher", "--port", str(port), *args],
                                cwd=ROOT, env=full_env, stdout=log, stderr=subprocess.STDOUT)
    server = Server(proc, f"http://127.0.0.1:{port}", log_path)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log()[-5000:]}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    server.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not come up in {timeout} s:\n{server.log()[-5000:]}")


def metric(url: str, name: str, headers: dict[str, str] | None = None) -> float:
    """Sum of the samples of one metric (all label sets) from /metrics."""
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} not in /metrics"
    return total


def wait_for(predicate, timeout: float = 5.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
