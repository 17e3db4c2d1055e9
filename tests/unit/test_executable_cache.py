"""ExecutableCache: a warm start loads without tracing, keys separate what differs, bad entries recompile."""

import gc
import hashlib
import json
import logging
import struct
import sys
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.compilation_cache import compilation_cache
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jinfer.engine.executable_cache import MAGIC, ExecutableCache


@jax.tree_util.register_dataclass
@dataclass
class Params:
    w: jax.Array
    b: jax.Array


class Out(NamedTuple):
    y: jax.Array
    extra: dict


def make_step(traces: list[int]):
    """A fresh function each time, so JAX's in-memory trace cache cannot hide a retrace."""

    def step(params: Params, x, kv, *, scale: int):
        traces[0] += 1
        y = jnp.tanh(x @ params.w + params.b) * scale
        return Out(y, {"sum": y.sum(), "none": None}), [kv + 1]

    return jax.jit(step, static_argnames=("scale",), donate_argnames=("kv",))


def inputs(n=16, dtype=jnp.float32):
    rng = np.random.default_rng(0)  # numpy, not jax.random: no compile per shape
    w, b, x = (jnp.asarray(rng.standard_normal(s), dtype) for s in ((n, n), (n,), (4, n)))
    return Params(w, b), x, jnp.zeros((8,), dtype)


@pytest.fixture(scope="module")
def expected():
    """The plain jit's output: a loaded executable must give exactly this (no reference in numpy: TF32 on GPU)."""
    params, x, kv = inputs()
    return make_step([0])(params, x, kv, scale=3)


def assert_same(a, b):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_warm_start_loads_without_tracing(tmp_path, expected):
    params, x, kv = inputs()

    traces = [0]
    cold = ExecutableCache(tmp_path, namespace="test")
    compiled = cold.compile("step", make_step(traces), params, x, kv, scale=3)
    assert traces == [1] and (cold.hits, cold.misses) == (0, 1)
    assert len(list(tmp_path.glob("*.jexe"))) == 1
    assert_same(compiled(params, x, jnp.zeros_like(kv)), expected)

    traces = [0]
    warm = ExecutableCache(tmp_path, namespace="test")
    loaded = warm.compile("step", make_step(traces), params, x, kv, scale=3)
    assert traces == [0] and (warm.hits, warm.misses) == (1, 0)
    assert_same(loaded(params, x, jnp.zeros_like(kv)), expected)


def test_compiled_and_loaded_executables_are_only_the_callers(tmp_path):
    """Neither a miss (compiled) nor a hit (loaded) is kept alive by JAX's in-memory caches: once the caller drops
    it, its executable (host and device code) is freed, which an engine unloading idle buckets counts on. (A plain
    `jitted.lower().compile()` is held by the cached lowering and JAX's compilation cache.)"""
    params, x, kv = inputs()
    jitted = make_step([0])
    for cache in (ExecutableCache(tmp_path, namespace="t"), ExecutableCache(tmp_path, namespace="t")):
        compiled = cache.compile("step", jitted, params, x, kv, scale=3)
        executable = compiled._executable.xla_executable
        del compiled
        gc.collect()
        assert sys.getrefcount(executable) == 2  # this name and the call's argument
    assert (cache.hits, cache.misses) == (1, 0)


def test_keys_separate_what_changes_the_executable(tmp_path):
    cache = ExecutableCache(tmp_path, namespace="a")
    jitted = make_step([0])
    params, x, kv = inputs()
    base = cache.key("step", jitted, params, x, kv, scale=3)
    assert cache.key("step", jitted, *inputs(), scale=3) == base  # same signature, other values
    sds = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    assert cache.key("step", jitted, params, sds, kv, scale=3) == base  # abstract args give the same key
    variants = [
        cache.key("step", jitted, *inputs(n=32), scale=3),  # shape
        cache.key("step", jitted, *inputs(dtype=jnp.bfloat16), scale=3),  # dtype
        cache.key("step", jitted, params, x, kv, scale=4),  # static argument
        cache.key("step", jitted, params, x.astype(jnp.int32), kv, scale=3),
        cache.key("other", jitted, params, x, kv, scale=3),  # name
        ExecutableCache(tmp_path, namespace="b").key("step", jitted, params, x, kv, scale=3),  # namespace
        cache.key("step", jax.jit(make_step([0]).__wrapped__, static_argnames=("scale",)), params, x, kv,
                  scale=3),  # no donation
    ]
    if len(jax.devices()) > 1:  # placement
        variants.append(cache.key("step", jitted, params, jax.device_put(x, jax.devices()[1]), kv, scale=3))
    assert len({base, *variants}) == len(variants) + 1


