"""Kernel micro-benchmarks, one script per kernel group, each a set of subcommands:
`python -m benchmarks.kernels.bench_<group> <subcommand> [options]`."""

import sys
from collections.abc import Callable


def run_subcommand(benchmarks: dict[str, Callable[[list[str]], None]], module: str, doc: str | None,
                   argv: list[str] | None = None) -> None:
    """Run `benchmarks[argv[0]](argv[1:])`; a usage message naming the subcommands otherwise."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in benchmarks:
        raise SystemExit(f"usage: python -m {module} {{{','.join(benchmarks)}}} [options]\n\n{doc}")
    benchmarks[argv[0]](argv[1:])
