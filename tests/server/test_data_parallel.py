"""Data-parallel replicas behind one server (`--data-parallel-size`): the router (prefix affinity, least
loaded, dead replicas skipped), per-replica metrics, and the death of one replica failing only its own
requests. The server tests use the fake engine core (fast, no model)."""

import asyncio
import os
import re
import signal
import time
from types import SimpleNamespace

import httpx
import openai
import pytest

from jinfer.client import EngineDeadError
from jinfer.engine.protocol import EngineReady
from jinfer.parallel.replicas import BALANCE_SLACK, BLOCK, PrefixTracker, ReplicaClient, replica_devices
from tests.server.helpers import FAKE_CORE, child_pids, start_server, wait_for

ENV = {"JINFER_FAKE_STEP_DELAY": "0.02"}


class StubClient:
    """The EngineClient surface ReplicaClient uses."""

    def __init__(self, max_num_seqs=4):
        self.info = SimpleNamespace(max_num_seqs=max_num_seqs, model_name="m")
        self.is_alive, self.dead_reason, self.callbacks, self.calls = True, None, [], []

    def add_death_callback(self, fn):
        self.callbacks.append(fn)

    def _prompt_ids(self, p):
        return list(p)

    async def stream_batch(self, prompts, params, request_id=None, suffix=True):
        self.calls.append(request_id)
        yield [(0, "delta")]

    def die(self):
        self.is_alive, self.dead_reason = False, "killed"
        for fn in self.callbacks:
            fn("killed")


def stub_replicas(n=3):
    clients = [StubClient() for _ in range(n)]
    for c in clients:  # ReplicaClient.replace()s the info: it must be the protocol's EngineReady
        c.info = EngineReady("m", max_model_len=64, vocab_size=100, max_num_seqs=4, pid=1)
    return ReplicaClient(clients), clients


def test_router_prefers_the_cached_prefix_then_the_least_loaded():
    rc, clients = stub_replicas()
    assert rc.info.max_num_seqs == 12
    assert [rc.route([i] * 2 * BLOCK) for i in range(3)] == [0, 1, 2]  # no prefix anywhere: spread
    system = list(range(4 * BLOCK))
    rc.load = [1, 0, 1]
    assert rc.route(system + [100]) == 1
    rc.load = [0, 2, 0]
    assert rc.route(system + [101]) == 1  # the shared system prompt is cached there
    rc.load = [5, 0, 0]
    other = list(range(1000, 1000 + 3 * BLOCK))
    assert rc.route(other) == 2  # unseen prompt: least loaded (ties: fewest routed)
    rc.load = [0, 0, 3]
    assert rc.route(other + [7]) == 2  # its prefix is on replica 2 now
    rc.load = [0, 0, BALANCE_SLACK + 1]
    assert rc.route(other + [8]) in (0, 1)  # ...unless replica 2 is too busy
    short = [1, 2, 3]  # shorter than a block: nothing to match
    rc.load = [3, 0, 3]
    assert rc.route(short) == 1


def test_dead_replica_takes_no_requests_and_all_dead_is_dead():
    rc, clients = stub_replicas(2)
    died = []
    rc.add_death_callback(died.append)
    clients[0].die()
    assert rc.is_alive and not died
    assert {rc.route([i] * 40) for i in range(5)} == {1}
    clients[1].die()
    assert not rc.is_alive and died and "replica 0" in died[0]
    with pytest.raises(EngineDeadError):
        rc.route([1] * 40)


def test_stream_batch_counts_load_while_streaming():
    rc, clients = stub_replicas(2)

    async def run():
        agen = rc.stream_batch([[1, 2, 3]], SimpleNamespace(n=2), "r1")
        assert await anext(agen) == [(0, "delta")]
        busy = list(rc.load)
        async for _ in agen:
            pass
        return busy

    busy = asyncio.run(run())
    assert sorted(busy) == [0, 2] and rc.load == [0, 0]


def test_prefix_tracker_is_bounded():
    t = PrefixTracker(capacity=4)
    ids = list(range(10 * BLOCK))
    t.add(PrefixTracker.hashes(ids))
    assert t.match(PrefixTracker.hashes(ids)) == 0  # the first blocks were evicted
    assert len(t._blocks) == 4


def test_replica_devices():
    assert replica_devices(1, 2, visible="") == "2,3"
    assert replica_devices(1, 2, visible="4,5,6,7") == "6,7"
    with pytest.raises(ValueError, match="needs 4 devices"):
        replica_devices(1, 2, visible="0,1,2")


def test_server_with_two_replicas_survives_the_death_of_one(tmp_path):
    srv = start_server(["--core-factory", FAKE_CORE, "--max-model-len", "64", "--data-parallel-size", "2"],
                       tmp_path, env=ENV, timeout=120)
    try:
        pids = [int(p) for p in re.search(r"engine pid ([\d, ]+) at", srv.log()).group(1).split(", ")]
        assert sorted(pids) == sorted(child_pids(srv.proc.pid)) and len(pids) == 2
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok", "replicas_alive": [0, 1]}
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        # two long streams: the router spreads them over the two replicas (no shared prefix, least loaded)
        doomed = client.completions.create(model="fake-model", prompt=[5, 6], max_tokens=60, stream=True)
        next(iter(doomed))
        survivor = client.completions.create(model="fake-model", prompt=[7, 8], max_tokens=40, stream=True)
        next(iter(survivor))
        text = httpx.get(f"{srv.url}/metrics").text
        assert 'jinfer_num_requests_running{replica="0"} 1.0' in text
        assert 'jinfer_num_requests_running{replica="1"} 1.0' in text
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(openai.APIError):  # replica 0's request fails at once...
            for _ in doomed:
                pass
        assert time.monotonic() - t0 < 1.0
        assert sum(1 for _ in survivor) > 0  # ...replica 1's goes on to its end
        assert httpx.get(f"{srv.url}/health").json() == {"status": "ok", "replicas_alive": [1]}
        assert 'jinfer_engine_alive{replica="0"} 0.0' in httpx.get(f"{srv.url}/metrics").text
        for _ in range(4):  # new requests all go to the live replica
            r = client.completions.create(model="fake-model", prompt=[9, 10], max_tokens=3)
            assert r.choices[0].finish_reason == "length"
        os.kill(pids[1], signal.SIGKILL)
        assert wait_for(lambda: httpx.get(f"{srv.url}/health").status_code == 503, 5)
        assert srv.proc.wait(15) != 0
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)
