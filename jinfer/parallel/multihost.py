"""Several processes, one mesh: `--nnodes N --node-rank R --master-addr HOST --master-port PORT`.

Every process of the group calls `jax.distributed.initialize` (process 0 hosts JAX's coordinator at
HOST:PORT) and builds the same EngineCore: the same config, one mesh over the devices of all
processes, each process holding its own shards of the weights and of the KV cache. Process 0 owns the
scheduler. For each step it sends the step's inputs (its shape key and ModelRunner's two packed int32
buffers, `StepInputs`) to the other processes over ZeroMQ, then launches the step itself; the others
(`Follower.serve`) launch the very same executables on the very same inputs, so the collectives inside
the step meet. Only process 0 reads the sampled tokens back; the others never leave the device.

    process 0:  schedule -> build batch -> send StepInputs ---------> launch -> read tokens -> ...
    process r:                           recv StepInputs -> launch (same executables, same order)

Liveness. A collective whose peer is gone never returns, and JAX's coordination service aborts every
process of the group a heartbeat timeout after one of them is lost: a group lives and dies as one. To
make that fast, each process runs a heartbeat thread on sockets of its own (process 0's step socket can
be blocked inside a collective), from the moment it joins: the others ping process 0 every HEARTBEAT_S
and process 0 beats back to each of them. A process logs why and exits at once with status
EXIT_PEER_LOST when
- a peer's process is gone: its heartbeat connection closed (the follower's socket monitor sees the
  disconnection; process 0's beat to that peer finds no route), within a heartbeat, at any time;
- a peer is silent for longer than `peer_timeout_s` once the group is up (process 0 has heard every
  process's hello and says so in its beats). While the processes start (loading weights, compiling), a
  thread can be starved for seconds: a slow peer is not a dead one, so silence only counts after
  STARTUP_PEER_TIMEOUT_S then.
Process 0 exiting is what the server's engine client sees (the process, or its socket, gone): it fails
the requests in flight and reports unhealthy; every other process exits by the same rules. A clean stop
is process 0 sending STOP (also on the heartbeat socket, so that nobody takes the quiet that follows for a
death) and every process then leaving JAX's coordination service together.

Messages are msgpack lists of ints, bools and bytes: nothing received is executed.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time

import zmq
from zmq.utils.monitor import recv_monitor_message

from jinfer.engine.step_inputs import StepInputs

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.1
# The default silence that ends the group once it is up (`join`'s peer_timeout_s): for a host that vanishes
# without closing its connections (a dead process is seen by its closed connection at once). A serving
# process's thread can be starved for a second by a compile on a busy host: that is not a death.
PEER_TIMEOUT_S = 5.0
STARTUP_PEER_TIMEOUT_S = 120.0  # while processes load weights and compile (threads can starve)
JAX_HEARTBEAT_TIMEOUT_S = 10  # JAX's own detection, the backstop
JAX_SHUTDOWN_TIMEOUT_S = 30
WORKER_WAIT_S = 600.0  # process 0 waits this long for the others to be ready
EXIT_PEER_LOST = 3
STOP = b"stop"
PING, PONG, UP = b"ping", b"pong", b"up"  # UP: process 0's beat once the group is up
_STEPS_KEY, _HEARTBEAT_KEY = "jinfer/steps", "jinfer/heartbeat"
_COMPILED_KEY = "jinfer/warmup_compiled"  # process 0's warm-up compiles are done


def check_group(nnodes: int, node_rank: int, master_port: int) -> None:
    """ValueError naming the field, for EngineConfig."""
    if not isinstance(nnodes, int) or isinstance(nnodes, bool) or nnodes < 1:
        raise ValueError(f"nnodes={nnodes!r} must be an integer >= 1")
    if not isinstance(node_rank, int) or isinstance(node_rank, bool) or not 0 <= node_rank < nnodes:
        raise ValueError(f"node_rank={node_rank!r} must be in [0, nnodes={nnodes})")
    if not isinstance(master_port, int) or isinstance(master_port, bool) or not 0 < master_port < 65536:
        raise ValueError(f"master_port={master_port!r} must be a TCP port in [1, 65535]")


def join(nnodes: int, node_rank: int, master_addr: str, master_port: int,
         peer_timeout_s: float = PEER_TIMEOUT_S) -> Leader | Follower | None:
    """Join the group (jax.distributed + this module's sockets); None for a single process. Call it before
    anything starts JAX's backends. `peer_timeout_s`: the silence after which a peer counts as lost, once
    the group is up."""
    if nnodes == 1:
        return None
    if not peer_timeout_s > 0:
        raise ValueError(f"peer_timeout_s={peer_timeout_s!r} must be > 0")
    import jax
    from jax._src import distributed as jax_distributed

    if jax_distributed.global_state.client is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU collectives across processes
        log.info("process %d of %d: joining the group at %s:%d", node_rank, nnodes, master_addr, master_port)
        jax.distributed.initialize(f"{master_addr}:{master_port}", nnodes, node_rank,
                                   heartbeat_timeout_seconds=JAX_HEARTBEAT_TIMEOUT_S,
                                   shutdown_timeout_seconds=JAX_SHUTDOWN_TIMEOUT_S)
    if (jax.process_count(), jax.process_index()) != (nnodes, node_rank):
        raise ValueError(f"nnodes={nnodes}, node_rank={node_rank} do not match JAX's distributed setup "
                         f"({jax.process_count()} processes, this one {jax.process_index()})")
    kv = jax_distributed.global_state.client
    if node_rank == 0:
        return Leader(nnodes, master_addr, kv, peer_timeout_s)
    return Follower(nnodes, node_rank, kv, peer_timeout_s)


def _bind_ip(host: str) -> str:
    try:
        return socket.gethostbyname(host)
    except OSError:
        return "*"


def _lost(reason: str) -> None:
    """A peer is gone: the group cannot go on, and a collective waiting on it would never return."""
    log.error("%s: exiting (status %d); the other processes of the group exit too", reason, EXIT_PEER_LOST)
    for handler in logging.getLogger().handlers:
        handler.flush()
    os._exit(EXIT_PEER_LOST)


def _leave_jax() -> None:
    """Leave JAX's coordination service; every process of the group does it at the same time."""
    import jax

    try:
        jax.distributed.shutdown()
    except Exception as e:  # noqa: BLE001 - a failed goodbye must not hide why we stop
        log.warning("jax.distributed.shutdown: %s", e)


class _Heartbeat(threading.Thread):
    """One process's side of the heartbeat, on a socket of its own: `on_lost` when a peer's connection
    closes (its process is gone), or when a peer is silent for longer than `timeout`.

    Process 0 (`peers`: the other processes' identities) beats to each process it has heard from, every
    HEARTBEAT_S: PONG while the group starts, UP once `up` is set; with ROUTER_MANDATORY a beat to a process
    whose connection closed fails at once. A follower (`peers` None) pings process 0 every HEARTBEAT_S,
    watches its connection with a socket monitor, and keeps the start-up timeout until process 0 beats UP.
    """

    def __init__(self, sock: zmq.Socket, peers: list[bytes] | None, peer_timeout_s: float, on_lost=_lost):
        super().__init__(name="jinfer-heartbeat", daemon=True)
        self.sock, self.peers, self.on_lost = sock, peers, on_lost  # peers: None on a follower
        self.peer_timeout_s = peer_timeout_s
        self.timeout = STARTUP_PEER_TIMEOUT_S  # peer_timeout_s once the group is up
        self.up = threading.Event()  # process 0: every process said hello
        # a follower: its one connection (to process 0) closing is process 0 gone
        self.monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED) if peers is None else None
        self.stopping = threading.Event()
        self.closed = threading.Event()

    def run(self) -> None:
        now = time.monotonic()
        last = {p: now for p in self.peers} if self.peers is not None else {b"": now}
        heard: set[bytes] = set()  # process 0: the peers whose connection is up (beats go to them)
        next_beat = now
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self.monitor is not None:
            poller.register(self.monitor, zmq.POLLIN)
        try:
            while not self.stopping.is_set():
                if time.monotonic() >= next_beat:
                    self._beat(heard)
                    next_beat = time.monotonic() + HEARTBEAT_S
                ready = dict(poller.poll(int(HEARTBEAT_S * 1000 / 2)))
                while self.sock.poll(0, zmq.POLLIN):  # what came before a disconnection is read first
                    frames = self.sock.recv_multipart()
                    if frames[-1] == STOP:  # the leader stops the group: silence from here on is expected
                        self.stopping.set()
                        return
                    if self.peers is None:
                        last[b""] = time.monotonic()
                        if frames[-1] == UP:
                            self.timeout = self.peer_timeout_s
                    elif frames[0] in last and frames[-1] == PING:
                        last[frames[0]] = time.monotonic()
                        heard.add(frames[0])
                if self.monitor is not None and self.monitor in ready:
                    event = recv_monitor_message(self.monitor)
                    if event["event"] == zmq.EVENT_DISCONNECTED:
                        self.on_lost("process 0 closed its connection (its process is gone)")
                        return
                quiet = [p for p, t in last.items() if time.monotonic() - t > self.timeout]
                if quiet and not self.stopping.is_set():
                    who = "process 0" if self.peers is None else ", ".join(_rank_name(p) for p in quiet)
                    self.on_lost(f"no heartbeat from {who} for {self.timeout:.1f} s")
                    return
        except _PeerGone as e:
            self.on_lost(f"{_rank_name(e.peer)} closed its connection (its process is gone)")
        except zmq.ZMQError as e:
            if not self.stopping.is_set():
                self.on_lost(f"heartbeat socket failed: {e}")
        finally:
            self.closed.set()

    def _beat(self, heard: set[bytes]) -> None:
        if self.peers is None:
            _send_unless_full(self.sock, [PING])
            return
        beat = UP if self.up.is_set() else PONG
        for peer in heard:
            try:
                _send_unless_full(self.sock, [peer, beat])
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH:  # ROUTER_MANDATORY: no connection to that peer any more
                    raise _PeerGone(peer) from None
                raise

    def stop(self, linger_ms: int = 0) -> None:
        """End the thread and close the socket, still sending for `linger_ms` what is queued."""
        self.stopping.set()
        self.closed.wait(2.0)
        if self.monitor is not None:
            self.sock.disable_monitor()
            self.monitor.close(linger=0)
        self.sock.close(linger=linger_ms)


