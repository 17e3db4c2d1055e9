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
    Rejected("r1", "the prompt (9 tokens) + max_tokens (60) exceeds it", "max_tokens", "context_length_exceeded"),
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


def test_frame_is_a_tagged_map_with_int_arrays():
    frame = encode(AddRequest("r", list(range(1000)), {"seed": 2**63 - 1}))
    body = msgpack.unpackb(frame, raw=False)
    assert body["type"] == "add" and body["prompt_token_ids"] == list(range(1000))
    assert len(frame) < 2700  # msgpack ints: 1-3 bytes each here


def test_numpy_values_are_encoded_as_plain_values():
    """A token id or logprob straight from numpy must not make the engine's send fail."""
    out = EngineOutput("r", 0, [np.int32(5)], "x", new_logprobs=[{np.int64(5): np.float32(-0.5)}],
                       stop_reason=np.int64(2))
    assert decode(encode(Outputs([out]))) == Outputs([EngineOutput("r", 0, [5], "x", new_logprobs=[{5: -0.5}],
                                                                   stop_reason=2)])
    assert decode(encode(Stats({"kv": np.float64(0.5), "n": np.int64(3)}))).stats == {"kv": 0.5, "n": 3}


ROW = ["r", 0, [1], "a", False, None, None, None, 0, 0, None, None, 0, 0, 0]  # an EngineOutput on the wire
pack = msgpack.packb


@pytest.mark.parametrize("frame", [
    b"",
    b"\xc1",  # never-used msgpack byte
    b"garbage that is not msgpack at all \x00\xff",
    pickle.dumps(Hello()),  # a pickle is just bytes to us: refused, never loaded
    pack(["hello", {"client_name": "x"}]),  # protocol 2's frame
    pack({"client_name": "x"}),  # no tag
    pack({"type": "no_such_tag"}),
    pack({"type": "hello", "client_name": "x", "evil": 1}),  # unknown field
    pack({"type": "hello", "client_name": 5}),  # wrong type
    pack({"type": "hello", "protocol_version": True}),  # bool is not an int
    pack({"type": "hello", "protocol_version": 3.0}),  # nor is a float
    pack({"type": "hello", "client_name": msgpack.ExtType(1, b"x")}),
    pack({"type": "hello"}) + b"\x00",  # trailing bytes
    pack({"type": "ready", "max_model_len": 1, "vocab_size": 1, "max_num_seqs": 1, "pid": 1}),  # missing field
    pack({"type": "add", "request_id": "r", "prompt_token_ids": b"\x01\x00\x00\x00", "params": {}}),  # packed
    pack({"type": "add", "request_id": "r", "prompt_token_ids": [1, "2"], "params": {}}),
    pack({"type": "add", "request_id": "r", "prompt_token_ids": [1], "params": {"a": {"b": 1}}}),  # a map
    pack({"type": "add", "request_id": "r", "prompt_token_ids": [1], "params": {"a": [[[1]]]}}),  # too deep
    pack({"type": "add", "request_id": "r", "prompt_token_ids": [1], "params": {1: 2}}),  # int key
    pack({"type": "abort", "request_ids": ["a", 3]}),
    pack({"type": "outputs", "outputs": [["r", 0]]}),  # an output missing fields
    pack({"type": "outputs", "outputs": [[*ROW, 1]]}),  # ... or with one too many
    pack({"type": "outputs", "outputs": [[*ROW[:7], [{"5": -0.5}], *ROW[8:]]]}),  # logprob keyed by a string
    pack({"type": "outputs", "outputs": [[*ROW[:7], [{5: "x"}], *ROW[8:]]]}),  # a logprob that is a string
    pack({"type": "stats", "stats": {"a": "b"}}),
    pack([{1: 2}, {}]),
])
def test_garbage_is_refused(frame):
    with pytest.raises(ProtocolError):
        decode(frame)


def test_frames_of_the_wrong_kind_or_size_are_refused(monkeypatch):
    with pytest.raises(ProtocolError, match="must be bytes"):
        decode("hello")
    monkeypatch.setattr("jinfer.engine.protocol.MAX_FRAME_BYTES", 10)
    with pytest.raises(ProtocolError, match="exceeds"):
        decode(encode(Hello("a longer client name")))


def test_encode_refuses_non_messages():
    with pytest.raises(TypeError):
        encode({"type": "hello"})
