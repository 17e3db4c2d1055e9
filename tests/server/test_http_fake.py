"""The HTTP server through `python -m server.launcher` on a fake engine core (fast, no model):
validation errors, auth, overload, disconnects, engine death, clean shutdown."""

import json
import os
import signal
import socket
import time

import httpx
import openai
import pytest

from tests.server.helpers import FAKE_CORE, child_pids, metric, pid_alive, start_server, wait_for

KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
# max_num_seqs 4 + 2 queued = at most 6 sequences in flight; each fake step takes 20 ms
ARGS = ["--core-factory", FAKE_CORE, "--max-model-len", "64", "--max-num-seqs", "4", "--max-queued-requests", "2",
        "--api-key", KEY]
ENV = {"JINFER_FAKE_STEP_DELAY": "0.02"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server(ARGS, tmp_path_factory.mktemp("fake"), env=ENV, timeout=120)
    engine = srv.engine_pid
    yield srv
    assert srv.stop(signal.SIGTERM) == 0, srv.log()[-3000:]  # clean shutdown on SIGTERM...
    assert wait_for(lambda: not pid_alive(engine), 5), "engine process left behind"  # ...of both processes
    assert "shut down cleanly" in srv.log()


def post(server, path, body, headers=AUTH, **kw):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content, headers={**headers, "Content-Type": "application/json"},
                      timeout=30, **kw)


C, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
INVALID = [
    (C, b"{not json", None),
    (C, b"[1, 2]", None),
    (C, {"model": "fake-model"}, "prompt"),
    (C, {"prompt": 123}, "prompt"),
    (C, {"prompt": []}, "prompt"),
    (C, {"prompt": [1, "a"]}, "prompt"),
    (C, {"prompt": [-1, 5]}, "prompt"),
    (C, {"prompt": [10**9]}, "prompt"),
    (C, {"prompt": "hello " * 70}, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": "10"}, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 64}, "max_tokens"),
    (C, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (C, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, "top_p"),
    (C, {"prompt": "hi", "top_p": 1.5}, "top_p"),
    (C, {"prompt": "hi", "n": 0}, "n"),
    (C, {"prompt": "hi", "n": True}, "n"),
    (C, {"prompt": "hi", "n": 7}, "n"),  # more sequences than the server ever takes
    (C, {"prompt": "hi", "logprobs": 50}, "logprobs"),
    (C, {"prompt": "hi", "stop": 5}, "stop"),
    (C, {"prompt": "hi", "stream": "yes"}, "stream"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (C, {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    (C, {"prompt": "hi", "model": "gpt-4"}, "model"),
    (C, {"prompt": "hi", "suffix": "x"}, "suffix"),
    (CHAT, {"model": "fake-model"}, "messages"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": [{"content": "hi"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    (CHAT, {"messages": MSG, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": MSG, "max_tokens": 60}, "max_tokens"),
    (CHAT, {"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
    (CHAT, {"messages": MSG, "logprobs": True, "top_logprobs": 99}, "top_logprobs"),
    (CHAT, {"messages": MSG, "temperature": -1}, "temperature"),
    (CHAT, {"messages": MSG, "tools": [{"type": "function"}]}, "tools[0].function"),
    (CHAT, {"messages": MSG, "model": "nope"}, "model"),
    (C, {"prompt": "hi", "allowed_token_ids": 5}, "allowed_token_ids"),  # vLLM's extra parameters
    (CHAT, {"messages": MSG, "allowed_token_ids": []}, "allowed_token_ids"),
    (CHAT, {"messages": MSG, "bad_words": "x"}, "bad_words"),
    (C, {"prompt": "hi", "bad_words": ["ok", ""]}, "bad_words"),
]


@pytest.mark.parametrize("path,body,param", INVALID, ids=[f"{i}-{p}" for i, (_, _, p) in enumerate(INVALID)])
def test_invalid_request_is_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize("path,body,param,code", [
    (C, {"prompt": "hi", "max_tokens": 64}, "max_tokens", "context_length_exceeded"),
    (C, {"prompt": [7] * 64, "max_tokens": 1}, "prompt", "context_length_exceeded"),
    (C, {"prompt": [[1], [10**6]], "max_tokens": 1}, "prompt", None),  # the second prompt: not in the vocabulary
    (C, {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias", None),
    (CHAT, {"messages": MSG, "allowed_token_ids": [1, 10**6]}, "allowed_token_ids", None),
    (CHAT, {"messages": MSG, "max_completion_tokens": 60}, "max_completion_tokens", "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": "hello " * 70}], "max_tokens": 1}, "messages",
     "context_length_exceeded"),
])
def test_engine_refusal_is_400_naming_the_request_field(server, path, body, param, code):
    """The engine checks prompts against the model (vocabulary, context length); its InvalidParam reaches the
    body with the endpoint's own name for the field and OpenAI's code."""
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"], err["type"]) == (param, code, "invalid_request_error"), err
    assert err["message"]


def test_bad_max_tokens_is_400_with_its_param(server):
    """SamplingParams' InvalidParam (built once, in the server) names max_tokens; no message parsing."""
    r = post(server, C, {"prompt": "hi", "max_tokens": -3})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "max_tokens" and "max_tokens=-3" in r.json()["error"]["message"]


def test_image_in_chat_is_a_clear_400(server):
    part = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    r = post(server, CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, part]}]})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "messages[0].content" and "images" in err["message"] and "image_url" in err["message"]


def test_server_healthy_and_idle_after_invalid_requests(server):
    before = metric(server.url, "jinfer_requests_total")
    assert all(post(server, path, body).status_code == 400 for path, body, _ in INVALID)
    assert post(server, C, {"prompt": "hi", "max_tokens": 3}).json()["usage"]["completion_tokens"] == 3
    assert metric(server.url, "jinfer_requests_total") >= before + len(INVALID)
    assert metric(server.url, "jinfer_num_requests_running") == 0


def test_unknown_route_and_method(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    assert httpx.get(f"{server.url}{C}").status_code == 405


def test_api_key(server):
    assert post(server, C, {"prompt": "hi"}, headers={}).status_code == 401
    r = post(server, C, {"prompt": "hi"}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]["id"] == "fake-model"
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/version").json()["version"]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong").completions.create(model="fake-model", prompt="x")


def test_overload_is_503_with_retry_after(server):
    body = {"prompt": "hi", "max_tokens": 40, "n": 6, "stream": True}  # fills all 6 slots for ~0.8 s
    with httpx.stream("POST", f"{server.url}{C}", json=body, headers=AUTH, timeout=30) as busy:
        assert busy.status_code == 200
        r = post(server, C, {"prompt": "hi", "max_tokens": 1})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        busy.read()
    assert post(server, C, {"prompt": "hi", "max_tokens": 1}).status_code == 200
    assert metric(server.url, 'jinfer_requests_total{endpoint="completions",status="overloaded"}') >= 1


ABORTED = 'jinfer_requests_total{endpoint="completions",status="aborted"}'


def test_stream_disconnect_aborts_in_engine(server):
    aborted, tokens = metric(server.url, ABORTED), metric(server.url, "jinfer_generation_tokens_total")
    body = {"prompt": "hi", "max_tokens": 60, "n": 2, "stream": True}  # 1.2 s if left alone
    with httpx.stream("POST", f"{server.url}{C}", json=body, headers=AUTH, timeout=30) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        assert metric(server.url, "jinfer_num_requests_running") == 2
    assert wait_for(lambda: metric(server.url, "jinfer_kv_cache_usage_ratio") == 0
                    and metric(server.url, "jinfer_num_requests_running") == 0, 10)
    assert wait_for(lambda: metric(server.url, ABORTED) == aborted + 1, 5)
    assert metric(server.url, "jinfer_generation_tokens_total") - tokens < 2 * 60  # stopped early


def test_non_streaming_disconnect_aborts_in_engine(server):
    aborted, tokens = metric(server.url, ABORTED), metric(server.url, "jinfer_generation_tokens_total")
    host, port = server.url.removeprefix("http://").split(":")
    body = json.dumps({"prompt": "hi", "max_tokens": 60}).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        assert wait_for(lambda: metric(server.url, "jinfer_num_requests_running") == 1, 5)
    assert wait_for(lambda: metric(server.url, "jinfer_num_requests_running") == 0, 10)
    assert wait_for(lambda: metric(server.url, ABORTED) == aborted + 1, 5)
    assert metric(server.url, "jinfer_generation_tokens_total") - tokens < 60


def test_engine_death(tmp_path):
    srv = start_server(["--core-factory", FAKE_CORE, "--max-model-len", "64"], tmp_path, env=ENV, timeout=120)
    try:
        engine = srv.engine_pid
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="fake-model", prompt="hi", max_tokens=60, stream=True)
        next(iter(stream))
        t0 = time.monotonic()
        assert child_pids(srv.proc.pid) == [engine]
        os.kill(engine, signal.SIGKILL)
        with pytest.raises(openai.APIError):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 1.0
        r = httpx.get(f"{srv.url}/health")
        assert r.status_code == 503 and r.json()["status"] == "unhealthy"
        r = httpx.post(f"{srv.url}{C}", json={"prompt": "hi"})
        assert r.status_code == 503
        assert srv.proc.wait(15) != 0
    finally:
        if srv.proc.poll() is None:
            srv.stop(signal.SIGKILL)



