"""Shared fixtures. Tests run on CPU; JAX sees 8 fake devices so sharding code paths are exercised."""

import atexit
import gc
import os
import shutil
import tempfile

# LLVM's backend at -O0: the suite's time is mostly XLA compiles (Pallas kernels interpreted, engines' buckets), about a
# third cheaper so; the executables run slower but give the same results (no fast math either way). No XNNPACK
# fusions: their compile pass costs ~8% of a tiny model's compile, and these tiny matmuls gain nothing from them.
FAST_COMPILE = "--xla_backend_optimization_level=0 --xla_cpu_use_xnnpack=false"
os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {FAST_COMPILE}")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One compilation cache for the whole run (xdist workers and spawned servers inherit the variable): engines built
# alike by different tests load each other's executables instead of compiling them again. Fresh each run, so a run
# neither reads nor fills ~/.cache/jinfer.
_OWN_CACHE = "JINFER_COMPILATION_CACHE" not in os.environ and os.environ.get("JINFER_TEST_CACHE") != "0"
if _OWN_CACHE:  # (the process that made it removes it at exit; xdist workers and servers only inherit it)
    os.environ["JINFER_COMPILATION_CACHE"] = tempfile.mkdtemp(prefix="jinfer-test-cache-")
    atexit.register(shutil.rmtree, os.environ["JINFER_COMPILATION_CACHE"], ignore_errors=True)

from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.experimental.pallas.fuser  # noqa: E402, F401
import pytest  # noqa: E402
from jax.experimental.compilation_cache import compilation_cache  # noqa: E402

# (The import above: the Pallas interpreter's lowering imports the fuser, which registers a config flag that is
# part of every jit's cache key. Imported mid-run, it changes the key of everything traced before it, and the next
# call of each such jitted function traces and compiles it again.)

# Python's cyclic GC less often: tracing allocates objects by the hundred thousand, and at the default thresholds
# (700, 10, 10) a worker spent ~4% of its time in collections (~1,600 per two engine files). What is imported by now
# (jax, numpy, pytest) stays alive for the run: frozen, it is never scanned. (Tests that need a collection call
# gc.collect().)
gc.freeze()
gc.set_threshold(10_000, 10, 10)

CACHE_CONFIG = {"jax_compilation_cache_dir": os.environ.get("JINFER_COMPILATION_CACHE"),
                "jax_persistent_cache_min_compile_time_secs": 0, "jax_persistent_cache_min_entry_size_bytes": 0}

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from jinfer.weights.loader import default_model_path

    path = default_model_path()
    if not path.is_file():
        pytest.skip(f"default model not installed at {path} (run `make install`)")
    return path


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """JAX's persistent cache in the run's directory for every compile (the plain jits and the engines built with
    compilation_cache_dir="" too), set before the test's fixtures: put back after a test whose engine pointed it at
    its own directory. Not for the kernel tests (tests/kernels): their interpreted kernels' executables are small and
    compiled once, and serializing one for the cache crashed a worker (a segfault in `executable.serialize()`)."""
    want = CACHE_CONFIG if "kernels" not in item.path.parts else {**CACHE_CONFIG, "jax_compilation_cache_dir": None}
    if os.environ.get("JINFER_TEST_CACHE") != "0" and any(jax.config.values[k] != v for k, v in want.items()):
        for k, v in want.items():
            jax.config.update(k, v)
        compilation_cache.reset_cache()


def pytest_collection_modifyitems(config, items):
    """Files with a test marked `slow` first (each file's own order kept): xdist hands out whole files in this order,
    and a long file handed out last would leave the other workers idle at the end."""
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.path not in slow_files)


# Files whose engines, forwards or kernels compile the same shapes (tests/cache_report.py): each group is one xdist work
# unit, so its files run one after another on one worker and the later ones load the first one's executables from the
# run's cache. Apart, which worker compiled a shared shape first varied from run to run: 1480 to 1800 s of CPU for the
# same suite.
SHARED_SHAPES = {
    "qwen3_5": ("test_qwen3_5_engine.py", "test_qwen3_5_spec.py", "test_qwen3_5_mtp.py", "test_golden_qwen3_5.py"),
    "tiny_forwards": ("test_deepseek.py", "test_golden_tiny.py", "test_parallel_golden.py"),
    "spec": ("test_spec_engine.py", "test_eagle3_engine.py", "test_spec_e2e.py"),
    "linear_attention": ("test_causal_conv.py", "test_gated_delta_rule.py", "test_gated_delta_rule_decode.py",
                         "test_gated_delta_rule_intra.py", "test_gated_delta_rule_chunked.py"),
    "attention": ("test_paged_attention.py", "test_prefill_attention.py"),
    "moe_kernels": ("test_moe_gemm.py", "test_moe_gemm_mgpu.py"),
    # the default model's servers (tests/server/helpers.py's SMOLLM2_ARGS): one after the other, the second loads the
    # first one's executables instead of compiling them at the same time
    "smollm2_server": ("test_openai_e2e.py", "test_structured_e2e.py"),
}
_GROUP_OF = {file: group for group, files in SHARED_SHAPES.items() for file in files}


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # (before xdist's own, which would return plain loadfile)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the SHARED_SHAPES groups as single work units."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedShapesScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = nodeid.split("::", 1)[0]
            return _GROUP_OF.get(file.rsplit("/", 1)[-1], file)

    return SharedShapesScheduling(config, log)
