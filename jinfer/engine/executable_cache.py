"""On-disk cache of compiled XLA executables, so that a warm start neither traces nor lowers.

Why: start-up compiles ~10 bucket shapes of a model whose layers are unrolled in Python. JAX's
persistent compilation cache only skips the XLA compile; every shape is still traced and lowered
to StableHLO in Python first, which is what a warm start of a 36-layer model spends its time on. This cache
stores the *compiled executable* (`jax.experimental.serialize_executable`) under a key computed
from the call's abstract signature alone, so a hit costs a tree flatten, a file read and an
executable load: the model function is never called.

    cache = ExecutableCache("~/.cache/jinfer/executables", namespace=repr((cfg, ops)))
    step = cache.compile("forward", forward_jit, weights, batch, kv_cache)  # a jax.stages.Compiled
    logits, kv_cache = step(weights, batch, kv_cache)                         # donation still applies

The returned object is exactly what `jitted.lower(*args, **kwargs).compile()` returns; call it
like one, i.e. without the static arguments.

The key (sha256, also the file name) covers: the caller's `namespace` (whatever `jitted` closes
over: model config, ops...), `name`, the jit options (static/donated arguments, shardings), the
argument tree with every array leaf's shape, dtype, weak_type and sharding (including the mesh's
device ids and order), the repr of every non-array leaf (static arguments), the jax and jaxlib
versions, backend platform and platform version, device kind and count, process count, the jax
config flags (all but cache, logging and networking ones), `XLA_FLAGS` / `LIBTPU_INIT_ARGS`, and a
hash of every .py file of the `jinfer` and `pallas_kernels` packages (computed once per process:
any edit there invalidates every entry).

The input and output PyTreeDefs, which `deserialize_and_load` needs and which cannot be derived
without tracing, are stored as JSON (node type by module:qualname, aux data as tagged JSON); the
types are looked up among already-imported modules at load time, nothing is imported. The
executable's device ids are stored too: loading it on other devices aborts the process.

A file is: MAGIC, an 8-byte header length, a JSON header (trees, device ids, payload size and
sha256), then JAX's payload. A truncated, corrupt or unloadable entry is logged, deleted and
recompiled. Writes go to a temporary file and `os.replace`, so processes can share a directory.

On CPU (jaxlib 0.11.2) an executable that JAX loaded from its persistent compilation cache
re-serializes without its compiled functions: it loads, then fails at its first call ("Function
... not found"). So on CPU a miss compiles with the persistent cache switched off for that compile
(globally, under a lock), and a compile that the persistent cache served anyway is not stored.

Limits:
- JAX's payload is itself a pickle (of its executable wrapper, avals and shardings), unpickled by
  `deserialize_and_load`. Only load directories that this user's processes write, as with JAX's
  persistent compilation cache or __pycache__; never a cache that came from elsewhere.
- Not cached (compiled normally, a warning says why): executables with host callbacks
  (`jax.debug.print`, `pure_callback`), with constants JAX passes as arguments, and trees with
  node types or aux data that are not JSON-representable (e.g. classes defined inside functions).
- A non-array leaf enters the key by its repr: a dynamic Python scalar makes one entry per value,
  and a repr that contains a memory address never hits (a warning says so).
- The key does not see code outside `jinfer`/`pallas_kernels` that `jitted` calls, nor explicit
  layouts of the arguments; the caller's namespace must cover what the function closes over.
- Single-process, default-backend executables only (loaded on this process's default-backend devices).
- A hit still pays the backend's executable load (on CPU about what a persistent-cache hit costs);
  what the cache removes is tracing and lowering.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
import struct
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import jax
import jaxlib
from jax.experimental.compilation_cache import compilation_cache
from jax.experimental.serialize_executable import deserialize_and_load, serialize

log = logging.getLogger(__name__)

MAGIC = b"JINFER-EXECUTABLE-1\n"
_HEADER_LEN = struct.Struct("<Q")
_PACKAGES = ("jinfer", "pallas_kernels")
# Environment that changes what is compiled: XLA's flags. (The kernel choices are the `KernelPolicy` that the
# caller's ModelOps carries, hashed with them in the namespace; nothing under jinfer reads them from the environment.)
_ENV_VARS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
STALE_TEMP_FILE_S = 600
# jax config flags that cannot change the executable: caches, logging, transfer guards, networking.
_CONFIG_IGNORED = re.compile(
    r"jax_(compilation_cache|persistent_cache|enable_compilation_cache|raise_persistent_cache|log|explain_cache"
    r"|pprint|traceback|tracer_error|transfer_guard|mtls|cross_host|distributed|dump_ir|debug_log_modules"
    r"|check_proxy_envs|source_url_schema|captured_constants|compiler_detailed_logging|cpu_get_"
    r"|share_binary_between_hosts_timeout|array_garbage_collection_guard|thread_guard|debug_leaked_clients)")
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
# XLA:CPU (jaxlib 0.11.2): an executable that JAX loaded from its persistent compilation cache serializes
# without its compiled functions, and the reloaded copy fails at its first call ("Function ... not found").
# On these platforms a miss compiles with that cache off. (On an H100 the same round trip works.)
_RESERIALIZE_LOSSY_PLATFORMS = frozenset({"cpu"})
_PERSISTENT_CACHE_HIT = "/jax/compilation_cache/cache_hits"
_persistent_cache_lock = threading.Lock()


class _QuietCacheResets(logging.Filter):
    """Drops JAX's INFO line "Resetting cache at ..." and nothing else: `_fresh_compile` resets the persistent
    cache's state twice per compile on CPU, which printed ~124 such lines at a server's first start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno < logging.WARNING and str(record.msg).startswith("Resetting cache"))