@pytest.mark.parametrize("var", ["XLA_FLAGS", "LIBTPU_INIT_ARGS"])
def test_environment_switches_are_part_of_the_key(tmp_path, monkeypatch, var):
    """XLA's flags in the environment change the compiled program: other entries. (The kernel choices are the
    KernelPolicy inside the ops, part of the namespace.)"""
    cache = ExecutableCache(tmp_path, namespace="a")
    jitted = make_step([0])
    monkeypatch.delenv(var, raising=False)
    base = cache.key("step", jitted, *inputs(), scale=3)
    monkeypatch.setenv(var, "64" if var != "XLA_FLAGS" else "--xla_dump_to=/dev/null")
    assert cache.key("step", jitted, *inputs(), scale=3) != base


def test_stale_temp_files_are_removed_at_start(tmp_path):
    """A write cut short (a process exiting mid-write) leaves its temp file: an old one is removed when a cache
    opens the directory, a young one (maybe another process's write in progress) is kept."""
    import os
    import time

    from jinfer.engine.executable_cache import STALE_TEMP_FILE_S

    old, young, entry = (tmp_path / n for n in ("k1.jexeab12.tmp", "k2.jexecd34.tmp", "k3.jexe"))
    for f in (old, young, entry):
        f.write_bytes(b"x")
    stamp = time.time() - STALE_TEMP_FILE_S - 60
    os.utime(old, (stamp, stamp))
    os.utime(entry, (stamp, stamp))
    ExecutableCache(tmp_path, namespace="a")
    assert not old.exists() and young.exists() and entry.exists()


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices")
def test_mesh_device_order_is_part_of_the_key(tmp_path):
    devices = np.array(jax.devices()[:4])
    f = jax.jit(lambda a: a * 2)
    results, keys = [], []
    for order in (devices, devices[::-1]):
        a = jax.device_put(jnp.arange(32.0).reshape(8, 4), NamedSharding(Mesh(order, ("x",)), P("x")))
        keys.append(ExecutableCache(tmp_path, namespace="t").key("f", f, a))
        ExecutableCache(tmp_path, namespace="t").compile("f", f, a)
        warm = ExecutableCache(tmp_path, namespace="t")
        out = warm.compile("f", f, a)(a)
        assert warm.hits == 1 and out.sharding == a.sharding
        results.append(np.asarray(out))
    assert keys[0] != keys[1]
    np.testing.assert_array_equal(results[0], results[1])


def forged_entry(data: bytes) -> bytes:
    """The entry with its payload replaced by garbage under a matching size and sha256: only the load fails."""
    start = len(MAGIC) + 8
    (header_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    header = json.loads(data[start:start + header_len])
    payload = b"\x80\x04not an executable"
    header.update(payload_size=len(payload), payload_sha256=hashlib.sha256(payload).hexdigest())
    new_header = json.dumps(header).encode()
    return MAGIC + struct.pack("<Q", len(new_header)) + new_header + payload


@pytest.fixture
def persistent_cache(tmp_path):
    """JAX's persistent compilation cache in a temporary directory, for every compile; restored after."""
    names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
             "jax_persistent_cache_min_entry_size_bytes")
    saved = {k: jax.config.values[k] for k in names}
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    compilation_cache.reset_cache()
    yield tmp_path / "xla"
    for k, v in saved.items():
        jax.config.update(k, v)
    compilation_cache.reset_cache()


def test_entry_is_not_taken_from_the_persistent_cache(tmp_path, persistent_cache, expected):
    """On CPU an executable loaded from JAX's persistent cache re-serializes without its code: the entry
    must come from a fresh compile, or its first call fails with "Function ... not found"."""
    params, x, kv = inputs()
    make_step([0]).lower(params, x, kv, scale=3).compile()  # fills the persistent cache
    assert any(persistent_cache.iterdir())
    ExecutableCache(tmp_path / "exe", namespace="t").compile("step", make_step([0]), params, x, kv, scale=3)
    warm = ExecutableCache(tmp_path / "exe", namespace="t")
    loaded = warm.compile("step", make_step([0]), params, x, kv, scale=3)
    assert warm.hits == 1
    assert_same(loaded(params, x, jnp.zeros_like(kv)), expected)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the persistent cache is bypassed on CPU only")
