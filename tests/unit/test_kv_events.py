"""KV-cache events as vLLM publishes them (jinfer/cache/kv_events.py): the real scheduler and cache manager under
a workload with shared prefixes, evictions, host-tier restores and a reset publish over a real ZeroMQ PUB socket; a
subscriber rebuilds the prefix cache's contents from the events alone, and a replay of a missed range gives the
same batches."""

import random
import time

import msgspec
import pytest
import zmq

from jinfer.cache.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventsConfig,
    ZmqEventPublisher,
    block_hash,
    decode_batch,
    make_publisher,
    offset_endpoint,
)
from jinfer.cache.manager import KVCacheManager, hash_page
from jinfer.config.engine import EngineConfig, SchedulerConfig
from jinfer.engine.request import Request
from jinfer.engine.scheduler import Scheduler
from jinfer.sampling_params import SamplingParams

PS = 4


class Mirror:
    """What a router knows of one replica's cache: block hash -> full digest, rebuilt from events only (the digest
    from the parent's and the block's token ids, which proves both are right)."""

    def __init__(self):
        self.blocks: dict[int, bytes] = {}

    def apply(self, event) -> None:
        if isinstance(event, BlockStored):
            assert event.block_size == PS and event.medium == "GPU" and len(event.token_ids) == PS * len(
                event.block_hashes)
            parent = b"" if event.parent_block_hash is None else self.blocks[event.parent_block_hash]
            for i, h in enumerate(event.block_hashes):
                parent = hash_page(parent, event.token_ids[i * PS:(i + 1) * PS])
                assert block_hash(parent) == h
                self.blocks[h] = parent
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                del self.blocks[h]
        else:
            assert isinstance(event, AllBlocksCleared)
            self.blocks.clear()


def cached(kv: KVCacheManager) -> dict[int, bytes]:
    return {block_hash(d): d for d in kv._hash_to_page}


def run_workload(kv: KVCacheManager, publish, seed: int = 0, steps: int = 120) -> None:
    """Requests over a few shared prefixes through the real scheduler; each step's events published."""
    rng = random.Random(seed)
    sched = Scheduler(SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32), kv)
    prefixes = [[rng.randrange(100, 200) for _ in range(4 * PS)] for _ in range(4)]
    for i in range(steps):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes)[:rng.randrange(PS, 4 * PS + 1)] + [rng.randrange(200, 300)
                                                                              for _ in range(rng.randrange(1, 9))]
            sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 9)),
                                      eos_token_ids=(2,)))
        if i == steps // 2:
            kv.reset_prefix_cache()
        out = sched.schedule()
        sched.update(out, {s.request_id: [rng.randrange(300, 400)] for s in out.scheduled if s.needs_sample})
        publish(kv.take_events())


def test_events_rebuild_the_cache_through_zmq_and_replay(tmp_path):
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv", '
                                  f'"endpoint": "ipc://{tmp_path}/pub", "replay_endpoint": "ipc://{tmp_path}/replay"}}')
    ctx = zmq.Context()
    pub = ZmqEventPublisher(config, data_parallel_rank=0, context=ctx)
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(config.endpoint)
    time.sleep(0.2)  # the subscription reaches the PUB socket (ZeroMQ's slow joiner)

    kv = KVCacheManager(num_pages=12, page_size=PS, num_host_pages=6)  # pressure: evictions and host hits
    kv.events = []
    mirror, payloads, kinds, expected = Mirror(), [], set(), []

    def publish(events):
        pub.publish(events)
        if events:
            expected.append(cached(kv))

    run_workload(kv, publish)
    assert kv.num_host_hit_tokens > 0  # restores from the host tier were stored as GPU blocks again
    for _ in expected:
        assert sub.poll(5000), "a batch did not arrive"
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv" and int.from_bytes(seq, "big") == len(payloads)
        payloads.append(payload)
        batch = decode_batch(payload)
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for event in batch.events:
            kinds.add(type(event).__name__)
            mirror.apply(event)
        assert mirror.blocks == expected[len(payloads) - 1]  # the router's view is the cache, after every step
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}
    # the wire layout vLLM's consumers decode: array-like batch and tagged array-like events
    raw = msgspec.msgpack.decode(payloads[0])
    assert isinstance(raw, list) and raw[2] == 0 and raw[1][0][0] == "BlockStored" and len(raw[1][0]) == 7

    # a subscriber that missed batches from `start` on asks the replay socket for them
    start = len(payloads) - 3
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(config.replay_endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    replayed = []
    while True:
        assert dealer.poll(5000), "no replay answer"
        _, seq, payload = dealer.recv_multipart()
        if seq == END_SEQ:
            break
        replayed.append((int.from_bytes(seq, "big"), payload))
    assert replayed == list(enumerate(payloads))[start:]
    pub.close()
    for s in (sub, dealer):
        s.close(linger=0)
    ctx.term()


def test_config_forms_and_off():
    assert KVEventsConfig.parse(None) is None and make_publisher(None) is None
    off = KVEventsConfig.parse({"enable_kv_cache_events": False})
    assert make_publisher(off) is None and make_publisher(KVEventsConfig(True, "null")) is None
    with pytest.raises(ValueError, match="unknown fields"):
        KVEventsConfig.parse('{"enable_kv_events": true}')
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"publisher": "kafka"})
    # through EngineConfig (the engine process gets it as a dict and parses it again)
    assert EngineConfig(kv_events_config='{"enable_kv_cache_events": true}').kv_events_config.endpoint == \
        "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 2) == "tcp://*:5559" and offset_endpoint("inproc://kv", 1) == "inproc://kv_dp1"


def test_no_events_recorded_when_off():
    kv = KVCacheManager(num_pages=12, page_size=PS)
    run_workload(kv, lambda events: None, steps=30)
    assert kv.events is None and kv.take_events() == []


def test_engine_core_publishes_each_steps_events():
    from types import SimpleNamespace

    from jinfer.engine.core import EngineCore

    kv = KVCacheManager(num_pages=12, page_size=PS)
    kv.events, sent = [], []
    core = SimpleNamespace(group=None, kv=kv, kv_events=SimpleNamespace(publish=sent.append),
                           _step=lambda: kv.reset_prefix_cache() or ["out"])
    assert EngineCore.step(core) == ["out"] and sent == [[AllBlocksCleared()]] and kv.events == []
