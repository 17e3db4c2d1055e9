"""`jinfer serve` on the tiny Qwen3 embedding checkpoint, driven by the official openai client's
`embeddings.create`: a string, a batch of strings and token ids, `dimensions`, base64; against HF's vectors
(tests/data/golden/tiny-qwen3-embedding.npz). Then the refusals, each a 400 naming its field. One server."""

import base64
import signal

import httpx
import numpy as np
import openai
import pytest

from tests.conftest import DATA
from tests.server.helpers import metric, start_server
from tests.unit.test_embedding import ATOL, ENGINE

TINY = str(DATA / "tiny-qwen3-embedding")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("embed")
    flags = {k: v for k, v in ENGINE.items() if k != "warmup"}  # (as the unit test's: its executables are reused)
    args = [TINY, "--no-warmup"] + [a for k, v in flags.items() for a in (f"--{k.replace('_', '-')}", str(v))]
    srv = start_server(args, tmp, timeout=600)
    yield srv
    srv.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def golden():
    z = np.load(DATA / "golden" / "tiny-qwen3-embedding.npz")
    return [str(t) for t in z["texts"]], [z[f"prompt_{i}"].tolist() for i in range(5)], \
        [z[f"embedding_{i}"] for i in range(5)]


def test_embeddings_create(client, server, golden):
    texts, prompts, want = golden
    one = client.embeddings.create(model=TINY, input=texts[0])
    assert len(one.data) == 1 and one.data[0].index == 0 and one.model == TINY
    np.testing.assert_allclose(one.data[0].embedding, want[0], atol=ATOL)
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(prompts[0])
    # a batch of strings, and one of token-id lists (the longest across several chunked-prefill steps)
    batch = client.embeddings.create(model=TINY, input=texts)
    ids = client.embeddings.create(model=TINY, input=prompts[2:])
    got = [d.embedding for d in batch.data + ids.data]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=ATOL)
    assert ids.usage.prompt_tokens == sum(map(len, prompts[2:]))
    short = client.embeddings.create(model=TINY, input=[prompts[4]], dimensions=16)
    np.testing.assert_allclose(short.data[0].embedding, want[4][:16] / np.linalg.norm(want[4][:16]), atol=ATOL)
    # base64: float32 little-endian bytes (the openai client decodes them itself unless asked for the raw form)
    raw = httpx.post(f"{server.url}/v1/embeddings", json={"input": texts[1], "encoding_format": "base64"}).json()
    vec = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), "<f4")
    np.testing.assert_allclose(vec, want[1], atol=ATOL)
    decoded = client.embeddings.create(model=TINY, input=texts[1], encoding_format="base64")
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(decoded.data[0].embedding), "<f4")
                               if isinstance(decoded.data[0].embedding, str) else decoded.data[0].embedding,
                               want[1], atol=ATOL)
    assert metric(server.url, 'jinfer_requests_total{endpoint="embeddings",status="success"}') == 6


def test_refusals(client):
    cases = [(dict(input="x", dimensions=65), "dimensions"), (dict(input=[]), "input"),
             (dict(input=[[1, 2], "x"]), "input"), (dict(input=[1, 300]), "input"),
             (dict(input="x", encoding_format="int8"), "encoding_format"), (dict(input="x", model="other"), "model")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.embeddings.create(**({"model": TINY} | kw))
        assert e.value.body["param"] == param, (kw, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:  # an embedding model does not generate
        client.completions.create(model=TINY, prompt="x", max_tokens=2)
    assert e.value.body["param"] == "model" and "/v1/embeddings" in e.value.body["message"]
