"""bench_startup's reading of the engine's log: the phases it reports in its JSON."""

from datetime import datetime

from benchmarks.bench_startup import parse_phases

LOG = """\
2026-11-25 16:38:17,900 INFO jinfer.engine: engine process 3371 listening on ipc:///tmp/x/engine.sock
2026-11-25 16:38:19,504 INFO jinfer.engine.core: start-up phases: process started 1.58 s before the engine, \
then resolve 0.05 s (655 MB), tokenizer 0.00 s (655 MB), backend 0.00 s, weights 0.16 s (680 MB), \
kv cache and runner 0.24 s (704 MB), warm-up 0.36 s (786 MB)
2026-11-25 16:38:19,505 INFO jinfer.engine.core: engine ready in 1.1 s: dummy:qwen3-4b, 27400 KV pages
2026-11-25 16:38:19,740 INFO jinfer.server: serving dummy:qwen3-4b on http://127.0.0.1:49539 (engine pid 3371)
2026-11-25 16:38:24,000 INFO jinfer.engine.executables: warm-up: all 9 token buckets ready 6.1 s after start-up began
2026-11-25 16:38:40,500 INFO jinfer.engine.executables: unloaded the executables of 6 bucket(s) idle for 8 s: 32, 64
"""


def test_parse_phases_reads_the_engine_phase_line_and_stamps():
    t0 = datetime.strptime("2026-11-25 16:38:17,000", "%Y-%m-%d %H:%M:%S,%f").timestamp()
    phases = parse_phases(LOG, t0)
    assert phases["engine_listening_after_s"] == 0.9 and phases["serving_after_s"] == 2.74
    assert phases["engine_init_s"] == 1.1
    engine = phases["engine_phases"]
    assert engine["imports (process age)"] == [1.58, None]
    assert engine["backend"] == [0.0, None]  # no RSS where /proc is missing
    assert phases["full_speed_after_s"] == 7.0 and phases["unloaded_after_s"] == 23.5
    assert engine["kv cache and runner"] == [0.24, 704] and engine["warm-up"] == [0.36, 786]
    assert list(engine) == ["imports (process age)", "resolve", "tokenizer", "backend", "weights",
                            "kv cache and runner", "warm-up"]