logging.getLogger("jax._src.compilation_cache").addFilter(_QuietCacheResets())  # the logger reset_cache() uses


class _Unsupported(Exception):
    """A tree or value that the JSON codec cannot represent faithfully."""


class ExecutableCache:
    """Compiled executables on disk, keyed by everything that changes them; `directory` None or "" disables."""

    def __init__(self, directory: str | os.PathLike | None, *, namespace: str):
        self.directory = Path(directory).expanduser() if directory else None
        self.namespace = namespace
        self.hits = self.misses = 0
        self._count_lock = threading.Lock()  # compile() may run in several threads (warm-up)
        self._remove_stale_temp_files()

    def _remove_stale_temp_files(self) -> None:
        """Temp files of writes cut short (a process exiting mid-write: the engine does not wait for background
        compiles at shutdown). Only old ones: a young one may be another process's write in progress."""
        if self.directory is None or not self.directory.is_dir():
            return
        cutoff = time.time() - STALE_TEMP_FILE_S
        for tmp in self.directory.glob("*.jexe*.tmp"):
            try:
                if tmp.stat().st_mtime < cutoff:
                    tmp.unlink()
            except OSError:
                pass

    def compile(self, name: str, jitted, /, *args, **kwargs) -> jax.stages.Compiled:
        """Return the compiled executable of jitted(*args, **kwargs) (arrays, numpy arrays or
        ShapeDtypeStructs): loaded from disk when an entry with the same key exists, else lowered,
        compiled, and written atomically."""
        if self.directory is None:
            return jitted.lower(*args, **kwargs).compile()
        key = self.key(name, jitted, *args, **kwargs)
        path = self.directory / f"{key}.jexe"
        t0 = time.perf_counter()
        if path.exists():
            try:
                compiled = _load(path)
            except Exception as e:  # any failure to load means: recompile
                log.warning("executable cache: dropping unloadable entry %s (%s: %s)", path, type(e).__name__, e)
                _remove(path)
            else:
                with self._count_lock:
                    self.hits += 1
                log.info("executable cache: %s loaded in %.3f s", name, time.perf_counter() - t0)
                return compiled
        with self._count_lock:
            self.misses += 1
        with _fresh_compile() as from_persistent_cache:
            compiled = _compile_unretained(jitted.lower(*args, **kwargs))
        t1 = time.perf_counter()
        try:
            if from_persistent_cache:
                raise _Unsupported("it came from JAX's persistent cache, whose executables re-serialize "
                                   f"without their code on {jax.default_backend()}")
            data = _dump(compiled)
        except Exception as e:  # an executable JAX cannot serialize is still usable
            log.warning("executable cache: %s not cached (%s: %s)", name, type(e).__name__, e)
            return compiled
        _write_atomic(path, data)
        log.info("executable cache: %s compiled in %.2f s, stored in %.3f s", name, t1 - t0,
                 time.perf_counter() - t1)
        return compiled

    def key(self, name: str, jitted, /, *args, **kwargs) -> str:
        """The sha256 (hex) that names the entry of jitted(*args, **kwargs)."""
        leaves, treedef = jax.tree.flatten((args, kwargs))
        try:
            tree = json.dumps(_tree_to_json(treedef))
        except _Unsupported:
            tree = "str:" + str(treedef)
        material = json.dumps({
            "namespace": self.namespace,
            "name": name,
            "jit": repr(getattr(jitted, "_jit_info", None)),
            "tree": tree,
            "leaves": [_leaf_signature(x) for x in leaves],
            "environment": _environment(),
        }, sort_keys=True)
        if _ADDRESS.search(material):
            log.warning("executable cache: the key of %s contains a memory address; it will never hit", name)
        return hashlib.sha256(material.encode()).hexdigest()


