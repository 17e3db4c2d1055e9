"""The engine wire protocol: typed messages between clients and the engine process, over ZeroMQ.

One message is one frame: msgpack of `[tag, {field: value}]`. Token ids travel as packed little-endian
int32 bytes, logprobs as packed float64 bytes. Decoding checks the tag and every field's type and
raises `ProtocolError` on anything else: a frame is data, never code (no pickle on any socket).

Topology: the engine binds one ROUTER socket; each client connects a DEALER. A client says `Hello`
and gets `EngineReady` (or `EngineError`); then it sends `AddRequest` / `Abort` / `StatsRequest` /
`Shutdown` and receives `Outputs` (per-step deltas of its own requests), `Rejected` (a request that
could not be added), `Stats` and, when the engine goes down, `EngineError`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import msgpack
import numpy as np

from jinfer.outputs import EngineOutput

PROTOCOL_VERSION = 2
_INT32 = np.dtype("<i4")
_FLOAT64 = np.dtype("<f8")
MAX_FRAME_BYTES = 256 << 20


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol."""


# ---- messages --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    """Client -> engine: first message on a connection; answered by EngineReady."""

    client_name: str = ""
    protocol_version: int = PROTOCOL_VERSION


@dataclass(frozen=True)
class EngineReady:
    """Engine -> client: what the engine serves."""

    model_name: str
    max_model_len: int
    vocab_size: int
    max_num_seqs: int
    pid: int
    tokenizer_path: str | None = None  # where a client can load the same tokenizer (same host)
    eos_token_ids: list[int] = field(default_factory=list)
    protocol_version: int = PROTOCOL_VERSION
    generation_defaults: dict[str, float] = field(default_factory=dict)  # from generation_config.json


@dataclass(frozen=True)
class AddRequest:
    """Client -> engine. `params` is `SamplingParams.to_dict()`; the engine validates it (-> Rejected)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]


@dataclass(frozen=True)
class Abort:
    request_ids: list[str]


@dataclass(frozen=True)
class Rejected:
    """Engine -> client: the request was not added (bad parameters, too long...); nothing ran."""

    request_id: str
    message: str


@dataclass(frozen=True)
class Outputs:
    """Engine -> client: the deltas of one engine step for this client's requests."""

    outputs: list[EngineOutput]


@dataclass(frozen=True)
class StatsRequest:
    token: int = 0  # echoed back in Stats to match the answer


@dataclass(frozen=True)
class Stats:
    """Engine -> client: `EngineCore.stats()`; pushed periodically (token 0) or answering a request."""

    stats: dict[str, float]
    token: int = 0


@dataclass(frozen=True)
class Shutdown:
    """Client -> engine: finish the loop and exit."""


@dataclass(frozen=True)
class EngineError:
    """Engine -> client: the engine failed to start or is going down; every request of it is lost."""

    message: str


Message = (Hello | EngineReady | AddRequest | Abort | Rejected | Outputs | StatsRequest | Stats | Shutdown
           | EngineError)


# ---- field codecs: (encode, decode) ------------------------------------------------------------------


def _fail(name: str, value: Any, want: str) -> ProtocolError:
    return ProtocolError(f"field {name!r}: expected {want}, got {type(value).__name__}")


