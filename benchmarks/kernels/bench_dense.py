"""Quick timings of the dense kernels (the full comparisons: benchmarks/bench_kernels.py, bench_decode_mlp.py).

    python -m benchmarks.kernels.bench_dense mlp                    # fused SwiGLU MLP vs XLA at Qwen3-4B shapes
    python -m benchmarks.kernels.bench_dense skinny_gemm [OUT.json]  # skinny GEMM launch sweep vs XLA
    python -m benchmarks.kernels.bench_dense fp8 [OUT.json]          # bf16 vs block-FP8 weights at Qwen3-8B shapes
    python -m benchmarks.kernels.bench_dense fp8_skinny [OUT.json [heads]]  # FP8 skinny GEMM: a sweep of its launch
    python -m benchmarks.kernels.bench_dense fp8_qkv [OUT.json]      # FP8 norm + q|k|v: a sweep of its launch
    python -m benchmarks.kernels.bench_dense fp8_prefill [OUT.json [qkv o gate down]]  # FP8 prefill GEMM

On CPU: tiny shapes in the interpreter, to check the script.
"""

from __future__ import annotations

import functools
import json

import jax
import jax.numpy as jnp

from benchmarks.kernels import run_subcommand
from pallas_kernels.dense.fused_mlp import fused_swiglu_mlp, fused_swiglu_mlp_reference
from pallas_kernels.dense.skinny_gemm import skinny_gemm, skinny_gemm_reference


def bench_mlp(argv: list[str] | None = None) -> None:
    """Quick timing at Qwen3-4B shapes; the full comparison is benchmarks/bench_kernels.py."""
    import time

    hidden, inter = 2560, 9728
    interpret = jax.default_backend() != "gpu"
    if interpret:
        hidden, inter = 256, 512
    key = jax.random.key(0)
    kx, kg, ku, kd = jax.random.split(key, 4)
    wg = jax.random.normal(kg, (hidden, inter), jnp.bfloat16) * hidden**-0.5
    wu = jax.random.normal(ku, (hidden, inter), jnp.bfloat16) * hidden**-0.5
    wd = jax.random.normal(kd, (inter, hidden), jnp.bfloat16) * inter**-0.5
    for tokens in (1, 16, 64):
        x = jax.random.normal(kx, (tokens, hidden), jnp.bfloat16)
        fn = functools.partial(fused_swiglu_mlp, interpret=interpret)
        for name, f in (("pallas", fn), ("xla", fused_swiglu_mlp_reference)):
            f(x, wg, wu, wd).block_until_ready()
            reps = 2 if interpret else 50
            t0 = time.perf_counter()
            for _ in range(reps):
                out = f(x, wg, wu, wd)
            out.block_until_ready()
            print(f"mlp T={tokens} {name}: {(time.perf_counter() - t0) / reps * 1e6:.1f} us")


LAUNCH = ("block_n", "block_k", "k_splits", "num_warps", "num_stages")
SHAPES = {"qkv": (2560, 6144), "o": (4096, 2560), "gate_up": (2560, 19456), "down": (9728, 2560),
          "lm_head": (2560, 151936)}


def _time_us(fn, x, ws, reps: int = 10) -> float:
    """Device time of one call: one executable applies `fn` to each of the distinct weights `ws` (more bytes than L2
    holds). On a GPU, the sum of the kernels' times per call from a profile of `reps` runs (the host's dispatch and
    the gaps between launches left out: a step runs these kernels inside one CUDA graph); elsewhere the median wall
    time of `reps` runs per call."""
    import tempfile
    import time

    import numpy as np

    chain = jax.jit(lambda x, ws: [fn(x, w) for w in ws])
    jax.block_until_ready(chain(x, ws))
    if jax.default_backend() == "gpu":
        from benchmarks.trace_summary import gpu_kernel_times

        with tempfile.TemporaryDirectory() as d:
            with jax.profiler.trace(d):
                for _ in range(reps):
                    jax.block_until_ready(chain(x, ws))
            return sum(gpu_kernel_times(d, reps * len(ws))[0].values())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(chain(x, ws))
        times.append((time.perf_counter() - t0) / len(ws) * 1e6)
    return float(np.median(times))


