"""The engine loop's idle work (`EngineCore.idle`: the host tier's write-backs) runs once each time the engine runs
out of requests, aborted ones included, and a failure in it does not stop the loop. While it stays idle the loop
asks the core to unload executables past their keep-alive (`EngineCore.unload_idle`) every UNLOAD_CHECK_S, never
while requests run."""

import threading
import time

import zmq

from jinfer.engine.core_proc import EngineCoreProc
from jinfer.engine.protocol import Abort, AddRequest, Hello, Shutdown, encode
from jinfer.sampling_params import SamplingParams

from .fake_core import FakeCore


class IdleCountingCore(FakeCore):
    def __init__(self, config):
        super().__init__(config)
        self.idle_calls = 0
        self.unload_calls: list[bool] = []  # per call: did the core have requests then

    def unload_idle(self) -> int:
        self.unload_calls.append(self.has_unfinished_requests())
        if len(self.unload_calls) == 1:
            raise RuntimeError("injected unload failure")
        return 0

    def idle(self) -> None:
        self.idle_calls += 1
        if self.idle_calls == 1:
            raise RuntimeError("injected idle failure")


def test_idle_after_the_last_request_finishes_or_is_aborted(monkeypatch):
    monkeypatch.setattr("jinfer.engine.core_proc.UNLOAD_CHECK_S", 0.05)
    ctx = zmq.Context()
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.bind("inproc://idle-test")
    dealer.connect("inproc://idle-test")
    core = IdleCountingCore({"max_model_len": 4096, "step_delay": 0.01})
    proc = EngineCoreProc(core, router)
    loop = threading.Thread(target=proc.run, daemon=True)
    loop.start()

    def wait(pred, timeout=10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if pred():
                return True
            time.sleep(0.01)
        return False

    try:
        dealer.send(encode(Hello("test")))
        params = SamplingParams(max_tokens=2).to_dict()
        dealer.send(encode(AddRequest("a", [5, 6], params)))
        assert wait(lambda: core.idle_calls == 1)  # finished: idle once (it raised: the loop goes on)
        assert wait(lambda: len(core.unload_calls) >= 2)  # and looks for idle executables (the first call raised)
        dealer.send(encode(AddRequest("b", [5, 6], SamplingParams(max_tokens=3000).to_dict())))
        assert wait(lambda: core.has_unfinished_requests())
        time.sleep(0.1)
        assert core.idle_calls == 1 and loop.is_alive()
        busy_calls = len(core.unload_calls)
        time.sleep(0.2)
        assert len(core.unload_calls) == busy_calls  # none while a request runs
        dealer.send(encode(Abort(["b"])))  # the engine runs out of requests by an abort: idle again
        assert wait(lambda: core.idle_calls == 2)
        time.sleep(0.1)
        assert core.idle_calls == 2 and loop.is_alive()  # once per time it goes idle
        assert wait(lambda: len(core.unload_calls) >= busy_calls + 2)  # periodically while idle
        assert not any(core.unload_calls)
    finally:
        dealer.send(encode(Shutdown()))
        loop.join(5)
        dealer.close(0)
        router.close(0)
        ctx.term()
    assert not loop.is_alive()
