"""The engine wire protocol: typed messages between clients and the engine process, over ZeroMQ.

Every message is a frozen `msgspec.Struct`; one message is one frame, a msgpack map of its fields with a
`type` tag (the deltas inside `Outputs` are positional arrays: `EngineOutput` is itself a Struct). Decoding is
msgspec's typed msgpack decoder over the tagged union of the messages, so a frame that is not msgpack, has an
unknown tag, lacks a required field, carries an unknown one or a value of the wrong type (a bool is not an
int, a float is not an int, no extension types, nothing nested deeper than the annotations) raises
`ProtocolError`. The decoder builds only these Structs and plain values: a frame is data, never code (no
pickle on any socket). Range checks beyond types (ids in the vocabulary, sampling parameters) are the
engine's: it answers them with `Rejected`, which a dropped frame could not.

Topology: the engine binds one ROUTER socket; each client connects a DEALER. A client says `Hello`
and gets `EngineReady` (or `EngineError`); then it sends `AddRequest` / `Abort` / `StatsRequest` /
`Shutdown` and receives `Outputs` (per-step deltas of its own requests), `Rejected` (a request that
could not be added), `Stats` and, when the engine goes down, `EngineError`.
"""

from __future__ import annotations

from typing import Any

import msgspec
import numpy as np

from jinfer.outputs import EngineOutput

PROTOCOL_VERSION = 4  # 3: msgspec Structs, maps with a "type" tag, token ids as msgpack int arrays; 4: Rejected.param
MAX_FRAME_BYTES = 256 << 20

Scalar = bool | int | float | str | None
Param = Scalar | list[Scalar | list[Scalar]]  # a list of scalars or of pairs (logit_bias); nothing deeper


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol."""


class _Message(msgspec.Struct, frozen=True, forbid_unknown_fields=True, tag_field="type"):
    """Base of the messages: frozen, a `type` tag per frame, unknown fields refused."""


class Hello(_Message, tag="hello"):
    """Client -> engine: first message on a connection; answered by EngineReady."""

    client_name: str = ""
    protocol_version: int = PROTOCOL_VERSION


class EngineReady(_Message, tag="ready"):
    """Engine -> client: what the engine serves."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    pid: int
    tokenizer_path: str | None = None  # where a client can load the same tokenizer (same host)
    eos_token_ids: list[int] = []
    protocol_version: int = PROTOCOL_VERSION
    generation_defaults: dict[str, int | float] = {}  # from generation_config.json
    chat_template: str | None = None  # the engine's chat_template= in place of the tokenizer's own
    embedding_size: int = 0  # an embedding model (runner pooling): the length of its vectors; 0: a generative model


class AddRequest(_Message, tag="add"):
    """Client -> engine. `params` is `SamplingParams.to_dict()`, or for an embedding request `pooling` is
    `PoolingParams.to_dict()` (and `params` empty); the engine validates them (-> Rejected)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Param]
    pooling: dict[str, Param] | None = None


class Abort(_Message, tag="abort"):
    request_ids: list[str]


class Rejected(_Message, tag="rejected"):
    """Engine -> client: the request was not added (bad parameters, too long...); nothing ran. `param` and `code`
    are those of the engine's `jinfer.errors.InvalidParam`, which the client raises again (the HTTP body's)."""

    request_id: str
    message: str
    param: str | None = None  # the request field at fault
    code: str | None = None  # e.g. "context_length_exceeded"


class Outputs(_Message, tag="outputs"):
    """Engine -> client: the deltas of one engine step for this client's requests."""

    outputs: list[EngineOutput]


class StatsRequest(_Message, tag="stats_request"):
    token: int = 0  # echoed back in Stats to match the answer


class Stats(_Message, tag="stats"):
    """Engine -> client: `EngineCore.stats()`; pushed periodically (token 0) or answering a request."""

    stats: dict[str, int | float]
    token: int = 0


class Shutdown(_Message, tag="shutdown"):
    """Client -> engine: finish the loop and exit."""


class EngineError(_Message, tag="error"):
    """Engine -> client: the engine failed to start or is going down; every request of it is lost."""

    message: str


Message = (Hello | EngineReady | AddRequest | Abort | Rejected | Outputs | StatsRequest | Stats | Shutdown
           | EngineError)


def _enc_hook(obj: Any) -> Any:
    """numpy scalars and arrays (a token id from the sampler, a stat) as plain values; anything else fails."""
    if isinstance(obj, np.generic | np.ndarray):
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
_DECODER = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    """One message -> one frame."""
    if not isinstance(msg, _Message):
        raise TypeError(f"not a protocol message: {type(msg).__name__}")
    return _ENCODER.encode(msg)


def decode(frame: bytes) -> Message:
    """One frame -> one message; ProtocolError for anything that is not exactly a valid message."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        return _DECODER.decode(frame)
    except msgspec.DecodeError as e:  # ValidationError (wrong type, missing/unknown field) is a DecodeError
        raise ProtocolError(f"invalid frame: {e}") from None
