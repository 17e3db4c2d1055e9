"""Which implementation computes each op of the forward pass: the choice of kernel per shape and policy.

`ModelOps` is a static (hashable) argument of `forward`, so each choice compiles its own executable. The reference
ops are plain jnp (XLA); the Pallas ops call the kernels in `pallas_kernels/`, natively on GPU or in the Pallas
interpreter on CPU (tests). The choices are made at trace time from the shapes and the `KernelPolicy`
(jinfer/config/kernels.py) the ops carry; each group of ops says how it chooses:

- attention.py: paged decode attention, the ragged prefill kernels (Triton, Mosaic GPU for long sequences);
- dense.py: the projections, the attention block's fused front end, the o projection, the dense MLP block;
- moe.py: the mixture-of-experts block (fused front end, routing, grouped GEMMs);
- linear_attention.py: Gated DeltaNet (delta rule, fused decode step, causal conv, gated RMSNorm).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax

from jinfer.config.kernels import KernelPolicy
from jinfer.ops.attention import AttentionOps
from jinfer.ops.dense import DenseOps
from jinfer.ops.linear_attention import LinearAttentionOps
from jinfer.ops.moe import MoeOps

DEFAULT_POLICY = KernelPolicy()


@dataclass(frozen=True)
class ModelOps(AttentionOps, DenseOps, MoeOps, LinearAttentionOps):
    backend: str = "reference"  # "reference" | "pallas"
    interpret: bool = False  # Pallas interpreter (CPU)
    mosaic_prefill: bool = False  # long prefill sequences on the Mosaic GPU kernel (see attention.py)
    # Set by the runner on the executables of decode-only steps: sequence b's one new token is row b
    # (T == B; padding sequences have seq_len 0), so attention is the paged decode kernel.
    decode_step: bool = False
    # Set by the runner on the executables of verify steps (speculative decoding): every sequence has at most this many
    # (> 1) new tokens, so attention is the paged decode kernel with that many query rows per sequence. 0: not set.
    verify_query_len: int = 0
    # The mesh axis this forward is sharded over (inside `jax.shard_map`, see jinfer/parallel/mesh.py): the
    # ops then hold their device's shards and reduce partial sums across it. None: one device.
    axis: str | None = None
    policy: KernelPolicy = DEFAULT_POLICY  # the kernel choices' thresholds and switches (part of the jit key)

    def __post_init__(self):
        if self.backend not in ("reference", "pallas"):
            raise ValueError(f"backend={self.backend!r} must be 'reference' or 'pallas'")
        if not isinstance(self.verify_query_len, int) or self.verify_query_len < 0:
            raise ValueError(f"verify_query_len={self.verify_query_len!r} must be an integer >= 0")
        if not isinstance(self.policy, KernelPolicy):
            raise ValueError(f"policy={self.policy!r} must be a KernelPolicy")
        if self.mosaic_prefill:
            # Importing Mosaic GPU points its custom call at the runtime library it resolves its host
            # symbols from (MOSAIC_GPU_RUNTIME_LIB_PATH). An executable loaded from the executable
            # cache is never traced, so without this the first one holding a Mosaic kernel failed to
            # load ("Symbols not found: mosaic_gpu_init_tma_desc") and was recompiled at every start.
            import jax.experimental.mosaic.gpu  # noqa: F401


REFERENCE_OPS = ModelOps()


def select_ops(backend: str | None = None, interpret: bool | None = None, *,
               policy: KernelPolicy = DEFAULT_POLICY) -> ModelOps:
    """The ops a policy asks for on this process's devices. `backend` / `interpret`, where given, override the
    policy's attention_backend / interpret (callers that hold only a backend name).

    "auto": the Pallas kernels on GPU, the jnp reference elsewhere; Pallas off-GPU runs interpreted. The Mosaic
    GPU prefill kernel is on for "pallas" when compiled for the GPU; "pallas-triton" and interpret mode (its
    interpreter is far slower) keep every prefill on the Triton kernel.
    """
    if backend is not None or interpret is not None:
        policy = dataclasses.replace(policy, attention_backend=policy.attention_backend if backend is None else backend,
                                     interpret=policy.interpret if interpret is None else interpret)
    on_gpu = jax.default_backend() == "gpu"
    backend = policy.attention_backend
    if backend == "auto":
        backend = "pallas" if on_gpu else "reference"
    interpret = (not on_gpu) if policy.interpret is None else policy.interpret
    mosaic = backend == "pallas" and not interpret
    return ModelOps("pallas" if backend == "pallas-triton" else backend, interpret, mosaic, policy=policy)

