"""lm-evaluation-harness against `jinfer serve`, checked against HF transformers on the same weights.

    .venv/bin/python benchmarks/lm_eval_vs_hf.py [--lm-eval-python /tmp/lmeval/bin/python]
                                                 [--torch-python /tmp/torchenv/bin/python]

1. starts `jinfer serve` on the default model (SmolLM2-135M-Instruct GGUF, float32, CPU);
2. runs lm-eval's `local-completions` model (loglikelihood through `echo` + `logprobs` + prompt logprobs,
   generate_until through plain completions; lm-eval's remote tokenizer: our /tokenizer_info, /tokenize,
   /detokenize) on our two small tasks in benchmarks/lm_eval_tasks/ (24 questions; 96 scored choices);
3. recomputes every request with HF transformers (this file again, under the PyTorch interpreter, with
   `--hf-reference`): each (context, continuation) split into tokens as lm-eval's `_encode_pair` does, the
   continuation's summed logprob and whether it is greedy; each generation greedy with the same stop;
4. writes benchmarks/results/lm_eval_vs_hf_smollm2_cpu.json: per example both numbers, the largest
   difference, and the task metrics of both.

lm-eval is not a jinfer dependency: install it in a scratch venv (`pip install "lm-eval[api]"`; torch and
transformers come from the reference environment, e.g. through a .pth file; HF loads a GGUF only with
`accelerate` installed: `--torch-python` may be that scratch venv). Neither is torch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("jinfer_capitals_mc", "jinfer_capitals_gen")
MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF = ROOT / "models" / MODEL_NAME / f"{MODEL_NAME}.Q4_1.gguf"
LL_TOL = 2e-3  # summed logprob of a continuation (a few tokens), float32 both sides


# ---- HF reference (runs under the PyTorch interpreter) ---------------------------------------------------


def hf_reference(requests_path: str, out_path: str, gguf: str) -> None:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    torch.set_num_threads(2)
    gguf = Path(gguf)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    encode = lambda s: tok.encode(s, add_special_tokens=False)
    reqs = json.loads(Path(requests_path).read_text())
    out = {"loglikelihood": [], "generate_until": [], "transformers": transformers.__version__,
           "torch": torch.__version__}
    with torch.no_grad():
        for context, continuation in reqs["loglikelihood"]:
            n_spaces = len(context) - len(context.rstrip())  # lm-eval's _encode_pair
            if n_spaces:
                context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
            whole, ctx = encode(context + continuation), encode(context)
            cont = whole[len(ctx):]
            logits = model(input_ids=torch.tensor([ctx + cont])).logits[0, len(ctx) - 1:-1].double()
            lsm = torch.log_softmax(logits, dim=-1)
            target = torch.tensor(cont)
            out["loglikelihood"].append({"whole": whole, "ids": ctx + cont, "ctxlen": len(ctx),
                                         "logprob": float(lsm.gather(1, target[:, None]).sum()),
                                         "is_greedy": bool((lsm.argmax(-1) == target).all())})
        for context, until, max_gen in reqs["generate_until"]:
            ids = encode(context)
            gen = model.generate(torch.tensor([ids]), max_new_tokens=max_gen, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)[0, len(ids):]
            text = tok.decode(gen, skip_special_tokens=True)
            for stop in until:
                text = text.split(stop)[0]
            out["generate_until"].append({"ids": ids, "text": text})
    Path(out_path).write_text(json.dumps(out))


# ---- orchestration (runs under jinfer's interpreter) -----------------------------------------------------


def start_server(port: int, log_path: Path) -> subprocess.Popen:
    import httpx

    cmd = [sys.executable, "-m", "server.launcher", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "512", "--max-num-batched-tokens", "128", "--max-num-seqs", "16", "--no-warmup"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    for _ in range(1200):
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def run_lm_eval(python: str, url: str, out_dir: Path) -> None:
    args = (f"base_url={url}/v1/completions,model={MODEL_NAME},tokenizer_backend=remote,tokenized_requests=True,"
            "num_concurrent=1,max_retries=1,max_length=512")
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    subprocess.run([python, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                    "--tasks", ",".join(TASKS), "--include_path", str(ROOT / "benchmarks" / "lm_eval_tasks"),
                    "--output_path", str(out_dir), "--log_samples", "--seed", "0"], cwd=ROOT, env=env, check=True)


def _arguments(sample: dict) -> list[list]:
    """A logged sample's request arguments: a list of lists, or (newer lm-eval) {"gen_args_i": {"arg_j": ..}}."""
    a = sample["arguments"]
    if isinstance(a, dict):
        rows = sorted(a.items(), key=lambda kv: int(kv[0].rsplit("_", 1)[1]))
        return [[v[f"arg_{j}"] for j in range(len(v))] for _, v in rows]
    return a


