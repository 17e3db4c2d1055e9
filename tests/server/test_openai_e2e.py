"""End to end: `python -m server.launcher` on the default model (SmolLM2-135M, float32, CPU), driven by
the official `openai` client (chat, completions, responses), raw HTTP and the ZeroMQ client. One server for the
module; the last test kills its engine process."""

import asyncio
import os
import signal
import time

import httpx
import numpy as np
import openai
import pytest

from jinfer.client import EngineClient
from jinfer.sampling_params import SamplingParams
from tests.server.helpers import SMOLLM2_ARGS, metric, smollm2_env, start_server, wait_for

MODEL = "SmolLM2-135M-Instruct"
PARIS = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_gguf, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    args = [*SMOLLM2_ARGS, "--engine-address", f"ipc://{tmp}/engine.sock"]
    srv = start_server(args, tmp, env=smollm2_env(), timeout=900)
    srv.engine_address = f"ipc://{tmp}/engine.sock"
    yield srv
    srv.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def tokenizer(default_gguf):
    from jinfer.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(default_gguf)


def kv_idle(server) -> bool:
    return metric(server.url, "jinfer_kv_cache_usage_ratio") == 0 and \
        metric(server.url, "jinfer_num_requests_running") == 0


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_chat_paris(client, tokenizer):
    r = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=20)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.created > 0
    choice = r.choices[0]
    assert "Paris" in choice.message.content and choice.message.role == "assistant"
    assert choice.finish_reason == "stop"
    prompt = tokenizer.encode(tokenizer.apply_chat_template(PARIS), add_special_tokens=False)
    assert r.usage.prompt_tokens == len(prompt)
    assert 0 < r.usage.completion_tokens < 20
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens

    chunks = list(client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-2])
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.completion_tokens == r.usage.completion_tokens
    assert usage.prompt_tokens == r.usage.prompt_tokens and usage.prompt_tokens_details.cached_tokens == 32
    assert all(c.usage is None for c in chunks[:-1]) and len({c.id for c in chunks}) == 1


def test_responses_paris(client, tokenizer):
    """/v1/responses, plain and streamed: the chat answer, as output items (server/responses.py)."""
    r = client.responses.create(model=MODEL, input="What is the capital of France?", temperature=0,
                                max_output_tokens=20)
    assert r.id.startswith("resp_") and r.status == "completed" and "Paris" in r.output_text
    prompt = tokenizer.encode(tokenizer.apply_chat_template(PARIS), add_special_tokens=False)
    assert r.usage.input_tokens == len(prompt) and 0 < r.usage.output_tokens < 20
    with client.responses.stream(model=MODEL, input=PARIS, temperature=0, max_output_tokens=20) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text and final.usage.output_tokens == r.usage.output_tokens


def test_completions(client, tokenizer):
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.usage.prompt_tokens == len(tokenizer.encode(prompt)) and r.usage.completion_tokens == 8
    assert r.choices[0].finish_reason == "length" and r.choices[0].text
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, temperature=0, max_tokens=8, stream=True))
    assert text == r.choices[0].text
    # token ids and a batch of prompts give the same greedy text
    ids = tokenizer.encode(prompt)
    r2 = client.completions.create(model=MODEL, prompt=[ids, tokenizer.encode("Hello")], temperature=0, max_tokens=8)
    assert [c.index for c in r2.choices] == [0, 1] and r2.choices[0].text == r.choices[0].text
    echo = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=8, echo=True)
    assert echo.choices[0].text == prompt + r.choices[0].text


