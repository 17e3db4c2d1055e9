"""The engine process and the ZeroMQ client, on a fake core (tests/server/fake_core.py): no model."""

import asyncio
import os
import signal
import threading
import time

import pytest
import zmq

from jinfer.client import EngineClient, EngineDeadError, RequestError
from jinfer.engine.protocol import AddRequest, Hello, Rejected, decode, encode
from jinfer.errors import ContextLengthExceeded, InvalidParam
from jinfer.sampling_params import SamplingParams
from tests.server.fake_core import FAIL_TOKEN
from tests.server.helpers import wait_for

FAKE = "tests.server.fake_core:make_fake_core"
CONFIG = {"step_delay": 0.005, "max_model_len": 64, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def client():
    with EngineClient.spawn(CONFIG, core_factory=FAKE, startup_timeout=60) as c:
        yield c


def _wait_idle(client, timeout=2.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = client.stats()
        if stats["num_running"] == 0 and stats["kv_usage"] == 0:
            return stats
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {stats}")


def test_ready_handshake(client):
    assert client.is_alive
    assert client.info.model_name == "fake-model" and client.info.max_model_len == 64
    assert client.info.pid == client.process.pid


def test_generate_sync(client):
    out = client.generate([1, 2, 3], SamplingParams(max_tokens=5, n=2, logprobs=1))
    assert out.finished and out.prompt_token_ids == [1, 2, 3]
    assert [o.token_ids for o in out.outputs] == [[4, 5, 6, 7, 8], [5, 6, 7, 8, 9]]
    assert out.outputs[0].text == " 4 5 6 7 8" and out.outputs[0].finish_reason == "length"
    lps = out.outputs[1].logprobs[0]  # vLLM's {token id: Logprob}, from the wire's {id: float}
    assert {t: lp.logprob for t, lp in lps.items()} == {5: -0.5, 6: -2.0} and next(iter(lps)) == 5


def test_stream_async(client):
    async def run():
        return [d async for d in client.stream([10], SamplingParams(max_tokens=4))]

    deltas = asyncio.run(run())
    assert [d.new_token_ids for d in deltas] == [[11], [12], [13], [14]]
    assert deltas[-1].finished and not any(d.finished for d in deltas[:-1])


def test_rejected_request_raises_value_error(client):
    with pytest.raises(ValueError, match="max_tokens"):
        client.generate([1] * 60, SamplingParams(max_tokens=10))
    assert client.generate([1], SamplingParams(max_tokens=1)).finished


@pytest.mark.parametrize("prompt,params,param,code", [
    ([1] * 60, SamplingParams(max_tokens=10), "max_tokens", "context_length_exceeded"),
    ([1] * 64, SamplingParams(max_tokens=None), "prompt", "context_length_exceeded"),
    ([10**6], SamplingParams(max_tokens=1), "prompt", None),  # outside the vocabulary
    ([1], SamplingParams(max_tokens=1, logit_bias={10**6: 1.0}), "logit_bias", None),
])
def test_rejection_carries_the_field(client, prompt, params, param, code):
    """The engine's InvalidParam crosses the socket (Rejected.param / code) and is raised again by the client."""
    with pytest.raises(InvalidParam) as e:
        client.generate(prompt, params)
    assert (e.value.param, e.value.code) == (param, code)
    assert isinstance(e.value, ContextLengthExceeded) == (code is not None)


def test_abort_frees_the_request(client):
    async def run():
        got = []
        async for d in client.stream([1], SamplingParams(max_tokens=50), request_id="to-abort"):
            got.append(d)
            if len(got) == 2:
                client.abort("to-abort")
        return got

    got = asyncio.run(run())
    # (outputs the core sent before the abort reached it still arrive: the stream ends on the abort, long before
    # max_tokens, however many were in flight)
    assert got[-1].finish_reason == "abort" and not any(d.finished for d in got[:-1])
    assert 3 <= len(got) < 50
    _wait_idle(client)


def test_closing_a_stream_early_aborts(client):
    async def run():
        agen = client.stream([1], SamplingParams(max_tokens=50))
        await anext(agen)
        assert client.stats()["num_running"] == 1
        await agen.aclose()

    asyncio.run(run())
    _wait_idle(client)


def test_failing_step_fails_its_requests_not_the_engine(client):
    with pytest.raises(RequestError, match="injected failure"):
        client.generate([FAIL_TOKEN], SamplingParams(max_tokens=3))
    assert client.is_alive
    assert client.generate([1], SamplingParams(max_tokens=2)).outputs[0].token_ids == [2, 3]


def test_raw_socket_garbage_and_bad_params(client):
    """A second, hand-written client: garbage is dropped, bad params are rejected, the engine lives."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(client.address)
    try:
        sock.send(b"\x93garbage")
        sock.send(encode(Hello("raw", protocol_version=99)))
        assert sock.poll(5000)
        assert "protocol" in decode(sock.recv()).message  # EngineError: refused
        sock.send(encode(Hello("raw")))
        assert sock.poll(5000)
        decode(sock.recv())  # EngineReady
        sock.send(encode(AddRequest("raw-1", [1], {"n": 0})))
        sock.send(encode(AddRequest("raw-2", [1], {"no_such_field": 1})))
        replies = []
        while len(replies) < 2 and sock.poll(5000):
            msg = decode(sock.recv())
            if isinstance(msg, Rejected):
                replies.append(msg)
        assert [r.request_id for r in replies] == ["raw-1", "raw-2"]
        assert "n=0" in replies[0].message and "no_such_field" in replies[1].message
    finally:
        sock.close(0)
        ctx.term()
    assert client.generate([1], SamplingParams(max_tokens=1)).finished


def test_second_client_shares_the_engine(client):
    with EngineClient.connect(client.address, name="second") as other:
        assert other.info.pid == client.info.pid
        results = {}
        t = threading.Thread(target=lambda: results.setdefault("a", client.generate([1], SamplingParams(max_tokens=8))))
        t.start()
        b = other.generate([100], SamplingParams(max_tokens=8))
        t.join()
        assert b.outputs[0].token_ids == list(range(101, 109))
        assert results["a"].outputs[0].token_ids == list(range(2, 10))
    assert client.is_alive  # closing a client that does not own the engine leaves it running


def test_engine_death_fails_in_flight_requests_fast():
    c = EngineClient.spawn({**CONFIG, "step_delay": 0.02}, core_factory=FAKE, startup_timeout=60)
    other = EngineClient.connect(c.address, name="watcher")
    reasons = []
    c.add_death_callback(reasons.append)

    async def run():
        async def consume():
            async for _ in c.stream([1], SamplingParams(max_tokens=60)):
                pass

        task = asyncio.create_task(consume())
        await asyncio.sleep(0.2)
        t0 = time.monotonic()
        os.kill(c.process.pid, signal.SIGKILL)
        with pytest.raises(EngineDeadError):
            await task
        return time.monotonic() - t0

    try:
        assert asyncio.run(run()) < 1.0
        assert not c.is_alive
        assert wait_for(lambda: reasons, 2)  # the callbacks run on the I/O thread right after
        with pytest.raises(EngineDeadError):
            c.generate([1])
        deadline = time.monotonic() + 2
        while other.is_alive and time.monotonic() < deadline:  # a connected client sees it too
            time.sleep(0.05)
        assert not other.is_alive
    finally:
        other.close()
        c.close()


def test_owner_close_shuts_the_engine_down():
    c = EngineClient.spawn(CONFIG, core_factory=FAKE, startup_timeout=60)
    other = EngineClient.connect(c.address, name="watcher")
    c.close()
    assert c.process.returncode == 0
    deadline = time.monotonic() + 2
    while other.is_alive and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not other.is_alive and "shut down" in other.dead_reason
    other.close()


def test_startup_failure_is_reported():
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError, match="no such model"):
        EngineClient.spawn(CONFIG, core_factory="tests.server.fake_core:broken_core", startup_timeout=60)
    assert time.monotonic() - t0 < 30
