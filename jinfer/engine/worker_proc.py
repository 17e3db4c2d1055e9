"""A process of rank > 0 in a multi-process group (`jinfer serve --node-rank R`, headless): build the same engine
as process 0, then replay the steps process 0 sends until it stops the group (jinfer/parallel/multihost.py).

    python -m jinfer.engine.worker_proc --config '{"nnodes": 2, "node_rank": 1, ...}'
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.parallel.multihost import Follower


def run_worker(config: EngineConfig) -> int:
    """Build the engine and follow process 0; the exit status (0: stopped by process 0, 3: a process was lost)."""
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
    sys.exit(main())