def test_n_greater_than_one(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", n=3, temperature=1.0, seed=1,
                                  max_tokens=8, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.completion_tokens == 24
    chunks = list(client.chat.completions.create(model=MODEL, messages=PARIS, n=2, max_tokens=8, stream=True))
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=5,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and len(top) >= 3
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy: the chosen one is the best
    assert lp.text_offset == sorted(lp.text_offset)

    c = client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=6, logprobs=True,
                                       top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob, abs=1e-4)

    chunks = list(client.chat.completions.create(model=MODEL, messages=PARIS, temperature=0, max_tokens=6,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t.token for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.content]
    assert streamed == [t.token for t in content]


def test_echo_prompt_logprobs_match_generation_logprobs(client, tokenizer):
    """The prompt logprobs of an echoed prompt (from the prefill's logits) equal the logprobs the same tokens
    had when they were generated one by one (decode steps), as lm-evaluation-harness relies on."""
    prompt = tokenizer.encode("The capital of France is")
    gen = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6, logprobs=2)
    gen_ids = tokenizer.encode(gen.choices[0].text, add_special_tokens=False)
    r = client.completions.create(model=MODEL, prompt=prompt + gen_ids, temperature=0, max_tokens=0, echo=True,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + len(gen_ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and r.usage.completion_tokens == 0
    assert r.choices[0].text == tokenizer.decode(prompt + gen_ids, skip_special_tokens=False)
    assert len(gen_ids) == gen.usage.completion_tokens  # the text re-encodes to the generated tokens
    np.testing.assert_allclose(lp.token_logprobs[len(prompt):], gen.choices[0].logprobs.token_logprobs, atol=2e-3)
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and all(len(t) in (2, 3) for t in lp.top_logprobs[1:])

    # vLLM's `prompt_logprobs` field: the same values, with ranks and texts, on a completion choice and a chat response
    full = prompt + gen_ids
    r2 = client.completions.create(model=MODEL, prompt=full, max_tokens=1, extra_body={"prompt_logprobs": 1})
    plp = r2.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(full)
    for i in range(1, len(full)):
        own = plp[i][str(full[i])]
        assert abs(own["logprob"] - lp.token_logprobs[i]) < 2e-3 and own["rank"] >= 1
        assert own["decoded_token"] == tokenizer.decode([full[i]], skip_special_tokens=False)
        assert any(v["rank"] == 1 for v in plp[i].values())
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    chat_plp = chat.model_extra["prompt_logprobs"]
    assert chat_plp[0] is None and len(chat_plp) == chat.usage.prompt_tokens
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in chat_plp[1:])


def test_stop_strings(client):
    base = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12)
    text = base.choices[0].text
    assert " 6" in text, text
    r = client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=[" 6"])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == text[:text.index(" 6")]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", temperature=0, max_tokens=12, stop=" 6", stream=True))
    assert streamed == r.choices[0].text


def test_48_concurrent_streams(server, tokenizer):
    """More streams than --max-num-seqs (32): some wait for a slot."""
    aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=300)
    prompts = [f"Request {i}: tell me a story about the number {i}." for i in range(48)]

    async def one(prompt):
        stream = await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0.8,
                                                  stream=True, stream_options={"include_usage": True},
                                                  extra_body={"ignore_eos": True})
        text, usage, reasons = "", None, []
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                reasons.append(chunk.choices[0].finish_reason)
            if chunk.usage:
                usage = chunk.usage
        return text, usage, reasons

    async def run():
        try:
            return await asyncio.gather(*map(one, prompts))
        finally:
            await aclient.close()

    t0 = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - t0
    for prompt, (text, usage, reasons) in zip(prompts, results, strict=True):
        assert usage.prompt_tokens == len(tokenizer.encode(prompt))
        assert usage.completion_tokens == 8 and reasons[-1] == "length" and text
    assert wait_for(lambda: kv_idle(server), 60)
    print(f"48 concurrent streams: {elapsed:.1f} s")


def test_client_disconnect_frees_pages(server):
    tokens = metric(server.url, "jinfer_generation_tokens_total")
    body = {"model": MODEL, "messages": PARIS, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=300) as r:
        lines = r.iter_lines()
        while not next(lines).startswith('data: {"id"'):
            pass
        assert metric(server.url, "jinfer_kv_cache_usage_ratio") > 0
    assert wait_for(lambda: kv_idle(server), 60)  # (a step may be compiling a new shape when it comes)
    assert metric(server.url, "jinfer_generation_tokens_total") - tokens < 400


def test_zmq_client_abort_frees_pages(server, tokenizer):
    with EngineClient.connect(server.engine_address, name="test") as zc:
        ids = tokenizer.encode("The capital of France is")
        out = zc.generate(ids, SamplingParams(temperature=0, max_tokens=4))
        assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4

        async def run():
            got = []
            async for d in zc.stream(ids, SamplingParams(max_tokens=300, ignore_eos=True), request_id="zmq-abort"):
                got.append(d)
                if len(got) == 3:
                    assert zc.stats()["kv_usage"] > 0
                    zc.abort("zmq-abort")
            return got

        assert asyncio.run(run())[-1].finish_reason == "abort"
        assert wait_for(lambda: zc.stats()["kv_usage"] == 0 and zc.stats()["num_running"] == 0, 60)


def test_engine_death_fails_fast_and_launcher_exits(server, client):
    """Destructive: keep it last in the module."""
    stream = client.chat.completions.create(model=MODEL, messages=PARIS, max_tokens=400, stream=True,
                                            extra_body={"ignore_eos": True})
    next(iter(stream))
    t0 = time.monotonic()
    os.kill(server.engine_pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 1.0
    assert httpx.get(f"{server.url}/health").status_code == 503
    assert server.proc.wait(15) == 1
    assert "engine died" in server.log()
