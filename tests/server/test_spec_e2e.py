"""`jinfer serve --speculative-config '{"method": "ngram", ...}'` end to end on the tiny random Qwen3: completions at
batch 1 and 8 (concurrent, mixed prompt lengths, a KV pool small enough to preempt) give the tokens the engine gives
without speculation, and /metrics carries the spec_decode counters (drafts both accepted and rejected)."""

import json
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from jinfer.config.engine import EngineConfig
from jinfer.engine.core import EngineCore
from jinfer.sampling_params import SamplingParams
from tests.conftest import DATA
from tests.server.helpers import metric, start_server
from tests.unit.test_engine import BASE
from tests.unit.test_spec_engine import NGRAM, spec_prompts

TINY = str(DATA / "tiny-qwen3")
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spec")
    args = [TINY, "--dtype", "float32", "--max-model-len", "128", "--max-num-batched-tokens", "64",
            "--max-num-seqs", "16", "--page-size", "4", "--num-pages", "40", "--no-warmup",
            "--compilation-cache-dir", "", "--speculative-config", json.dumps(NGRAM)]
    srv = start_server(args, tmp, timeout=600)
    yield srv
    srv.stop(signal.SIGTERM)


def complete(url: str, prompt: list[int]) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": TINY, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


def reference(prompts: list[list[int]]) -> list[list[int]]:
    core = EngineCore(EngineConfig(TINY, **BASE))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(str(i), p, params)
    out: dict[str, list[int]] = {}
    while core.has_unfinished_requests():
        for d in core.step():
            out.setdefault(d.request_id, []).extend(d.new_token_ids)
    return [out[str(i)] for i in range(len(prompts))]


def test_server_outputs_equal_without_speculation_and_metrics(server):
    prompts = spec_prompts(9, seed=31)
    want = reference(prompts)
    assert complete(server.url, prompts[0]) == want[0]  # batch 1
    with ThreadPoolExecutor(8) as pool:  # batch 8, arriving together
        got = list(pool.map(lambda p: complete(server.url, p), prompts[1:]))
    assert got == want[1:]
    drafted = metric(server.url, "jinfer_spec_decode_num_draft_tokens_total")
    accepted = metric(server.url, "jinfer_spec_decode_num_accepted_tokens_total")
    assert metric(server.url, "jinfer_spec_decode_num_drafts_total") > 0 and 0 < accepted < drafted
    assert metric(server.url, "jinfer_spec_decode_num_accepted_tokens_per_pos_total") == accepted


def test_bad_speculative_config_is_a_clear_cli_error(tmp_path):
    with pytest.raises(RuntimeError, match="prompt_lookup_min"):
        start_server([TINY, "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2, '
                      '"prompt_lookup_min": 0}'], tmp_path, timeout=60)
