"""Data-parallel replicas behind one client: N engine processes (each its own mesh of devices), one router.

`ReplicaClient` speaks the `EngineClient` interface the server uses (`stream_batch`, `info`, `is_alive`,
`add_death_callback`, `replicas`...), so `jinfer serve --data-parallel-size N` changes nothing else in
the server. Routing, per request:
- the replica that holds the longest cached prefix of the prompt (tracked here: the chained hashes of
  the 16-token blocks of the prompts sent to each replica, an LRU bounded per replica; an approximation
  of the replica's own prefix cache, as SGLang's cache-aware router keeps one), unless that replica
  is already `BALANCE_SLACK` sequences busier than the least loaded one;
- else the least loaded replica (sequences in flight from this client).
A replica that dies fails its own requests (its EngineClient does that) and takes no new ones; the
client is dead (the server unhealthy) only when every replica is.

Devices: replica i sees GPUs [i * tp, (i + 1) * tp) of the host's (of $CUDA_VISIBLE_DEVICES when set),
through its own CUDA_VISIBLE_DEVICES, so each process's JAX only touches its own GPUs.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from msgspec.structs import replace

from jinfer.client import EngineClient, EngineDeadError
from jinfer.engine.spawn import default_address, discard_engine_process, start_engine_process
from jinfer.sampling_params import SamplingParams

log = logging.getLogger(__name__)

BLOCK = 16  # tokens per routing block
MAX_BLOCKS_PER_REPLICA = 1 << 17  # ~2M tokens of prompts remembered per replica
BALANCE_SLACK = 8  # prefix affinity yields to load balance past this many extra sequences


def replica_devices(index: int, devices_per_replica: int, visible: str | None = None) -> str:
    """CUDA_VISIBLE_DEVICES of replica `index`: its slice of the visible devices (`visible`, default the
    environment's, else 0..)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    ids = [d for d in visible.split(",") if d.strip()] if visible else None
    need = (index + 1) * devices_per_replica
    if ids is not None and len(ids) < need:
        raise ValueError(f"data_parallel_size x tensor_parallel_size needs {need} devices; "
                         f"CUDA_VISIBLE_DEVICES={visible!r} has {len(ids)}")
    chosen = range(index * devices_per_replica, need)
    return ",".join(ids[i] if ids is not None else str(i) for i in chosen)


class PrefixTracker:
    """Which prompt blocks were sent to one replica: chained hashes in LRU order, at most `capacity`."""

    def __init__(self, capacity: int = MAX_BLOCKS_PER_REPLICA):
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @staticmethod
    def hashes(ids: Sequence[int]) -> list[int]:
        out, h = [], 0
        for start in range(0, len(ids) - BLOCK + 1, BLOCK):
            h = hash((h, tuple(ids[start:start + BLOCK])))
            out.append(h)
        return out

    def match(self, hashes: list[int]) -> int:
        """Leading blocks of the prompt this replica has seen."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def add(self, hashes: list[int]) -> None:
        for h in hashes:
            self._blocks[h] = None
            self._blocks.move_to_end(h)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)

    def clear(self) -> None:
        self._blocks.clear()


class ReplicaClient:
    """N EngineClients, one router (see the module doc)."""

    def __init__(self, clients: list[EngineClient]):
        if not clients:
            raise ValueError("a ReplicaClient needs at least one replica")
        self.clients = clients
        self.trackers = [PrefixTracker() for _ in clients]
        self.load = [0] * len(clients)  # sequences in flight per replica
        self.routed = [0] * len(clients)  # requests sent per replica
        self.prefix_routed = 0  # requests sent to a replica for its cached prefix
        self._lock = threading.Lock()
        self._death_callbacks: list[Callable[[str], None]] = []
        first = clients[0].info
        # admission: the server may hold every replica's batch
        self.info = replace(first, max_num_seqs=sum(c.info.max_num_seqs for c in clients))
        for i, c in enumerate(clients):
            c.add_death_callback(lambda reason, i=i: self._on_replica_death(i, reason))

    @classmethod
    def spawn(cls, config: dict, data_parallel_size: int, *, core_factory: str | None = None,
              startup_timeout: float = 900.0, name: str = "client") -> ReplicaClient:
        """Start `data_parallel_size` engine processes for `config` (EngineConfig fields), each on its own
        devices, and connect to all of them. Any replica failing to start stops the others."""
        tp = int(config.get("tensor_parallel_size") or 1)
        envs = [{"CUDA_VISIBLE_DEVICES": replica_devices(i, tp)} for i in range(data_parallel_size)]
        clients: list[EngineClient] = []
        procs: list = []
        try:
            # start every process first (they load in parallel), then wait for each

            for env in envs:
                address = default_address()
                procs.append((address, start_engine_process(config, address, core_factory=core_factory, env=env,
                                                            owned_ipc_dir=os.path.dirname(address.removeprefix("ipc://")))))
            for i, (address, proc) in enumerate(procs):
                clients.append(EngineClient(address, process=proc, startup_timeout=startup_timeout,
                                            name=f"{name}-dp{i}",
                                            ipc_dir=os.path.dirname(address.removeprefix("ipc://"))))
        except BaseException:
            for c in clients:
                c.close()
            for address, proc in procs[len(clients):]:
                discard_engine_process(proc, os.path.dirname(address.removeprefix("ipc://")))
            raise
        return cls(clients)

    # ---- the EngineClient surface the server uses ---------------------------------------------------

    @property
    def replicas(self) -> list[EngineClient]:
        return self.clients

    @property
    def is_alive(self) -> bool:
        return any(c.is_alive for c in self.clients)

    @property
    def dead_reason(self) -> str | None:
        if self.is_alive:
            return None
        return "; ".join(f"replica {i}: {c.dead_reason or 'closed'}" for i, c in enumerate(self.clients))

    @property
    def address(self) -> str:
        return ", ".join(c.address for c in self.clients)

    @property
    def tokenizer(self):
        return self.clients[0].tokenizer

    @property
    def latest_stats(self) -> dict[str, float]:
        return self.clients[0].latest_stats

    def add_death_callback(self, fn: Callable[[str], None]) -> None:
        """`fn(reason)` once every replica is dead."""
        self._death_callbacks.append(fn)

    def close(self) -> None:
        for c in self.clients:
            c.close()

    def __enter__(self) -> ReplicaClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    async def stats_async(self, timeout: float = 5.0) -> dict[str, float]:
        return await self.clients[0].stats_async(timeout)

    def route(self, ids: list[int]) -> int:
        """The replica for a prompt (see the module doc); raises EngineDeadError when none is alive."""
        alive = [i for i, c in enumerate(self.clients) if c.is_alive]
        if not alive:
            raise EngineDeadError(self.dead_reason or "no replica alive")
        hashes = PrefixTracker.hashes(ids)
        with self._lock:
            least = min(alive, key=lambda i: (self.load[i], self.routed[i]))
            best = max(alive, key=lambda i: (self.trackers[i].match(hashes), -self.load[i]))
            use_prefix = (self.trackers[best].match(hashes) > 0
                          and self.load[best] - self.load[least] <= BALANCE_SLACK)
            chosen = best if use_prefix else least
            self.prefix_routed += use_prefix and chosen != least
            self.trackers[chosen].add(hashes)
            self.routed[chosen] += 1
        return chosen

    async def stream_batch(self, prompts: Sequence[Any], params: SamplingParams | None = None,
                           request_id: str | None = None, *, suffix: bool = True
                           ) -> AsyncIterator[list[tuple[int, Any]]]:
        """`EngineClient.stream_batch` on the replica chosen for the first prompt (a request's prompts
        stay together)."""
        params = params or SamplingParams()
        first = self.clients[0]._prompt_ids(prompts[0]) if prompts else []
        i = self.route(first)
        seqs = len(prompts) * params.n
        with self._lock:
            self.load[i] += seqs
        try:
            async for chunk in self.clients[i].stream_batch(prompts, params, request_id, suffix=suffix):
                yield chunk
        finally:
            with self._lock:
                self.load[i] -= seqs

    # ---- failures ---------------------------------------------------------------------------------

    def _on_replica_death(self, index: int, reason: str) -> None:
        log.error("data-parallel replica %d died (%s): its requests failed; %d of %d replicas serve",
                  index, reason, sum(c.is_alive for c in self.clients), len(self.clients))
        self.trackers[index].clear()
        if not self.is_alive:
            for fn in self._death_callbacks:
                fn(self.dead_reason)
