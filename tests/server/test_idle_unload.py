"""`jinfer serve --executable-keep-alive`: an idle server drops the step shapes beyond its staged warm-up's first one
that requests did not use last (its engine loop does, while idle), says so in /metrics and its log, and still answers
(padded into the loaded shape) with the same tokens as once the shape is loaded again."""

import signal

import httpx

from tests.conftest import DATA
from tests.server.helpers import metric, start_server, wait_for

TINY = str(DATA / "tiny-llama")


def complete(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=120, json={
        "model": TINY, "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]["tokens"]


def test_idle_server_drops_shapes_and_still_serves(tmp_path):
    args = [TINY, "--dtype", "float32", "--max-model-len", "128", "--max-num-batched-tokens", "16",
            "--max-num-seqs", "8", "--page-size", "4", "--warmup-first-tokens", "8", "--executable-keep-alive", "1",
            "--compilation-cache-dir", str(tmp_path / "cache")]
    srv = start_server(args, tmp_path, timeout=600)
    try:
        prompt = list(range(3, 23))  # 20 tokens: more than the first shape's 8
        assert wait_for(lambda: metric(srv.url, "jinfer_warmup_pending_shapes") == 0, timeout=300)
        # idle after the warm-up: the 16-token shape, which no request used, is dropped
        assert wait_for(lambda: metric(srv.url, "jinfer_executable_unloads") >= 1, timeout=60)
        assert "unloaded the executables of 1 bucket(s) idle for 1 s: 16" in srv.log()
        padded = complete(srv.url, prompt)  # in steps of 8 tokens
        compiles = metric(srv.url, "jinfer_compiles_after_warmup")  # (the logprobs sampler: compiled on first use)
        # a long prompt's 15 steps at the 8-token budget want the 16-token shape: it is loaded again (from disk)
        complete(srv.url, list(range(130, 250)))  # (no prefix in common with `prompt`)
        assert wait_for(lambda: metric(srv.url, "jinfer_executable_reloads") >= 1, timeout=120)
        assert complete(srv.url, prompt) == padded
        assert metric(srv.url, "jinfer_compiles_after_warmup") == compiles  # nothing compiled for either
    finally:
        assert srv.stop(signal.SIGTERM) == 0