def _compile_unretained(lowered: jax.stages.Lowered) -> jax.stages.Compiled:
    """`lowered.compile()`, but not also kept alive by JAX's in-memory caches. Plainly, the lowering (cached as long as
    the jit's trace is) stores its executable, and `pxla._cached_compilation` maps the module to it: the executable
    then outlives every reference its caller drops, and an engine that drops an idle bucket's executables
    (model_runner.unload_idle) got none of their memory back after a cold start. Explicit (empty) compiler options
    keep the lowering from storing it (the jit's own options still apply); the compilation cache is cleared after
    (it only ever served a second compile of the same module, which the callers here never make)."""
    compiled = lowered.compile({})
    try:
        from jax._src.interpreters import pxla

        pxla.clear_in_memory_compilation_cache()
    except (ImportError, AttributeError):  # another jax: at worst the memory stays, as before
        pass
    return compiled


@contextmanager
def _fresh_compile():
    """On platforms where re-serializing a persistent-cache hit is lossy, compile with that cache off.

    Yields a list that is non-empty if the persistent cache served the compile anyway (another thread
    turned it back on): such an executable must not be stored. Turning the cache off is global, so
    another thread compiling meanwhile only misses it; it is back on (and re-read) afterwards.
    """
    hits: list[str] = []
    if jax.default_backend() not in _RESERIALIZE_LOSSY_PLATFORMS:
        yield hits
        return

    def listener(event: str, **_):
        if event == _PERSISTENT_CACHE_HIT:
            hits.append(event)

    with _persistent_cache_lock:
        enabled = jax.config.jax_enable_compilation_cache
        jax.config.update("jax_enable_compilation_cache", False)
        compilation_cache.reset_cache()  # the cache memoizes whether it is on
        jax.monitoring.register_event_listener(listener)
        try:
            yield hits
        finally:
            jax.monitoring.unregister_event_listener(listener)
            jax.config.update("jax_enable_compilation_cache", enabled)
            compilation_cache.reset_cache()


# ---- key material -------------------------------------------------------------------------------


def _leaf_signature(x) -> list:
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return ["array", list(x.shape), str(x.dtype), bool(getattr(x, "weak_type", False)),
                _sharding_signature(getattr(x, "sharding", None))]
    return ["value", f"{type(x).__module__}:{type(x).__qualname__}", repr(x)]


def _sharding_signature(s) -> list | None:
    if s is None:
        return None
    try:  # the device order matters: a mesh over devices [3, 2, 1, 0] is another executable
        device_ids = [d.id for d in s._device_assignment]
    except Exception:  # abstract meshes have no devices
        device_ids = None
    return [type(s).__qualname__, repr(s), device_ids]


def _environment() -> dict:
    """Per-process part of the key (the config and env are read on every call: tests change them)."""
    backend = jax.devices()[0].client
    config = {k: repr(v) for k, v in jax.config.values.items() if not _CONFIG_IGNORED.match(k)}
    return {
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "platform": backend.platform,
        "platform_version": backend.platform_version,
        "device_kind": jax.devices()[0].device_kind,
        "device_count": jax.device_count(),
        "process_count": jax.process_count(),
        "config": config,
        "env": {k: os.environ.get(k) for k in _ENV_VARS},
        "source": source_digest(),
    }


