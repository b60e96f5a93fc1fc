"""The shape of a Gemma 4 dense text model (HF `Gemma4ForCausalLM`, the text part of `Gemma4ForConditionalGeneration`).

What differs from Gemma 3 (transformers' modeling_gemma4.py), all read here from config.json:
- RMSNorms multiply by their weight (not 1 + weight); values are RMS-normed per head with no weight; queries are
  not scaled (the q/k norms fix their size: scaling 1.0);
- global (full-attention) layers have their own head size (`per_layer_config` or `global_head_dim`), their own
  number of key/value heads where `attention_k_eq_v` (then their values are the key projection's output), and a
  proportional rotary: only `partial_rotary_factor` of the head's frequencies turn, the rest stay at 0;
- the last `num_kv_shared_layers` layers compute no keys/values: each reads those of the last earlier layer of
  its own type (sliding or full);
- per-layer input embeddings (PLE): a second embedding table [vocab, layers * P] plus a projection of the
  embeddings, mixed into the residual after each layer's MLP through a gate and a projection;
- a learned scalar per layer multiplies its output; the MLP of a KV-shared layer is twice as wide where
  `use_double_wide_mlp`.
Mixture-of-experts variants (`enable_moe_block`) and bidirectional text attention are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import SpeculantError
from .config import ModelConfig

GEMMA4_ARCHS = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration")
GEMMA4_TYPES = ("gemma4_text", "gemma4")


@dataclass(frozen=True, slots=True)
class Gemma4Config:
    base: ModelConfig  # the shared switches; head_dim / n_kv_heads are the sliding layers'
    head_dims: tuple[int, ...]  # per layer
    kv_heads: tuple[int, ...]  # per layer
    kv_source: tuple[int, ...]  # per layer: the layer whose keys/values it attends to (itself unless shared)
    k_eq_v: tuple[bool, ...]  # per layer: values are the key projection's output
    mlp_hidden: tuple[int, ...]  # per layer
    ple_dim: int  # per-layer input width (0: no PLE)
    local_theta: float
    global_theta: float
    global_partial: float  # the share of a global head's dims that the rotary turns
    global_factor: float

    @property
    def n_layers(self) -> int:
        return self.base.n_layers

    def kv_slots(self) -> dict[int, int]:
        """Layer -> its slot in the cache, for the layers that write keys/values."""
        owners = [i for i in range(self.n_layers) if self.kv_source[i] == i]
        return {layer: slot for slot, layer in enumerate(owners)}

    def inv_freq(self, local: bool) -> list[float]:
        """The rotary's inverse frequencies of sliding (default rotary) or global layers (proportional rotary)."""
        if local:
            hd = self.base.head_dim
            return [1.0 / self.local_theta ** (2 * i / hd) for i in range(hd // 2)]
        hd = max((d for d, loc in zip(self.head_dims, self.base.local_layers) if not loc), default=self.base.head_dim)
        turned = int(self.global_partial * hd // 2)
        return [(1.0 / self.global_theta ** (2 * i / hd) if i < turned else 0.0) / self.global_factor
                for i in range(hd // 2)]


def is_gemma4(raw: dict[str, Any]) -> bool:
    archs = raw.get("architectures") or []
    return raw.get("model_type") in GEMMA4_TYPES or any(a in GEMMA4_ARCHS for a in archs)


def text_config(raw: dict[str, Any]) -> dict[str, Any]:
    """The text model's fields: the multimodal class nests them under text_config."""
    if raw.get("model_type") == "gemma4" or "text_config" in raw:
        tc = raw.get("text_config")
        if not isinstance(tc, dict):
            raise SpeculantError("a Gemma 4 multimodal config.json needs a text_config object")
        return tc
    return raw


def gemma4_config(raw: dict[str, Any], source: str = "config.json") -> Gemma4Config:
    c = text_config(raw)

    def need(key: str, kind: type = int) -> Any:
        v = c.get(key)
        if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
            raise SpeculantError(f"{source}: Gemma 4 needs {key} ({kind.__name__}), got {v!r}")
        return v

    if c.get("enable_moe_block"):
        raise SpeculantError(f"{source}: Gemma 4 mixture-of-experts models (enable_moe_block) are not supported; "
                             "speculant runs the dense Gemma 4 models (E2B, E4B, 31B)")
    if c.get("use_bidirectional_attention") == "all":
        raise SpeculantError(f"{source}: use_bidirectional_attention 'all' makes an encoder, not a decoder")
    if c.get("attention_bias"):
        raise SpeculantError(f"{source}: attention_bias is not supported for Gemma 4")
    act = c.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise SpeculantError(f"{source}: hidden_activation {act!r} is not supported (Gemma 4 uses gelu_pytorch_tanh)")
    n, dim, heads = need("num_hidden_layers"), need("hidden_size"), need("num_attention_heads")
    kv, hd, vocab = need("num_key_value_heads"), need("head_dim"), need("vocab_size")
    hidden, window = need("intermediate_size"), need("sliding_window")
    types = c.get("layer_types")
    if not isinstance(types, list) or len(types) != n or any(t not in ("sliding_attention", "full_attention")
                                                             for t in types):
        raise SpeculantError(f"{source}: layer_types must list sliding_attention/full_attention for each of the "
                             f"{n} layers")
    # transformers makes the last layer global whatever the config says (with a warning); so does this
    local = tuple(t == "sliding_attention" for t in types[:-1]) + (False,)
    k_eq_v_cfg = bool(c.get("attention_k_eq_v", False))
    per_layer = c.get("per_layer_config") or {}
    if not isinstance(per_layer, dict):
        raise SpeculantError(f"{source}: per_layer_config must be an object")
    g_hd = c.get("global_head_dim", 512 if not per_layer else hd)
    g_kv = c.get("num_global_key_value_heads") if k_eq_v_cfg else None
    head_dims, kv_heads = [], []
    for i, loc in enumerate(local):
        over = per_layer.get(str(i), per_layer.get(i)) or {}
        if loc:
            over = over if per_layer else {}
            head_dims.append(int(over.get("head_dim", hd)))
            kv_heads.append(int(over.get("num_key_value_heads", kv)))
        else:
            head_dims.append(int(over.get("head_dim", hd if per_layer else g_hd)))
            kv_heads.append(int(over.get("num_key_value_heads", kv if per_layer or g_kv is None else g_kv)))
    shared = int(c.get("num_kv_shared_layers", 0) or 0)
    first = n - shared
    if not 0 <= shared < n:
        raise SpeculantError(f"{source}: num_kv_shared_layers {shared} must be below num_hidden_layers {n}")
    source_of = []
    for i in range(n):
        if i < first:
            source_of.append(i)
            continue
        owners = [j for j in range(first) if local[j] == local[i]]
        if not owners:
            raise SpeculantError(f"{source}: KV-shared layer {i} has no earlier {types[i]} layer to read from")
        source_of.append(owners[-1])
    double = bool(c.get("use_double_wide_mlp", False))
    mlp = tuple(hidden * (2 if double and i >= first else 1) for i in range(n))
    rope = c.get("rope_parameters") or {}
    lp, gp = rope.get("sliding_attention") or {}, rope.get("full_attention") or {}
    if lp.get("rope_type", "default") != "default" or gp.get("rope_type", "proportional") not in ("proportional",
                                                                                                  "default"):
        raise SpeculantError(f"{source}: Gemma 4 rotary types {lp.get('rope_type')!r}/{gp.get('rope_type')!r} are "
                             "not supported (sliding: default, full: proportional)")
    softcap = c.get("final_logit_softcapping")
    base = ModelConfig(
        arch="gemma4", n_layers=n, dim=dim, n_heads=heads, n_kv_heads=kv, hidden_dim=hidden, vocab_size=vocab,
        context_length=int(c.get("max_position_embeddings", 131072)), norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_base=float(gp.get("rope_theta", 1e6)), head_dim=hd, tie_embeddings=bool(c.get("tie_word_embeddings", True)),
        qk_norm=True, post_norms=True, activation="gelu_tanh", embed_scale=dim**0.5,
        attn_scale=1.0, sliding_window=window, local_layers=local, rope_local_base=float(lp.get("rope_theta", 1e4)),
        final_softcap=float(softcap) if softcap else None)
    ple = int(c.get("hidden_size_per_layer_input", 0) or 0)
    if ple and int(c.get("vocab_size_per_layer_input", vocab)) != vocab:
        raise SpeculantError(f"{source}: vocab_size_per_layer_input differs from vocab_size; not supported")
    partial = float(gp.get("partial_rotary_factor", 1.0)) if gp.get("rope_type", "proportional") == "proportional" else 1.0
    return Gemma4Config(base, tuple(head_dims), tuple(kv_heads), tuple(source_of),
                        tuple(k_eq_v_cfg and not loc for loc in local), mlp, ple, base.rope_local_base,
                        base.rope_base, partial, float(gp.get("factor", 1.0)))
