"""The engine process does not outlive its parent, nor wait for its own background compiles to exit."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from jinfer.client import EngineClient
from jinfer.sampling_params import SamplingParams
from tests.server.helpers import ROOT, pid_alive

CONFIG = {"max_model_len": 64, "max_num_seqs": 4}
PARENT = """\
import os, sys, time
from jinfer.engine.spawn import default_address, start_engine_process
address = sys.argv[2] if len(sys.argv) > 2 else default_address()
owned = None if len(sys.argv) > 2 else os.path.dirname(address.removeprefix("ipc://"))
p = start_engine_process({config!r}, address, core_factory=sys.argv[1], owned_ipc_dir=owned)
print(p.pid, address, flush=True)
time.sleep(600)
"""


def start_parent(factory: str, *address: str) -> tuple[subprocess.Popen, int, str]:
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(config=CONFIG), f"tests.server.fake_core:{factory}",
                               *address], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    pid, addr = parent.stdout.readline().split()
    return parent, int(pid), addr


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return not pid_alive(pid)


@pytest.mark.parametrize("factory", ["slow_core", "compiling_core", "deaf_slow_core"])
def test_engine_exits_soon_after_its_parent_is_killed(factory):
    """The parent is SIGKILLed (no goodbye) while the engine loads its model (slow_core: 30 s; deaf_slow_core
    ignores SIGTERM meanwhile, as after jax.distributed.initialize), or while it serves with a 60 s background
    compile running (compiling_core): the engine is gone within seconds, and so is the socket directory
    spawn made for it."""
    parent, pid, address = start_parent(factory)
    try:
        if factory == "compiling_core":  # serving: a second client sees it ready, then leaves
            with EngineClient.connect(address, startup_timeout=60) as c:
                assert c.is_alive
        else:
            time.sleep(1.0)
        assert pid_alive(pid)
        parent.kill()
        parent.wait(10)
        assert _gone_within(pid, 4.0), f"engine {pid} still alive 4 s after its parent was killed"
        assert not Path(address.removeprefix("ipc://")).parent.exists()
    finally:
        parent.kill()
        parent.stdout.close()


def test_a_socket_directory_the_user_named_is_left_alone(tmp_path):
    """An address the user chose (`jinfer serve --engine-address`, `EngineClient.spawn(address=...)`) lives in
    a directory spawn did not make: after the parent's death the engine leaves it and its other files alone."""
    keep = tmp_path / "jinfer-deploy"
    keep.mkdir()
    (keep / "config.yaml").write_text("mine")
    parent, pid, address = start_parent("slow_core", f"ipc://{keep}/engine.sock")
    try:
        time.sleep(1.0)
        parent.kill()
        parent.wait(10)
        assert _gone_within(pid, 4.0)
        assert (keep / "config.yaml").read_text() == "mine"
    finally:
        parent.kill()
        parent.stdout.close()


def test_shutdown_does_not_wait_for_a_background_compile():
    """Closing the client that owns the engine ends the process cleanly (exit code 0, no signal) at once,
    although a 60 s compile still runs in a warm-up thread."""
    c = EngineClient.spawn(CONFIG, core_factory="tests.server.fake_core:compiling_core", startup_timeout=60)
    assert c.generate([1, 2, 3], SamplingParams(max_tokens=2)) is not None
    t0 = time.monotonic()
    c.close()
    assert time.monotonic() - t0 < 5.0
    assert c.process.returncode == 0, c.process.returncode