class _PeerGone(Exception):
    def __init__(self, peer: bytes):
        super().__init__(peer)
        self.peer = peer


def _send_unless_full(sock: zmq.Socket, frames: list[bytes]) -> None:
    """Send without blocking; a full queue (the peer is slow to read: starting, or starved) drops the beat."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _rank_name(identity: bytes) -> str:
    return f"process {identity.decode()[1:]}"


def _worker_id(rank: int) -> bytes:
    return f"w{rank}".encode()


class _Member:
    def __init__(self, nnodes: int, rank: int, kv):
        self.nnodes, self.rank, self.kv = nnodes, rank, kv
        self.ctx = zmq.Context()

    def lost(self, reason: str) -> None:
        _lost(reason)

    def __enter__(self):
        """The compiles ahead of a warm-up (`ModelRunner.warmup`'s compile_turn): the others wait for process 0's."""
        if self.rank:
            self.kv.blocking_key_value_get(_COMPILED_KEY, int(WORKER_WAIT_S * 1000))
        return self

    def __exit__(self, *exc) -> None:
        if not self.rank and exc[0] is None:
            self.kv.key_value_set(_COMPILED_KEY, "1")

    def agree_min(self, name: str, value: int) -> int:
        """The least of every process's `value` (e.g. KV pages: each process sizes its pool by its own
        free memory, but the executables must have the same shapes everywhere)."""
        self.kv.key_value_set(f"jinfer/{name}/{self.rank}", str(int(value)))
        return min(int(self.kv.blocking_key_value_get(f"jinfer/{name}/{r}", int(WORKER_WAIT_S * 1000)))
                   for r in range(self.nnodes))


class Leader(_Member):
    """Process 0's side: the step socket it sends every step on, and its heartbeat to the others."""

    def __init__(self, nnodes: int, master_addr: str, kv, peer_timeout_s: float = PEER_TIMEOUT_S):
        super().__init__(nnodes, 0, kv)
        self.workers = [_worker_id(r) for r in range(1, nnodes)]
        ip = _bind_ip(master_addr)
        self.steps = self.ctx.socket(zmq.ROUTER)
        self.steps.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.steps.setsockopt(zmq.SNDHWM, 0)
        hb = self.ctx.socket(zmq.ROUTER)
        hb.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a beat to a process whose connection closed fails
        host = master_addr if ip == "*" else ip
        kv.key_value_set(_STEPS_KEY, f"tcp://{host}:{self.steps.bind_to_random_port(f'tcp://{ip}')}")
        kv.key_value_set(_HEARTBEAT_KEY, f"tcp://{host}:{hb.bind_to_random_port(f'tcp://{ip}')}")
        self.heartbeat = _Heartbeat(hb, self.workers, peer_timeout_s)
        self.heartbeat.start()
        self.ready = False
        self.closed = False

    def wait_for_workers(self, timeout: float = WORKER_WAIT_S) -> None:
        """Until every other process has built its engine and said hello on the step socket."""
        waiting, deadline = set(self.workers), time.monotonic() + timeout
        while waiting:
            if not self.steps.poll(int(max(0.0, deadline - time.monotonic()) * 1000), zmq.POLLIN):
                raise RuntimeError(f"processes {sorted(w.decode()[1:] for w in waiting)} not ready "
                                   f"within {timeout:.0f} s")
            identity, _ = self.steps.recv_multipart()
            waiting.discard(identity)
        self.ready = True
        self.heartbeat.timeout = self.heartbeat.peer_timeout_s
        self.heartbeat.up.set()  # the others keep their start-up timeout until they hear it
        log.info("all %d processes of the group are ready", len(self.workers) + 1)

    def send_step(self, step: StepInputs) -> None:
        self._send(step.to_wire())

    def _send(self, frame: bytes) -> None:
        for w in self.workers:
            self.steps.send_multipart([w, frame])

    def close(self) -> None:
        """Stop the group: the others leave their loops, then all leave JAX's coordination service."""
        if self.closed:
            return
        self.closed = True
        self.heartbeat.stopping.set()
        self.heartbeat.closed.wait(2.0)  # the thread is off its socket: ours to use now
        for w in self.workers:  # on the heartbeat socket first: nobody may take the coming silence for a death
            try:
                self.heartbeat.sock.send_multipart([w, STOP], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        if self.ready:
            try:
                self._send(STOP)
            except zmq.ZMQError as e:
                log.warning("could not tell the group to stop: %s", e)
        self.heartbeat.stop(linger_ms=1000)  # STOP reaches the others before the connection closes
        self.steps.close(linger=1000)
        self.ctx.term()
        _leave_jax()


class Follower(_Member):
    """Process r > 0: replays every step process 0 sends, until STOP."""

    def __init__(self, nnodes: int, rank: int, kv, peer_timeout_s: float = PEER_TIMEOUT_S):
        super().__init__(nnodes, rank, kv)
        hb = self.ctx.socket(zmq.DEALER)
        hb.setsockopt(zmq.IDENTITY, _worker_id(rank))
        self.heartbeat = _Heartbeat(hb, None, peer_timeout_s)  # (its monitor watches the connection made next)
        hb.connect(kv.blocking_key_value_get(_HEARTBEAT_KEY, int(WORKER_WAIT_S * 1000)))
        self.heartbeat.start()
        self.steps = self.ctx.socket(zmq.DEALER)
        self.steps.setsockopt(zmq.IDENTITY, _worker_id(rank))
        self.steps.setsockopt(zmq.RCVHWM, 0)
        self.steps.connect(kv.blocking_key_value_get(_STEPS_KEY, int(WORKER_WAIT_S * 1000)))

    def serve(self, runner) -> int:
        """Say hello, then launch each step process 0 sends on `runner` (a ModelRunner); 0 after STOP."""
        import jax

        self.steps.send(b"hello")  # process 0's heartbeat says UP once every process has
        in_flight: list = []
        while True:
            frame = self.steps.recv()
            if frame == STOP:
                break
            try:
                packed, _, _ = runner.run_step(StepInputs.from_wire(frame))
                in_flight.append(packed)  # (not the tokens: the next step's sampler takes their buffer)
                if len(in_flight) > 2:  # as deep as process 0's pipeline: launch N+1, then wait for N
                    done = in_flight.pop(0)
                    jax.block_until_ready(done)
                    runner.give_back_packed(done)  # (never read here: the sampler's next buffer of its shape)
            except Exception as e:  # noqa: BLE001 - the group's collectives are out of step for good
                self.lost(f"a step failed ({type(e).__name__}: {e}); the group cannot go on")
        log.info("process %d: stopped by process 0", self.rank)
        self.close()
        return 0

    def close(self) -> None:
        self.heartbeat.stopping.set()
        self.heartbeat.stop()
        self.steps.close(linger=0)
        self.ctx.term()
        _leave_jax()
