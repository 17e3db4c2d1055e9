#!/usr/bin/env python
"""Generate golden reference files for the jinfer test suite from HF transformers.

Run with a PyTorch environment, NOT the jinfer (JAX) one:

    /tmp/torchenv/bin/python scripts/make_golden.py [path/to/SmolLM2-135M-Instruct.Q4_1.gguf]

Environment used: Python 3.11, torch==2.13.0 (CPU), transformers==5.23, gguf, safetensors, numpy.
The jinfer tests only read the outputs (numpy / json / safetensors); they never import torch.

Outputs (all under tests/data/, see tests/data/README.md):
  tiny-llama/, tiny-qwen2/, tiny-qwen3/,
  tiny-qwen3_moe/, tiny-qwen3_5/, tiny-qwen3_5_moe/, tiny-qwen3_5_moe_h4/ (heads for 4 devices),
  tiny-deepseek_v2/, tiny-deepseek_v3/,
  tiny-deepseek_v2_lite/                      tiny random-weight HF checkpoints (float32 safetensors)
  golden/tiny-<arch>.npz                      prefill logits, greedy ids and per-step decode logits
  golden/smollm2_greedy.json                  greedy continuations of SmolLM2-135M-Instruct (Q4_1 GGUF)
  golden/smollm2_chat0_last_logits.npy        HF prefill logits of the first chat prompt, last position
  golden/prompt_logprobs_tiny-qwen3.npz       prompt logprobs (+ top 5) of tiny-qwen3 (`--only prompt-logprobs`
                                              writes just this file, from the committed checkpoint)

Deterministic: fixed seeds, CPU, float32, eager attention, deterministic torch algorithms.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tiny_models import VOCAB, tiny_specs
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
GOLDEN = DATA / "golden"
DEFAULT_GGUF = REPO / "models" / "SmolLM2-135M-Instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"

PROMPT_LENS = (5, 19, 37)
# qwen3_5: the longest prompt spans two of HF's 64-token delta-rule chunks
PROMPT_LENS_BY_ARCH = {"qwen3_5": (5, 37, 80), "qwen3_5_moe": (5, 37, 80), "qwen3_5_moe_h4": (5, 37, 80)}
N_DECODE = 32
MIN_MARGIN = 0.02  # logits have std ~0.8; see make_tiny
# The tiny DeepSeek models' logits and router scores are flatter: prompts with a 0.02 margin and 1e-3 router gaps
# at every step are too rare to find; their float32 differences to HF are ~1e-6, far below these.
MIN_MARGIN_BY_ARCH = {"deepseek_v2": 0.005, "deepseek_v3": 0.005, "deepseek_v2_lite": 0.005}
MIN_ROUTER_GAP_BY_ARCH = {"deepseek_v2": 3e-5, "deepseek_v3": 3e-5, "deepseek_v2_lite": 3e-5}

META = {
    "transformers": transformers.__version__,
    "torch": torch.__version__,
    "numpy": np.__version__,
    "python": sys.version.split()[0],
}


MIN_ROUTER_GAP = 1e-3  # k-th minus (k+1)-th routing probability, every token of every MoE layer


def router_gap(model, ids):
    """Smallest gap between the k-th and (k+1)-th expert probability over the sequence (MoE only): a
    near-tie could route differently under another engine's float32 rounding."""
    cfg = model.config
    if not hasattr(cfg, "num_experts_per_tok"):
        return float("inf")
    if hasattr(cfg, "kv_lora_rank"):
        return deepseek_router_gap(model, ids)
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    gaps = []
    for logits in out.router_logits:
        p = torch.softmax(logits.float(), dim=-1).sort(dim=-1, descending=True).values
        k = cfg.num_experts_per_tok
        gaps.append(float((p[:, k - 1] - p[:, k]).min()))
    return min(gaps)


def _gap(x, k):
    s = x.sort(dim=-1, descending=True).values
    return float((s[:, k - 1] - s[:, k]).min())


