#!/usr/bin/env python
"""A tiny random EAGLE-3 draft head for tests/data/tiny-qwen3 and its golden outputs, from a PyTorch reference.

Run with the PyTorch environment of scripts/make_golden.py (Python 3.11, torch 2.13 CPU, transformers 5.23):

    /tmp/torchenv/bin/python scripts/make_eagle3_golden.py

Writes (see tests/data/README.md):
  tests/data/tiny-eagle3-qwen3/      config.json (LlamaForCausalLMEagle3, SpecForge's layout) + model.safetensors
                                     (SpecForge's tensor names: fc, midlayer.*, norm, lm_head, d2t, t2d; no
                                     embed_tokens: the head shares the target's embedding, as vLLM and SGLang do)
  tests/data/golden/tiny-eagle3-qwen3.npz

The head is SpecForge's `LlamaForCausalLMEagle3` (specforge/modeling/draft/llama3_eagle.py) written out here on
transformers' Llama building blocks (RMSNorm, MLP, rotary embedding), run the way SGLang and vLLM run it at
inference: a first pass over the prompt (row p: the token at p + 1 and fc of the target's states at p; the last
row takes the target's greedy next token), then one token per step, each feeding the previous draft with the
previous step's output before the final norm, over a growing K/V cache. The target's states are HF's
`output_hidden_states` (its last entry is after the final norm, so the last layer's own output is taken from a
hook instead). Float32, CPU, fixed seeds: a rerun in the same environment gives the same bytes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import save_file
from torch import nn
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    repeat_kv,
)

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
TARGET = DATA / "tiny-qwen3"
OUT = DATA / "tiny-eagle3-qwen3"
GOLDEN = DATA / "golden" / "tiny-eagle3-qwen3.npz"

SEED = 0
DRAFT_VOCAB = 64
AUX_LAYER_IDS = [0, 1, 2]  # tiny-qwen3 has 2 layers: the embedding, layer 0's and layer 1's outputs
PROMPT_LENS = (6, 11, 17)
NUM_STEPS = 5
MIN_MARGIN = 0.02
MIN_DISTINCT = 3  # distinct drafts in each golden chain
HEAD_CONFIG = {
    "architectures": ["LlamaForCausalLMEagle3"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 1,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,  # the target's is 1e6: a head must use its own
    "max_position_embeddings": 512,
    "vocab_size": 256,
    "draft_vocab_size": DRAFT_VOCAB,
    "target_hidden_size": 64,
    "tie_word_embeddings": False,
    "initializer_range": 0.1,
    "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_LAYER_IDS, "use_aux_hidden_state": True},
    "torch_dtype": "float32",
}


class Eagle3Attention(nn.Module):
    """SpecForge's LlamaAttention: q/k/v read concat(embedding, hidden) [.., 2H]; cached K/V for decoding."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        h, self.heads, self.kv_heads, self.head_dim = (cfg.hidden_size, cfg.num_attention_heads,
                                                       cfg.num_key_value_heads, cfg.head_dim)
        self.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(cfg)

    def forward(self, x, positions, cache):
        n = x.shape[0]
        q = self.q_proj(x).view(1, n, self.heads, self.head_dim).transpose(1, 2)  # [1, heads, n, D]
        k = self.k_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(1, n, self.kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary_emb(v, positions[None])
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        s = k.shape[2]
        groups = self.heads // self.kv_heads
        scores = q @ repeat_kv(k, groups).transpose(2, 3) / self.head_dim**0.5  # [1, heads, n, s]
        causal = torch.arange(s)[None, :] <= (s - n + torch.arange(n))[:, None]
        scores = scores.masked_fill(~causal, float("-inf"))
        out = torch.softmax(scores, dim=-1, dtype=torch.float32) @ repeat_kv(v, groups)
        return self.o_proj(out.transpose(1, 2).reshape(n, -1))


class Eagle3Layer(nn.Module):
    """SpecForge's LlamaDecoderLayer (the `midlayer`): the residual is the hidden state itself."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = Eagle3Attention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.hidden_norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, embeds, hidden, positions, cache):
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = residual + self.self_attn(x, positions, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(nn.Module):
    """SpecForge's LlamaForCausalLMEagle3 at inference: `fc` over the target's three states, the midlayer, `norm`,
    `lm_head` over the draft vocabulary, `d2t` (target id - draft id) and `t2d` (target ids in the draft vocab)."""

    def __init__(self, cfg: LlamaConfig, embed: torch.Tensor):
        super().__init__()
        self.embed = embed  # the target's: not part of the checkpoint
        self.fc = nn.Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))

    def step(self, ids, hidden, positions, cache):
        """-> (logits [n, draft_vocab], pre-norm output [n, H]: the next step's hidden)."""
        x = self.midlayer(self.embed[ids], hidden, positions, cache)
        return self.lm_head(self.norm(x)), x

    def to_target(self, draft_ids):
        return draft_ids + self.d2t[draft_ids]


def make_head(target) -> Eagle3Head:
    cfg = LlamaConfig(**{k: v for k, v in HEAD_CONFIG.items() if k not in ("architectures", "torch_dtype")})
    torch.manual_seed(SEED)
    head = Eagle3Head(cfg, target.model.embed_tokens.weight.detach())
    with torch.no_grad():
        for name, p in head.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))  # a norm's weight that is not all ones is checked
            else:
                p.normal_(0.0, 0.1)
        # the draft vocabulary: 64 of the 256 target ids, sorted (SpecForge keeps the most frequent ones)
        keep = torch.sort(torch.randperm(cfg.vocab_size)[:DRAFT_VOCAB]).values
        head.d2t.copy_(keep - torch.arange(DRAFT_VOCAB))
        head.t2d.zero_()
        head.t2d[keep] = True
    return head


