"""Hugging Face model IDs (jinfer/weights/hub.py) offline, on a hub cache laid out as huggingface_hub writes it:
models--ORG--NAME/{blobs/<hash>, snapshots/<commit>/<file> -> ../../blobs/<hash>, refs/main}."""

import hashlib
import os
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers

from jinfer import LLM, SamplingParams
from jinfer.config.engine import EngineConfig
from jinfer.engine.builder import _load_tokenizer
from jinfer.weights.hub import resolve_path
from tests.conftest import DATA

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OLD_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


def add_repo(cache: Path, repo_id: str, files: dict[str, bytes], commit: str = COMMIT, main: bool = True) -> Path:
    """One snapshot of `repo_id` in the hub cache `cache`, as snapshot_download leaves it."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(os.path.relpath(blob, (snapshot / name).parent), snapshot / name)
    if main:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)
    return snapshot


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An offline hub cache holding tiny-qwen3 as org/tiny-qwen3 (main, and an older commit)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache = tmp_path / "hub"
    files = {p.name: p.read_bytes() for p in (DATA / "tiny-qwen3").iterdir()}
    add_repo(cache, "org/tiny-qwen3", files)
    add_repo(cache, "org/tiny-qwen3", {"config.json": files["config.json"]}, commit=OLD_COMMIT, main=False)
    return cache


def test_offline_id_resolves_to_its_snapshot(hub):
    path = resolve_path("org/tiny-qwen3", download_dir=str(hub))
    assert path == hub / "models--org--tiny-qwen3" / "snapshots" / COMMIT
    assert (path / "model.safetensors").read_bytes() == (DATA / "tiny-qwen3" / "model.safetensors").read_bytes()
    old = resolve_path("org/tiny-qwen3", revision=OLD_COMMIT, download_dir=str(hub))
    assert old.name == OLD_COMMIT and not (old / "model.safetensors").exists()
    assert resolve_path(str(DATA / "tiny-qwen3")) == DATA / "tiny-qwen3"  # a path stays a path


def test_unknown_id_offline_is_a_clear_error(hub):
    with pytest.raises(ValueError, match=r"model='org/nope' is neither a local path nor in the Hugging Face "
                                         r"cache .*HF_HUB_OFFLINE"):
        resolve_path("org/nope", download_dir=str(hub))
    with pytest.raises(ValueError, match=r"tokenizer='org/nope'"):
        resolve_path("org/nope", download_dir=str(hub), field="tokenizer")
    with pytest.raises(ValueError, match=r"model='\./nope/x' does not exist"):
        resolve_path("./nope/x")  # no ID: never looked up


def test_tokenizer_id_and_chat_template(hub, tmp_path):
    """--tokenizer ORG/NAME from the cache, with --chat-template in place of the tokenizer's own."""
    backend = HFTokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    add_repo(hub, "org/tok", {"tokenizer.json": (tmp_path / "tokenizer.json").read_bytes()})
    template = "{% for m in messages %}<{{ m.content }}>{% endfor %}"
    config = EngineConfig(model="org/tiny-qwen3", tokenizer="org/tok", download_dir=str(hub), chat_template=template)
    tok, path = _load_tokenizer(config, None, None)
    assert path == str(hub / "models--org--tok" / "snapshots" / COMMIT)
    assert tok.encode("hi", add_special_tokens=False) == [1]
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=False) == "<hi>"


def test_llm_from_an_id_in_the_cache(hub):
    """LLM("ORG/NAME") loads from the cache under $HF_HOME-like download_dir; a max_model_len over the model's 512
    positions fails before the weights load, naming both numbers."""
    with pytest.raises(ValueError, match=r"max_model_len=4096 .* max_position_embeddings=512"):
        LLM("org/tiny-qwen3", download_dir=str(hub), max_model_len=4096, compilation_cache_dir="")
    llm = LLM("org/tiny-qwen3", download_dir=str(hub), dtype="float32", enforce_eager=True, block_size=8,
              max_model_len=64, num_pages=16, max_num_seqs=2, max_num_batched_tokens=16)
    assert (llm.engine.model_name, llm.engine.config.page_size) == ("org/tiny-qwen3", 8)
    assert not llm.engine.config.warmup
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=3, temperature=0))[0].outputs[0]
    assert len(out.token_ids) == 3