@torch.no_grad()
def deepseek_router_gap(model, ids):
    """DeepSeek's routing: the smallest gap between the kept and the first dropped group score, and between the
    k-th and (k+1)-th choice score among the kept groups' experts (V2: softmax, groups by their best expert; V3:
    sigmoid + correction bias, groups by the sum of their best two)."""
    cfg = model.config
    out = model(input_ids=torch.tensor([ids]), output_router_logits=True)
    gates = [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]
    gaps = []
    for logits, gate in zip(out.router_logits, gates, strict=True):
        logits = logits.float()
        e, g = logits.shape[-1], cfg.n_group
        if hasattr(gate, "e_score_correction_bias"):
            choice = logits.sigmoid() + gate.e_score_correction_bias
            groups = choice.view(-1, g, e // g).topk(2, dim=-1)[0].sum(-1)
        else:
            choice = logits.softmax(dim=-1)
            groups = choice.view(-1, g, e // g).max(dim=-1).values
        if g > cfg.topk_group:  # (one group, V2-Lite's greedy top-k: no group choice to be near a tie)
            gaps.append(_gap(groups, cfg.topk_group))
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(cfg.topk_group, dim=-1)[1], 1.0)
        masked = choice.masked_fill(~keep.repeat_interleave(e // g, dim=1).bool(), -1e9)
        gaps.append(_gap(masked, cfg.num_experts_per_tok))
    return min(gaps)


@torch.no_grad()
def randomize_norms_and_biases(model, gen):
    """Make every norm weight / bias non-trivial so bugs in applying them are caught."""
    n_norm = n_bias = 0
    for name, p in model.named_parameters():
        if name.endswith("dt_bias"):  # Gated DeltaNet's time-step bias (HF initialises it to ones)
            p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=gen))
            n_bias += 1
        elif name.endswith("A_log"):
            # HF draws A from U(0.01, 16); decays that strong make HF's own chunked prefill and recurrent
            # decode disagree by ~4e-4 in float32 (the sanity check below), so keep A in (0.1, 2)
            p.copy_(torch.empty(p.shape).uniform_(0.1, 2.0, generator=gen).log())
        elif name.endswith("norm.weight"):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            n_norm += 1
        elif name.endswith(".bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            n_bias += 1
    for name, b in model.named_buffers():  # DeepSeek-V3's routing correction bias (a buffer, zeros in HF's init)
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.1 * torch.randn(b.shape, generator=gen))
            n_bias += 1
    return n_norm, n_bias


@torch.no_grad()
def greedy_with_cache(model, prompt, n):
    """Manual greedy decode with the KV cache.

    Returns (prefill_logits [L,V], greedy ids [n], decode_logits [n,V]) where decode_logits[k] are
    the logits that produced greedy[k]: decode_logits[0] == prefill_logits[-1], and decode_logits[k]
    (k >= 1) come from feeding greedy[k-1] at position L+k-1.
    """
    ids = torch.tensor([prompt], dtype=torch.long)
    out = model(input_ids=ids, use_cache=True)
    prefill = out.logits[0].float()
    past = out.past_key_values
    step_logits = [prefill[-1]]
    toks = [int(torch.argmax(prefill[-1]))]
    for _ in range(n - 1):
        out = model(input_ids=torch.tensor([[toks[-1]]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
        lg = out.logits[0, -1].float()
        step_logits.append(lg)
        toks.append(int(torch.argmax(lg)))
    return prefill.numpy(), np.array(toks, dtype=np.int32), torch.stack(step_logits).numpy()


def top2_margin(logits):
    s = np.sort(logits, axis=-1)
    return s[..., -1] - s[..., -2]


@torch.no_grad()
def make_tiny(arch, cls, cfg, shard, seed):
    torch.manual_seed(seed)
    model = cls(cfg).eval().float()
    gen = torch.Generator().manual_seed(seed + 1)
    n_norm, n_bias = randomize_norms_and_biases(model, gen)
    out_dir = DATA / f"tiny-{arch}"
    if out_dir.exists():
        shutil.rmtree(out_dir)
    kw = {"safe_serialization": True}
    if shard:
        kw["max_shard_size"] = shard
    model.save_pretrained(out_dir, **kw)
    # generation_config.json is irrelevant to jinfer's loader tests; keep it (harmless) if written.

    # Reload from disk so the golden numbers come from exactly what was saved.
    model = cls.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager").eval()

    rng = np.random.default_rng(seed + 2)
    min_margin = MIN_MARGIN_BY_ARCH.get(arch, MIN_MARGIN)
    min_gap = MIN_ROUTER_GAP_BY_ARCH.get(arch, MIN_ROUTER_GAP)
    arrays = {}
    margins = []
    for i, L in enumerate(PROMPT_LENS_BY_ARCH.get(arch, PROMPT_LENS)):
        # Deterministic rejection sampling: keep the first random prompt whose whole greedy
        # trajectory has a top-1/top-2 logit gap >= MIN_MARGIN at every step, so an engine with
        # slightly different float32 rounding cannot legitimately pick a different token.
        for _attempt in range(500):
            prompt = rng.integers(0, VOCAB, size=L).astype(np.int32)
            prefill, greedy, dec = greedy_with_cache(model, prompt.tolist(), N_DECODE)
            if top2_margin(dec).min() >= min_margin and router_gap(
                    model, prompt.tolist() + greedy.tolist()) >= min_gap:
                break
        else:
            raise RuntimeError(f"no prompt with margin >= {min_margin} for {arch} L={L}")
        # Sanity: cached decode must agree with a full recompute of prompt+greedy.
        full = model(input_ids=torch.tensor([prompt.tolist() + greedy.tolist()])).logits[0].numpy()
        np.testing.assert_allclose(full[L - 1 : L - 1 + N_DECODE], dec, atol=1e-4, rtol=1e-4)
        arrays[f"prompt_{i}"] = prompt
        arrays[f"prefill_logits_{i}"] = prefill.astype(np.float32)
        arrays[f"greedy_{i}"] = greedy
        arrays[f"decode_logits_{i}"] = dec.astype(np.float32)
        m = top2_margin(dec)
        arrays[f"decode_margin_{i}"] = m.astype(np.float32)
        margins.append(float(m.min()))
    arrays["meta"] = np.array(json.dumps({**META, "arch": arch, "seed": seed, "n_decode": N_DECODE,
                                            "min_margin": min_margin, "min_router_gap": min_gap}))
    GOLDEN.mkdir(parents=True, exist_ok=True)
    np.savez(GOLDEN / f"tiny-{arch}.npz", **arrays)
    size = sum(f.stat().st_size for f in out_dir.iterdir())
    print(
        f"tiny-{arch}: params={sum(p.numel() for p in model.parameters())} norms={n_norm} "
        f"biases={n_bias} dir={size / 1024:.0f}KB files={sorted(f.name for f in out_dir.iterdir())} "
        f"min top2 margin per prompt={[f'{m:.4f}' for m in margins]}"
    )


CHAT_QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What is 2 + 2?",
]
RAW_TEXTS = [
    "The quick brown fox",
    "def fibonacci(n):",
    "Once upon a time",
]


@torch.no_grad()
def make_smollm2(gguf_path: Path):
    gguf_path = Path(gguf_path)
    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    print("smollm2: tie_word_embeddings =", model.config.tie_word_embeddings,
          "| lm_head is embed:", model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr(),
          "| eos_token_id =", model.config.eos_token_id, "| tok.eos =", tok.eos_token, tok.eos_token_id)
    eos_ids = model.generation_config.eos_token_id
    if isinstance(eos_ids, int):
        eos_ids = [eos_ids]
    eos_ids = set(eos_ids or []) | ({tok.eos_token_id} if tok.eos_token_id is not None else set())

    records = []
    prompts = [("chat", [{"role": "user", "content": q}]) for q in CHAT_QUESTIONS]
    prompts += [("raw", t) for t in RAW_TEXTS]
    chat0_logits = None
    for kind, p in prompts:
        if kind == "chat":
            ids = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=True)
            if hasattr(ids, "keys"):  # BatchEncoding in newer transformers
                ids = ids["input_ids"]
            ids = list(ids)
            prompt_text = tok.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
        else:
            ids = tok(p, add_special_tokens=True)["input_ids"]
            prompt_text = p
        x = torch.tensor([ids])
        if kind == "chat" and chat0_logits is None:
            chat0_logits = model(input_ids=x).logits[0, -1].float().numpy()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=N_DECODE,
            do_sample=False,
            num_beams=1,
            repetition_penalty=1.0,
            eos_token_id=None,  # no EOS stop: always 32 tokens; stop_index below marks the first EOS
            pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        new = out[0, len(ids):].tolist()
        # Independent check (no cache): argmax of a full forward over prompt+output reproduces
        # every generated token; also record the top-1/top-2 logit gap at each step.
        full = model(input_ids=out).logits[0, len(ids) - 1 : -1].float().numpy()
        assert full.argmax(-1).tolist() == new, (kind, p)
        margins = [round(float(m), 4) for m in top2_margin(full)]
        first_eos = next((i for i, t in enumerate(new) if t in eos_ids), None)
        upto = new if first_eos is None else new[: first_eos + 1]
        rec = {
            "kind": kind,
            ("messages" if kind == "chat" else "text"): p,
            "prompt_text": prompt_text,
            "prompt_ids": ids,
            "output_ids": new,
            "output_text": tok.decode(new, skip_special_tokens=False),
            "eos_index": first_eos,
            "top2_margins": margins,
            "output_ids_until_eos": upto,
            "output_text_until_eos": tok.decode(upto, skip_special_tokens=True),
        }
        records.append(rec)
        print(f"[{kind}] {p!r} -> {rec['output_text_until_eos']!r} (eos_index={first_eos}, "
              f"min margin before eos={min(margins[: len(upto)]):.3f})")

    france = records[0]["output_text_until_eos"].strip()
    print("FRANCE ANSWER:", repr(france))
    if france != "The capital of France is Paris.":
        print("WARNING: France answer differs from expected 'The capital of France is Paris.'")

    meta = {
        **META,
        "gguf_file": name,
        "dtype": "float32 (GGUF dequantized by transformers/gguf)",
        "decoding": "greedy, do_sample=False, 32 new tokens, EOS does NOT stop generation",
        "eos_token_ids": sorted(eos_ids),
        "notes": "top2_margins[k] is the top-1 minus top-2 logit gap when output_ids[k] was chosen. "
                 "output_ids always has 32 tokens; eos_index is the index of the first EOS in "
                 "output_ids (or null); *_until_eos are truncated after (and including) that EOS.",
    }
    GOLDEN.mkdir(parents=True, exist_ok=True)
    with open(GOLDEN / "smollm2_greedy.json", "w") as f:
        json.dump({"meta": meta, "records": records}, f, indent=1, ensure_ascii=False)
    np.save(GOLDEN / "smollm2_chat0_last_logits.npy", chat0_logits.astype(np.float32))


PROMPT_LOGPROBS_LENS = (6, 45, 90)
PROMPT_LOGPROBS_TOP = 5


@torch.no_grad()
def make_prompt_logprobs(arch: str = "qwen3", seed: int = 7):
    """vLLM's prompt_logprobs from HF logits of the committed tiny checkpoint: entry j >= 1 is
    log_softmax(logits[j - 1])[prompt[j]], with the top PROMPT_LOGPROBS_TOP of that row. The last prompt
    repeats the first 32 tokens of the one before it (a prefix-cache hit if the engine used the cache)."""
    d = DATA / f"tiny-{arch}"
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=L).astype(np.int32) for L in PROMPT_LOGPROBS_LENS]
    prompts.append(np.concatenate([prompts[-1][:32], rng.integers(0, VOCAB, size=20).astype(np.int32)]))
    arrays = {}
    for i, prompt in enumerate(prompts):
        logits = model(input_ids=torch.tensor([prompt.tolist()])).logits[0].double()
        lsm = torch.log_softmax(logits, dim=-1)[:-1]  # row j - 1 scores prompt[j]
        top = torch.topk(lsm, PROMPT_LOGPROBS_TOP, dim=-1)
        arrays[f"prompt_{i}"] = prompt
        arrays[f"logprobs_{i}"] = lsm.gather(1, torch.tensor(prompt[1:], dtype=torch.long)[:, None])[:, 0].numpy()
        arrays[f"top_ids_{i}"] = top.indices.numpy().astype(np.int32)
        arrays[f"top_logprobs_{i}"] = top.values.numpy()
    arrays["meta"] = np.array(json.dumps({**META, "arch": arch, "seed": seed, "top": PROMPT_LOGPROBS_TOP}))
    out = GOLDEN / f"prompt_logprobs_tiny-{arch}.npz"
    np.savez(out, **arrays)
    print(f"wrote {out.relative_to(REPO)}: prompts of {[len(p) for p in prompts]} tokens")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("gguf", nargs="?", default=str(DEFAULT_GGUF))
    ap.add_argument("--skip-gguf", action="store_true")
    ap.add_argument("--skip-tiny", action="store_true")
    ap.add_argument("--only", nargs="+", metavar="NAME",
                    help="regenerate only these: tiny model archs (e.g. qwen3_5, with --skip-gguf; seeds stay the "
                         "same) or prompt-logprobs (from the committed checkpoints)")
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(min(2, os.cpu_count() or 1))

    if args.only and "prompt-logprobs" in args.only:
        make_prompt_logprobs()
        if args.only == ["prompt-logprobs"]:
            return
    if not args.skip_tiny:
        for seed, (arch, (cls, cfg, shard)) in enumerate(tiny_specs().items()):
            if args.only is None or arch in args.only:
                make_tiny(arch, cls, cfg, shard, seed=1000 + 10 * seed)
    if not args.skip_gguf:
        make_smollm2(Path(args.gguf))


if __name__ == "__main__":
    main()
