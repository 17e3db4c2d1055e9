#!/usr/bin/env python
"""tests/data/tiny-qwen3_5-mtp (tiny-qwen3_5 plus one random MTP layer under `mtp.*`) and its golden draft chains,
from a PyTorch port of vLLM's Qwen3.5 MTP module (vllm/model_executor/models/qwen3_5_mtp.py) on transformers'
Qwen3.5 building blocks.

Run with the PyTorch environment of scripts/make_golden.py (Python 3.11, torch 2.13 CPU, transformers 5.23):

    /tmp/eagle_torchenv/bin/python scripts/make_mtp_golden.py

The module (`Qwen3_5MultiTokenPredictor`): fc(concat(pre_fc_norm_embedding(embed(token)), pre_fc_norm_hidden(h)))
[2H -> H], one full-attention Qwen3.5 decoder layer (gated queries, q/k norm, partial RoPE, dense MLP), `norm`; the
target's `lm_head` gives the logits. h is the target's last hidden state after its final norm (what vLLM's target
model returns); a chain step's h is the previous MTP output after `mtp.norm`. Row p reads the target's h at p and
the token at p + 1, at position p. Chains as vLLM runs them: a first pass over the prompt (the last row takes the
target's greedy next token), then one token per step at the next position, each over the whole sequence so far
(causal attention: the same as a KV cache). All norms are zero-centred (1 + w). Float32, fixed seeds.

Writes tests/data/tiny-qwen3_5-mtp/{config.json, generation_config.json, model.safetensors} and
tests/data/golden/tiny-qwen3_5-mtp.npz (per prompt i: prompt_i, hidden_i (the target's), next_i (its greedy token),
first_logits_i [T, V], chain_ids_i [NUM_STEPS], chain_logits_i [NUM_STEPS, V], chain_margin_i).
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer, Qwen3_5RMSNorm

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
TARGET = DATA / "tiny-qwen3_5"
OUT = DATA / "tiny-qwen3_5-mtp"
GOLDEN = DATA / "golden" / "tiny-qwen3_5-mtp.npz"
SEED = 0
PROMPT_LENS = (6, 11, 17)
NUM_STEPS = 4


class MultiTokenPredictor(nn.Module):
    def __init__(self, config):
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        full = config.layer_types.index("full_attention")  # (layer_idx only picks the layer's type)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Qwen3_5DecoderLayer(config, full)])
        self.norm = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_hidden = Qwen3_5RMSNorm(h, eps)
        self.pre_fc_norm_embedding = Qwen3_5RMSNorm(h, eps)

    def forward(self, embeds, hidden, positions, rotary):
        """Rows [n]: embeds [n, H] of the tokens read, hidden [n, H], positions [n] -> the output after `norm`."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))[None]
        n = x.shape[1]
        cos_sin = rotary(x, positions.view(1, 1, -1).expand(3, 1, -1))
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return self.norm(self.layers[0](x, position_embeddings=cos_sin, attention_mask=mask,
                                         position_ids=positions[None]))[0]


def make_mtp(config) -> MultiTokenPredictor:
    torch.manual_seed(SEED)
    mtp = MultiTokenPredictor(config)
    with torch.no_grad():
        for p in mtp.parameters():
            p.normal_(0.0, 0.1)  # norms too: zero-centred, so 0.1 * randn checks the 1 + w
    return mtp


def chain(target, mtp, ids: list[int]) -> dict[str, np.ndarray]:
    out = target.model(input_ids=torch.tensor([ids]))
    hidden = out.last_hidden_state[0]  # after the final norm
    logits = target.lm_head(hidden)
    nxt = int(logits[-1].argmax())
    embed, rotary = target.model.embed_tokens, target.model.rotary_emb
    tokens, hs = ids[1:] + [nxt], list(hidden)
    n = len(ids)
    y = mtp(embed(torch.tensor(tokens)), torch.stack(hs), torch.arange(n), rotary)
    first_logits = target.lm_head(y)
    chain_logits = [first_logits[-1]]
    for step in range(1, NUM_STEPS):
        tokens.append(int(chain_logits[-1].argmax()))
        hs.append(y[-1])
        y = mtp(embed(torch.tensor(tokens)), torch.stack(hs), torch.arange(n + step), rotary)
        chain_logits.append(target.lm_head(y[-1]))
    cl = torch.stack(chain_logits)
    top = torch.topk(cl, 2, dim=-1).values
    rec = {"hidden": hidden, "next": torch.tensor(nxt), "first_logits": first_logits, "chain_logits": cl,
           "chain_ids": cl.argmax(-1).to(torch.int32), "chain_margin": top[:, 0] - top[:, 1]}
    return {k: v.detach().numpy() for k, v in rec.items()}


def main() -> int:
    torch.set_grad_enabled(False)
    config = AutoConfig.from_pretrained(TARGET)
    config._attn_implementation = "eager"
    target = AutoModelForCausalLM.from_pretrained(TARGET, config=config, dtype=torch.float32).eval()
    mtp = make_mtp(target.config).eval()
    OUT.mkdir(exist_ok=True)
    raw = json.loads((TARGET / "config.json").read_text())
    (OUT / "config.json").write_text(json.dumps(raw | {"mtp_num_hidden_layers": 1}, indent=2) + "\n")
    shutil.copy(TARGET / "generation_config.json", OUT / "generation_config.json")
    tensors = load_file(TARGET / "model.safetensors")
    tensors |= {"mtp." + k: v.contiguous() for k, v in mtp.state_dict().items()}
    save_file(tensors, OUT / "model.safetensors", metadata={"format": "pt"})
    rng = np.random.default_rng(SEED)
    golden = {"meta": np.array(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}))}
    for i, n in enumerate(PROMPT_LENS):
        ids = rng.integers(3, 256, size=n).tolist()
        golden[f"prompt_{i}"] = np.array(ids, np.int32)
        golden |= {f"{k}_{i}": v for k, v in chain(target, mtp, ids).items()}
        print(i, golden[f"chain_ids_{i}"].tolist(), golden[f"chain_margin_{i}"].round(3).tolist())
    np.savez(GOLDEN, **golden)
    return 0


if __name__ == "__main__":
    sys.exit(main())
