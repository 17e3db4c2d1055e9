"""What a profile's kernel is: the instructions of one forward bucket's optimized HLO whose name matches a
pattern, with the computations their fusions call.

    python -m benchmarks.hlo_ops --shape qwen3.5-4b --tokens 1024 --pattern 'wrapped_concatenate|loop_convert_fusion'

Compiles the bucket afresh (no executable cache) with dummy weights; prints to stdout.
"""

from __future__ import annotations

import argparse
import re

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore


def computations(text: str) -> dict[str, str]:
    """Computation name -> its text, from an HLO module's text."""
    out, name, lines = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), [line]
        elif name is not None:
            lines.append(line)
            if line == "}":
                out[name] = "\n".join(lines)
                name = None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3.5-4b")
    ap.add_argument("--tokens", type=int, default=1024, help="the bucket (tokens per step)")
    ap.add_argument("--decode", action="store_true", help="the decode-only variant of the bucket")
    ap.add_argument("--pattern", required=True, help="regex on instruction names (a profile's kernel names)")
    ap.add_argument("--max-matches", type=int, default=3, help="per distinct instruction name")
    ap.add_argument("--max-num-seqs", type=int, default=64, help="the engine's (the bucket's sequence count)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--out", help="also write the whole optimized HLO module here")
    args = ap.parse_args()
    model = args.shape if "/" in args.shape else f"dummy:{args.shape}"
    core = EngineCore(EngineConfig(model=model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                                   warmup=False, executable_cache=False, max_num_batched_tokens=max(args.tokens, 256)))
    runner = core.runner
    T = args.tokens
    compiled = runner.forward_executable(T, runner.seqs_bucket(T), runner.page_buckets[-1], args.decode,
                                         background=True)  # a jax.stages.Compiled, not the lazy jit
    text = compiled.as_text()
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    comps = computations(text)
    pat = re.compile(args.pattern)
    seen: dict[str, int] = {}
    for line in text.splitlines():
        m = re.match(r"^\s+(?:ROOT )?%?([\w.\-]+) = (.*)$", line)
        if not m or not pat.search(m.group(1)):
            continue
        base = re.sub(r"\.\d+$", "", m.group(1))
        seen[base] = seen.get(base, 0) + 1
        if seen[base] > args.max_matches:
            continue
        print(line.strip()[:600])
        called = re.search(r"calls=%?([\w.\-]+)", m.group(2))
        if called and called.group(1) in comps:
            print("\n".join("    " + c[:300] for c in comps[called.group(1)].splitlines()[:40]))
        print()


if __name__ == "__main__":
    main()
