"""Time an EAGLE-3 draft chain (jinfer/models/eagle3.py `propose`) at a published head's shape, with random weights.

    python -m benchmarks.bench_eagle3 [--batch-sizes 1 8 32] [--num-steps 3] [--context 1024]

The default shape is SpecForge's Qwen3-8B head (hidden 4096, 32 q / 8 kv heads of 128, MLP 12288, draft vocabulary
32000, target vocabulary 151936) in bfloat16. One call is what the engine runs after a verification step: a first
pass over each sequence's k + 1 verified rows, then k - 1 one-token steps. Each sequence has `--context` tokens of
KV already. Also checks, first, that the chain on the Pallas kernels gives the reference ops' drafts.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from jinfer.config.model import NAMED_SHAPES
from jinfer.models import eagle3
from jinfer.models.batch import make_batch
from jinfer.ops import REFERENCE_OPS, select_ops

HEAD = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": 4096, "intermediate_size": 12288,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "num_hidden_layers": 1,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000, "vocab_size": 151936, "draft_vocab_size": 32000}
PAGE = 16


def random_head(cfg: eagle3.Eagle3Config, dtype) -> eagle3.Eagle3Weights:
    arrays, key = {}, jax.random.key(0)
    for name, spec in eagle3.weight_specs(cfg).items():
        key, sub = jax.random.split(key)
        if name == "d2t":
            arrays[name] = jax.random.randint(sub, spec.shape, 0, cfg.layer.vocab_size - cfg.draft_vocab_size)
        elif spec.init == "ones":
            arrays[name] = jnp.ones(spec.shape, dtype)
        else:
            arrays[name] = (jax.random.normal(sub, spec.shape, jnp.float32) * 0.02).astype(dtype)
    return eagle3.assemble_weights(cfg, arrays)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-steps", type=int, default=3)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args()
    cfg = eagle3.eagle3_config(HEAD, NAMED_SHAPES["qwen3-8b"])
    head = random_head(cfg, jnp.bfloat16)
    ops = select_ops()
    k, ctx = args.num_steps, args.context
    pages_per_seq = (ctx + 2 * k + PAGE) // PAGE
    propose = jax.jit(eagle3.propose, static_argnames=("cfg", "num_steps", "ops"), donate_argnames=("kv",))
    print(f"device {jax.devices()[0].device_kind}, ops {ops.backend}, k={k}, context {ctx}")
    for b in args.batch_sizes:
        num_pages = b * pages_per_seq + 1
        shape = (num_pages, PAGE, cfg.layer.num_kv_heads, cfg.layer.head_dim)
        rng = np.random.default_rng(b)
        pages = [list(range(1 + i * pages_per_seq, 1 + (i + 1) * pages_per_seq)) for i in range(b)]
        kv = tuple(jnp.asarray(rng.normal(size=shape), jnp.bfloat16) for _ in range(2))
        seqs = [(rng.integers(0, 151936, k + 1).tolist(), ctx, pages[i])
                for i in range(b)]
        batch = make_batch(seqs, PAGE, num_seqs=b, pages_per_seq=pages_per_seq)
        aux = jnp.asarray(rng.normal(size=(b * (k + 1), 3 * cfg.target_hidden_size)), jnp.bfloat16)
        ref, _ = jax.jit(eagle3.propose, static_argnames=("cfg", "num_steps", "ops"))(
            head, cfg, batch, aux, kv, num_steps=k, ops=REFERENCE_OPS)
        out, kv = propose(head, cfg, batch, aux, kv, num_steps=k, ops=ops)
        agree = float(np.mean(np.asarray(ref) == np.asarray(out)))
        for _ in range(3):
            out, kv = propose(head, cfg, batch, aux, kv, num_steps=k, ops=ops)
        jax.block_until_ready(out)
        t0 = time.perf_counter()
        for _ in range(args.iters):
            out, kv = propose(head, cfg, batch, aux, kv, num_steps=k, ops=ops)
        jax.block_until_ready(out)
        ms = (time.perf_counter() - t0) / args.iters * 1e3
        print(f"batch {b}: {ms:.3f} ms per chain of {k} drafts; drafts equal to the reference ops': {agree:.2f}")


if __name__ == "__main__":
    main()
