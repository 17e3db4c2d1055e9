"""Wait until a server's /health answers 200 (the GPU run scripts start `jinfer serve` in the background).

    python -m benchmarks.wait_ready [--url http://127.0.0.1:8000/health] [--timeout 400] [--interval 0.2] [--full-speed]

Prints "server ready in N s" and exits 0, or exits 1 after the timeout. `--full-speed`: then also until every replica's
staged warm-up is done (`jinfer_warmup_pending_shapes` 0 in /metrics): a throughput figure taken while shapes still
compile measures the compiles. `wait_ready(url, ...)` is the same wait for a
benchmark that started the server itself (and fails at once if that process exits).
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx


def wait_ready(url: str, timeout: float = 400, interval: float = 0.2, proc=None) -> float | None:
    """Seconds until GET `url` answered 200, or None after `timeout`; RuntimeError if `proc` (a Popen) exits first."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return time.monotonic() - t
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return None


def pending_shapes(metrics_text: str) -> list[float]:
    """Every replica's `jinfer_warmup_pending_shapes` in a Prometheus exposition."""
    return [float(line.rsplit(" ", 1)[1]) for line in metrics_text.splitlines()
            if line.startswith("jinfer_warmup_pending_shapes")]


def wait_full_speed(metrics_url: str, timeout: float, interval: float = 0.5) -> float | None:
    """Seconds until every replica's staged warm-up is done, or None after `timeout`."""
    t = time.monotonic()
    while time.monotonic() - t < timeout:
        try:
            pending = pending_shapes(httpx.get(metrics_url, timeout=2).text)
            if pending and not any(pending):
                return time.monotonic() - t
        except httpx.HTTPError:
            pass
        time.sleep(interval)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000/health")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--full-speed", action="store_true", help="also wait until no shape is left to compile")
    args = ap.parse_args()
    if (waited := wait_ready(args.url, args.timeout, args.interval)) is None:
        print(f"server not ready after {args.timeout:.0f} s", file=sys.stderr)
        return 1
    print(f"server ready in {waited:.1f} s")
    if args.full_speed:
        metrics_url = args.url.rsplit("/", 1)[0] + "/metrics"
        if (more := wait_full_speed(metrics_url, args.timeout)) is None:
            print(f"warm-up not done after {args.timeout:.0f} s more", file=sys.stderr)
            return 1
        print(f"full speed {more:.1f} s later")
    return 0


if __name__ == "__main__":
    sys.exit(main())
