"""one_shot_all_reduce (Triton, NVLink peer memory) vs XLA's psum and the exact sum, on two or more GPUs of one
process. The kernel has no interpreter (peer memory exists only between GPUs): off the GPU the sharded forward
keeps psum, which tests/models/test_parallel_golden.py checks against HF."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from pallas_kernels import all_reduce
from tests.kernels.conftest import HAS_GPU

GPUS = len(jax.devices()) if HAS_GPU else 0


def test_supported_shapes():
    assert all_reduce.supported((1, 4096), jnp.bfloat16) and all_reduce.supported((7, 2560), jnp.float32)
    assert not all_reduce.supported((256, 4096), jnp.float32) and not all_reduce.supported((1, 4096), jnp.int32)


def test_reduce_without_workspace_is_psum():
    """ModelOps.reduce takes the kernel only while a forward is traced under a workspace (`all_reduce.use`)."""
    from jinfer.config.kernels import KernelPolicy
    from jinfer.ops import ModelOps

    ops = ModelOps(backend="pallas", interpret=False, axis="tp", policy=KernelPolicy(one_shot_all_reduce_bytes=1 << 20))
    mesh = jax.make_mesh((2,), ("tp",))
    f = jax.shard_map(ops.reduce, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)
    jaxpr = str(jax.make_jaxpr(f)(jnp.ones((1, 256), jnp.float32)))
    assert "psum" in jaxpr and "one_shot_collective" not in jaxpr


def test_workspace_is_per_thread():
    """Warm-up traces several forwards at once: each thread's trace sees only the table it set (`use`)."""
    import threading

    inside, leave, seen = threading.Barrier(2), threading.Event(), {}

    def trace(name):
        with all_reduce.use(name):
            inside.wait(5)  # both threads inside `use` at once
            seen[name] = all_reduce._active()[-1]
            leave.wait(5)
        seen[name + " after"] = all_reduce.active()

    threads = [threading.Thread(target=trace, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    leave.set()
    for t in threads:
        t.join(5)
    assert seen == {"a": "a", "b": "b", "a after": False, "b after": False}
    assert not all_reduce.active()


def test_kernel_is_xla_triton_custom_call():
    """The kernel reaches XLA as the Triton custom call XLA compiles itself (a kernel its command buffers hold),
    not jax-triton's legacy call, which cut a sharded step into a command buffer per reduction."""
    pytest.importorskip("triton")  # the `cuda` extras (jax-triton's dependency): Triton's front end writes the IR
    mesh = jax.make_mesh((2,), ("tp",))

    def body(v, t):
        with all_reduce.use(t):
            return jnp.concatenate([all_reduce.one_shot_all_reduce(v[0], "tp"),
                                    all_reduce.one_shot_all_gather(v[0], "tp")[:, :64]], 1)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"), check_vma=False))
    x = jax.device_put(jnp.ones((2, 1, 64), jnp.bfloat16), NamedSharding(mesh, P("tp")))
    text = f.trace(x, jnp.zeros((2, 12), jnp.uint32)).lower(lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call" in line]
    assert len(calls) == 2 and all("__gpu$xla.gpu.triton" in c for c in calls), calls
    assert "triton_kernel_call" not in text


def test_engine_takes_the_kernel_only_on_gpus_of_one_process():
    from dataclasses import replace

    from jinfer.config.kernels import KernelPolicy
    from jinfer.ops import ModelOps
    from jinfer.parallel.mesh import all_reduce_table

    mesh = jax.make_mesh((2,), ("tp",))
    ops = ModelOps(backend="pallas", interpret=False)
    assert all_reduce_table(jax.make_mesh((1,), ("tp",)), ops) == ()
    assert all_reduce_table(mesh, replace(ops, interpret=True)) == ()
    assert all_reduce_table(mesh, replace(ops, policy=KernelPolicy(one_shot_all_reduce_bytes=0))) == ()
    assert len(all_reduce_table(mesh, replace(ops, policy=KernelPolicy(one_shot_all_reduce_bytes=0,
                                                                       one_shot_all_gather_bytes=1)))) == HAS_GPU
    assert len(all_reduce_table(mesh, ops)) == (1 if HAS_GPU else 0)
    # the default limit follows the layout (measured): the kernel's whole range with one GPU a process
    assert KernelPolicy().all_reduce_limit(1) == 1 << 20 and KernelPolicy().all_reduce_limit(2) == 16384
    assert KernelPolicy(one_shot_all_reduce_bytes=0).all_reduce_limit(1) == 0


@pytest.mark.gpu
@pytest.mark.skipif(GPUS < 2, reason="needs two GPUs")
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("shape,dtype", [((1, 4096), jnp.bfloat16), ((16, 4096), jnp.bfloat16),
                                         ((3, 2560), jnp.float32), ((64, 5120), jnp.bfloat16), ((1, 100), jnp.float32)])
def test_one_shot_all_reduce_matches_psum(n, shape, dtype):
    if n > GPUS:
        pytest.skip(f"needs {n} GPUs")
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:n]), ("tp",))
    table = all_reduce.workspace(mesh).table
    x = jax.device_put(jnp.asarray(np.random.default_rng(n).standard_normal((n, *shape)), dtype),
                       NamedSharding(mesh, P("tp")))

    def run(fn, *args):
        def body(v, t):
            with all_reduce.use(t):
                return fn(v[0])[None]
        return np.asarray(jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P("tp"),
                                                check_vma=False))(x, table).astype(jnp.float32))

    out = run(lambda v: all_reduce.one_shot_all_reduce(v, "tp"))
    ref = run(lambda v: jax.lax.psum(v, "tp"))
    exact = np.asarray(x.astype(jnp.float32)).sum(0)
    for d in range(n):  # every device holds the same bits
        np.testing.assert_array_equal(out[d], out[0])
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(out[0], exact, atol=tol * n, rtol=tol)
    np.testing.assert_allclose(out[0], ref[0], atol=tol * n, rtol=tol)
    # 41 calls in a row, each on the last's result (both parities, the counters running on): still the exact
    # chain, and the psum of the same chain
    def chain(reduce):
        return lambda v: jax.lax.fori_loop(0, 41, lambda i, y: reduce(y) * (1.0 / n), v)

    out = run(chain(lambda y: all_reduce.one_shot_all_reduce(y, "tp")))
    ref = run(chain(lambda y: jax.lax.psum(y, "tp")))
    np.testing.assert_allclose(out[0], ref[0], atol=tol * n, rtol=tol)
    np.testing.assert_array_equal(out[n - 1], out[0])
    # the all-gather of [rows, cols] parts into [rows, n * cols]; and after a reduction in the same executable
    parts = np.asarray(x.astype(jnp.float32))
    out = run(lambda v: all_reduce.one_shot_all_gather(v, "tp"))
    for d in range(n):
        np.testing.assert_array_equal(out[d], np.concatenate(list(parts), axis=1))
    out = run(lambda v: all_reduce.one_shot_all_gather(all_reduce.one_shot_all_reduce(v, "tp"), "tp"))
    np.testing.assert_allclose(out[n - 1], np.concatenate([exact] * n, axis=1), atol=tol * n, rtol=tol)
