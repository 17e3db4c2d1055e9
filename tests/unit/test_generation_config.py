"""--generation-config (vLLM's semantics): defaults from generation_config.json, a request's values win, and
max_new_tokens caps max_tokens; in the server's request parsing and the offline LLM."""

import json

import pytest

from jinfer.generation_config import load_generation_defaults
from jinfer.llm import LLM
from jinfer.sampling_params import SamplingParams
from server.errors import InvalidRequest
from server.validation import ServingContext, parse_completion

from ..conftest import DATA

CONFIG = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 12,
          "do_sample": True, "eos_token_id": [1, 2]}


@pytest.fixture
def gen_dir(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(CONFIG))
    return tmp_path


def test_load(gen_dir):
    want = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "repetition_penalty": 1.1, "max_tokens": 12}
    assert load_generation_defaults(str(gen_dir), None) == want
    assert load_generation_defaults("auto", gen_dir) == want  # the model's directory
    assert load_generation_defaults("auto", gen_dir / "model.gguf") == want  # beside a GGUF file
    assert load_generation_defaults("vllm", gen_dir) == {}
    assert load_generation_defaults("auto", DATA / "tiny-qwen3") == {}  # no sampling fields in it
    assert load_generation_defaults("auto", None) == {}
    with pytest.raises(ValueError, match="generation_config="):
        load_generation_defaults(str(gen_dir / "nope"), None)
    (gen_dir / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match="temperature"):
        load_generation_defaults(str(gen_dir), None)


def test_server_applies_defaults_request_wins():
    ctx = ServingContext(("m",), 64, 100, None, {"temperature": 0.6, "top_k": 20, "max_tokens": 12})
    p = parse_completion({"prompt": [1, 2, 3]}, ctx).params
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 20, 12)  # completions' default 16, capped at 12
    p = parse_completion({"prompt": [1, 2, 3], "temperature": 0, "max_tokens": 5, "top_k": 0}, ctx).params
    assert (p.temperature, p.top_k, p.max_tokens) == (0.0, -1, 5)
    assert parse_completion({"prompt": [1, 2, 3], "max_tokens": 40}, ctx).params.max_tokens == 12  # capped
    assert parse_completion({"prompt": [1] * 58}, ctx).params.max_tokens == 6  # within the context left
    p = parse_completion({"prompt": [1, 2, 3]}, ServingContext(("m",), 64, 100, None)).params
    assert (p.temperature, p.top_k, p.max_tokens) == (1.0, -1, 16)  # no defaults: SamplingParams'
    with pytest.raises(InvalidRequest):
        parse_completion({"prompt": [1, 2, 3], "min_p": 2}, ctx)


def test_llm_default_sampling_params(gen_dir):
    llm = LLM(str(DATA / "tiny-qwen3"), dtype="float32", max_model_len=64, num_pages=32, warmup=False,
              compilation_cache_dir="", generation_config=str(gen_dir))
    sp = llm.get_default_sampling_params()
    assert (sp.temperature, sp.top_p, sp.top_k, sp.repetition_penalty, sp.max_tokens) == (0.6, 0.95, 20, 1.1, 12)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]})[0].outputs[0]
    assert len(out.token_ids) == 12 or out.finish_reason == "stop"
    assert LLM(str(DATA / "tiny-qwen3"), dtype="float32", max_model_len=64, num_pages=32, warmup=False,
               compilation_cache_dir="").get_default_sampling_params() == SamplingParams()  # "auto": nothing there
