"""`jinfer` command line: `jinfer generate ...` (offline) and `jinfer serve ...` (OpenAI server).

The console entry point lives in the server package, which may import the engine library (never the other way
round). `jinfer serve` imports nothing heavy before it starts the engine process (server/launcher.py)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
import time

from jinfer import __version__
from jinfer.engine.args import HelpFormatter, add_engine_arguments, engine_config_kwargs
from server.launcher import add_serve_arguments, run_serve


def cmd_generate(args: argparse.Namespace) -> int:
    from jinfer import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    kwargs = engine_config_kwargs(args)
    kwargs["warmup"] = False  # one prompt: compile only the shapes it uses
    llm = LLM(**kwargs)
    if args.chat:
        run = functools.partial(llm.chat, [{"role": "user", "content": args.prompt}], params, use_tqdm=False)
    else:
        run = functools.partial(llm.generate, args.prompt, params, use_tqdm=False)
    t0 = time.perf_counter()
    out = run()[0].outputs[0]
    first = time.perf_counter() - t0
    print(out.text)
    n = len(out.token_ids)
    # The first run includes compiling its shapes; a second run shows the steady speed.
    t0 = time.perf_counter()
    run()
    steady = time.perf_counter() - t0
    print(f"[{n} tokens, {n / steady:.1f} tokens/s steady ({steady:.2f} s), first run {first:.2f} s incl. compile; "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jinfer", description="LLM inference engine on JAX",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"jinfer {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate a completion for one prompt", formatter_class=HelpFormatter)
    g.add_argument("--model", default=None, help="Hugging Face model ID (ORG/NAME), model directory, .gguf file or "
                                                 "dummy:<shape> (default: the embedded SmolLM2-135M)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling")
    g.add_argument("--prompt", required=True, help="the prompt (required)")
    g.add_argument("--chat", action="store_true", help="apply the model's chat template")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    add_engine_arguments(g)
    g.set_defaults(func=cmd_generate)
    s = sub.add_parser("serve", help="serve a model over the OpenAI API", formatter_class=HelpFormatter,
                       description="OpenAI-compatible server for jinfer")
    add_serve_arguments(s)
    s.set_defaults(func=run_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as e:
        print(f"jinfer: error: {e}", file=sys.stderr)
        return 2
    if args.command == "generate" and argv is None:  # the program `jinfer generate` (not a call from Python)
        # Free the engine on this thread, then exit without the interpreter's teardown: its final garbage collection
        # could free XLA objects on a helper thread (tqdm's monitor, an idle-unload timer) and abort the process
        # ("terminate called without an active exception") after the answer was printed.
        from jinfer.engine.builder import release_engines

        release_engines()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
