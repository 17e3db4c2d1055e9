"""Wait until a server's /health answers 200 (the GPU run scripts start `jinfer serve` in the background).

    python -m benchmarks.wait_ready [--url http://127.0.0.1:8000/health] [--timeout 400] [--interval 0.2]

Prints "server ready in N s" and exits 0, or exits 1 after the timeout. `wait_ready(url, ...)` is the same wait for a
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000/health")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--interval", type=float, default=0.2)
    args = ap.parse_args()
    if (waited := wait_ready(args.url, args.timeout, args.interval)) is None:
        print(f"server not ready after {args.timeout:.0f} s", file=sys.stderr)
        return 1
    print(f"server ready in {waited:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
