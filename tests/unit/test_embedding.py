"""Embeddings: the tiny random Qwen3 embedding checkpoint (tests/data/tiny-qwen3-embedding, laid out as
Qwen3-Embedding is) through `LLM.embed` and the engine against HF transformers' pooled vectors
(scripts/make_embedding_golden.py): batched prompts with one across several chunked-prefill steps, a prefix-cache
hit, Matryoshka `dimensions`, and the refusals (generation on an embedding model, embeddings on a generative one,
dimensions beyond the hidden size). One engine for the module."""

import json

import numpy as np
import pytest

from jinfer import LLM, PoolingParams, SamplingParams
from jinfer.config.model import ModelConfig
from jinfer.config.pooling import resolve_runner, sentence_transformers_pooling
from jinfer.engine.pooling import pooling_request
from jinfer.engine.protocol import AddRequest, Outputs, decode, encode
from jinfer.errors import InvalidParam
from jinfer.outputs import EngineOutput
from tests.conftest import DATA

TINY = DATA / "tiny-qwen3-embedding"
ATOL = 2e-5  # float32 against PyTorch float32 on unit vectors (~0.1 per entry)
# The server test (tests/server/test_embeddings_e2e.py) starts its engine alike: it loads these executables. Pages of
# 32 tokens: 4 per sequence, one page-table bucket, so three forward shapes in all (T = 8, 16, 32).
ENGINE = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4, page_size=32,
              num_pages=24, warmup=False)


@pytest.fixture(scope="module")
def golden():
    z = np.load(DATA / "golden" / "tiny-qwen3-embedding.npz")
    n = len([k for k in z.files if k.startswith("prompt_")])
    return z, [z[f"prompt_{i}"].tolist() for i in range(n)], [z[f"embedding_{i}"] for i in range(n)]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(TINY), **ENGINE)


def test_embed_matches_hf_batched_and_chunked(llm, golden):
    z, prompts, want = golden
    assert llm.engine.model_config.pooling  # from the sentence-transformers files (config.json says CausalLM)
    assert max(map(len, prompts)) > 2 * ENGINE["max_num_batched_tokens"]  # the longest takes several steps
    texts = [str(t) for t in z["texts"]]
    inputs = texts + [{"prompt_token_ids": p} for p in prompts[len(texts):]]
    steps = llm.engine.num_steps_total
    outs = llm.embed(inputs)
    assert llm.engine.num_steps_total - steps >= 3
    for out, p, w in zip(outs, prompts, want, strict=True):
        assert out.finished and out.prompt_token_ids == p  # the texts' tokens as HF's tokenizer made them
        np.testing.assert_allclose(out.outputs.embedding, w, atol=ATOL)
        assert abs(np.linalg.norm(out.outputs.embedding) - 1) < 1e-5


def test_prefix_cache_hit_and_dimensions(llm, golden):
    _, prompts, want = golden
    core, out = llm.engine, {}

    def run(*requests):
        for rid, ids, params in requests:
            core.add_request(rid, ids, params)
        while core.has_unfinished_requests():
            out.update({d.request_id: d for d in core.step()})

    run(("again", prompts[-1], PoolingParams()))  # its full pages are cached by the test above
    assert out["again"].num_cached_tokens >= 64 and out["again"].new_token_ids == []
    np.testing.assert_allclose(out["again"].embedding_list(), want[-1], atol=ATOL)
    # (two 5-token prompts: a 16-token step, the shape the server test needs besides the 8- and 32-token ones)
    run(("short", prompts[2], PoolingParams(dimensions=16)), ("full", prompts[2], None))
    short = want[2][:16] / np.linalg.norm(want[2][:16])  # Matryoshka: truncate, then normalise again
    np.testing.assert_allclose(out["short"].embedding_list(), short, atol=ATOL)
    np.testing.assert_allclose(out["full"].embedding_list(), want[2], atol=ATOL)  # (None: the model's task)


def test_refusals(llm):
    core = llm.engine
    with pytest.raises(InvalidParam) as e:
        core.add_request("big", [1, 2], PoolingParams(dimensions=65))
    assert e.value.param == "dimensions" and "64" in str(e.value)
    with pytest.raises(InvalidParam) as e:
        core.add_request("gen", [1, 2], SamplingParams(max_tokens=4))
    assert e.value.param == "model" and "embedding model" in str(e.value)
    with pytest.raises(InvalidParam) as e:  # embeddings asked of a generative model
        pooling_request(PoolingParams(), ModelConfig.from_hf_config(DATA / "tiny-qwen3"))
    assert e.value.param == "model"
    with pytest.raises(InvalidParam) as e:
        PoolingParams(dimensions=0)
    assert e.value.param == "dimensions"
    assert not core.has_unfinished_requests()


def test_runner_resolution(tmp_path):
    gen = ModelConfig.from_hf_config(DATA / "tiny-qwen3")
    assert sentence_transformers_pooling(TINY) == "lasttoken"
    assert sentence_transformers_pooling(DATA / "tiny-qwen3") is None
    assert not resolve_runner("auto", gen, DATA / "tiny-qwen3").pooling
    assert resolve_runner("pooling", gen, DATA / "tiny-qwen3").pooling
    base = json.loads((DATA / "tiny-qwen3" / "config.json").read_text()) | {"architectures": ["Qwen3Model"]}
    assert ModelConfig.from_hf_config(base).pooling  # a base model: an embedding model by itself
    with pytest.raises(ValueError, match="runner='pooling'"):
        resolve_runner("generate", ModelConfig.from_hf_config(base), None)
    (tmp_path / "modules.json").write_text(json.dumps([{"path": "1_Pooling",
                                                        "type": "sentence_transformers.models.Pooling"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    with pytest.raises(ValueError, match="'mean' pooling"):
        resolve_runner("auto", gen, tmp_path)


def test_wire_messages():
    add = decode(encode(AddRequest("r", [1, 2], {}, pooling=PoolingParams(dimensions=8).to_dict())))
    assert PoolingParams(**add.pooling) == PoolingParams(dimensions=8)
    vec = np.array([0.6, -0.8], "<f4")
    out = decode(encode(Outputs([EngineOutput("r", 0, [], "", True, "stop", embedding=vec.tobytes())])))
    assert out.outputs[0].embedding_list() == vec.tolist()
