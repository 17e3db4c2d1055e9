"""Host memory of loaded executables: what the idle engine's RSS is made of.

    python -m benchmarks.executable_memory --model dummy:qwen3-4b --dir /tmp/exe-mem --out result.json

Builds an engine with a staged warm-up (the first token buckets, as `jinfer serve` does) so that its
executables land in `--dir`, then, in a fresh process that has only started JAX's backend, loads each
executable file in turn and records the RSS it added, its size, and how much of it is GPU code (PTX
text, cubin images) against the rest (the optimized HLO and XLA's metadata). JSON on stdout (and --out).

Experiments in one call: `--load-env` loads the same files once per environment given (e.g. ""
CUDA_MODULE_LOADING=EAGER "XLA_FLAGS=--xla_gpu_..."), each in its own fresh process; building with other
compiler flags is the caller's environment over a fresh `--dir`.

On the CPU backend every XLA fusion is its own object file: the tiny Qwen3.5 checkpoint's 72 executables hold
5494 ELF images and add 934 MB of RSS (0.17 MB an image), the same with
XLA_FLAGS=--xla_cpu_parallel_codegen_split_count=1 (the image count does not move).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def rss_mb() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def rss_by_mapping(top: int = 12) -> dict:
    """RSS (MB) per mapped file, anonymous memory as "[anon]", the largest `top` of them."""
    sizes: dict[str, int] = {}
    name = "[anon]"
    for line in open("/proc/self/smaps"):
        parts = line.split()
        if parts and "-" in parts[0] and len(parts) >= 5 and not parts[0].endswith(":"):
            name = parts[5] if len(parts) > 5 else "[anon]"
            name = name if name.startswith("[") else os.path.basename(name)
        elif parts and parts[0] == "Rss:":
            sizes[name] = sizes.get(name, 0) + int(parts[1])
    rows = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return {k: round(v / 1024, 1) for k, v in rows}


def load_all(directory: Path) -> dict:
    import ctypes
    import gc

    import jax

    import jinfer.models.base  # noqa: F401  (the executables' pytrees name these modules)
    import jinfer.models.qwen3_5  # noqa: F401
    import jinfer.models.qwen3_moe  # noqa: F401
    from jinfer.engine.executable_cache import _load

    try:
        import jax.experimental.mosaic.gpu  # noqa: F401  (Mosaic kernels' host symbols, as ModelOps does)
    except ImportError:
        pass
    jax.devices()
    base = rss_mb()
    base_maps = rss_by_mapping()
    rows, keep = [], []

    def trim() -> None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass

    paths = sorted(directory.rglob("*.jexe"), key=lambda p: p.stat().st_size, reverse=True)
    for path in paths:
        data = path.read_bytes()
        before = rss_mb()
        t0 = time.perf_counter()
        keep.append(_load(path))
        load_s = time.perf_counter() - t0
        trim()
        rows.append({"file": path.name[:16], "file_mb": round(len(data) / 2**20, 2), "load_s": round(load_s, 3),
                     "rss_added_mb": round(rss_mb() - before, 1), "ptx_modules": data.count(b"\n.version "),
                     "cubin_images": data.count(b"\x7fELF"),
                     # call sites of the two Pallas GPU lowerings in the stored HLO: a Mosaic GPU call carries its
                     # kernel's MLIR in its backend config (compiled when loaded, cached by hash), a Triton call
                     # its Triton IR
                     "mosaic_calls": data.count(b"mosaic_gpu_v2"), "triton_calls": data.count(b"__gpu$xla.gpu.triton")})
    after, after_maps = rss_mb(), rss_by_mapping()
    # Dropped and loaded again, twice (what an engine that unloads idle executables does): is the memory given
    # back, does a second load cost the same time, and does the process grow over cycles?
    cycles = []
    for _ in range(2):
        keep.clear()
        trim()
        dropped = rss_mb()
        t0 = time.perf_counter()
        keep.extend(_load(path) for path in paths)
        reload_s = time.perf_counter() - t0
        trim()
        cycles.append({"rss_after_drop_mb": round(dropped, 1), "reload_s": round(reload_s, 2),
                       "rss_after_reload_mb": round(rss_mb(), 1)})
    keep.clear()
    trim()
    return {"backend_rss_mb": round(base, 1), "loaded": len(rows), "rss_after_mb": round(after, 1),
            "load_s": round(sum(r["load_s"] for r in rows), 2), "unload_cycles": cycles,
            "rss_after_final_drop_mb": round(rss_mb(), 1),
            "rss_by_mapping_backend_mb": base_maps, "rss_by_mapping_after_mb": after_maps,
            "executables": rows}


def engine_cycle(model: str, directory: Path, cycles: int = 2, warmup_threads: int | None = None) -> dict:
    """RSS of an engine (in this process) through what an idle server does: a staged warm-up's first buckets only,
    every bucket loaded, then dropping the idle ones (`ModelRunner.unload_idle`), loading them again and dropping
    them again `cycles` times. What the drop leaves above the first buckets' RSS is what unloading cannot give back."""
    import ctypes
    import gc
    import time

    from jinfer.config.engine import EngineConfig
    from jinfer.engine import executables as model_runner
    from jinfer.engine.core import EngineCore
    from jinfer.engine.idle_unload import RELOAD_AFTER_STEPS

    if warmup_threads:
        model_runner.WARMUP_THREADS = warmup_threads

    def point(name: str) -> None:
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        points.append({"point": name, "rss_mb": round(rss_mb(), 1), "executables": len(runner._compiled),
                       "mappings_mb": rss_by_mapping(8)})

    points: list[dict] = []
    core = EngineCore(EngineConfig(model=model, max_model_len=2048, compilation_cache_dir=str(directory),
                                   warmup=False, executable_keep_alive=1.0))
    runner = core.runner
    runner.warmup(first_tokens=256, background=False)
    point("first buckets")
    runner.start_background()
    runner.wait_warmup()
    point("every bucket")
    for c in range(cycles):
        time.sleep(1.1)
        runner.unload_idle()
        point(f"unloaded {c}")
        for T, decode in sorted(runner._unloaded):
            for _ in range(RELOAD_AFTER_STEPS):
                runner._want(T, decode)
        while runner._unloaded or runner._loading:
            time.sleep(0.05)
        point(f"loaded again {c}")
    time.sleep(1.1)
    runner.unload_idle()
    point("unloaded last")
    return {"model": model, "warmup_threads": model_runner.WARMUP_THREADS,
            "malloc_env": {k: v for k, v in os.environ.items() if k.startswith("MALLOC_")},
            "hits": runner.executables.hits, "misses": runner.executables.misses, "points": points}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="dummy:qwen3-4b")
    ap.add_argument("--dir", required=True, help="compilation cache directory (built here if empty)")
    ap.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)  # the fresh process
    ap.add_argument("--load-env", nargs="+", default=None, metavar="KEY=VALUE[,KEY=VALUE]",
                    help="load once per environment (comma-separated settings added to this one; \"\" for none)")
    ap.add_argument("--engine-cycle", action="store_true",
                    help="instead: an engine's RSS through unload / reload cycles (engine_cycle), in this process")
    ap.add_argument("--warmup-threads", type=int, default=None, help="engine_cycle: WARMUP_THREADS")
    ap.add_argument("--out")
    args = ap.parse_args()
    directory = Path(args.dir)
    if args.engine_cycle:
        text = json.dumps(engine_cycle(args.model, directory, warmup_threads=args.warmup_threads), indent=1)
        if args.out:
            Path(args.out).write_text(text + "\n")
        print(text)
        return
    if args.load_only:
        print(json.dumps(load_all(directory)))
        return
    if not any(directory.rglob("*.jexe")):
        from jinfer.config.engine import EngineConfig
        from jinfer.engine.core import EngineCore

        core = EngineCore(EngineConfig(model=args.model, max_model_len=2048, compilation_cache_dir=str(directory),
                                       warmup_first_tokens=256))
        core.runner.wait_warmup()  # every bucket, as an idle server holds them
        del core

    def load(extra: str) -> dict:
        env = dict(os.environ) | dict(kv.split("=", 1) for kv in extra.split(",") if kv)
        out = subprocess.run([sys.executable, "-m", "benchmarks.executable_memory", "--dir", str(directory),
                              "--load-only"], capture_output=True, text=True, env=env, check=True).stdout
        res = json.loads(out.strip().splitlines()[-1])
        images = sum(r["cubin_images"] for r in res["executables"])
        added = res["rss_after_mb"] - res["backend_rss_mb"]
        return res | {"cubin_images": images, "rss_added_mb": round(added, 1),
                      "rss_mb_per_image": round(added / images, 3) if images else None}

    if args.load_env is None:
        result = load("") | {"model": args.model}
    else:
        result = {"model": args.model, "xla_flags_at_build": os.environ.get("XLA_FLAGS", ""),
                  "variants": {extra or "(as is)": load(extra) for extra in args.load_env}}
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