def target_states(target, ids: list[int]) -> tuple[torch.Tensor, int, float]:
    """The target's states at the head's boundaries [L, 3 * 64], its greedy next token and that token's margin."""
    outputs = {}
    hook = target.model.layers[-1].register_forward_hook(lambda m, a, out: outputs.update(last=out))
    out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    hook.remove()
    last = outputs["last"][0] if isinstance(outputs["last"], tuple) else outputs["last"]
    states = list(out.hidden_states[:-1]) + [last]  # boundary i = input of layer i; L = last layer's output
    aux = torch.cat([states[i][0] for i in AUX_LAYER_IDS], dim=-1)
    top = torch.topk(out.logits[0, -1], 2).values
    return aux, int(out.logits[0, -1].argmax()), float(top[0] - top[1])


def draft_chain(head: Eagle3Head, ids: list[int], aux: torch.Tensor, next_token: int) -> dict[str, np.ndarray]:
    n = len(ids)
    cache: list[torch.Tensor] = []
    logits, x = head.step(torch.tensor(ids[1:] + [next_token]), head.fc(aux), torch.arange(n), cache)
    rec = {"first_hidden": x, "first_logits": logits}
    chain_logits, chain_hidden = [logits[-1]], [x[-1]]
    for step in range(1, NUM_STEPS):
        token = head.to_target(chain_logits[-1].argmax())
        logits, x = head.step(token[None], chain_hidden[-1][None], torch.tensor([n - 1 + step]), cache)
        chain_logits.append(logits[0])
        chain_hidden.append(x[0])
    logits = torch.stack(chain_logits)
    top = torch.topk(logits, 2, dim=-1).values
    rec |= {"chain_logits": logits, "chain_hidden": torch.stack(chain_hidden),
            "chain_ids": head.to_target(logits.argmax(dim=-1)).to(torch.int32), "chain_margin": top[:, 0] - top[:, 1]}
    return {k: v.detach().numpy() for k, v in rec.items()}


def main() -> None:
    torch.use_deterministic_algorithms(True)
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32, attn_implementation="eager")
    target.eval()
    head = make_head(target)
    OUT.mkdir(exist_ok=True)
    tensors = {k: v.contiguous() for k, v in head.state_dict().items() if not k.startswith("embed")}
    save_file(tensors, OUT / "model.safetensors", metadata={"format": "pt"})
    (OUT / "config.json").write_text(json.dumps(HEAD_CONFIG, indent=2) + "\n")

    meta = {"transformers": transformers.__version__, "torch": torch.__version__, "numpy": np.__version__,
            "python": sys.version.split()[0], "seed": SEED, "num_steps": NUM_STEPS, "min_margin": MIN_MARGIN}
    golden, rng, margins = {}, np.random.default_rng(SEED), []
    with torch.no_grad():
        for i, n in enumerate(PROMPT_LENS):
            # prompts whose every greedy choice has a clear margin and whose chain does not settle on one token
            # at once (a random head often repeats its first draft)
            for _ in range(1000):
                ids = [int(t) for t in rng.integers(3, 256, n)]
                aux, next_token, target_margin = target_states(target, ids)
                rec = draft_chain(head, ids, aux, next_token)
                if min(target_margin, rec["chain_margin"].min()) >= MIN_MARGIN \
                        and len(set(rec["chain_ids"].tolist())) >= MIN_DISTINCT:
                    break
            else:
                raise RuntimeError(f"no prompt of {n} tokens with margins >= {MIN_MARGIN}")
            margins.append(min(target_margin, float(rec["chain_margin"].min())))
            golden |= {f"prompt_{i}": np.asarray(ids, np.int32), f"next_{i}": np.int32(next_token),
                       f"aux_{i}": aux.numpy()} | {f"{k}_{i}": v for k, v in rec.items()}
    meta["smallest_margin"] = min(margins)
    np.savez(GOLDEN, meta=np.array(json.dumps(meta)), **golden)
    print(f"wrote {OUT} and {GOLDEN}; smallest margin {min(margins):.4f}")


if __name__ == "__main__":
    main()
