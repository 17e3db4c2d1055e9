"""Shared fixtures. Tests run on CPU; JAX sees 8 fake devices so sharding code paths are exercised."""

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

from pathlib import Path  # noqa: E402

import jax.experimental.pallas.fuser  # noqa: E402, F401
import pytest  # noqa: E402

# (The import above: the Pallas interpreter's lowering imports the fuser, which registers a config flag that is
# part of every jit's cache key. Imported mid-run, it changes the key of everything traced before it, and the next
# call of each such jitted function traces and compiles it again.)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    from jinfer.weights.loader import default_model_path

    path = default_model_path()
    if not path.is_file():
        pytest.skip(f"default model not installed at {path} (run `make install`)")
    return path