VLLM_NAMES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
              "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:prefix_cache_queries_total",
              "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
              "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
              "vllm:e2e_request_latency_seconds_bucket", "vllm:request_success_total")


def test_vllm_metric_names(server):
    """vLLM's names and label sets beside jinfer's, for vLLM's dashboards and routers (server/metrics.py)."""
    from prometheus_client.parser import text_string_to_metric_families

    before = metric(server.url, "vllm:generation_tokens_total")
    assert post(server, C, {"prompt": [5, 6, 7], "max_tokens": 3}).status_code == 200
    samples = [s for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics", timeout=10).text)
               for s in f.samples]
    labels = {"model_name": "fake-model", "engine": "0"}
    for name in VLLM_NAMES:
        found = [s.labels for s in samples if s.name == name]
        assert found and all(lab.items() >= labels.items() for lab in found), name
    success = {s.labels["finished_reason"]: s.value for s in samples if s.name == "vllm:request_success_total"}
    assert success.keys() == {"stop", "length", "abort", "error"} and success["length"] >= 1  # all from the start
    ttft_le = [s.labels["le"] for s in samples if s.name == "vllm:time_to_first_token_seconds_bucket"]
    assert ttft_le[-2:] == ["2560.0", "+Inf"] and len(ttft_le) == 23  # vLLM's 22 boundaries
    assert not any(s.name.startswith("vllm:spec_decode") for s in samples)  # only with speculative decoding
    assert metric(server.url, "vllm:generation_tokens_total") == before + 3
    assert metric(server.url, "jinfer_e2e_request_latency_seconds_count") == \
        metric(server.url, "vllm:e2e_request_latency_seconds_count") >= 1  # one observation feeds both families