def sweep(tokens_list=(1, 8), shapes=("qkv", "o", "down", "gate_up")) -> list[dict]:
    import itertools

    interpret = jax.default_backend() != "gpu"
    rows = []
    key = jax.random.key(0)
    for name in shapes:
        k, n = SHAPES[name]
        if interpret:
            k, n = 256, 512
        copies = 1 if interpret else max(4, -(-400_000_000 // (k * n * 2)))  # >= 400 MB of distinct weights
        ws = [jax.random.normal(jax.random.fold_in(key, i), (k, n), jnp.bfloat16) for i in range(copies)]
        swept = None  # the best launch of the full sweep (first token count), tried at the others
        for tokens in tokens_list:
            x = jax.random.normal(key, (tokens, k), jnp.bfloat16)
            nbytes = k * n * 2
            reps = 2 if interpret else 10
            t = _time_us(skinny_gemm_reference, x, ws, reps=reps)
            rows.append({"shape": name, "K": k, "N": n, "tokens": tokens, "impl": "xla", "time_us": t,
                         "tb_per_s": nbytes / t / 1e6})
            print(json.dumps(rows[-1]), flush=True)
            if interpret:
                configs = [None, (64, 64, 2, 4, 3)]
            elif swept is None:
                configs = [None, *itertools.product((32, 64, 128), (128,), (1, 2, 4), (4,), (3, 5))]
            else:
                configs = [None, swept]
            best = None
            for c in configs:
                kw = {} if c is None else dict(zip(LAUNCH, c, strict=True))
                if c is not None and (n % c[0] or k % (c[2] * c[1]) or k // (c[2] * c[1]) < 2):
                    continue
                try:
                    t = _time_us(functools.partial(skinny_gemm, interpret=interpret, **kw), x, ws, reps=reps)
                except Exception as e:  # noqa: BLE001 (a config Triton cannot compile: shared memory)
                    rows.append({"shape": name, "tokens": tokens, "impl": "pallas", **kw, "error": str(e)[:200]})
                    continue
                row = {"shape": name, "K": k, "N": n, "tokens": tokens, "impl": "pallas" if kw else "pallas(default)",
                       **kw, "time_us": t, "tb_per_s": nbytes / t / 1e6}
                rows.append(row)
                if c is not None and (best is None or t < best["time_us"]):
                    best = row
                if c is None:
                    print(json.dumps(row), flush=True)
            print("best", json.dumps(best), flush=True)
            if swept is None and best is not None:
                swept = tuple(best[f] for f in LAUNCH)
    return rows


def bench_skinny_gemm(argv: list[str] | None = None) -> None:
    """Qwen3-4B's decode projections: XLA against a sweep of the skinny GEMM's launch parameters (JSON to argv[0])."""
    argv = argv or []
    result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "results": sweep()}
    if argv:
        with open(argv[0], "w") as f:
            json.dump(result, f, indent=1)


def _fp8_cases(tokens: int, interpret: bool) -> dict:
    """{kernel: (weights in bf16, FP8 weights as (values, scales), call(x, weights, scales) for the kernel, the same
    for the jnp reference, the FP8 calls {impl: call})} at Qwen3-8B's decode shapes (tiny ones in the interpreter)."""
    from jinfer.models.fp8 import quantize
    from pallas_kernels.dense.norm_qkv_rope import norm_qkv_rope_write, norm_qkv_rope_write_reference

    hidden, inter, heads, kv_heads, dim, block = (256, 512, 2, 1, 128, (128, 128)) if interpret else \
        (4096, 12288, 32, 8, 128, (128, 128))
    key = jax.random.key(1)
    bf16 = jnp.bfloat16

    def weights(*shapes):
        return [jax.random.normal(jax.random.fold_in(key, i), s, bf16) * s[0]**-0.5 for i, s in enumerate(shapes)]

    norm = jnp.ones((hidden,), bf16)
    rope = (jnp.ones((tokens, dim), bf16), jnp.zeros((tokens, dim), bf16), jnp.arange(tokens, dtype=jnp.int32),
            jnp.ones((dim,), bf16), jnp.ones((dim,), bf16))
    cache = jnp.zeros((8, 16, kv_heads, dim), bf16)
    counters = jnp.zeros((1024,), jnp.int32)
    qkv_kw = dict(num_heads=heads, num_kv_heads=kv_heads)

    def mlp(ref):
        if ref:
            return lambda x, w, s: fused_swiglu_mlp_reference(x, *w, norm, s, scale_block=s and block)
        fn = functools.partial(fused_swiglu_mlp, interpret=interpret)
        return lambda x, w, s: fn(x, *w, norm, s, scale_block=s and block)

    def o(ref):
        if ref:
            return lambda x, w, s: skinny_gemm_reference(x, w[0], s and s[0], scale_block=s and block)
        fn = functools.partial(skinny_gemm, interpret=interpret)
        return lambda x, w, s: fn(x, w[0], s and s[0], scale_block=s and block)

    def qkv(ref):
        def call(x, w, s, **launch):  # (launch: norm_qkv_rope_write's own k_splits, num_warps, num_stages)
            kw = dict(qkv_kw, wqkv_scale=s and s[0], scale_block=s and block)
            if ref:
                return norm_qkv_rope_write_reference(x, norm, w[0], *rope[:3], *rope[3:], cache, cache, **kw)
            return norm_qkv_rope_write(x, norm, w[0], *rope[:3], *rope[3:], cache, cache, counters, **kw,
                                       interpret=interpret, **launch)
        return call

    cases = {"mlp": (weights((hidden, inter), (hidden, inter), (inter, hidden)), mlp),
             "o": (weights((hidden, hidden)), o),
             "qkv": (weights((hidden, (heads + 2 * kv_heads) * dim)), qkv)}
    out = {}
    for name, (ws, make) in cases.items():
        qs = [quantize(w.astype(jnp.float32), block) for w in ws]
        # (the kernels read FP8 weights [out, in], as checkpoints store them: "_nk")
        variants = {"pallas_nk": make(False)}
        out[name] = (tuple(ws), (tuple(q.w for q in qs), tuple(q.scale for q in qs)), make(False), make(True),
                     variants)
    return out


def bench_fp8(argv: list[str] | None = None) -> None:
    """Qwen3-8B's decode kernels (fused MLP, skinny o, norm + q|k|v at 1 and 8 tokens) with bf16 weights (the Pallas
    kernel and XLA) and block-FP8 (128 x 128) ones: the Pallas kernel (e4m3 activations, fp8_tiles.py; the weights
    [out, in], "_nk"), device time per call over distinct weight copies (more than L2 holds) and weight
    bytes / time. JSON to argv[0]."""
    argv = argv or []
    interpret = jax.default_backend() != "gpu"
    rows = []
    for tokens in (1, 8):
        x = jax.random.normal(jax.random.key(0), (tokens, 256 if interpret else 4096), jnp.bfloat16)
        for name, (ws, (qw, qs), kernel, ref, variants) in _fp8_cases(tokens, interpret).items():
            for fmt, w, s in (("bf16", ws, None), ("fp8", qw, qs)):
                nbytes = sum(a.nbytes for a in w) + (0 if s is None else sum(a.nbytes for a in s))
                copies = 1 if interpret else max(2, -(-400_000_000 // nbytes))
                wcopies = [(w, s)] + [(tuple(jnp.array(a, copy=True) for a in w), s) for _ in range(copies - 1)]
                impls = {"pallas": kernel, "xla": ref} if s is None else variants
                for impl, fn in impls.items():
                    wc = wcopies
                    if impl.endswith("_nk"):
                        wc = [(tuple(jnp.asarray(a.T) for a in w_), s_) for w_, s_ in wcopies]
                    try:
                        t = _time_us(lambda x, ws_, fn=fn: fn(x, *ws_), x, wc, reps=2 if interpret else 10)
                    except Exception as e:  # a variant that does not compile: recorded, the others still run
                        rows.append({"kernel": name, "tokens": tokens, "weights": fmt, "impl": impl,
                                     "error": str(e)[:300]})
                        print(json.dumps(rows[-1]), flush=True)
                        continue
                    rows.append({"kernel": name, "tokens": tokens, "weights": fmt, "impl": impl, "time_us": t,
                                 "weight_bytes": nbytes, "tb_per_s": nbytes / t / 1e6})
                    print(json.dumps(rows[-1]), flush=True)
    if argv:
        with open(argv[0], "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "results": rows}, f, indent=1)


def _record(rows: list, row: dict, argv) -> None:
    """Append a result row, print it and rewrite the JSON at argv[0] (after every row: a time limit keeps what ran)."""
    rows.append(row)
    print(json.dumps(row), flush=True)
    if argv:
        with open(argv[0], "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "results": rows}, f, indent=1)


def _record_launch(rows: list, row: dict, fn, x, weights: list, nbytes: int, interpret: bool, argv) -> None:
    """`row` with fn(x, *w)'s device time over the weight copies `weights` and weight bytes / time (or the error of a
    launch that does not compile: the others still run), recorded (`_record`)."""
    try:
        t = _time_us(lambda x, ws_: fn(x, *ws_), x, weights, reps=2 if interpret else 10)
        row.update(time_us=t, weight_bytes=nbytes, tb_per_s=nbytes / t / 1e6)
    except Exception as e:
        row["error"] = str(e)[:200]
    _record(rows, row, argv)


# Draft heads' projections at one token (`fp8_skinny OUT.json heads`): Qwen3.5-4B's lm_head (its MTP head's FP8
# copy), and a Qwen3-8B EAGLE-3 head's lm_head (32000-token draft vocabulary), q|k|v (of 2H inputs) and fc (3H -> H).
HEAD_SHAPES = {"lm_head_qwen3.5": (2560, 248320), "eagle_lm_head": (4096, 32000), "eagle_qkv": (8192, 6144),
               "eagle_fc": (12288, 4096)}


def bench_fp8_skinny(argv: list[str] | None = None) -> None:
    """The block-FP8 skinny GEMM (skinny_gemm.py: e4m3 rows per 128 columns quantized in every program; [N, K]
    weights) at Qwen3-8B's o / gate (or up) / down shapes, 1 / 8 / 16 tokens: its default launch and a sweep of K
    splits and warps; with "heads" after the JSON path, at HEAD_SHAPES and one token: a sweep of column blocks, K
    splits and warps, and XLA's bf16 GEMM of the same weight for scale. Device time per call over distinct weight
    copies, and weight bytes / time. JSON to argv[0]."""
    from jinfer.models.fp8 import quantize

    argv = list(argv or [])
    heads = "heads" in argv[1:]
    interpret = jax.default_backend() != "gpu"
    block = (128, 128)
    shapes = {"o": (256, 256), "down": (512, 256)} if interpret else \
        HEAD_SHAPES if heads else {"o": (4096, 4096), "gate": (4096, 12288), "down": (12288, 4096)}
    configs = [dict()] + [dict(k_splits=ks, num_stages=4, num_warps=nw) for ks in (4, 8) for nw in (4, 8)]
    if heads:
        configs = [dict()] + [dict(block_n=bn, k_splits=ks, num_stages=4, num_warps=nw) for bn in (64, 128)
                              for ks in (1, 2, 4, 8) for nw in (4, 8)]
    if interpret:
        configs = configs[:1]
    rows = []
    for name, (k, n) in shapes.items():
        w = jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * k**-0.5
        q = quantize(w, block)
        nbytes = q.w.nbytes + q.scale.nbytes
        copies = 1 if interpret else max(2, -(-400_000_000 // nbytes))
        wcopies = [(jnp.array(q.w.T, copy=True), q.scale) for _ in range(copies)]
        if heads:  # (XLA's bf16 GEMM of the same weight, the token padded to two rows as ops.project pads it)
            bf16 = [(w.astype(jnp.bfloat16) + i,) for i in range(max(2, copies // 2))]
            x = jax.random.normal(jax.random.key(0), (1, k), jnp.bfloat16)
            _record_launch(rows, {"kernel": name, "tokens": 1, "impl": "xla_bf16"},
                           lambda x, w: jnp.dot(jnp.pad(x, ((0, 1), (0, 0))), w)[:1], x, bf16, bf16[0][0].nbytes,
                           interpret, argv)
        for tokens in (1,) if heads else (1, 8, 16):
            x = jax.random.normal(jax.random.key(0), (tokens, k), jnp.bfloat16)
            for cfg in configs:
                if "k_splits" in cfg and cfg["k_splits"] * 128 * 8 > k:  # (each split >= 8 tiles)
                    continue
                fn = functools.partial(skinny_gemm, scale_block=block, interpret=interpret, **cfg)
                _record_launch(rows, {"kernel": name, "tokens": tokens, "impl": "triton", **cfg}, fn, x, wcopies,
                               nbytes, interpret, argv)


def bench_fp8_qkv(argv: list[str] | None = None) -> None:
    """The block-FP8 norm + q|k|v + RoPE kernel (norm_qkv_rope.py, [out, in] weights) at Qwen3-8B's shapes, 1 / 8
    tokens: its default launch and a sweep of K splits (past one wave of programs), warps and stages. Device time per
    call over distinct weight copies, and weight bytes / time. JSON to argv[0]."""
    argv = list(argv or [])
    interpret = jax.default_backend() != "gpu"
    # (8 warps were 1.1-1.4x slower at 4 / 8 splits, 4 warps 1.2x slower at 2: dense_fp8_qkv_sweep_h200.json)
    configs = [dict()] + ([] if interpret else [dict(k_splits=2, num_warps=8, num_stages=4)] + [
        dict(k_splits=ks, num_warps=4, num_stages=ns) for ks in (4, 8, 16) for ns in (2, 3, 4)])
    rows = []
    for tokens in (1, 8):
        x = jax.random.normal(jax.random.key(0), (tokens, 256 if interpret else 4096), jnp.bfloat16)
        _ws, (qw, qs), call, _ref, _variants = _fp8_cases(tokens, interpret)["qkv"]
        nbytes = qw[0].nbytes + qs[0].nbytes
        copies = 1 if interpret else max(2, -(-400_000_000 // nbytes))
        wc = [((jnp.array(qw[0].T, copy=True),), qs) for _ in range(copies)]
        for cfg in configs:
            _record_launch(rows, {"kernel": "qkv", "tokens": tokens, "impl": "pallas_nk", **cfg},
                           functools.partial(call, **cfg), x, wc, nbytes, interpret, argv)


def bench_fp8_prefill(argv: list[str] | None = None) -> None:
    """Block-FP8 GEMMs for prefill at Qwen3-8B's q|k|v / o / gate / down shapes, 4096 (and 1000, 32) tokens: the Mosaic
    GPU e4m3 GEMM (fp8_gemm_mgpu.py: defaults and a sweep of its ring depth; the
    token quantization's own kernel included) against what the engine did before it (the weight
    dequantized to bf16, then XLA's GEMM) and XLA's GEMM of bf16 weights (a bf16 model's). Device time per call,
    TFLOP/s, and the kernel's largest difference from its jnp reference relative to the output's largest value. JSON
    to argv[0]."""
    from jinfer.models.fp8 import dense, quantize
    from pallas_kernels.dense.fp8_gemm_mgpu import fp8_gemm_mgpu, fp8_gemm_reference

    argv = list(argv or [])
    interpret = jax.default_backend() != "gpu"
    block = (128, 128)
    shapes = {"o": (256, 256)} if interpret else \
        {"qkv": (4096, 6144), "o": (4096, 4096), "gate": (4096, 12288), "down": (12288, 4096)}
    shapes = {k: v for k, v in shapes.items() if k in argv[1:]} or shapes  # (kernel names after the JSON path)
    # (the 64 x 256 tiles, 6-slot rings and the grid's other order measured 1-3% slower: dense_fp8_prefill_sweep_h200;
    # the warpgroups' wgmmas in turn, "ping-pong", 11-12%: dense_fp8_prefill_pingpong_h200)
    sweep_ = [dict()] if interpret else [dict(), dict(max_steps=5)]
    rows = []
    record = functools.partial(_record, rows, argv=argv)

    for name, (k, n) in shapes.items():
        q = quantize(jax.random.normal(jax.random.key(1), (k, n), jnp.float32) * k**-0.5, block)
        # (decode-sized steps stream the weights: more copies than L2 holds)
        copies = 2 if interpret else max(2, -(-400_000_000 // q.w.nbytes))
        wq = [(jnp.array(q.w.T, copy=True), q.scale) for _ in range(copies)]
        wb = [dense(q, jnp.bfloat16) for _ in range(max(2, copies // 2))]
        for tokens in ((128,) if interpret else (4096, 1000, 32)):
            x = jax.random.normal(jax.random.key(0), (tokens, k), jnp.bfloat16)
            flop = 2 * tokens * k * n
            base = {"kernel": name, "tokens": tokens}
            for impl, fn, ws in (("xla_bf16", lambda x, w: x @ w, wb),
                                 ("dequant_xla", lambda x, w: x @ dense(w, x.dtype), [q] * len(wb))):
                t = _time_us(fn, x, ws, reps=2 if interpret else 10)
                wbytes = wb[0].nbytes if impl == "xla_bf16" else q.w.nbytes
                record({**base, "impl": impl, "time_us": t, "tflop_per_s": flop / t / 1e6,
                        "weight_tb_per_s": wbytes / t / 1e6})
            ref = fp8_gemm_reference(x, *wq[0]).astype(jnp.float32)
            for cfg in sweep_ if tokens == 4096 or interpret else [{}, {"k_splits": 1}] if tokens <= 128 else [{}]:
                fn = functools.partial(fp8_gemm_mgpu, scale_block=block, interpret=interpret, **cfg)
                row = {**base, "impl": "mgpu", **cfg}
                try:
                    t = _time_us(lambda x, ws_, fn=fn: fn(x, *ws_), x, wq, reps=2 if interpret else 10)
                    err = jnp.max(jnp.abs(fn(x, *wq[0]).astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))
                    row.update(time_us=t, tflop_per_s=flop / t / 1e6, weight_tb_per_s=q.w.nbytes / t / 1e6,
                               rel_err_vs_ref=float(err))
                except Exception as e:  # a launch that does not compile: recorded, the others still run
                    row["error"] = str(e)[:200]
                record(row)


BENCHMARKS = {"mlp": bench_mlp, "skinny_gemm": bench_skinny_gemm, "fp8": bench_fp8, "fp8_skinny": bench_fp8_skinny,
              "fp8_qkv": bench_fp8_qkv, "fp8_prefill": bench_fp8_prefill}

def main(argv: list[str] | None = None) -> None:
    run_subcommand(BENCHMARKS, __spec__.name, __doc__, argv)


if __name__ == "__main__":
    main()
