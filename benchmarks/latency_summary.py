"""Several bench_latency processes per configuration -> one JSON: per configuration and batch size every process's TPOT
and TTFT, their medians (the figures), the roofline, each process's peak host RSS, and each configuration's medians
over the first one's.

    python3 -m benchmarks.latency_summary OUT.json bf16='/tmp/r/qwen3-8b_*.json' fp8='/tmp/r/qwen3-8b-fp8_*.json'
"""

from __future__ import annotations

import glob
import json
import statistics
import sys


def summarize(groups: dict[str, str]) -> dict:
    out: dict = {"configurations": {}}
    for label, pattern in groups.items():
        files = sorted(glob.glob(pattern))  # (a process that failed wrote none)
        tpot: dict[int, list[float]] = {}
        ttft: dict[int, list[float]] = {}
        roof: dict[int, float] = {}
        head: dict = {}
        rss: list = []  # each process's peak host RSS, MB (bench_latency's peak_rss_mb)
        for f in files:
            d = json.load(open(f))
            rss.append(d.get("peak_rss_mb"))
            head = {k: d.get(k) for k in ("device", "jax_version", "commit", "source_hash", "shape",
                                          "speculative_config", "replay_acceptance", "async_scheduling")}
            for row in d["rows"]:
                tpot.setdefault(row["batch_size"], []).append(row["tpot_ms"])
                if "ttft_ms" in row:
                    ttft.setdefault(row["batch_size"], []).append(row["ttft_ms"])
                roof[row["batch_size"]] = row["roofline_tpot_ms"]
        median = {b: statistics.median(v) for b, v in tpot.items()}
        out["configurations"][label] = {
            **head, "files": files, "peak_rss_mb": rss, "tpot_ms": tpot, "tpot_ms_median": median,
            "roofline_tpot_ms": roof,
            "tpot_over_roofline": {b: median[b] / roof[b] for b in median},
            "ttft_ms": ttft, "ttft_ms_median": {b: statistics.median(v) for b, v in ttft.items()}}
    configs = out["configurations"]
    first = next(iter(configs.values()), None)
    if first is not None:
        out["median_over_" + next(iter(configs))] = {
            label: {b: c["tpot_ms_median"][b] / first["tpot_ms_median"][b] for b in c["tpot_ms_median"]
                    if b in first["tpot_ms_median"]} for label, c in configs.items()}
        out["ttft_median_over_" + next(iter(configs))] = {
            label: {b: c["ttft_ms_median"][b] / first["ttft_ms_median"][b] for b in c["ttft_ms_median"]
                    if b in first["ttft_ms_median"]} for label, c in configs.items()}
    return out


def main(argv: list[str]) -> None:
    out_path, pairs = argv[0], argv[1:]
    result = summarize(dict(p.split("=", 1) for p in pairs))
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    for label, c in result["configurations"].items():
        print(label, {b: round(v, 3) for b, v in c["tpot_ms_median"].items()},
              {b: round(v, 2) for b, v in c["tpot_over_roofline"].items()}, f"({len(c['files'])} processes)")
    for key, ratios in result.items():
        if key.startswith(("median_over_", "ttft_median_over_")):
            print(key, {label: {b: round(v, 3) for b, v in r.items()} for label, r in ratios.items()})


if __name__ == "__main__":
    main(sys.argv[1:])
