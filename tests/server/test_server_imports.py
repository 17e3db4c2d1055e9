"""The HTTP server's process must not load JAX: it never touches a device, and JAX there costs ~1 s of
start-up and 150-300 MB of host memory. Checked on its modules, and on a live launcher process."""

import signal
import subprocess
import sys
from pathlib import Path

import httpx

from tests.server.helpers import FAKE_CORE, ROOT, start_server

SERVER_MODULES = ("server.launcher", "server.app", "jinfer.cli", "jinfer.client", "jinfer.tokenizer",
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
