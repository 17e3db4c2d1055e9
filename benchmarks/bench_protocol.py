"""Wire protocol micro-benchmark: jinfer's hand-checked msgpack codec (jinfer/engine/protocol.py) against
msgspec Structs (typed msgpack with validation, what vLLM v1's engine protocol uses) for the same messages.

    .venv/bin/pip install msgspec   # not a jinfer dependency
    .venv/bin/python -m benchmarks.bench_protocol [--out benchmarks/results/protocol_codec_cpu.json]

Messages: an engine step's Outputs (1 and 256 one-token deltas, and 256 with 5 logprobs each), an AddRequest
of a 1k-token prompt. Reported: microseconds per encode and per decode (median of 7 runs of N calls), and
the frame sizes. The msgspec side decodes into typed Structs (a type error raises msgspec.ValidationError);
neither side executes anything it receives.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import time
from pathlib import Path

import msgspec

from jinfer.engine import protocol as proto
from jinfer.outputs import EngineOutput
from jinfer.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[1]


# ---- the same messages as msgspec Structs -------------------------------------------------------------


class MOutput(msgspec.Struct, array_like=True):
    request_id: str
    index: int
    new_token_ids: bytes  # packed int32, as in jinfer's codec
    new_text: str
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    new_logprobs: list[tuple[bytes, bytes]] | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[tuple[bytes, bytes]] | None = None


class MOutputs(msgspec.Struct, tag="outputs", array_like=True):
    outputs: list[MOutput]


class MAddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt_token_ids: bytes
    params: dict[str, int | float | str | bool | None | list[int | float | str | bool | None | list[int | float]]]


Message = MOutputs | MAddRequest
ENC = msgspec.msgpack.Encoder()
DEC = msgspec.msgpack.Decoder(Message)


def _lps(lps):
    if lps is None:
        return None
    return [(proto.pack_ids(list(d)), __import__("numpy").asarray(list(d.values()), "<f8").tobytes()) for d in lps]


def to_struct(msg):
    if isinstance(msg, proto.Outputs):
        return MOutputs([MOutput(o.request_id, o.index, proto.pack_ids(o.new_token_ids), o.new_text, o.finished,
                                 o.finish_reason, o.stop_reason, _lps(o.new_logprobs), o.num_prompt_tokens,
                                 o.num_cached_tokens, o.error, None) for o in msg.outputs])
    return MAddRequest(msg.request_id, proto.pack_ids(msg.prompt_token_ids), msg.params)


def from_struct(m):
    """What a caller needs back: EngineOutputs with int ids (msgspec gives bytes: unpack like jinfer does)."""
    if isinstance(m, MOutputs):
        return [EngineOutput(o.request_id, o.index, proto.unpack_ids(o.new_token_ids), o.new_text, o.finished,
                             o.finish_reason, o.stop_reason, None if o.new_logprobs is None else
                             [dict(zip(proto.unpack_ids(i), __import__("numpy").frombuffer(v, "<f8").tolist(),
                                       strict=True)) for i, v in o.new_logprobs],
                             o.num_prompt_tokens, o.num_cached_tokens, o.error) for o in m.outputs]
    return m


def timed(fn, n: int) -> float:
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "protocol_codec_cpu.json"))
    args = ap.parse_args()
    delta = lambda i, lp=None: EngineOutput(f"cmpl-{i:032x}-0", 0, [1234 + i], " word", new_logprobs=lp,
                                            num_prompt_tokens=1000, num_cached_tokens=512)
    lp5 = [{1234: -0.1, 1: -2.0, 2: -3.0, 3: -4.0, 4: -5.0, 5: -6.0}]
    cases = {
        "outputs_1": proto.Outputs([delta(0)]),
        "outputs_256": proto.Outputs([delta(i) for i in range(256)]),
        "outputs_256_logprobs5": proto.Outputs([delta(i, lp5) for i in range(256)]),
        "add_request_1k": proto.AddRequest("r" * 36, list(range(1000)),
                                           SamplingParams(temperature=0.7, top_p=0.9, stop=["\n\n"], seed=1,
                                                          max_tokens=128).to_dict()),
    }
    rows = {}
    for name, msg in cases.items():
        n = 20000 if name == "outputs_1" else 300 if "256" in name else 5000
        frame = proto.encode(msg)
        struct = to_struct(msg)
        mframe = ENC.encode(struct)
        assert proto.decode(frame) == msg
        back = from_struct(DEC.decode(mframe))
        if isinstance(msg, proto.Outputs):
            assert back == msg.outputs
        rows[name] = {
            "jinfer_encode_us": timed(lambda msg=msg: proto.encode(msg), n),
            "jinfer_decode_us": timed(lambda frame=frame: proto.decode(frame), n),
            # msgspec: from our objects (conversion included, as a switch would need it unless the engine
            # built Structs directly), and the codec alone on ready Structs
            "msgspec_encode_us": timed(lambda msg=msg: ENC.encode(to_struct(msg)), n),
            "msgspec_decode_us": timed(lambda f=mframe: from_struct(DEC.decode(f)), n),
            "msgspec_codec_only_encode_us": timed(lambda s=struct: ENC.encode(s), n),
            "msgspec_codec_only_decode_us": timed(lambda f=mframe: DEC.decode(f), n),
            "jinfer_frame_bytes": len(frame), "msgspec_frame_bytes": len(mframe),
        }
        rows[name] = {k: round(v, 2) if isinstance(v, float) else v for k, v in rows[name].items()}
        print(name, rows[name])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    Path(args.out).write_text(json.dumps({
        "what": "wire protocol codec: jinfer's hand-checked msgpack vs msgspec Structs, same messages",
        "script": "benchmarks/bench_protocol.py", "commit": commit.stdout.strip(), "msgspec": msgspec.__version__,
        "python": platform.python_version(), "cpu": platform.processor() or platform.machine(),
        "note": "shared 2-core CPU; medians of 7 runs", "cases": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
