"""KV-cache events as vLLM publishes them (vllm/distributed/kv_events.py), so that a cache-aware router built for
vLLM (llm-d's kv-cache-manager, sgl-model-gateway) follows a jinfer replica's prefix cache unchanged.

Wire format, vLLM's: a PUB socket sends each step's events as three frames (topic, sequence number as 8 bytes
big-endian, payload); the payload is msgpack of `KVEventBatch(ts, events, data_parallel_rank)` and the events are
tagged structs `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)`,
`BlockRemoved(block_hashes, medium)`, `AllBlocksCleared()`, all encoded as arrays (msgspec `array_like`, the tag
first): the layout every vLLM consumer decodes. A ROUTER socket (`replay_endpoint`) answers a request frame holding
a start sequence number (8 bytes big-endian) with every buffered batch from there, one (seq, payload) message
each, then (-1, b"") to end.

A block is one full page of the prefix cache. Its hash is vLLM's integer form of a digest: the low 64 bits of
the page's 128-bit chained digest (jinfer/cache/manager.py), unsigned. The host tier is not reported (medium "GPU"
only). Nothing received is executed: the replay socket reads one integer.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from jinfer.config.json_fields import config_fields

log = logging.getLogger("jinfer.kv_events")

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay's end marker


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the events (the tag is the class name, as vLLM's)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None


def block_hash(digest: bytes) -> int:
    """vLLM's integer block hash of a page digest: its last 8 bytes, big-endian, unsigned."""
    return int.from_bytes(digest[-8:], "big")


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload back into its batch (type-checked by msgspec; consumers and tests)."""
    return _DECODER.decode(payload)


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig (`--kv-events-config` JSON, `LLM(kv_events_config=...)`)."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq", or "null" (events collected, never sent)
    endpoint: str = "tcp://*:5557"  # a wildcard, ipc:// or inproc:// address is bound, another connected to
    replay_endpoint: str | None = None  # ROUTER address answering replay requests; None: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    def __post_init__(self):
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher={self.publisher!r} must be 'zmq' or 'null'")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"kv_events_config.{name}={v!r} must be an integer >= 1")

    @classmethod
    def parse(cls, value: KVEventsConfig | dict[str, Any] | str | None) -> KVEventsConfig | None:
        """From vLLM's forms: a dict of the fields, its JSON text, or a config (None: no events)."""
        if value is None or isinstance(value, cls):
            return value
        value = config_fields(cls, "kv_events_config", value)
        return cls(**value)


def offset_endpoint(endpoint: str | None, rank: int) -> str | None:
    """Data-parallel replica `rank`'s address, as vLLM's: a tcp port + rank, an inproc name + `_dp<rank>`."""
    if not endpoint or rank == 0:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return f"{base}:{int(port) + rank}"
    raise ValueError(f"kv_events_config endpoint {endpoint!r}: data parallel needs tcp:// or inproc://")


class ZmqEventPublisher:
    """PUB socket + replay ROUTER, owned by one thread (ZeroMQ sockets are not thread-safe): the engine step only
    puts a batch on a queue, the thread encodes and sends it, keeps it for replay and answers replay requests."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0, context=None):
        import zmq

        self._zmq, self.rank = zmq, data_parallel_rank
        self._ctx = context or zmq.Context.instance()
        self._topic = config.topic.encode()
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):  # as vLLM decides
            self._pub.bind(endpoint)
        else:
            self._pub.connect(endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(offset_endpoint(config.replay_endpoint, data_parallel_rank))
        self.endpoint = self._pub.getsockopt(zmq.LAST_ENDPOINT).decode()  # the bound port, if it was 0
        self._thread = threading.Thread(target=self._run, name="jinfer-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list) -> None:
        """One step's events (none: nothing sent). A full queue drops the batch: the engine never waits."""
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events, self.rank))
        except queue.Full:
            log.warning("KV events dropped: the publisher is %d batches behind", self._queue.maxsize)

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = encode_batch(batch)
                self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
        except Exception:
            log.exception("KV event publisher failed: no more events are sent")
        finally:
            self._pub.close()
            if self._replay is not None:
                self._replay.close()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:  # identity, empty delimiter (a REQ/DEALER client), start seq
            log.warning("dropped a KV event replay request of %d frames", len(frames))
            return
        identity, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in self._buffer:
            if seq >= start:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> ZmqEventPublisher | None:
    """The publisher a config asks for; None when events are off or go nowhere ("null")."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    return ZmqEventPublisher(config, data_parallel_rank)
