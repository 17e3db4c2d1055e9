"""A process of rank > 0 of a multi-process group (jinfer/parallel/multihost.py), headless: it builds the
same engine as process 0, then replays every step process 0 sends until process 0 stops the group.

    python -m jinfer.parallel.worker --config '{"model": ..., "nnodes": 2, "node_rank": 1, ...}'

(`jinfer serve --node-rank R` runs `run_worker` too.) This entry point sits above the engine, so that
multihost.py, which the engine imports, imports nothing of the engine.
"""

from __future__ import annotations

import argparse
import json
import logging

from jinfer.engine.core import EngineConfig, EngineCore
from jinfer.parallel.multihost import Follower


def run_worker(config: EngineConfig) -> int:
    """Build the engine, follow process 0; 0 once process 0 stops the group."""
    core = EngineCore(config)
    if not isinstance(core.group, Follower):
        raise ValueError(f"node_rank={config.node_rank}: only processes of rank > 0 follow process 0")
    return core.group.serve(core.runner)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="jinfer: a process of rank > 0 in a multi-process group")
    parser.add_argument("--config", required=True, help="EngineConfig fields as JSON (nnodes, node_rank, ...)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run_worker(EngineConfig(**json.loads(args.config)))


if __name__ == "__main__":
    raise SystemExit(main())
