"""KV-cache bytes per token and the pages a fixed memory budget holds, by the engine's own sizing
(`engine/builder._auto_num_pages` over `cache/layout.py`): MLA's latent cache (one [kv_lora_rank + rope_dim] row
per token per layer) against grouped-query attention's K and V pages. No device and no weights needed.

    python -m benchmarks.kv_bytes --shapes deepseek-v2-lite deepseek-v3 qwen3-30b-a3b --budget-gib 40 --out kv.json
"""

from __future__ import annotations

import argparse

from benchmarks.common import write_result
from jinfer.config.engine import EngineConfig
from jinfer.engine.builder import _auto_num_pages
from jinfer.weights.loader import resolve_model

GIB = 1 << 30


class _Device:
    """A device whose free memory is the budget (what `_auto_num_pages` reads)."""

    def __init__(self, budget: int, utilization: float):
        self.stats = {"bytes_limit": int(budget / utilization) + 1, "bytes_in_use": 0}

    def memory_stats(self):
        return self.stats


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["deepseek-v2-lite", "deepseek-v3", "qwen3-30b-a3b", "qwen3-8b"])
    ap.add_argument("--budget-gib", type=float, default=40.0, help="KV memory of one device")
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--out")
    args = ap.parse_args()
    rows = []
    for shape in args.shapes:
        cfg = resolve_model(f"dummy:{shape}").config
        config = EngineConfig(model=f"dummy:{shape}", page_size=args.page_size, max_num_seqs=1 << 16,
                              max_model_len=cfg.max_position_embeddings, kv_cache_dtype=args.kv_cache_dtype)
        device = _Device(int(args.budget_gib * GIB), config.gpu_memory_utilization)
        pages = _auto_num_pages(config, cfg, "bfloat16", 0, device)
        tokens = pages * args.page_size
        rows.append({"shape": shape, "layers": cfg.num_layers, "pages": pages, "tokens": tokens,
                     "bytes_per_token": args.budget_gib * GIB / tokens})
        print(f"{shape}: {pages} pages of {args.page_size} tokens in {args.budget_gib:g} GiB, "
              f"{rows[-1]['bytes_per_token']:.0f} bytes a token")
    write_result({"benchmark": "kv_bytes", "budget_gib": args.budget_gib, "page_size": args.page_size,
                  "kv_cache_dtype": args.kv_cache_dtype, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
