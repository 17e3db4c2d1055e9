"""Several processes, one mesh (jinfer/parallel/multihost.py), on CPU with gloo collectives: each process is a
fresh interpreter with its own fake CPU devices, joined by `jax.distributed`. The group gives HF's greedy
tokens (what one process gives too, tests/models/test_parallel_engine.py), stops cleanly, and a process
that dies takes the group down at once: the server's client fails the request in flight and no process
is left behind. A process slow to start is not taken for a dead one; one that dies while the others start
is seen at once."""

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from jinfer.client import EngineClient
from jinfer.config.engine import EngineConfig
from jinfer.engine.args import add_engine_arguments, engine_config_kwargs
from jinfer.engine.step_inputs import StepInputs
from jinfer.parallel.multihost import EXIT_PEER_LOST, check_group
from jinfer.sampling_params import SamplingParams

from ..conftest import DATA, FAST_COMPILE, ROOT

BASE = dict(dtype="float32", page_size=4, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=8,
            compilation_cache_dir="")
# Prints the greedy ids of the golden prompts (the first GROUP_TOKENS of each) as JSON, then stops the group.
GROUP_TOKENS = 16  # (every step of the group is a collective over gloo: HF's 32 add steps, not code paths)
LEADER = """
import json, sys
from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams
config, prompts = json.loads(sys.argv[1]), json.loads(sys.argv[2])
llm = LLM(**config)
outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                    SamplingParams(temperature=0.0, max_tokens=int(sys.argv[3]), ignore_eos=True), use_tqdm=False)
print("TOKENS", json.dumps([list(o.outputs[0].token_ids) for o in outs]), flush=True)
llm.engine.close()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(devices: int) -> dict:
    return dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}",
                JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))


def start_follower(config: dict, rank: int, devices: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jinfer.engine.worker_proc", "--config",
                             json.dumps(config | {"node_rank": rank})], env=process_env(devices),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def gold(arch):
    g = np.load(DATA / "golden" / f"tiny-{arch}.npz")
    return [g[f"prompt_{i}"].tolist() for i in range(3)], [g[f"greedy_{i}"].tolist() for i in range(3)]


@pytest.mark.parametrize("arch,devices,ep,backend,warmup", [
    # tp=4: two devices each, experts split over all four. The reference ops: the Pallas kernels run per shard, the
    # same in one process (tests/models/test_parallel_engine.py's ep=4 Pallas case) as in two. (One device in each
    # process, warmed up: the served group below.)
    ("qwen3_moe", 2, True, "reference", False),
])
def test_two_processes_give_hf_tokens(arch, devices, ep, backend, warmup):
    prompts, greedy = gold(arch)
    config = dict(BASE, model=str(DATA / f"tiny-{arch}"), tensor_parallel_size=2 * devices, nnodes=2,
                  master_port=free_port(), enable_expert_parallel=ep, attention_backend=backend, warmup=warmup)
    follower = start_follower(config, 1, devices)
    leader = subprocess.run([sys.executable, "-c", LEADER, json.dumps(config | {"node_rank": 0}),
                             json.dumps(prompts), str(GROUP_TOKENS)], env=process_env(devices), capture_output=True,
                            text=True, timeout=300)
    try:
        assert follower.wait(timeout=60) == 0, follower.stderr.read()[-3000:]  # stopped by process 0, cleanly
    finally:
        follower.kill()
    assert leader.returncode == 0, leader.stderr[-3000:]
    line = next(x for x in leader.stdout.splitlines() if x.startswith("TOKENS"))
    assert json.loads(line.removeprefix("TOKENS ")) == [g[:GROUP_TOKENS] for g in greedy]


def spawn_group(monkeypatch):
    """A served 2-process group: process 0 behind an EngineClient (as `jinfer serve` runs it), process 1
    headless."""
    config = dict(BASE, model=str(DATA / "tiny-qwen3"), tensor_parallel_size=2, nnodes=2, master_port=free_port(),
                  max_model_len=512, warmup=False)
    follower = start_follower(config, 1, 1)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}")
    try:
        client = EngineClient.spawn(config | {"node_rank": 0}, startup_timeout=240)
    except BaseException:
        follower.kill()
        raise
    return client, follower


def long_request(client, result: dict) -> threading.Thread:
    def run():
        try:
            client.generate([1, 2, 3], SamplingParams(max_tokens=500, ignore_eos=True),
                            timeout=120)
            result["outcome"] = "finished"
        except Exception as e:  # noqa: BLE001 - what the test looks at
            result["outcome"] = type(e).__name__
        result["at"] = time.monotonic()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("victim", ["follower", "leader"])
def test_a_dead_process_takes_the_group_down_at_once(victim, monkeypatch):
    client, follower = spawn_group(monkeypatch)
    leader = client.process
    try:
        assert client.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True),
                               timeout=60).outputs[0].token_ids  # the group serves
        result = {}
        thread = long_request(client, result)
        time.sleep(0.5)  # the request is running
        assert "outcome" not in result
        killed = time.monotonic()
        (follower if victim == "follower" else leader).send_signal(signal.SIGKILL)
        thread.join(timeout=10)
        # the request in flight fails (not hangs), the client reports the engine dead, within a second or so
        assert result["outcome"] in ("EngineDeadError", "RequestError"), result
        assert result["at"] - killed < 2.0, result["at"] - killed
        deadline = time.monotonic() + 2.0
        while client.is_alive and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not client.is_alive, "the engine client still reports the group alive"
        # and no process of the group is left: the survivor exits by itself, having lost its peer (our
        # heartbeat, EXIT_PEER_LOST; or JAX's coordination client aborting when process 0's service is gone)
        survivor = leader if victim == "follower" else follower
        code = survivor.wait(timeout=5)
        assert code == EXIT_PEER_LOST if victim == "follower" else code != 0
    finally:
        client.close()
        follower.kill()
        leader.kill()


def children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except OSError:
            pass
    return out


def test_served_engine_spreads_over_a_process_per_device(monkeypatch):
    """`--distributed-executor-backend mp` (the GPU default): the engine process of `jinfer serve -tp 2` spawns its
    follower itself and leads the group, both warmed up (compiled ahead, every shape); HF's greedy ids; the client's
    Shutdown stops both processes cleanly."""
    prompts, greedy = gold("qwen3")
    # (8-token steps and 16 pages a sequence: 3 forward shapes to warm up in both processes, not 8)
    config = dict(BASE, model=str(DATA / "tiny-qwen3"), tensor_parallel_size=2, distributed_executor_backend="mp",
                  max_num_batched_tokens=8, max_model_len=64)
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=1 {FAST_COMPILE}")  # per process
    client = EngineClient.spawn(config, startup_timeout=240)
    engine = client.process
    try:
        followers = children(engine.pid)
        assert len(followers) == 1, followers
        out = client.generate(prompts[0], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                              timeout=60)
        assert list(out.outputs[0].token_ids) == greedy[0]
    finally:
        client.close()  # Shutdown to process 0, which stops process 1
        code = engine.wait(timeout=60)
        engine.kill()
    assert code == 0
    assert not [p for p in followers if os.path.exists(f"/proc/{p}")]


# A bare group (multihost.join, no engine). "hold": libc's sleep called holding the GIL, so that no thread of
# the process runs (as a long load or compile can starve the heartbeat thread); "sleep": starting, threads free.
GROUP = """
import ctypes, sys, time
from jinfer.parallel import multihost
rank, port, start, seconds = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
group = multihost.join(2, rank, "127.0.0.1", port, peer_timeout_s=0.5)
print("JOINED", flush=True)
if start == "hold":
    ctypes.PyDLL(None).sleep(seconds)