def read_samples(out_dir: Path) -> tuple[dict, dict]:
    samples = {t: [json.loads(line) for p in sorted(out_dir.rglob(f"samples_{t}_*.jsonl"))
                   for line in p.read_text().splitlines()] for t in TASKS}
    results = json.loads(sorted(out_dir.rglob("results_*.json"))[-1].read_text())["results"]
    return samples, results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lm-eval-python", default="/tmp/lmeval/bin/python")
    ap.add_argument("--torch-python", default="/tmp/torchenv/bin/python")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "lm_eval_vs_hf_smollm2_cpu.json"))
    ap.add_argument("--keep", default=None, help="copy lm-eval's output (samples) to this directory")
    ap.add_argument("--hf-reference", nargs=2, metavar=("REQUESTS", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.hf_reference:
        hf_reference(*args.hf_reference, str(GGUF))
        return 0

    import httpx

    url = f"http://127.0.0.1:{args.port}"
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        server = start_server(args.port, tmp / "server.log")
        try:
            t0 = time.perf_counter()
            run_lm_eval(args.lm_eval_python, url, tmp / "lm_eval")
            lm_eval_s = time.perf_counter() - t0
            samples, metrics = read_samples(tmp / "lm_eval")
            if args.keep:
                shutil.copytree(tmp / "lm_eval", args.keep, dirs_exist_ok=True)
            tokenize = lambda s: httpx.post(f"{url}/tokenize", json={"prompt": s, "add_special_tokens": False},
                                            timeout=30).json()["tokens"]
            # the same requests, for HF
            ll_args = [a for s in samples[TASKS[0]] for a in _arguments(s)]
            gen_args = [(_arguments(s)[0][0], _arguments(s)[0][1]["until"], _arguments(s)[0][1]["max_gen_toks"])
                        for s in samples[TASKS[1]]]
            (tmp / "requests.json").write_text(json.dumps({"loglikelihood": [[a[0], a[1]] for a in ll_args],
                                                           "generate_until": gen_args}))
            subprocess.run([args.torch_python, __file__, "--hf-reference", str(tmp / "requests.json"),
                            str(tmp / "hf.json")], cwd=ROOT, check=True)
            hf = json.loads((tmp / "hf.json").read_text())
            same_tokens = all(tokenize(a[0] + a[1]) == r["whole"]
                              for a, r in zip(ll_args, hf["loglikelihood"], strict=True))
        finally:
            server.terminate()
            server.wait(30)

    rows, gens = [], []
    ours_ll = [r for s in samples[TASKS[0]] for r in s["resps"]]
    for (context, continuation), ours, ref in zip(ll_args, ours_ll, hf["loglikelihood"], strict=True):
        lp, greedy = ours[0]
        rows.append({"context": context, "continuation": continuation, "jinfer": float(lp),
                     "hf": ref["logprob"], "abs_diff": abs(float(lp) - ref["logprob"]),
                     "jinfer_is_greedy": greedy in (True, "True"), "hf_is_greedy": ref["is_greedy"]})
    for s, ref in zip(samples[TASKS[1]], hf["generate_until"], strict=True):
        ours = s["resps"][0][0]
        gens.append({"context": _arguments(s)[0][0], "jinfer": ours, "hf": ref["text"], "same": ours == ref["text"]})
    hf_acc = sum(max(range(len(_arguments(s))), key=lambda i, k=k: hf["loglikelihood"][k + i]["logprob"])
                 == int(s["target"]) for s, k in zip(samples[TASKS[0]], _offsets(samples[TASKS[0]]), strict=True))
    max_diff = max(r["abs_diff"] for r in rows)
    result = {
        "what": "lm-evaluation-harness local-completions against jinfer serve vs HF transformers on the same "
                "weights (SmolLM2-135M-Instruct Q4_1 GGUF dequantized to float32), CPU",
        "script": "benchmarks/lm_eval_vs_hf.py", "commit": _git("rev-parse", "--short", "HEAD"),
        "lm_eval": _version(args.lm_eval_python, "lm_eval"), "transformers": hf["transformers"],
        "torch": hf["torch"], "tasks": list(TASKS), "lm_eval_seconds": round(lm_eval_s, 1),
        "loglikelihood": {"requests": len(rows), "max_abs_diff": max_diff, "tolerance": LL_TOL,
                          "all_within_tolerance": max_diff <= LL_TOL,
                          "is_greedy_agree": sum(r["jinfer_is_greedy"] == r["hf_is_greedy"] for r in rows),
                          "jinfer_acc": metrics[TASKS[0]].get("acc,none"), "hf_acc": hf_acc / len(samples[TASKS[0]]),
                          "tokenization_matches_hf": same_tokens},
        "generate_until": {"requests": len(gens), "identical_text": sum(g["same"] for g in gens),
                           "non_empty": sum(bool(g["jinfer"].strip()) for g in gens),
                           "jinfer_exact_match": metrics[TASKS[1]].get("exact_match,none")},
        "per_example": {"loglikelihood": rows, "generate_until": gens},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "per_example"}, indent=1))
    ok = (result["loglikelihood"]["all_within_tolerance"] and result["generate_until"]["identical_text"] == len(gens)
          and result["generate_until"]["non_empty"] == len(gens))  # an empty answer compares nothing
    return 0 if ok else 1


def _offsets(samples: list[dict]) -> list[int]:
    out, k = [], 0
    for s in samples:
        out.append(k)
        k += len(_arguments(s))
    return out


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()


def _version(python: str, module: str) -> str:
    code = f"import importlib.metadata as m; print(m.version('{module.replace('_', '-')}'))"
    return subprocess.run([python, "-c", code], capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