def _dec_str(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise _fail(name, v, "a string")
    return v


def _dec_int(v: Any, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise _fail(name, v, "an integer")
    return v


def _dec_bool(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise _fail(name, v, "a bool")
    return v


def _dec_number(v: Any, name: str) -> float:
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise _fail(name, v, "a number")
    return v


def _optional(dec: Callable[[Any, str], Any]) -> Callable[[Any, str], Any]:
    return lambda v, name: None if v is None else dec(v, name)


def pack_ids(ids: Any) -> bytes:
    return np.asarray(ids, dtype=_INT32).tobytes()


def unpack_ids(v: Any, name: str = "ids") -> list[int]:
    if not isinstance(v, bytes) or len(v) % 4:
        raise _fail(name, v, "packed int32 bytes")
    return np.frombuffer(v, dtype=_INT32).tolist()


def _dec_str_list(v: Any, name: str) -> list[str]:
    if not isinstance(v, list):
        raise _fail(name, v, "a list of strings")
    return [_dec_str(x, name) for x in v]


def _dec_scalar(v: Any, name: str) -> Any:
    if v is None or isinstance(v, str | int | float | bool):
        return v
    raise _fail(name, v, "a scalar")


def _dec_params(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise _fail(name, v, "a map")
    out = {}
    for k, x in v.items():
        _dec_str(k, f"{name} key")
        out[k] = _dec_param_list(x, f"{name}.{k}") if isinstance(x, list) else _dec_scalar(x, f"{name}.{k}")
    return out


def _dec_param_list(v: list, name: str) -> list:
    """A list of scalars, or of lists of scalars (logit_bias: [[id, bias], ...]); nothing deeper."""
    return [[_dec_scalar(y, name) for y in e] if isinstance(e, list) else _dec_scalar(e, name) for e in v]


def _dec_stats(v: Any, name: str) -> dict[str, float]:
    if not isinstance(v, dict):
        raise _fail(name, v, "a map")
    return {_dec_str(k, f"{name} key"): _dec_number(x, f"{name}.{k}") for k, x in v.items()}


def _enc_logprobs(lps: list[dict[int, float]] | None) -> Any:
    if lps is None:
        return None
    return [[pack_ids(list(d)), np.asarray(list(d.values()), dtype=_FLOAT64).tobytes()] for d in lps]


def _dec_logprobs(v: Any, name: str) -> list[dict[int, float]] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise _fail(name, v, "a list")
    out = []
    for pair in v:
        if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[1], bytes) or len(pair[1]) % 8:
            raise _fail(name, pair, "[packed ids, packed float64]")
        ids, vals = unpack_ids(pair[0], name), np.frombuffer(pair[1], dtype=_FLOAT64).tolist()
        if len(ids) != len(vals):
            raise ProtocolError(f"field {name!r}: {len(ids)} ids but {len(vals)} logprobs")
        out.append(dict(zip(ids, vals, strict=True)))
    return out


# EngineOutput as a fixed-order list: (field, encode, decode)
_OUTPUT_FIELDS: list[tuple[str, Callable[[Any], Any], Callable[[Any, str], Any]]] = [
    ("request_id", str, _dec_str),
    ("index", int, _dec_int),
    ("new_token_ids", pack_ids, unpack_ids),
    ("new_text", str, _dec_str),
    ("finished", bool, _dec_bool),
    ("finish_reason", lambda x: x if x is None else str(x), _optional(_dec_str)),
    ("stop_reason", lambda x: x, lambda v, n: v if v is None or isinstance(v, str) else _dec_int(v, n)),
    ("new_logprobs", _enc_logprobs, _dec_logprobs),
    ("num_prompt_tokens", int, _dec_int),
    ("num_cached_tokens", int, _dec_int),
    ("error", lambda x: x, _optional(_dec_str)),
    ("prompt_logprobs", lambda x: None if x is None else _enc_logprobs(x[1:]),  # the first entry is always None
     lambda v, n: None if v is None else [None, *_dec_logprobs(v, n)]),
]


def _enc_outputs(outs: list[EngineOutput]) -> list[list[Any]]:
    return [[enc(getattr(o, name)) for name, enc, _ in _OUTPUT_FIELDS] for o in outs]


def _dec_outputs(v: Any, name: str) -> list[EngineOutput]:
    if not isinstance(v, list):
        raise _fail(name, v, "a list")
    outs = []
    for row in v:
        if not isinstance(row, list) or len(row) != len(_OUTPUT_FIELDS):
            raise ProtocolError(f"field {name!r}: an output must be a list of {len(_OUTPUT_FIELDS)} fields")
        outs.append(EngineOutput(**{f: dec(x, f"{name}.{f}") for (f, _, dec), x in zip(_OUTPUT_FIELDS, row,
                                                                                         strict=True)}))
    return outs


_ident = lambda x: x
_STR, _INT = (_ident, _dec_str), (_ident, _dec_int)
_SCHEMAS: dict[type, tuple[str, dict[str, tuple[Callable[[Any], Any], Callable[[Any, str], Any]]]]] = {
    Hello: ("hello", {"client_name": _STR, "protocol_version": _INT}),
    EngineReady: ("ready", {"model_name": _STR, "max_model_len": _INT, "vocab_size": _INT,
                            "max_num_seqs": _INT, "pid": _INT, "tokenizer_path": (_ident, _optional(_dec_str)),
                            "eos_token_ids": (pack_ids, unpack_ids), "protocol_version": _INT,
                            "generation_defaults": (_ident, _dec_stats)}),
    AddRequest: ("add", {"request_id": _STR, "prompt_token_ids": (pack_ids, unpack_ids),
                         "params": (_ident, _dec_params)}),
    Abort: ("abort", {"request_ids": (list, _dec_str_list)}),
    Rejected: ("rejected", {"request_id": _STR, "message": _STR}),
    Outputs: ("outputs", {"outputs": (_enc_outputs, _dec_outputs)}),
    StatsRequest: ("stats_request", {"token": _INT}),
    Stats: ("stats", {"stats": (_ident, _dec_stats), "token": _INT}),
    Shutdown: ("shutdown", {}),
    EngineError: ("error", {"message": _STR}),
}
_BY_TAG = {tag: (cls, spec) for cls, (tag, spec) in _SCHEMAS.items()}
for _cls, (_tag, _spec) in _SCHEMAS.items():  # every dataclass field has a codec, and nothing more
    assert set(_spec) == {f.name for f in fields(_cls)}, _cls


# ---- frames ----------------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """One message -> one frame."""
    try:
        tag, spec = _SCHEMAS[type(msg)]
    except KeyError:
        raise TypeError(f"not a protocol message: {type(msg).__name__}") from None
    return msgpack.packb([tag, {name: enc(getattr(msg, name)) for name, (enc, _) in spec.items()}],
                         use_bin_type=True)


def decode(frame: bytes) -> Message:
    """One frame -> one message; ProtocolError for anything that is not exactly a valid message."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise ProtocolError(f"a frame must be bytes, got {type(frame).__name__}")
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(f"frame of {len(frame)} bytes exceeds {MAX_FRAME_BYTES}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack raises several types (ExtraData, FormatError, ValueError...)
        raise ProtocolError(f"frame is not valid msgpack: {e}") from None
    if not isinstance(obj, list) or len(obj) != 2 or not isinstance(obj[0], str) or not isinstance(obj[1], dict):
        raise ProtocolError("frame must be msgpack [tag, {fields}]")
    tag, body = obj
    if tag not in _BY_TAG:
        raise ProtocolError(f"unknown message tag {tag!r}")
    cls, spec = _BY_TAG[tag]
    if set(body) != set(spec):
        missing, extra = sorted(set(spec) - set(body)), sorted(map(str, set(body) - set(spec)))
        raise ProtocolError(f"message {tag!r}: missing fields {missing}, unknown fields {extra}")
    return cls(**{name: dec(body[name], name) for name, (_, dec) in spec.items()})
