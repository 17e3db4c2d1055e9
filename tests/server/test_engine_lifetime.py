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
import sys, time
from jinfer.engine.spawn import default_address, start_engine_process
address = default_address()
p = start_engine_process({config!r}, address, core_factory=sys.argv[1])
print(p.pid, address, flush=True)
time.sleep(600)
"""


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.1)
    return not pid_alive(pid)


@pytest.mark.parametrize("factory", ["slow_core", "compiling_core"])
def test_engine_exits_soon_after_its_parent_is_killed(factory):
    """The parent is SIGKILLed (no goodbye) while the engine loads its model (slow_core: 30 s), or while it
    serves with a 60 s background compile running (compiling_core): the engine is gone within seconds and its
    socket directory too."""
    parent = subprocess.Popen([sys.executable, "-c", PARENT.format(config=CONFIG),
                               f"tests.server.fake_core:{factory}"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        pid, address = parent.stdout.readline().split()
        pid = int(pid)
        if factory == "compiling_core":  # serving: a second client sees it ready, then leaves
            with EngineClient.connect(address, startup_timeout=60) as c:
                assert c.is_alive
        else:
            time.sleep(1.0)
        assert pid_alive(pid)
        parent.kill()
        parent.wait(10)
        assert _gone_within(pid, 8.0), f"engine {pid} still alive 8 s after its parent was killed"
        assert not Path(address.removeprefix("ipc://")).parent.exists()
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

