"""Start-up time and idle host memory of `jinfer serve` (the launcher and the processes it starts).

    python -m benchmarks.bench_startup --model dummy:qwen3-4b --runs 2 -- --max-model-len 2048
    python -m benchmarks.bench_startup --runs 2 --fresh-cache      # the embedded default model

Each run starts `python -m server.launcher MODEL --port P ARGS...` (ARGS: everything after `--`),
measures the seconds until GET /health answers 200, waits for a staged warm-up's background loads and then
`--idle-s`, reads the RSS of the launcher and of every process below it from /proc (role from the command
line: "server" is the launcher, which runs the HTTP server itself; "engine" is jinfer.engine.core_proc):
`rss_mb_total_loaded`, every executable loaded. Then it waits (up to `--unload-wait-s`) for the engine to
drop the executables unused for their keep-alive (serve's `--executable-keep-alive`) and reads the RSS again:
`rss_mb_total`, the idle server's memory (the same as loaded when nothing was dropped in that time). Then it
stops the server with SIGTERM (SIGKILL after `--stop-timeout`). With `--fresh-cache` the runs share a new,
empty JAX compilation cache: the first run is cold, the others warm. Phase timings come from the engine's log lines.
`startup_s` is the median of the runs after the first (the only run if there is one).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

# Engine log lines -> phase names (seconds as logged, or the line's timestamp for "*_at").
PHASE_PATTERNS = {
    "engine_listening_at": re.compile(r"^(\S+ \S+) INFO jinfer\.engine: engine process \d+ listening"),
    "weights_s": re.compile(r"weights loaded in ([\d.]+) s"),
    "warmup_s": re.compile(r"warm-up: \d+ forward shapes ready in ([\d.]+) s"),
    "engine_init_s": re.compile(r"engine ready in ([\d.]+) s"),
    "serving_at": re.compile(r"^(\S+ \S+) INFO jinfer\.server: serving "),
    # a staged warm-up (serve's default) compiles the other shapes while serving: full speed from here
    "full_speed_at": re.compile(r"^(\S+ \S+) INFO jinfer\.engine\.\w+: warm-up: all \d+ token buckets ready"),
    # ... and drops the executables no step used for its keep-alive (serve's default --executable-keep-alive)
    "unloaded_at": re.compile(r"^(\S+ \S+) INFO jinfer\.engine\.\w+: unloaded the executables of"),
}
MB = 1 << 20


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """All processes below `pid` (children, grandchildren...), from /proc."""
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parent_of.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def memory(pid: int) -> dict | None:
    """RSS (and its anon / file / shmem parts, PSS) in MB, and whether jaxlib is mapped."""
    proc = Path(f"/proc/{pid}")
    try:
        status = dict(line.split(":", 1) for line in (proc / "status").read_text().splitlines() if ":" in line)
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        maps = (proc / "maps").read_text()
    except OSError:
        return None
    kb = lambda key: int(status[key].split()[0]) if key in status else 0  # noqa: E731
    pss = None
    try:
        for line in (proc / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1]) / 1024
    except OSError:
        pass
    role = "engine" if "jinfer.engine.core_proc" in cmdline else "other"
    return {"largest_mappings": largest_mappings(proc),
            "pid": pid, "role": role, "rss_mb": round(kb("VmRSS") / 1024, 1),
            "anon_mb": round(kb("RssAnon") / 1024, 1), "file_mb": round(kb("RssFile") / 1024, 1),
            "shmem_mb": round(kb("RssShmem") / 1024, 1), "pss_mb": None if pss is None else round(pss, 1),
            "jaxlib_loaded": "/jaxlib/" in maps, "cmdline": cmdline[:200]}


def largest_mappings(proc: Path, top: int = 8) -> list[str]:
    """The mappings holding the most RSS ("<MB> MB <perms> <name or [anon]>"): where idle memory sits."""
    out, head = [], None
    try:
        for line in (proc / "smaps").read_text().splitlines():
            fields = line.split()
            if fields and "-" in fields[0] and ":" not in fields[0]:
                head = fields[1] + " " + (fields[5] if len(fields) > 5 else "[anon]")
            elif fields and fields[0] == "Rss:" and head is not None:
                out.append((int(fields[1]), head))
    except OSError:
        return []
    return [f"{kb / 1024:.0f} MB {head}" for kb, head in sorted(out, reverse=True)[:top]]


# The engine's own line: "start-up phases: process started 1.58 s before the engine, then resolve 0.05 s (655 MB), ..."
ENGINE_PHASES = re.compile(r"start-up phases: process started ([\d.?]+) s before the engine, then (.*)$")
ENGINE_PHASE = re.compile(r"([a-z -]+?) ([\d.]+) s(?: \((\d+) MB\))?(?:, |$)")


def parse_phases(log: str, t_launch: float) -> dict[str, float]:
    phases: dict = {}
    for line in log.splitlines():
        m = ENGINE_PHASES.search(line)
        if m and "engine_phases" not in phases:  # {phase: [seconds, RSS MB after it]}
            phases["engine_phases"] = {"imports (process age)": [float(m.group(1)) if m.group(1) != "?" else None,
                                                                 None]}
            phases["engine_phases"] |= {p.strip(): [float(t), int(r) if r else None]
                                        for p, t, r in ENGINE_PHASE.findall(m.group(2))}
        for name, pat in PHASE_PATTERNS.items():
            m = pat.search(line)
            if m is None or name in phases:
                continue
            if name.endswith("_at"):  # a logging asctime: seconds after the launch
                stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
                phases[name.removesuffix("_at") + "_after_s"] = round(stamp - t_launch, 2)
            else:
                phases[name] = float(m.group(1))
    return phases


UNLOAD_LINE = ": unloaded the executables of"  # (whichever engine module logs it)


def wait_for_unloads(log_path: Path, proc: subprocess.Popen, wait_s: float, seen: int) -> bool:
    """Wait up to `wait_s` for the engine to log unloads beyond the `seen` ones and then none for 3 s."""
    deadline = time.perf_counter() + wait_s
    unloads, quiet_since = seen, None
    while time.perf_counter() < deadline and proc.poll() is None:
        n = log_path.read_text(errors="replace").count(UNLOAD_LINE)
        if n != unloads:
            unloads, quiet_since = n, time.perf_counter()
        elif unloads > seen and time.perf_counter() - quiet_since >= 3.0:
            return True
        time.sleep(0.25)
    return False


def timed_completion(port: int, num_tokens: int, max_tokens: int, salt: int) -> float:
    """Seconds for one completion of a `num_tokens`-token prompt (token ids, distinct per `salt`: no prefix hits)."""
    base = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    prompt = [(7 + 13 * (j + 1000 * salt)) % 30000 + 10 for j in range(num_tokens)]
    t0 = time.perf_counter()
    r = httpx.post(f"{base}/v1/completions", timeout=120, json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
    r.raise_for_status()
    return round(time.perf_counter() - t0, 3)


def probe_requests(port: int, num_tokens: int, max_tokens: int = 16) -> dict:
    """Seconds for a completion of a `num_tokens`-token prompt (token ids) on the idle server, then for another
    one 2 s later: what the first request after the idle executables were dropped pays (its prefill runs in the
    loaded buckets while the larger ones load again) against a warm one. The first is also the server's first
    request (`again_after_idle_s`, measured after another idle spell, is not)."""
    first = timed_completion(port, num_tokens, max_tokens, 0)
    time.sleep(2.0)
    warm = timed_completion(port, num_tokens, max_tokens, 1)
    return {"prompt_tokens": num_tokens, "max_tokens": max_tokens, "first_after_idle_s": first, "warm_s": warm}


def stop(proc: subprocess.Popen, pids: list[int], timeout: float) -> tuple[float, int | None]:
    """SIGTERM the launcher (it shuts its engine down), SIGKILL whatever is left after `timeout`."""
    t0 = time.perf_counter()
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    deadline = time.monotonic() + timeout
    for pid in pids:  # the engine exits by itself once the launcher is gone; wait, then insist
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            os.kill(pid, signal.SIGKILL)
            code = None
        except (ProcessLookupError, PermissionError):
            pass
    return time.perf_counter() - t0, code


def one_run(i: int, args: argparse.Namespace, server_args: list[str], env: dict[str, str], log_dir: Path) -> dict:
    port = free_port()
    cmd = [sys.executable, "-m", "server.launcher", *([args.model] if args.model else []), "--port", str(port),
           *server_args]
    log_path = log_dir / f"serve_{i}.log"
    url = f"http://127.0.0.1:{port}/health"
    with open(log_path, "wb") as log:
        t_launch = time.time()
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    startup, pids = None, []
    try:
        while time.perf_counter() - t0 < args.timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            try:
                if httpx.get(url, timeout=1).status_code == 200:
                    startup = time.perf_counter() - t0
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        if startup is None:
            raise RuntimeError(f"no /health 200 within {args.timeout} s:\n{log_path.read_text()[-3000:]}")
        while time.perf_counter() - t0 < args.timeout and "full_speed_after_s" not in parse_phases(
                log_path.read_text(errors="replace"), t_launch) and "--warmup-first-tokens 0" not in " ".join(cmd):
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.25)  # the background compiles of a staged warm-up (idle RSS counts them)
        time.sleep(args.idle_s)
        pids = descendants(proc.pid)
        loaded = [m for m in map(memory, [proc.pid, *pids]) if m is not None]
        procs = loaded
        if wait_for_unloads(log_path, proc, args.unload_wait_s, 0):
            procs = [m for m in map(memory, [proc.pid, *pids]) if m is not None]
        probe = probe_requests(port, args.probe_tokens) if args.probe_tokens else None
        if probe and args.unload_wait_s:
            # The first probe is also the server's first request ever: one more after another idle spell, without
            # first-request costs. The probes may have reloaded no shape (one reloads once 16 steps want it), and
            # then nothing is dropped again: the wait runs out and the request is timed all the same.
            done = log_path.read_text(errors="replace").count(UNLOAD_LINE)
            probe["unloaded_again"] = wait_for_unloads(log_path, proc, args.unload_wait_s, done)
            probe["again_after_idle_s"] = timed_completion(port, args.probe_tokens, probe["max_tokens"], 2)
    finally:
        pids = pids or descendants(proc.pid)
        stop_s, code = stop(proc, pids, args.stop_timeout)

    def by_role(procs: list[dict]) -> dict[str, float]:
        procs[0]["role"] = "server"
        rss = {}
        for p in procs:
            rss[p["role"] if p["role"] not in rss else f"{p['role']}-{p['pid']}"] = p["rss_mb"]
        return rss

    rss, rss_loaded = by_role(procs), by_role(loaded)
    return {"run": i, "startup_s": round(startup, 2), "rss_mb_total": round(sum(rss.values()), 1), "rss_mb": rss,
            "rss_mb_total_loaded": round(sum(rss_loaded.values()), 1), "rss_mb_loaded": rss_loaded,
            "unloaded": procs is not loaded, "probe": probe, "processes": procs, "processes_loaded": loaded,
            "phases": parse_phases(log_path.read_text(errors="replace"), t_launch),
            "stop_s": round(stop_s, 2), "exit_code": code, "log": str(log_path)}


def main() -> None:
    argv = sys.argv[1:]
    server_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model argument of jinfer serve (default: the embedded model)")
    ap.add_argument("--runs", type=int, default=1, help="start-ups to measure (the first may be cold-cache)")
    ap.add_argument("--idle-s", type=float, default=3.0, help="seconds idle after /health before reading RSS")
    ap.add_argument("--unload-wait-s", type=float, default=90.0,
                    help="seconds to wait, after the loaded RSS is read, for the engine to drop idle executables "
                         "(serve's --executable-keep-alive, 60 s by default; 0: do not wait)")
    ap.add_argument("--probe-tokens", type=int, default=0,
                    help="after the idle RSS, time two completions of this many prompt tokens (0: none)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for /health")
    ap.add_argument("--stop-timeout", type=float, default=30.0, help="seconds after SIGTERM before SIGKILL")
    ap.add_argument("--fresh-cache", action="store_true", help="a new empty compilation cache for these runs")
    ap.add_argument("--log-dir", default=None, help="keep the servers' logs here (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args(argv)
    if args.runs < 1:
        ap.error(f"--runs={args.runs} must be >= 1")

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    with tempfile.TemporaryDirectory(prefix="jinfer-startup-") as tmp:
        if args.fresh_cache:
            env["JINFER_COMPILATION_CACHE"] = str(Path(tmp) / "xla")
        log_dir = Path(args.log_dir) if args.log_dir else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        runs = []
        for i in range(args.runs):
            runs.append(one_run(i, args, server_args, env, log_dir))
            r = runs[-1]
            print(f"run {i}: ready in {r['startup_s']:.2f} s, full speed after "
                  f"{r['phases'].get('full_speed_after_s')} s, idle RSS {r['rss_mb_total']:.0f} MB {r['rss_mb']} "
                  f"({r['rss_mb_total_loaded']:.0f} MB with every executable loaded), "
                  f"phases {r['phases']}", file=sys.stderr)
        if not args.log_dir:
            for r in runs:
                r.pop("log")

    # Only now (no server running) may this process touch JAX: on a GPU it would take the device's memory.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    from benchmarks.common import environment, write_result

    warm = runs[1:] or runs
    last = runs[-1]
    startup = statistics.median(r["startup_s"] for r in warm)
    shape = (args.model or "SmolLM2-135M-Instruct").removeprefix("dummy:")
    roles = ", ".join(f"{k} {v:.0f}" for k, v in last["rss_mb"].items())
    summary = (f"jinfer serve {shape}: ready in {startup:.2f} s (runs: "
               f"{', '.join(f'{r['startup_s']:.2f}' for r in runs)}), idle RSS {last['rss_mb_total']:.0f} MB "
               f"({roles}{'; idle executables unloaded' if last['unloaded'] else ''}), "
               f"{last['rss_mb_total_loaded']:.0f} MB with every executable loaded")
    result = {**environment(), "benchmark": "startup", "shape": shape, "model": args.model,
              "server_args": server_args, "fresh_cache": args.fresh_cache, "idle_s": args.idle_s,
              "startup_s": startup, "startup_s_first": runs[0]["startup_s"],
              "rss_mb_total": last["rss_mb_total"], "rss_mb": last["rss_mb"],
              "rss_mb_total_loaded": last["rss_mb_total_loaded"], "unloaded": last["unloaded"],
              "phases": last["phases"],
              "runs": runs, "summary": summary}
    write_result(result, args.out)
    print(summary)


if __name__ == "__main__":
    main()