else:
    time.sleep(seconds)
if rank == 0:
    group.wait_for_workers()
    group.close()
else:
    sys.exit(group.serve(runner=None))  # no step comes: 0 once process 0 stops the group
"""


def start_member(rank: int, port: int, start: str, seconds: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", GROUP, str(rank), str(port), start, str(seconds)],
                            env=process_env(1), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_joined(*procs: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for p in procs:
        ready, _, _ = select.select([p.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready and p.stdout.readline().strip() == "JOINED", p.stderr.read()[-3000:] if p.poll() else ""


def test_a_slow_process_is_not_a_dead_one():
    """Process 0 stalls for 2 s (four times the peer timeout) before its group is up, with its heartbeat
    thread starved: process 1, already serving, waits for it; then the group stops cleanly."""
    port = free_port()
    leader, follower = start_member(0, port, "hold", 2), start_member(1, port, "sleep", 0)
    try:
        assert follower.wait(timeout=60) == 0, follower.stderr.read()[-3000:]
        assert leader.wait(timeout=30) == 0, leader.stderr.read()[-3000:]
    finally:
        leader.kill()
        follower.kill()


@pytest.mark.parametrize("victim", [0, 1])
def test_a_process_dying_while_the_group_starts_is_seen_at_once(victim):
    """Both processes still starting (the start-up timeout is minutes): the survivor exits within a
    second of its peer's death, by the peer's closed connection."""
    port = free_port()
    members = [start_member(0, port, "sleep", 60), start_member(1, port, "sleep", 60)]
    try:
        wait_joined(*members)
        time.sleep(0.5)  # the heartbeats have met
        members[victim].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        survivor = members[1 - victim]
        code = survivor.wait(timeout=10)
        assert time.monotonic() - killed < 1.5, (time.monotonic() - killed, survivor.stderr.read()[-3000:])
        # our heartbeat (EXIT_PEER_LOST); process 1 may also be aborted by JAX's coordination client when process
        # 0, which hosts its service, is gone
        assert code == EXIT_PEER_LOST if victim == 1 else code != 0, survivor.stderr.read()[-3000:]
        if code == EXIT_PEER_LOST:
            assert "closed its connection" in survivor.stderr.read()
    finally:
        for p in members:
            p.kill()


def test_step_inputs_round_trip():
    step = StepInputs(16, 8, 32, True, 3, 2, 5, (True, False, True), np.arange(10, dtype=np.int32),
                      np.array([-1, 2**31 - 1], np.int32))
    back = StepInputs.from_wire(step.to_wire())
    assert (back.T, back.B, back.P, back.decode, back.M, back.W, back.num_logprobs, back.flags) == \
        (16, 8, 32, True, 3, 2, 5, (True, False, True))
    assert back.batch.tolist() == list(range(10)) and back.sampling.tolist() == [-1, 2**31 - 1]
    verify = StepInputs(16, 8, 32, 5, 0, 0, -1, (False,) * 3, step.batch, step.sampling, R=16)  # a verify step's kind
    assert StepInputs.from_wire(verify.to_wire()).decode == 5


@pytest.mark.parametrize("kw,match", [
    ({"nnodes": 0}, "nnodes=0"),
    ({"nnodes": 2, "node_rank": 2}, "node_rank=2"),
    ({"nnodes": 2, "master_port": 70000}, "master_port=70000"),
    ({"nnodes": 2, "data_parallel_size": 2}, "data_parallel_size=2"),
])
def test_config_names_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kw)
    if "data_parallel_size" not in kw:
        with pytest.raises(ValueError, match=match):
            check_group(kw.get("nnodes", 1), kw.get("node_rank", 0), kw.get("master_port", 29500))


def test_cli_flags():
    import argparse

    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    add_engine_arguments(parser)
    kw = engine_config_kwargs(parser.parse_args(["-tp", "4", "--nnodes", "2", "--node-rank", "1",
                                                 "--master-addr", "10.0.0.1", "--master-port", "1234"]))
    assert (kw["nnodes"], kw["node_rank"], kw["master_addr"], kw["master_port"]) == (2, 1, "10.0.0.1", 1234)
    assert EngineConfig(**kw).tensor_parallel_size == 4
