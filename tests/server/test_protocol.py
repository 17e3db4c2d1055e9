"""The engine wire protocol: every message round-trips; anything else is a ProtocolError."""

import pickle

import msgpack
import numpy as np
import pytest

from jinfer.engine.protocol import (
    Abort,
    AddRequest,
    EngineError,
    EngineReady,
    Hello,
    Outputs,
    ProtocolError,
    Rejected,
    Shutdown,
    Stats,
    StatsRequest,
    decode,
    encode,
)
from jinfer.outputs import EngineOutput
from jinfer.sampling_params import SamplingParams

MESSAGES = [
    Hello("server"),
    EngineReady("m", 512, 49152, 64, 1234, "/tmp/x.gguf", [2, 0]),
    EngineReady("m", 512, 49152, 64, 1234, None, []),
    AddRequest("r1", [1, 2, 3, 2**31 - 1], SamplingParams(n=2, stop=["\n"], seed=3, logprobs=2).to_dict()),
    Abort(["a", "b"]),
    Rejected("r1", "max_tokens=0 must be >= 1"),
    Outputs([EngineOutput("r1", 0, [5, 6], "hé", new_logprobs=[{5: -0.1, 7: -2.5}, {6: -0.0}],
                          num_prompt_tokens=3, num_cached_tokens=16),
             EngineOutput("r1", 1, [], "", finished=True, finish_reason="stop", stop_reason="\n"),
             EngineOutput("r2", 0, [2], "", finished=True, finish_reason="stop", stop_reason=2),
             EngineOutput("r3", 0, [], "", finished=True, finish_reason="error", error="boom"),
             EngineOutput("r4", 0, [1], "a", prompt_logprobs=[None, {3: -1.5, 9: -0.25}, {4: -0.0}]),
             EngineOutput("r5", 0, [1], "a", prompt_logprobs=[None])]),
    StatsRequest(7),
    Stats({"kv_usage": 0.25, "num_running": 3}, 7),
    Shutdown(),
    EngineError("engine shut down"),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    assert decode(encode(msg)) == msg


def test_sampling_params_round_trip():
    params = SamplingParams(n=3, temperature=0.5, top_k=5, stop="x", stop_token_ids=[1], max_tokens=None,
                            prompt_logprobs=2, logit_bias={"7": -1.5, 3: 100})
    assert SamplingParams(**decode(encode(AddRequest("r", [1], params.to_dict()))).params) == params


def test_token_ids_are_packed_int32():
    frame = encode(AddRequest("r", list(range(1000)), {}))
    tag, body = msgpack.unpackb(frame, raw=False)
    assert tag == "add" and isinstance(body["prompt_token_ids"], bytes)
    assert np.frombuffer(body["prompt_token_ids"], "<i4").tolist() == list(range(1000))
    assert len(frame) < 4100


@pytest.mark.parametrize("frame", [
    b"",
    b"\xc1",  # never-used msgpack byte
    b"garbage that is not msgpack at all \x00\xff",
    pickle.dumps(Hello()),  # a pickle is just bytes to us: refused, never loaded
    msgpack.packb(["hello"]),
    msgpack.packb({"hello": {}}),
    msgpack.packb(["no_such_tag", {}]),
    msgpack.packb(["hello", {"client_name": "x"}]),  # missing field
    msgpack.packb(["hello", {"client_name": "x", "protocol_version": 1, "evil": 1}]),  # extra field
    msgpack.packb(["hello", {"client_name": 5, "protocol_version": 1}]),  # wrong type
    msgpack.packb(["hello", {"client_name": "x", "protocol_version": True}]),  # bool is not an int
    msgpack.packb(["add", {"request_id": "r", "prompt_token_ids": b"\x01\x02\x03", "params": {}}]),  # 3 bytes
    msgpack.packb(["add", {"request_id": "r", "prompt_token_ids": [1, 2], "params": {}}]),  # not packed
    msgpack.packb(["add", {"request_id": "r", "prompt_token_ids": b"", "params": {"a": {"b": 1}}}]),
    msgpack.packb(["abort", {"request_ids": ["a", 3]}]),
    msgpack.packb(["outputs", {"outputs": [["r", 0]]}]),
    msgpack.packb(["stats", {"stats": {"a": "b"}, "token": 0}]),
    msgpack.packb(["hello", {"client_name": msgpack.ExtType(1, b"x"), "protocol_version": 1}]),
    msgpack.packb([{1: 2}, {}]),
])
def test_garbage_is_refused(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        encode({"type": "hello"})
