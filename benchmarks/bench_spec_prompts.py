"""Speculative decoding on real prompts at batch 1: each request alone, plain decoding against a speculative config,
greedy, through the offline API (chat template). Reports each mode's median TPOT over the requests, the drafts'
mean acceptance length, the speed-up (plain decode time / speculative decode time, summed over the requests), and
whether every request gave the same tokens both ways (greedy speculation is lossless).

    python -m benchmarks.bench_spec_prompts --model models/SmolLM2-135M-Instruct \
        --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}' --out spec_prompts.json

Prompts: benchmarks/spec_prompts/quote.jsonl (passages to quote and summarise: what n-gram drafting is for). The two
engines run in one process, alternating request by request over `--rounds` rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from benchmarks.common import environment, write_result
from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams

PROMPTS = Path(__file__).parent / "spec_prompts" / "quote.jsonl"


def decode_stats(out) -> tuple[float, int, float | None]:
    """(seconds from the first token to the last, tokens after the first, mean acceptance length) of a request."""
    m = out.metrics
    return m.last_token_time - m.first_token_time, len(out.outputs[0].token_ids) - 1, m.mean_acceptance_length


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    ap.add_argument("--speculative-config", required=True, metavar="JSON")
    ap.add_argument("--prompts", default=str(PROMPTS))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.4, help="each of the two engines'")
    ap.add_argument("--out")
    args = ap.parse_args()

    prompts = [json.loads(line) for line in Path(args.prompts).read_text().splitlines() if line.strip()]
    common = dict(max_model_len=2048, max_num_seqs=1, gpu_memory_utilization=args.gpu_memory_utilization)
    engines = {"plain": LLM(args.model, **common),
               "spec": LLM(args.model, speculative_config=json.loads(args.speculative_config), **common)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in engines.values():  # compile the shapes a request takes
        llm.chat(prompts[0]["messages"], params, use_tqdm=False)
    runs = {mode: [] for mode in engines}
    tokens = {mode: [None] * len(prompts) for mode in engines}
    for _ in range(args.rounds):
        for i, p in enumerate(prompts):
            for mode, llm in engines.items():
                out = llm.chat(p["messages"], params, use_tqdm=False)[0]
                seconds, n, accept = decode_stats(out)
                runs[mode].append({"prompt": i, "decode_s": seconds, "tokens": n, "acceptance_length": accept,
                                   "tpot_ms": seconds / max(n, 1) * 1e3})
                tokens[mode][i] = list(out.outputs[0].token_ids)
    same = [tokens["plain"][i] == tokens["spec"][i] for i in range(len(prompts))]
    summary = {mode: {"tpot_ms_median": statistics.median(r["tpot_ms"] for r in rs),
                      "decode_s": sum(r["decode_s"] for r in rs), "tokens": sum(r["tokens"] for r in rs)}
               for mode, rs in runs.items()}
    accepts = [r["acceptance_length"] for r in runs["spec"] if r["acceptance_length"]]
    result = {"benchmark": "spec_prompts", **environment(), "model": args.model,
              "speculative_config": json.loads(args.speculative_config), "prompts": args.prompts,
              "max_tokens": args.max_tokens, "rounds": args.rounds, "summary": summary,
              "mean_acceptance_length": statistics.mean(accepts) if accepts else None,
              "speedup": summary["plain"]["decode_s"] / summary["spec"]["decode_s"],
              "same_tokens": sum(same), "requests": len(prompts), "runs": runs}
    print(f"plain TPOT {summary['plain']['tpot_ms_median']:.2f} ms, spec {summary['spec']['tpot_ms_median']:.2f} ms "
          f"(median over requests); mean acceptance length {result['mean_acceptance_length']}; speed-up "
          f"{result['speedup']:.2f}x; same tokens {sum(same)} / {len(prompts)}")
    write_result(result, args.out)


if __name__ == "__main__":
    main()
