"""Model IDs on the Hugging Face Hub ("Qwen/Qwen3-0.6B") to local directories, through huggingface_hub.

`snapshot_download` does the work, so its conventions hold as a vLLM user knows them: its cache (`HF_HOME`,
`HF_HUB_CACHE`, or `download_dir`), `HF_HUB_OFFLINE=1` (the cache only), `HF_TOKEN` for gated models, and
`revision` (a branch, tag or commit). JAX-free: the tokenizer is resolved this way too.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# A repository ID: NAME or ORG/NAME (what the Hub accepts); anything else that does not exist is a bad path.
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?$")
# What a safetensors checkpoint, its tokenizer and its chat template need: not the .bin / .gguf / ONNX copies
# that many repositories carry besides (often several times the model's size).
# (tokenization_*.py: a tiktoken tokenizer's split pattern is read from it, never run: jinfer/tokenizer_tiktoken.py)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken", "tokenization_*.py"]


def _offline() -> bool:
    from huggingface_hub import constants

    # huggingface_hub reads HF_HUB_OFFLINE once, at import; read it again for a value set later (tests, notebooks).
    env = os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE")
    return bool(constants.HF_HUB_OFFLINE) or env


def is_repo_id(name: str) -> bool:
    """Could `name` be a Hub repository ID (and is it no local path)?"""
    return bool(_REPO_ID.match(name)) and not name.endswith(".gguf") and not Path(name).expanduser().exists()


def resolve_path(name: str, *, revision: str | None = None, download_dir: str | None = None,
                 field: str = "model") -> Path:
    """A local path as it is; a Hub ID as the directory of its snapshot (downloaded unless cached or offline).
    ValueError naming `field` and the ID when neither works."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    if not is_repo_id(name):
        raise ValueError(f"{field}={name!r} does not exist (give a model directory, a .gguf file, dummy:<shape> "
                         "or a Hugging Face model ID such as Qwen/Qwen3-0.6B)")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    offline = _offline()
    cache = download_dir or constants.HF_HUB_CACHE
    try:
        snapshot = snapshot_download(name, revision=revision, cache_dir=download_dir, allow_patterns=ALLOW_PATTERNS,
                                     local_files_only=offline)
    except LocalEntryNotFoundError as e:
        why = "HF_HUB_OFFLINE is set" if offline else f"the Hub could not be reached ({_first_line(e)})"
        raise ValueError(f"{field}={name!r} is neither a local path nor in the Hugging Face cache ({cache}), and "
                         f"{why}: download it once online, or give its directory") from None
    except (HfHubHTTPError, OSError, ValueError) as e:  # not found, gated (HF_TOKEN), bad revision, disk
        rev = f" at revision {revision!r}" if revision else ""
        raise ValueError(f"{field}={name!r}{rev}: {type(e).__name__}: {_first_line(e)}") from None
    log.info("%s %s%s: %s", field, name, f"@{revision}" if revision else "", snapshot)
    return Path(snapshot)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
