"""Wait until a server's /health answers 200 (the GPU run scripts start `jinfer serve` in the background).

    python -m benchmarks.wait_ready [--url http://127.0.0.1:8000/health] [--timeout 400] [--interval 0.2]

Prints "server ready in N s" and exits 0, or exits 1 after the timeout.
"""

from __future__ import annotations

import argparse
import sys
import time

import httpx


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000/health")
    ap.add_argument("--timeout", type=float, default=400)
    ap.add_argument("--interval", type=float, default=0.2)
    args = ap.parse_args()
    t = time.time()
    while time.time() - t < args.timeout:
        try:
            if httpx.get(args.url, timeout=1).status_code == 200:
                print(f"server ready in {time.time() - t:.1f} s")
                return 0
        except httpx.HTTPError:
            pass
        time.sleep(args.interval)
    print(f"server not ready after {args.timeout:.0f} s", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
