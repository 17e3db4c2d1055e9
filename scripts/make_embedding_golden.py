#!/usr/bin/env python
"""tests/data/tiny-qwen3-embedding (a tiny random Qwen3 embedding checkpoint, laid out as Qwen/Qwen3-Embedding-0.6B
is) and its golden pooled vectors, from HF transformers as Qwen3-Embedding's model card uses it: `AutoModel`, the
last token's final (normed) hidden state, L2-normalised.

Run with the PyTorch environment of scripts/make_golden.py (Python 3.11, torch 2.13 CPU, transformers 5.23):

    /tmp/eagle_torchenv/bin/python scripts/make_embedding_golden.py

The checkpoint mirrors the published one: `Qwen3Model.save_pretrained` weights (no `model.` prefix, no lm_head,
`tie_word_embeddings: true`), a config.json whose `architectures` says "Qwen3ForCausalLM" (as Qwen3-Embedding's
does: the sentence-transformers files mark it an embedding model), modules.json (Transformer, Pooling, Normalize)
and 1_Pooling/config.json (`pooling_mode_lasttoken`). Its tokenizer.json is byte-level BPE with no merges (one
token per UTF-8 byte, ids 0-255) plus `<|endoftext|>` (256), which the post-processor appends to every text, as
Qwen3-Embedding's tokenizer does. Float32, eager attention, fixed seeds.

Writes tests/data/tiny-qwen3-embedding/{config.json, model.safetensors, tokenizer.json, tokenizer_config.json,
modules.json, 1_Pooling/config.json} and tests/data/golden/tiny-qwen3-embedding.npz: `texts` (the text prompts),
per prompt i `prompt_i` (int32 ids: the texts' tokens, then random ids, one longer than 64 tokens) and
`embedding_i` (float32 [hidden], unit norm); `meta`.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoModel, Qwen3Config, Qwen3Model

REPO = Path(__file__).resolve().parent.parent
DATA = REPO / "tests" / "data"
OUT = DATA / "tiny-qwen3-embedding"
GOLDEN = DATA / "golden" / "tiny-qwen3-embedding.npz"
SEED = 0
EOS = "<|endoftext|>"
TEXTS = ("What is the capital of France?", "Instruct: retrieve passages\nQuery: héllo wörld")
RANDOM_LENS = (5, 23, 90)  # 90: several chunks at the tests' 32-token steps


def make_tokenizer() -> Tokenizer:
    byte_chars = pre_tokenizers.ByteLevel.alphabet()  # GPT-2's printable spelling of the 256 bytes
    # id = the byte's value, so a token id and the byte it stands for are the same number
    table = {b: c for b, c in enumerate(sorted(byte_chars, key=_byte_of))}
    tok = Tokenizer(models.BPE(vocab={c: b for b, c in table.items()}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])
    tok.post_processor = processors.TemplateProcessing(single=f"$A {EOS}", special_tokens=[(EOS, 256)])
    return tok


def _byte_of(char: str) -> int:
    """The byte GPT-2's byte-level alphabet spells as `char` (printable bytes are themselves, the others 256+)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    code = ord(char)
    return code if code in printable else moved[code - 256]


def make_model() -> Qwen3Model:
    config = Qwen3Config(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=True, initializer_range=0.1,
                         bos_token_id=None, eos_token_id=256, pad_token_id=256)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = Qwen3Model(config).eval()
    with torch.no_grad():  # norms away from 1 so that a norm not applied (or applied twice) shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
    return model


def embed(model: Qwen3Model, ids: list[int]) -> np.ndarray:
    hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]  # after the final norm
    return torch.nn.functional.normalize(hidden, p=2, dim=-1).numpy()


def main() -> int:
    torch.set_grad_enabled(False)
    if OUT.exists():
        shutil.rmtree(OUT)
    model = make_model()
    model.save_pretrained(OUT, safe_serialization=True)
    config = json.loads((OUT / "config.json").read_text())
    (OUT / "config.json").write_text(json.dumps(config | {"architectures": ["Qwen3ForCausalLM"]}, indent=2) + "\n")
    tok = make_tokenizer()
    tok.save(str(OUT / "tokenizer.json"))
    (OUT / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "pad_token": EOS}, indent=2) + "\n")
    (OUT / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], indent=2) + "\n")
    (OUT / "1_Pooling").mkdir()
    (OUT / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 64, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
        "pooling_mode_max_tokens": False, "pooling_mode_mean_sqrt_len_tokens": False,
        "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": True, "include_prompt": True,
    }, indent=2) + "\n")
    # HF's own loading of what was written (as the model card does) gives the goldens
    reloaded = AutoModel.from_pretrained(OUT, dtype=torch.float32, attn_implementation="eager").eval()
    assert type(reloaded).__name__ == "Qwen3Model", type(reloaded)
    rng = np.random.default_rng(SEED)
    prompts = [tok.encode(t).ids for t in TEXTS] + [rng.integers(0, 257, size=n).tolist() for n in RANDOM_LENS]
    golden = {"meta": np.array(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__,
                                           "seed": SEED})),
              "texts": np.array(TEXTS)}
    for i, ids in enumerate(prompts):
        golden[f"prompt_{i}"] = np.array(ids, np.int32)
        golden[f"embedding_{i}"] = embed(reloaded, ids)
        print(i, len(ids), golden[f"embedding_{i}"][:4].round(4).tolist())
    np.savez(GOLDEN, **golden)
    return 0


if __name__ == "__main__":
    sys.exit(main())