def test_persistent_cache_hit_is_never_stored(tmp_path, persistent_cache, monkeypatch, caplog):
    """If the persistent cache serves the compile anyway (here: its memo of being on is not reset), no entry."""
    params, x, kv = inputs()
    make_step([0]).lower(params, x, kv, scale=3).compile()
    monkeypatch.setattr(compilation_cache, "reset_cache", lambda: None)
    with caplog.at_level(logging.WARNING, logger="jinfer.engine.executables"):
        compiled = ExecutableCache(tmp_path / "exe", namespace="t").compile("step", make_step([0]), params, x, kv,
                                                                            scale=3)
    assert "persistent cache" in caplog.text and not (tmp_path / "exe").exists()
    compiled(params, x, jnp.zeros_like(kv))


@pytest.mark.parametrize("damage", ["truncate", "flip_payload_byte", "garbage", "forged_payload"])
def test_corrupt_entry_is_dropped_and_recompiled(tmp_path, caplog, expected, damage):
    params, x, kv = inputs()
    ExecutableCache(tmp_path, namespace="t").compile("step", make_step([0]), params, x, kv, scale=3)
    (path,) = tmp_path.glob("*.jexe")
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) // 2],
                      "flip_payload_byte": data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:],
                      "garbage": b"\x80\x04not an executable" * 10,
                      "forged_payload": forged_entry(data)}[damage])

    traces = [0]
    cache = ExecutableCache(tmp_path, namespace="t")
    with caplog.at_level(logging.WARNING, logger="jinfer.engine.executables"):
        compiled = cache.compile("step", make_step(traces), params, x, kv, scale=3)
    assert "dropping unloadable entry" in caplog.text
    assert traces == [1] and cache.misses == 1
    assert_same(compiled(params, x, jnp.zeros_like(kv)), expected)
    warm = ExecutableCache(tmp_path, namespace="t")
    warm.compile("step", make_step([0]), params, x, kv, scale=3)
    assert warm.hits == 1  # the entry was rewritten whole


@pytest.mark.parametrize("directory", [None, ""])
def test_disabled_cache_compiles_every_time(tmp_path, monkeypatch, directory):
    monkeypatch.chdir(tmp_path)
    params, x, kv = inputs()
    traces = [0]
    jitted = make_step(traces)
    cache = ExecutableCache(directory, namespace="t")
    compiled = cache.compile("step", jitted, params, x, kv, scale=3)
    assert traces == [1] and list(tmp_path.iterdir()) == []
    assert_same(compiled(params, x, jnp.zeros_like(kv)), jitted(params, x, jnp.zeros_like(kv), scale=3))


def test_loaded_executable_still_donates(tmp_path):
    params, x, kv = inputs()
    probe = jnp.zeros_like(kv)
    make_step([0])(params, x, probe, scale=1)
    if not probe.is_deleted():
        pytest.skip(f"the {jax.default_backend()} backend does not honour donation")
    ExecutableCache(tmp_path, namespace="t").compile("step", make_step([0]), params, x, kv, scale=1)
    warm = ExecutableCache(tmp_path, namespace="t")
    loaded = warm.compile("step", make_step([0]), params, x, kv, scale=1)
    assert warm.hits == 1
    kv = jnp.zeros_like(kv)
    _, [new_kv] = loaded(params, x, kv)
    assert kv.is_deleted()
    np.testing.assert_array_equal(np.asarray(new_kv), np.ones(8))


def test_executable_with_host_callback_is_compiled_but_not_stored(tmp_path, caplog):
    def noisy(a):
        jax.debug.print("a={a}", a=a)
        return a + 1

    with caplog.at_level(logging.WARNING, logger="jinfer.engine.executables"):
        compiled = ExecutableCache(tmp_path, namespace="t").compile("noisy", jax.jit(noisy), jnp.ones(2))
    assert "not cached" in caplog.text and list(tmp_path.glob("*.jexe")) == []
    np.testing.assert_array_equal(np.asarray(compiled(jnp.ones(2))), [2.0, 2.0])


def test_cache_resets_around_a_compile_log_nothing(caplog):
    """JAX logs each persistent-cache reset at INFO; two per compile flooded a server's first start."""
    from jinfer.engine.executable_cache import _fresh_compile

    with caplog.at_level(logging.INFO):
        with _fresh_compile():
            pass
        logging.getLogger("jax._src.compilation_cache").warning("a real warning")
    assert "Resetting cache" not in caplog.text and "a real warning" in caplog.text
