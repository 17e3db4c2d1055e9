"""The EAGLE-3 draft head (speculative decoding's "eagle3" method): one Llama decoder layer that reads the
target model's hidden states and proposes the next tokens.

Published heads (SpecForge's `LlamaForCausalLMEagle3`, what SGLang and vLLM load, and vLLM's `speculators` export
`Eagle3Speculator`, whose config nests the layer's; jinfer/weights/eagle3.py reads both) are, with H the head's
hidden size and Ht the target's:
- `fc` [H, 3*Ht]: the target's residual stream at three layer boundaries (low, middle, high; `aux_layers`),
  concatenated, projected to H. Only the first step of a chain sees the target's states.
- one decoder layer whose q/k/v take 2H inputs: concat(input_layernorm(embed(token)), hidden_norm(h)); the
  residual is h itself (`norm_before_residual`: hidden_norm(h)); then o, post_attention_layernorm, SwiGLU MLP.
  Its output before the final norm is the next step's h; `norm` + `lm_head` [draft_vocab, H] give the logits.
- a draft vocabulary (the target's most frequent tokens): `d2t[d]` is target id minus draft id.
- the embedding is the target's (a head without `embed_tokens` shares it).

Positions: the head's row at position p takes the target's hidden state at p and the token at p + 1, and
predicts the token at p + 2. So a chain after a verification step is: one pass over the step's rows (their
tokens shifted by one; a sequence's last accepted row takes the token just sampled there), then k - 1 one-token
steps each feeding the previous draft at the next position with the previous step's pre-norm output. The head's
one layer has its own paged KV cache `[num_pages, page_size, kv_heads, head_dim]` on the target's page tables;
rows past a sequence's last accepted one write KV that the next steps overwrite.

Everything here is pure and jit-able with static shapes: `Eagle3Config` is static (hashable) under jit.

How the engine runs it (jinfer/spec/eagle.py): the head is loaded after the target; its one layer's KV is paged on
the target's page ids (a page's bytes grow by it); the target's executables return `aux` (`aux_layers` is part of
their key). After each step is read back, one jitted call runs the first pass over every row of the step (tokens
shifted by one from the host's accepted tokens; rows whose next token is unknown write nothing) and the k - 1
chain steps of the sequences that go on; the drafts [B, k] are read back and verified by the next step. Pages the
chain writes are allocated one step ahead (k - 1 lookahead slots); a write to an unallocated entry (page 0) or past
the page table goes nowhere. A prefix hit is one page shorter (that page's head KV is recomputed). Drafts are greedy
(vLLM's too): the rejection step treats them as one-hot proposals. Rows after a sequence's last accepted one leave
junk KV that the chain and the next step's first pass overwrite before anything reads it
(tests/models/test_eagle3.py::test_rejected_rows_are_overwritten). Not built: the chain inside the step's own launch
(drafts kept on the device), a tensor-parallel head (it runs replicated).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from jinfer.cache.spec import AttentionKV
from jinfer.config.model import ModelConfig
from jinfer.models.batch import Batch
from jinfer.models.layers import apply_rope, rms_norm, rope_cos_sin, write_kv
from jinfer.models.spec import ArrayInfo
from jinfer.ops import REFERENCE_OPS, ModelOps

__all__ = ["Eagle3Config", "Eagle3Weights", "assemble_weights", "cache_spec", "combine_hidden", "default_aux_layers",
           "chain_batch", "draft_forward", "draft_logits", "eagle3_config", "propose", "weight_specs"]

KV = tuple[jax.Array, jax.Array]
HF_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATORS_FIELDS = ("draft_vocab_size", "target_hidden_size", "norm_before_residual",
                      "eagle_aux_hidden_state_layer_ids")


@dataclass(frozen=True)
class Eagle3Config:
    """A head's shapes and how it reads its target.

    `layer`: the decoder layer's config (hidden size, heads, head_dim, MLP, eps, RoPE; `vocab_size` the target's,
    the embedding's rows; `num_layers` 1). `aux_layers`: the target's layer boundaries whose residual stream `fc`
    reads (boundary i is the input of target layer i, HF's `output_hidden_states[i]`).
    """

    layer: ModelConfig
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False

    def __post_init__(self):
        if not 0 < self.draft_vocab_size <= self.layer.vocab_size:
            raise ValueError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, {self.layer.vocab_size}]")
        if self.target_hidden_size <= 0:
            raise ValueError(f"target_hidden_size={self.target_hidden_size} must be > 0")
        if len(self.aux_layers) != 3 or any(not isinstance(i, int) or i < 0 for i in self.aux_layers):
            raise ValueError(f"aux_layers={self.aux_layers!r} must be three layer boundaries >= 0")

    @property
    def hidden_size(self) -> int:
        return self.layer.hidden_size


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """vLLM's and SGLang's default boundaries (2, L // 2, L - 3): SpecForge's training captures the outputs of
    layers (1, L // 2 - 1, L - 4), the same states."""
    if num_target_layers < 6:
        raise ValueError(f"a target of {num_target_layers} layers has no default EAGLE-3 layers; name them in the "
                         f"head's config (eagle_config.eagle_aux_hidden_state_layer_ids)")
    return 2, num_target_layers // 2, num_target_layers - 3


def _aux_layers(raw: dict[str, Any], num_target_layers: int) -> tuple[int, ...]:
    """The boundaries a head's config names (top level or `eagle_config`), else the default; in increasing order,
    the order SGLang and vLLM concatenate them in (they collect them walking the layers).

    Two conventions are published: SpecForge writes "output of layer k" ids starting at 1 ([1, L//2-1, L-4]),
    others write boundaries ([2, L//2, L-3]; vLLM reads every list so). As SGLang reads them: ids starting at 1
    are shifted by one (here: ids whose lowest is 1)."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_aux_layers(num_target_layers)
    if not isinstance(ids, list) or any(not isinstance(i, int) or isinstance(i, bool) for i in ids):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={ids!r} must be a list of integers")
    layers = tuple(sorted(i + 1 for i in ids) if min(ids) == 1 else sorted(ids))
    if any(not 0 <= i <= num_target_layers for i in layers):
        raise ValueError(f"eagle_aux_hidden_state_layer_ids={ids!r}: boundaries {layers} must be in "
                         f"[0, {num_target_layers}] for a target of {num_target_layers} layers")
    return layers


def eagle3_config(raw: dict[str, Any] | str | Path, target: ModelConfig) -> Eagle3Config:
    """A head's config.json (parsed, or its path / directory) for a target of config `target`."""
    if not isinstance(raw, dict):
        path = Path(raw)
        raw = json.loads((path / "config.json" if path.is_dir() else path).read_text())
    arch = (raw.get("architectures") or [None])[0]
    if arch == SPECULATORS_ARCHITECTURE:  # vLLM's `speculators` export: the layer's config nested
        layer = raw.get("transformer_layer_config")
        if not isinstance(layer, dict):
            raise ValueError(f"transformer_layer_config={layer!r} must be an object ({arch})")
        raw = layer | {k: raw[k] for k in SPECULATORS_FIELDS if raw.get(k) is not None} | {
            "architectures": [HF_ARCHITECTURES[0]]}
        arch = HF_ARCHITECTURES[0]
    if arch not in HF_ARCHITECTURES:
        raise ValueError(f"architectures={raw.get('architectures')!r}: an EAGLE-3 head is one of "
                         f"{(*HF_ARCHITECTURES, SPECULATORS_ARCHITECTURE)}")
    if raw.get("num_hidden_layers", 1) != 1:
        raise ValueError(f"num_hidden_layers={raw['num_hidden_layers']!r}: only one-layer heads are supported")
    if (raw.get("eagle_config") or {}).get("use_aux_hidden_state", True) is False:
        raise ValueError("eagle_config.use_aux_hidden_state=false (an EAGLE-1 style head) is not supported")
    if raw.get("vocab_size", target.vocab_size) != target.vocab_size:
        raise ValueError(f"vocab_size={raw['vocab_size']} differs from the target's {target.vocab_size}")
    # the layer is a Llama layer: parse its shapes and RoPE as a one-layer Llama's config
    layer = ModelConfig.from_hf_config({**raw, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1,
                                        "vocab_size": target.vocab_size, "attention_bias": False})
    draft_vocab = raw.get("draft_vocab_size") or target.vocab_size
    return Eagle3Config(layer, int(draft_vocab), int(raw.get("target_hidden_size") or target.hidden_size),
                        _aux_layers(raw, target.num_layers), bool(raw.get("norm_before_residual", False)))


@jax.tree_util.register_dataclass
@dataclass
class Eagle3Weights:
    embed: jax.Array  # [vocab, H]: the target's unless the head has its own
    fc: jax.Array  # [3*Ht, H]
    embed_norm: jax.Array  # [H] input_layernorm (of the token's embedding)
    hidden_norm: jax.Array  # [H] (of h)
    wqkv: jax.Array  # [2H, (heads + 2*kv_heads) * head_dim]: q | k | v of concat(embed_norm(e), hidden_norm(h))
    wo: jax.Array  # [heads * head_dim, H]
    mlp_norm: jax.Array  # [H] post_attention_layernorm
    w_gate: jax.Array  # [H, I]
    w_up: jax.Array  # [H, I]
    w_down: jax.Array  # [I, H]
    final_norm: jax.Array  # [H]
    lm_head: jax.Array  # [H, draft_vocab]
    draft_to_target: jax.Array  # [draft_vocab] int32: target id of each draft id (d + d2t[d])


def weight_specs(cfg: Eagle3Config) -> dict[str, ArrayInfo]:
    """Every tensor of a head under SpecForge's names (jinfer/weights/eagle3.py also finds `layers.0.` for
    `midlayer.` and a `model.` prefix). Replicated (the head is small); `d2t` and `embed` are optional in files."""
    c = cfg.layer
    h, q, kv, inter = c.hidden_size, c.q_size, c.kv_size, c.intermediate_size
    rep = (None, None)
    m = "midlayer."

    def norm(name: str) -> ArrayInfo:
        return ArrayInfo((h,), (None,), name, "", init="ones")

    return {
        "embed": ArrayInfo((c.vocab_size, h), rep, "embed_tokens.weight", ""),
        "fc": ArrayInfo((3 * cfg.target_hidden_size, h), rep, "fc.weight", "", True),
        "embed_norm": norm(m + "input_layernorm.weight"),
        "hidden_norm": norm(m + "hidden_norm.weight"),
        "wq": ArrayInfo((2 * h, q), rep, m + "self_attn.q_proj.weight", "", True),
        "wk": ArrayInfo((2 * h, kv), rep, m + "self_attn.k_proj.weight", "", True),
        "wv": ArrayInfo((2 * h, kv), rep, m + "self_attn.v_proj.weight", "", True),
        "wo": ArrayInfo((q, h), rep, m + "self_attn.o_proj.weight", "", True),
        "mlp_norm": norm(m + "post_attention_layernorm.weight"),
        "w_gate": ArrayInfo((h, inter), rep, m + "mlp.gate_proj.weight", "", True),
        "w_up": ArrayInfo((h, inter), rep, m + "mlp.up_proj.weight", "", True),
        "w_down": ArrayInfo((inter, h), rep, m + "mlp.down_proj.weight", "", True),
        "final_norm": norm("norm.weight"),
        "lm_head": ArrayInfo((h, cfg.draft_vocab_size), rep, "lm_head.weight", "", True),
        "d2t": ArrayInfo((cfg.draft_vocab_size,), (None,), "d2t", "", init="zeros"),
    }


def assemble_weights(cfg: Eagle3Config, arrays: dict[str, jax.Array]) -> Eagle3Weights:
    """The pytree from a flat {spec name: array} dict; q | k | v fused into one projection, `d2t` (offsets,
    identity when absent) turned into target ids."""
    a = dict(arrays)
    d2t = a.pop("d2t", None)
    ids = jnp.arange(cfg.draft_vocab_size, dtype=jnp.int32)
    a["draft_to_target"] = ids if d2t is None else ids + jnp.asarray(d2t).astype(jnp.int32)
    a["wqkv"] = jnp.concatenate([a.pop("wq"), a.pop("wk"), a.pop("wv")], axis=1)
    return Eagle3Weights(**a)


def cache_spec(cfg: Eagle3Config) -> AttentionKV:
    """The head's one layer of paged KV, on the target's pages."""
    return AttentionKV(cfg.layer.num_kv_heads, cfg.layer.head_dim)


def combine_hidden(weights: Eagle3Weights, aux: jax.Array, ops: ModelOps = REFERENCE_OPS) -> jax.Array:
    """fc(concat(low, mid, high)): the target's states [T, 3*Ht] (`forward(..., aux_layers=cfg.aux_layers)`'s third
    output) -> the head's h [T, H]."""
    return ops.project(aux.astype(weights.embed.dtype), weights.fc)


def draft_forward(weights: Eagle3Weights, cfg: Eagle3Config, batch: Batch, hidden: jax.Array, kv: KV,
                  ops: ModelOps = REFERENCE_OPS) -> tuple[jax.Array, jax.Array, KV]:
    """One pass of the head's layer over a packed batch: `batch.input_ids` are the tokens it reads (each row's
    next token), `hidden` [T, H] each row's h (`combine_hidden` of the target's states, or the head's previous
    output). Returns (logits [N, draft_vocab] float32 at `batch.logits_indices`, the rows' pre-norm output [T, H]:
    the next step's h, the updated KV)."""
    c = cfg.layer
    T, H, KVH, D = hidden.shape[0], c.num_heads, c.num_kv_heads, c.head_dim
    hidden = hidden.astype(weights.embed.dtype)
    e = rms_norm(ops.embed(weights.embed, batch.input_ids, c.vocab_size), weights.embed_norm, c.rms_norm_eps)
    h = rms_norm(hidden, weights.hidden_norm, c.rms_norm_eps)
    qkv = ops.project(jnp.concatenate([e, h], axis=-1), weights.wqkv)  # [T, (H + 2*KVH) * D]
    q, k, v = jnp.split(qkv, [H * D, (H + KVH) * D], axis=-1)
    q, k, v = q.reshape(T, H, D), k.reshape(T, KVH, D), v.reshape(T, KVH, D)
    cos, sin = rope_cos_sin(batch.positions, c, q.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k_cache, v_cache = write_kv(kv[0], kv[1], k, v, batch.slot_mapping)
    out = ops.attention(q, k_cache, v_cache, batch, D**-0.5)  # [T, H, D]
    x = ops.out_proj(out.reshape(T, H * D), weights.wo, h if cfg.norm_before_residual else hidden)
    x = ops.mlp_block(x, weights.mlp_norm, weights.w_gate, weights.w_up, weights.w_down, c.rms_norm_eps)
    return draft_logits(weights, cfg, x[batch.logits_indices], ops), x, (k_cache, v_cache)


def draft_logits(weights: Eagle3Weights, cfg: Eagle3Config, x: jax.Array, ops: ModelOps = REFERENCE_OPS
                 ) -> jax.Array:
    """lm_head(norm(x)) over the draft vocabulary [N, draft_vocab], float32."""
    return ops.project(rms_norm(x, weights.final_norm, cfg.layer.rms_norm_eps), weights.lm_head,
                       preferred_element_type=jnp.float32)


def _greedy(weights: Eagle3Weights, logits: jax.Array) -> jax.Array:
    """The argmax over the draft vocabulary, as target ids [N] int32."""
    return weights.draft_to_target[jnp.argmax(logits, axis=-1)]


def chain_batch(batch: Batch, ids: jax.Array, positions: jax.Array, page_size: int,
                live: jax.Array | None = None) -> Batch:
    """The chain's one-token step: sequence b's token `ids[b]` at `positions[b]` (row b), written through its row of
    the page table. Padding sequences (seq_len 0) and those not `live` stay padding; a position past the table or in
    an unallocated entry (the reserved page 0) writes nowhere, so a write never lands in another sequence's page."""
    B, P = batch.page_table.shape
    real = batch.seq_lens > 0
    if live is not None:
        real = real & live
    index = positions // page_size
    page = jnp.take_along_axis(batch.page_table, jnp.clip(index, 0, P - 1)[:, None], axis=1)[:, 0]
    slots = jnp.where(real & (index < P) & (page > 0), page * page_size + positions % page_size, -1)
    return Batch(ids, positions, slots.astype(jnp.int32), jnp.arange(B + 1, dtype=jnp.int32),
                 jnp.where(real, positions + 1, 0).astype(jnp.int32), batch.page_table,
                 jnp.arange(B, dtype=jnp.int32), batch.state_slots)


def propose(weights: Eagle3Weights, cfg: Eagle3Config, batch: Batch, aux: jax.Array, kv: KV, num_steps: int,
            ops: ModelOps = REFERENCE_OPS, live: jax.Array | None = None) -> tuple[jax.Array, KV]:
    """A greedy chain of `num_steps` drafts per sequence.

    `batch`: the rows of the target's step (same positions, slots, page table, seq_lens), `input_ids` shifted by
    one (row t holds the token at position t + 1; a sequence's last accepted row the token just sampled), and
    `logits_indices` [B] each sequence's last accepted row. `aux` [T, 3*Ht]: the target's states of those rows.
    `live` [B] bool: the sequences whose chain steps run (None: all); the others only take the first pass.
    Returns (drafts [B, num_steps] int32 target ids, the head's updated KV); padding sequences' drafts are junk.
    """
    return greedy_chain(partial(draft_forward, weights, cfg), partial(_greedy, weights), batch,
                        combine_hidden(weights, aux, ops), kv, num_steps, ops, live)


def greedy_chain(step_fn, greedy_fn, batch: Batch, hidden: jax.Array, kv: KV, num_steps: int, ops: ModelOps,
                 live: jax.Array | None) -> tuple[jax.Array, KV]:
    """A draft head's chain (EAGLE-3's, MTP's): `step_fn(batch, hidden, kv, ops)` -> (logits, hidden, kv) first over
    the step's rows, then `num_steps - 1` one-token steps feeding each sequence its previous draft and its own
    previous hidden state; `greedy_fn(logits)` -> target ids. Returns (drafts [B, num_steps] int32, kv)."""
    logits, x, kv = step_fn(batch, hidden, kv, ops)
    drafts = [greedy_fn(logits)]
    hidden = x[batch.logits_indices]  # [B, H]
    positions = batch.positions[batch.logits_indices]
    step_ops = dataclasses.replace(ops, decode_step=True) if ops.backend == "pallas" else ops
    for _ in range(num_steps - 1):
        positions = positions + 1
        step = chain_batch(batch, drafts[-1], positions, kv[0].shape[1], live)
        logits, hidden, kv = step_fn(step, hidden, kv, step_ops)
        drafts.append(greedy_fn(logits))
    return jnp.stack(drafts, axis=1), kv
