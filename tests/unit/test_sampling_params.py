import dataclasses

import pytest

from jinfer.errors import InvalidParam
from jinfer.sampling_params import SamplingParams


def test_defaults_match_vllm():
    sp = SamplingParams()
    assert (sp.n, sp.temperature, sp.top_p, sp.top_k, sp.min_p) == (1, 1.0, 1.0, -1, 0.0)
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (sp.seed, sp.max_tokens, sp.min_tokens, sp.logprobs) == (None, 16, 0, None)
    assert sp.stop == () and sp.stop_token_ids == ()
    assert not sp.ignore_eos and sp.skip_special_tokens and not sp.include_stop_str_in_output
    assert not sp.is_greedy
    assert SamplingParams(temperature=0).is_greedy


def test_normalization():
    sp = SamplingParams(stop="###", stop_token_ids=[5, 7], top_k=0, temperature=1, max_tokens=None)
    assert sp.stop == ("###",)
    assert sp.stop_token_ids == (5, 7)
    assert sp.top_k == -1
    assert isinstance(sp.temperature, float)
    assert sp.max_tokens is None
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(**sp.to_dict()) == sp
    sp = SamplingParams(allowed_token_ids=[3, 1], bad_words=["a b"])
    assert sp.allowed_token_ids == (3, 1) and sp.bad_words == ("a b",)
    assert SamplingParams(**sp.to_dict()) == sp and SamplingParams().allowed_token_ids is None


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        SamplingParams().temperature = 0.5


@pytest.mark.parametrize("kwargs, field", [
    ({"n": 0}, "n"),
    ({"n": 1.5}, "n"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"presence_penalty": 2.1}, "presence_penalty"),
    ({"presence_penalty": -2.1}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"seed": 1.0}, "seed"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"stop": 3}, "stop"),
    ({"stop": ["ok", ""]}, "stop"),
    ({"stop": ["ok", 1]}, "stop"),
    ({"stop_token_ids": [1, -1]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": 21}, "logprobs"),
    ({"skip_special_tokens": None}, "skip_special_tokens"),
])
def test_invalid(kwargs, field):
    with pytest.raises(InvalidParam, match=f"^{field}=") as e:  # an InvalidParam is a ValueError
        SamplingParams(**kwargs)
    assert e.value.param == field and isinstance(e.value, ValueError)


@pytest.mark.parametrize("kwargs, field", [
    ({"logit_bias": {"x": 1}}, "logit_bias"), ({"logit_bias": 5}, "logit_bias"),
    ({"stop": ["x"] * 100}, "stop"), ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"allowed_token_ids": []}, "allowed_token_ids"), ({"allowed_token_ids": [1, -2]}, "allowed_token_ids"),
    ({"allowed_token_ids": 3}, "allowed_token_ids"), ({"allowed_token_ids": [1.0]}, "allowed_token_ids"),
    ({"bad_words": "x"}, "bad_words"), ({"bad_words": ["ok", " "]}, "bad_words"), ({"bad_words": [3]}, "bad_words"),
    ({"bad_words": ["w"] * 1000}, "bad_words"),
])
def test_invalid_names_the_field_whatever_the_message(kwargs, field):
    """The field travels as InvalidParam.param (to the HTTP body), not parsed out of the message."""
    with pytest.raises(InvalidParam) as e:
        SamplingParams(**kwargs)
    assert e.value.param == field


def test_valid_edges():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, presence_penalty=-2, frequency_penalty=2,
                   repetition_penalty=0.01, logprobs=0, min_tokens=16, max_tokens=16, seed=0)
    SamplingParams(logprobs=20, max_tokens=None, min_tokens=100)
