"""The HTTP server's process must not load JAX: it never touches a device, and JAX there costs ~1 s of
start-up and 150-300 MB of host memory. Checked on its modules, and on a live launcher process."""

import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.server.helpers import FAKE_CORE, ROOT, start_server

SERVER_MODULES = ("server.launcher", "server.app", "server.cli", "jinfer.client", "jinfer.tokenizer",
                  "jinfer.weights.gguf_meta")


def test_server_modules_do_not_import_jax():
    code = (f"import sys\nfor m in {SERVER_MODULES!r}: __import__(m)\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib'))\n"
            "assert not bad, bad[:5]\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_running_server_process_does_not_load_jax(tmp_path):
    """The whole path: options, engine start, tokenizer load (the fake core names the default model's
    when it is installed), a request. The engine process (the fake core imports JAX) is the control."""
    srv = start_server(["--core-factory", FAKE_CORE, "--max-model-len", "64"], tmp_path, timeout=120)
    try:
        r = httpx.post(f"{srv.url}/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        assert "/jaxlib/" in Path(f"/proc/{srv.engine_pid}/maps").read_text()
        assert "/jaxlib/" not in Path(f"/proc/{srv.proc.pid}/maps").read_text()
    finally:
        assert srv.stop(signal.SIGTERM) == 0, srv.log()[-3000:]


def test_launcher_starts_the_engine_before_its_heavy_imports():
    """`jinfer serve` starts the engine process first: until then the launcher has imported none of uvicorn,
    the app, ZeroMQ or numpy (they load while the engine starts, instead of delaying it)."""
    code = ("import sys\nimport server.launcher as L\n"
            "heavy = ('uvicorn', 'zmq', 'numpy', 'server.app', 'starlette')\n"
            "def spawn(*a, **k):\n"
            "    print(sorted(m for m in heavy if m in sys.modules)); raise SystemExit(0)\n"
            "L.start_engine_process = spawn\n"
            "L.main(['--port', '0'])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


DRIVER = """\
import os, signal, sys, threading
import server.launcher as L
orig = L.start_engine_process
def spawn(config, address, **k):
    p = orig(config, address, **k)
    print('ENGINE', p.pid, address, flush=True)
    {after_spawn}
    return p
L.start_engine_process = spawn
{before}
sys.exit(L.main(['--port', '0', '--core-factory', 'tests.server.fake_core:slow_core']))
"""


@pytest.mark.parametrize("after_spawn,before,codes", [
    # SIGTERM while the launcher imports the server (or, at the latest, while its client waits for the engine);
    # 1 where it interrupted an extension module's import, which then fails as an ImportError
    ("threading.Timer(0.02, os.kill, (os.getpid(), signal.SIGTERM)).start()", "", (130, 1)),
    ("", "sys.modules['server.app'] = None  # a broken install: importing the app fails", (1,)),
], ids=["sigterm", "import-error"])
def test_interrupted_start_leaves_no_engine_behind(after_spawn, before, codes):
    """Between starting the engine and a client holding it, the launcher stops: the engine process is stopped
    at once (not after its 30 s 'model load') and its socket directory removed."""
    driver = DRIVER.format(after_spawn=after_spawn, before=before)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", driver], cwd=ROOT, capture_output=True, text=True, timeout=60)
    pid, address = r.stdout.split("ENGINE")[1].split()[:2]
    assert r.returncode in codes, r.stderr[-2000:]
    assert time.monotonic() - t0 < 20  # nobody waited for the engine (its pipes would have kept run() waiting)
    assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z"
    assert not Path(address.removeprefix("ipc://")).parent.exists()
