"""Opt-in pytest plugin: which test compiles what, and which compiles other tests share.

    JINFER_CACHE_REPORT=/tmp/cr make test PYTEST_ARGS="-p tests.cache_report"
    python -m tests.cache_report /tmp/cr        # summary: compile seconds per file, keys shared between files

Each worker appends JSON lines to DIR/<worker>.jsonl: the test, the cache (`jax` persistent compilation cache or
jinfer's `exe` executable cache), the key, hit or miss, and the seconds spent. Used to place tests that share
executables so the run's cache serves them whatever the order of the files.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

_current = {"test": None}
_out = None


def _log(cache: str, key: str, hit: bool, seconds: float) -> None:
    if _out is not None:
        _out.write(json.dumps({"test": _current["test"], "cache": cache, "key": key, "hit": hit,
                               "s": round(seconds, 3)}) + "\n")
        _out.flush()


def pytest_configure(config):
    global _out
    directory = os.environ.get("JINFER_CACHE_REPORT")
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _out = open(Path(directory) / f"{worker}.jsonl", "a")  # noqa: SIM115 (open for the whole run)

    from jax._src import compilation_cache, compiler

    from jinfer.engine import executable_cache

    get, compile_or_get = compilation_cache.get_executable_and_time, compiler.compile_or_get_cached

    def logged_get(cache_key, *args, **kwargs):
        executable, compile_time = get(cache_key, *args, **kwargs)
        _log("jax", cache_key, executable is not None, 0.0)
        return executable, compile_time

    def timed_compile(backend, computation, devices, compile_options, host_callbacks, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return compile_or_get(backend, computation, devices, compile_options, host_callbacks, *args, **kwargs)
        finally:
            _log("jax_compile", "", False, time.perf_counter() - t0)

    compilation_cache.get_executable_and_time = logged_get
    compiler.compile_or_get_cached = timed_compile
    original = executable_cache.ExecutableCache.compile

    def logged_compile(self, name, jitted, /, *args, **kwargs):
        t0 = time.perf_counter()
        hits = self.hits
        try:
            return original(self, name, jitted, *args, **kwargs)
        finally:
            key = self.key(name, jitted, *args, **kwargs) if self.directory is not None else name
            _log("exe", key, self.hits > hits, time.perf_counter() - t0)

    executable_cache.ExecutableCache.compile = logged_compile


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    _current["test"] = item.nodeid


def summarize(directory: str) -> None:
    rows = [json.loads(line) for f in Path(directory).glob("*.jsonl") for line in open(f)]
    per_file = collections.defaultdict(float)
    users = collections.defaultdict(set)
    for r in rows:
        file = (r["test"] or "?").split("::")[0]
        if r["cache"] in ("jax_compile", "exe"):
            per_file[file] += r["s"]
        if r["cache"] in ("jax", "exe") and r["key"]:
            users[r["key"]].add(file)
    print("compile + load seconds per file:")
    for file, s in sorted(per_file.items(), key=lambda x: -x[1])[:40]:
        print(f"  {s:7.1f}  {file}")
    pairs = collections.Counter()
    for files in users.values():
        for a in files:
            for b in files:
                if a < b:
                    pairs[a, b] += 1
    print("files sharing keys (count):")
    for (a, b), n in pairs.most_common(40):
        print(f"  {n:4d}  {a}  {b}")


if __name__ == "__main__":
    summarize(sys.argv[1])
