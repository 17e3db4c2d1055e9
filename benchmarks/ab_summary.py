"""Summarise run_gpu_ab.sh's per-process JSONs of one shape: step and TPOT per batch size and tree, the median over
processes and new / base.  python benchmarks/ab_summary.py DIR SHAPE > ab_SHAPE.json"""

import glob
import json
import statistics
import sys


def collect(directory: str, shape: str) -> dict:
    out = {"shape": shape, "sides": {}}
    for side in ("base", "new"):
        step, tpot, p50, env = {}, {}, {}, {}
        for f in sorted(glob.glob(f"{directory}/{side}_local_{shape}_*.json")):  # (a process that failed wrote none)
            d = json.load(open(f))
            env = {k: d.get(k) for k in ("device", "jax_version", "commit", "source_hash")}
            for row in d["rows"]:
                if row["variant"] == "default":
                    step.setdefault(row["batch_size"], []).append(row["step_ms"])
        for f in sorted(glob.glob(f"{directory}/{side}_latency_{shape}_*.json")):
            for row in json.load(open(f))["rows"]:
                tpot.setdefault(row["batch_size"], []).append(row["tpot_ms"])
                p50.setdefault(row["batch_size"], []).append(row["tpot_p50_ms"])  # (a slow mean: spikes or not)
        out["sides"][side] = {"env": env, "step_ms": step, "tpot_ms": tpot, "tpot_p50_ms": p50,
                              "step_ms_median": {b: statistics.median(v) for b, v in step.items()},
                              "tpot_ms_median": {b: statistics.median(v) for b, v in tpot.items()}}
    base, new = out["sides"]["base"], out["sides"]["new"]
    out["new_over_base"] = {
        kind: {b: new[kind][b] / base[kind][b] for b in new[kind] if b in base[kind]}
        for kind in ("step_ms_median", "tpot_ms_median")}
    return out


if __name__ == "__main__":
    json.dump(collect(sys.argv[1], sys.argv[2]), sys.stdout, indent=1)
    print()
