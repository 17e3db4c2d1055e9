"""vLLM's command line and LLM(...) keywords as jinfer takes them (jinfer/engine/args.py, server/launcher.py,
server/cli.py): parsing and mapping only, no engine."""

import argparse
import logging

import pytest

from jinfer.config.engine import EngineConfig
from jinfer.engine.args import HelpFormatter, engine_config_kwargs, vllm_engine_args
from jinfer.engine.builder import check_max_model_len
from jinfer.engine.input_processor import check_request
from jinfer.errors import InvalidParam
from jinfer.sampling_params import SamplingParams
from server import cli
from server.launcher import add_serve_arguments


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jinfer serve", formatter_class=HelpFormatter)
    add_serve_arguments(parser)
    return parser


def config_of(argv: list[str]) -> tuple[argparse.Namespace, EngineConfig]:
    args = serve_parser().parse_args(argv)
    return args, EngineConfig(**engine_config_kwargs(args))


def test_vllm_command_line_maps_to_the_engine(tmp_path, caplog):
    template = tmp_path / "t.jinja"
    template.write_text("{{ messages[0].content }}")
    argv = ["--model", "Qwen/Qwen3-0.6B", "--revision", "v1", "--download-dir", str(tmp_path), "--tokenizer",
            "Qwen/Qwen3-0.6B", "--chat-template", str(template), "--no-enable-prefix-caching", "--enforce-eager",
            "--kv-cache-dtype", "float16", "--block-size", "32", "--swap-space", "4", "--trust-remote-code",
            "--max-logprobs", "5", "--disable-log-requests", "--uvicorn-log-level", "warning",
            "--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096", "--max-model-len", "4096",
            "--dtype", "half", "--quantization", "gguf", "--disable-log-stats"]
    with caplog.at_level(logging.WARNING, logger="jinfer"):
        args, cfg = config_of(argv)
    assert (cfg.model, cfg.revision, cfg.download_dir, cfg.tokenizer) == ("Qwen/Qwen3-0.6B", "v1", str(tmp_path),
                                                                          "Qwen/Qwen3-0.6B")
    assert cfg.chat_template == "{{ messages[0].content }}"  # the file's text travels, not its path
    assert (cfg.enable_prefix_caching, cfg.enable_chunked_prefill, cfg.warmup) == (False, False, False)
    assert (cfg.dtype, cfg.kv_cache_dtype, cfg.page_size, cfg.max_logprobs) == ("float16", "float16", 32, 5)
    assert (cfg.quantization, cfg.log_stats_interval, args.uvicorn_log_level) == ("gguf", 0.0, "warning")
    no_effect = sorted(r.getMessage().split(":")[0] for r in caplog.records if "no effect" in r.getMessage())
    assert no_effect == ["swap_space", "trust_remote_code"]
    _, default = config_of(["Qwen/Qwen3-0.6B", "--enable-prefix-caching"])
    assert (default.model, default.enable_prefix_caching, default.enable_chunked_prefill) == ("Qwen/Qwen3-0.6B",
                                                                                              True, True)
    _, old = config_of(["--no-prefix-caching", "--no-chunked-prefill", "--page-size", "8"])  # jinfer's own names
    assert (old.enable_prefix_caching, old.enable_chunked_prefill, old.page_size) == (False, False, 8)
    with pytest.raises(ValueError, match="model given twice"):
        config_of(["a/b", "--model", "c/d"])


def test_every_flag_has_help_and_shows_its_default(capsys):
    for parser in (serve_parser(), cli_subparser("generate")):
        for action in parser._actions:
            if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction,
                                                                        argparse._VersionAction)):
                continue
            assert action.help, action.option_strings or action.dest
            shown = HelpFormatter("x")._get_help_string(action)
            assert "default" in shown, (action.option_strings or action.dest, shown)
    for argv in (["--version"], ["serve", "--version"]):
        with pytest.raises(SystemExit) as e:
            cli.main(argv)
        assert e.value.code == 0 and capsys.readouterr().out.startswith("jinfer 0.")