@functools.cache
def source_digest() -> str:
    """sha256 over the path and bytes of every .py file of the jinfer and pallas_kernels packages."""
    root = Path(__file__).resolve().parents[2]
    h = hashlib.sha256()
    for package in _PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(path.read_bytes() + b"\0")
    return h.hexdigest()


# ---- PyTreeDef <-> JSON ---------------------------------------------------------------------------
# A leaf is null; a node is [module:qualname, aux data, children]. Aux data keeps tuple/list/dict
# apart ({"tuple": [...]}...), because PyTreeDef equality compares it exactly.

_BUILTIN_TYPES = {f"builtins:{t.__qualname__}": t for t in (tuple, list, dict, type(None))}


def _tree_to_json(treedef) -> Any:
    node = treedef.node_data()
    if node is None:
        return None
    typ, aux = node
    name = f"{typ.__module__}:{typ.__qualname__}"
    if "<locals>" in name:
        raise _Unsupported(f"node type {name} is not importable")
    return [name, _value_to_json(aux), [_tree_to_json(c) for c in treedef.children()]]


def _tree_from_json(obj) -> jax.tree_util.PyTreeDef:
    registry = jax.tree_util.default_registry
    if obj is None:
        return jax.tree_util.PyTreeDef.from_node_data_and_children(registry, None, [])
    name, aux, children = obj
    node_data = (_resolve_type(name), _value_from_json(aux))
    return jax.tree_util.PyTreeDef.from_node_data_and_children(registry, node_data,
                                                               [_tree_from_json(c) for c in children])


def _resolve_type(name: str) -> type:
    if name in _BUILTIN_TYPES:
        return _BUILTIN_TYPES[name]
    module_name, qualname = name.split(":")
    obj = sys.modules.get(module_name)  # only modules this process has imported: nothing runs from the file
    if obj is None:
        raise _Unsupported(f"module {module_name} is not imported")
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, type):
        raise _Unsupported(f"{name} is not a type")
    return obj


def _value_to_json(v) -> Any:
    if v is None or isinstance(v, bool | int | float | str):
        return v
    if isinstance(v, tuple | list):
        return {type(v).__name__: [_value_to_json(x) for x in v]}
    if isinstance(v, dict):
        return {"dict": [[_value_to_json(k), _value_to_json(x)] for k, x in v.items()]}
    raise _Unsupported(f"aux data of type {type(v).__name__}")


def _value_from_json(v) -> Any:
    if not isinstance(v, dict):
        return v
    (tag, items), = v.items()
    if tag == "dict":
        return {_value_from_json(k): _value_from_json(x) for k, x in items}
    return {"tuple": tuple, "list": list}[tag](_value_from_json(x) for x in items)


# ---- file format --------------------------------------------------------------------------------


def _dump(compiled: jax.stages.Compiled) -> bytes:
    payload, in_tree, out_tree = serialize(compiled)
    trees = {"in_tree": _tree_to_json(in_tree), "out_tree": _tree_to_json(out_tree)}
    if _tree_from_json(trees["in_tree"]) != in_tree or _tree_from_json(trees["out_tree"]) != out_tree:
        raise _Unsupported("a tree does not survive its JSON round trip")
    header = json.dumps({
        **trees,
        # deserialize_and_load must get the executable's own devices, in order (others abort the process)
        "device_ids": [d.id for d in compiled.runtime_executable().local_devices()],
        "payload_size": len(payload),
        "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }).encode()
    return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload


def _load(path: Path) -> jax.stages.Compiled:
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError("bad magic")
    start = len(MAGIC) + _HEADER_LEN.size
    (header_len,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    header = json.loads(data[start:start + header_len])
    payload = data[start + header_len:]
    if len(payload) != header["payload_size"] or hashlib.sha256(payload).hexdigest() != header["payload_sha256"]:
        raise ValueError("truncated or corrupt payload")
    devices = {d.id: d for d in jax.devices()}
    execution_devices = [devices[i] for i in header["device_ids"]]
    return deserialize_and_load(payload, _tree_from_json(header["in_tree"]), _tree_from_json(header["out_tree"]),
                                execution_devices=execution_devices)


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as e:  # a cache that cannot be written only costs the next start its compile
        log.warning("executable cache: cannot write %s (%s)", path, e)
        if tmp is not None:
            _remove(Path(tmp))


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass
