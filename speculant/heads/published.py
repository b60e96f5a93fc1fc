"""EAGLE-3 drafters as they are published, read into speculant's EagleHead.

Three layouts carry the same model (Li et al. 2025; the math below is that of the EAGLE repo's
`cnets.py`, SpecForge's `llama3_eagle.py`, speculators' `eagle3/model_definitions.py` and vLLM's
`llama_eagle3.py`):

| layout | config.json | layer tensors |
|---|---|---|
| EAGLE repo / AngelSlim | Llama config, `architectures: [LlamaForCausalLMEagle3]`, `draft_vocab_size`, optional `eagle_config.eagle_aux_hidden_state_layer_ids` | `midlayer.*` |
| SpecForge | the same config | `midlayer.*`, or `model.`-prefixed names where a wrapper saved them |
| speculators (RedHatAI, vLLM) | `speculators_model_type: eagle3`, `transformer_layer_config`, `draft_vocab_size`, `eagle_aux_hidden_state_layer_ids`, `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output` | `layers.0.*` (+ `input_norm` or `fc_norm.{i}`) |

All hold `fc.weight` [D, 3D], `norm.weight`, `lm_head.weight` [Vd, D], `d2t` [Vd] (offsets: draft id i
is target id i + d2t[i]) and `t2d` [V] (bool: the target ids in the draft vocabulary). A step:
h = fc(concat of the target's taps) on the first step, the layer's previous output after; the layer
reads [rms(embed(x)); rms(h)] (2D wide), keeps h (or rms(h) with norm_before_residual) as residual,
and its output o gives logits lm_head(rms(o)). speculators' options: the taps RMS-normed before fc, all
together (norm_before_fc) or each (fc_norm); rms(o) fed back instead of o (norm_output); a Qwen3 layer
(transformer_layer_config model_type qwen3: q/k RMSNorms per head before the rotary). The embedding is the target's own (EAGLE-3 trains with
it frozen; an `embed_tokens.weight` in the file is ignored). The rotary is the drafter's own
(`rope_theta`, `rope_scaling` of its config), at the target's positions.

Tap layers: EAGLE-3 id i is the input of target layer i (vLLM's aux hidden states; HF
hidden_states[i]), which is speculant's tap i - 1 (the residual after layer i - 1). Without ids in
the config, EAGLE-3's default (2, N/2, N-3).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from ..models.hf_config import config_from_hf
from .config import HeadConfig

# the keys of a drafter's layer config that shape its one decoder layer and its rotary
_LAYER_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
               "rms_norm_eps", "max_position_embeddings", "rope_theta", "rope_scaling", "rope_parameters",
               "hidden_act")


def is_eagle3(raw: dict, tensors: dict[str, Tensor]) -> bool:
    """Whether a folder's config and tensor names are a published EAGLE-3 drafter."""
    archs = raw.get("architectures") or []
    return (raw.get("speculators_model_type") == "eagle3" or any("Eagle3" in str(a) for a in archs)
            or any(k.startswith("midlayer.") or k.endswith("hidden_norm.weight") for k in tensors))


def strip_wrapper(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """Tensor names without a `model.` prefix (a wrapper's save), lm_head and d2t/t2d as they are."""
    return {k.removeprefix("model."): v for k, v in tensors.items()}


def eagle3_config(raw: dict, tensors: dict[str, Tensor], target_cfg, folder: Path) -> HeadConfig:
    """The HeadConfig of a published EAGLE-3 drafter for `target_cfg` (a models.ModelConfig); every
    shape is checked against the target, and a mismatch says what differs."""
    speculators = "speculators_model_type" in raw
    layer_cfg = raw.get("transformer_layer_config") if speculators else raw
    if not isinstance(layer_cfg, dict):
        raise SpeculantError(f"{folder}/config.json: transformer_layer_config must be an object")
    if raw.get("norm_before_fc") and raw.get("fc_norm"):
        raise SpeculantError(f"{folder}/config.json: norm_before_fc and fc_norm are exclusive (speculators says so too)")
    n_layers = int(layer_cfg.get("num_hidden_layers", 1) or 1)
    if n_layers != 1 or any(k.startswith("layers.1.") for k in tensors):
        raise SpeculantError(f"{folder}: the drafter has {n_layers} decoder layers; speculant runs EAGLE-3 drafters "
                             "of one layer")
    src = f"{folder}/config.json"
    # the EAGLE repo and SpecForge build a Llama layer whatever model_type says; speculators builds a Qwen3
    # layer (q/k norms, transformers' Qwen3Config head_dim default 128) for model_type qwen3
    qwen3 = layer_cfg.get("model_type") == "qwen3" and speculators
    layer = config_from_hf({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1, "vocab_size": 1,
                            **({"head_dim": 128} if qwen3 else {}),
                            **{k: layer_cfg[k] for k in _LAYER_KEYS if k in layer_cfg}},
                           source=src, has_lm_head=True)
    D = target_cfg.dim
    for name, width in (("hidden_size", layer.dim), ("target_hidden_size", raw.get("target_hidden_size") or D)):
        if width != D:
            raise SpeculantError(f"{folder}: the drafter's {name} is {width}, the target's hidden size is {D}: it was "
                                 "made for another target (speculant runs EAGLE-3 drafters at the target's width)")
    vocab = layer_cfg.get("vocab_size", raw.get("vocab_size"))
    t2d = tensors.get("t2d")
    for what, v in (("config vocab_size", vocab), ("t2d", None if t2d is None else t2d.numel())):
        if v is not None and int(v) != target_cfg.vocab_size:
            raise SpeculantError(f"{folder}: the drafter's {what} says a vocabulary of {int(v)} tokens, the target has "
                                 f"{target_cfg.vocab_size}: it was made for another target (tokenizer)")
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    n = target_cfg.n_layers
    ids = [int(i) for i in ids] if ids else [2, n // 2, n - 3]
    if any(not 1 <= i <= n for i in ids):
        raise SpeculantError(f"{folder}: the drafter reads the inputs of target layers {ids} (EAGLE-3 counting, 0 = "
                             f"the embeddings), the target has {n} layers (1..{n} can be read): it was made for "
                             "another target")
    lm = tensors.get("lm_head.weight")
    draft_vocab = int(raw.get("draft_vocab_size") or (lm.shape[0] if lm is not None else target_cfg.vocab_size))
    if lm is not None and lm.shape[0] != draft_vocab:
        raise SpeculantError(f"{folder}: lm_head has {lm.shape[0]} rows, draft_vocab_size says {draft_vocab}")
    p = layer_prefix(tensors)
    return HeadConfig("eagle3", hidden=D, vocab=target_cfg.vocab_size, draft_vocab=draft_vocab,
                      taps=tuple(i - 1 for i in ids), n_heads=layer.n_heads, n_kv_heads=layer.n_kv_heads,
                      head_dim=layer.head_dim, intermediate=layer.hidden_dim, norm_eps=layer.norm_eps,
                      fc_bias="fc.bias" in tensors, qkv_bias=f"{p}self_attn.q_proj.bias" in tensors,
                      norm_before_residual=bool(raw.get("norm_before_residual", False)),
                      feature_norm="concat" if raw.get("norm_before_fc") else "per_tap" if raw.get("fc_norm") else "none",
                      norm_output=bool(raw.get("norm_output", False)),
                      qk_norm=qwen3 or f"{p}self_attn.q_norm.weight" in tensors,
                      rope_inv_freq=tuple(layer.inv_freq()))


def layer_prefix(tensors: dict[str, Tensor]) -> str:
    return "midlayer." if any(k.startswith("midlayer.") for k in tensors) else "layers.0."


def vocab_map(tensors: dict[str, Tensor], cfg: HeadConfig, folder: Path) -> Tensor | None:
    """Target ids of the draft vocabulary [Vd] from `d2t` offsets (None: the full vocabulary), checked
    against `t2d` where the file has one."""
    if "d2t" not in tensors:
        if cfg.draft_vocab != cfg.vocab:
            raise SpeculantError(f"{folder}: a reduced draft vocabulary ({cfg.draft_vocab} of {cfg.vocab}) needs its "
                                 "d2t map, which the file lacks")
        return None
    d2t = tensors["d2t"].long().reshape(-1)
    if d2t.numel() != cfg.draft_vocab:
        raise SpeculantError(f"{folder}: d2t has {d2t.numel()} entries for a draft vocabulary of {cfg.draft_vocab}")
    ids = d2t + torch.arange(cfg.draft_vocab)
    t2d = tensors.get("t2d")
    if t2d is not None:
        t2d = t2d.reshape(-1).bool()
        inside = ids[(ids >= 0) & (ids < t2d.numel())]
        if inside.numel() != ids.numel() or not bool(t2d[inside].all()) or int(t2d.sum()) != ids.numel():
            raise SpeculantError(f"{folder}: d2t and t2d disagree on which target ids the draft vocabulary holds")
    return ids