def cli_subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


@pytest.mark.parametrize("kw, message", [
    ({"kv_cache_dtype": "fp8_e5m2"}, "kv_cache_dtype='fp8_e5m2' must be one of"),
    ({"kv_cache_dtype": "bfloat16", "dtype": "float32"}, "kv_cache_dtype='bfloat16' must be 'auto', 'fp8' or the"),
    ({"quantization": "awq"}, "quantization='awq' is not supported"),
    ({"max_logprobs": 21}, r"max_logprobs=21 must be an integer in \[0, 20\]"),
    ({"dtype": "float8"}, "dtype='float8' must be"),
    ({"tokenizer": ""}, "tokenizer='' must be"),
])
def test_engine_config_refuses_what_is_not_built(kw, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kw)


def test_vllm_keywords_shared_by_llm_and_cli(tmp_path):
    assert EngineConfig(dtype="half").dtype == "float16" and EngineConfig(dtype="float").dtype == "float32"
    kw = vllm_engine_args({"enforce_eager": True, "block_size": 32, "disable_log_stats": True,
                           "chat_template": "{{ x }}"})
    assert kw == {"warmup": False, "page_size": 32, "log_stats_interval": 0.0, "chat_template": "{{ x }}"}
    with pytest.raises(ValueError, match="block_size=32 and page_size=16"):
        vllm_engine_args({"block_size": 32, "page_size": 16})
    with pytest.raises(ValueError, match="chat_template='/no/such.jinja' looks like a file path"):
        vllm_engine_args({"chat_template": "/no/such.jinja"})
    with pytest.raises(ValueError, match="chat_template: not a valid Jinja template"):
        vllm_engine_args({"chat_template": "{% for x in y %}"})


def test_max_model_len_beyond_the_model_is_an_error_naming_both():
    with pytest.raises(ValueError, match="max_model_len=100000 .* max_position_embeddings=8192"):
        check_max_model_len(100000, 8192)
    with pytest.raises(ValueError, match="max_model_len=8192 is larger than the 4096 tokens the KV cache holds"):
        check_max_model_len(8192, 8192, 4096)
    assert check_max_model_len(None, 8192, 4096) == 4096  # no request: the model's, capped by the pool
    assert check_max_model_len(2048, 8192, 4096) == 2048
    assert check_max_model_len(8192, 8192, 4096, explicit_pages=True) == 4096  # num_pages= sized the pool


def test_max_logprobs_limits_requests():
    check_request([1, 2], SamplingParams(logprobs=5), 100, 64, max_logprobs=5)
    for name in ("logprobs", "prompt_logprobs"):
        with pytest.raises(InvalidParam, match=f"{name}=6 is more than this server's max_logprobs=5") as e:
            check_request([1, 2], SamplingParams(**{name: 6}), 100, 64, max_logprobs=5)
        assert e.value.param == name


def test_chat_template_reaches_the_servers_tokenizer(tmp_path):
    """The engine process announces --chat-template (EngineReady); the server's tokenizer, loaded from the
    engine's tokenizer path, applies it instead of its own."""
    from types import SimpleNamespace

    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from jinfer.client import EngineClient
    from jinfer.engine.core_proc import _ready_message

    HFTokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")).save(str(tmp_path / "tokenizer.json"))
    core = SimpleNamespace(model_name="m", max_model_len=64, model_config=SimpleNamespace(vocab_size=1),
                           config=SimpleNamespace(max_num_seqs=1, chat_template="<{{ messages[0].content }}>"),
                           tokenizer_path=str(tmp_path))
    client = EngineClient.__new__(EngineClient)  # (no engine: only its tokenizer property)
    client._tokenizer, client.info = None, _ready_message(core)
    assert client.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "<hi>"
