"""The shape of a Qwen3.5 text model (dense), read from an HF config.json or a GGUF header.

Qwen3.5 is not a Llama block (config.py's switches do not cover it): three of every four layers are Gated DeltaNet
linear attention (a causal depthwise convolution over q/k/v, then a gated delta-rule recurrence with a matrix state
per value head), the others full attention with an output gate and per-head q/k norms; the rotary covers the first
`rotary_dim` values of each head; every RMSNorm but the DeltaNet's gated one multiplies by (1 + weight). The text
model applies interleaved M-RoPE, whose three position streams are equal for text, so it is the plain rotary here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import SpeculantError

HF_ARCHS = ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration")
HF_MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_MARKS = ("qwen3_5_moe", "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration")


@dataclass(frozen=True, slots=True)
class Qwen35Config:
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    vocab_size: int
    context_length: int
    layer_types: tuple[str, ...]  # per layer: "linear_attention" or "full_attention"
    lin_k_heads: int
    lin_v_heads: int
    lin_k_dim: int
    lin_v_dim: int
    conv_kernel: int
    rotary_dim: int
    rope_base: float = 10_000_000.0
    norm_eps: float = 1e-6
    tie_embeddings: bool = False
    mtp_layers: int = 0  # MTP decoder layers the checkpoint declares (mtp_num_hidden_layers)
    arch: str = "qwen35"

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.n_layers:
            raise SpeculantError(f"layer_types lists {len(self.layer_types)} layers, the model has {self.n_layers}")
        bad = sorted(set(self.layer_types) - {"linear_attention", "full_attention"})
        if bad:
            raise SpeculantError(f"layer type {bad[0]!r} is not a Qwen3.5 layer (linear_attention, full_attention)")
        if self.n_heads % self.n_kv_heads or self.lin_v_heads % self.lin_k_heads:
            raise SpeculantError("attention heads must be a multiple of key/value heads (full and linear layers)")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise SpeculantError(f"rotary dimension {self.rotary_dim} must be even and within head_dim {self.head_dim}")

    def is_linear(self, layer: int) -> bool:
        return self.layer_types[layer] == "linear_attention"

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    @property
    def linear_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def conv_dim(self) -> int:  # the convolution's channels: q, k (lin_k_heads each), v (lin_v_heads)
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def inv_freq(self) -> list[float]:
        return [1.0 / self.rope_base ** (i / self.rotary_dim) for i in range(0, self.rotary_dim, 2)]


def is_qwen35_hf(raw: Mapping[str, Any]) -> bool:
    """Whether a config.json describes a Qwen3.5 model (refusing the MoE variants with a clear message)."""
    names = [raw.get("model_type")] + list(raw.get("architectures") or [])
    text = raw.get("text_config")
    if isinstance(text, Mapping):
        names.append(text.get("model_type"))
    if any(n in MOE_MARKS for n in names):
        raise SpeculantError("Qwen3.5 mixture-of-experts models (qwen3_5_moe) are not supported; speculant runs the "
                             "dense Qwen3.5 models (0.8B, 2B, 4B, 9B, 27B)")
    return any(n in HF_ARCHS or n in HF_MODEL_TYPES for n in names)


def config_from_hf(raw: Mapping[str, Any], source: str) -> Qwen35Config:
    """Qwen3.5's text config (top level, or `text_config` of Qwen3_5ForConditionalGeneration) with transformers'
    defaults for absent fields."""
    text = raw.get("text_config") if isinstance(raw.get("text_config"), Mapping) else raw

    def integer(key: str, default: int | None = None) -> int:
        v = text.get(key, default)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise SpeculantError(f"{source}: {key} must be a positive integer, got {v!r}")
        return v

    for key in ("attention_bias",):
        if text.get(key):
            raise SpeculantError(f"{source}: {key}=true is not supported for Qwen3.5")
    if text.get("hidden_act", "silu") not in ("silu", "swish"):
        raise SpeculantError(f"{source}: hidden_act {text.get('hidden_act')!r} is not supported; Qwen3.5 uses silu")
    if raw.get("quantization_config") or text.get("quantization_config"):
        raise SpeculantError(f"{source}: quantized checkpoints are not loaded; use the unquantized folder or a GGUF")
    n_layers = integer("num_hidden_layers", 32)
    rope = text.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise SpeculantError(f"{source}: rope_parameters must be an object")
    if rope.get("rope_type", "default") != "default":
        raise SpeculantError(f"{source}: rope_type {rope.get('rope_type')!r} is not supported for Qwen3.5 (default)")
    theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
    factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    head_dim = integer("head_dim", 256)
    layer_types = text.get("layer_types")
    if layer_types is None:
        every = integer("full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % every else "full_attention" for i in range(n_layers)]
    if not isinstance(layer_types, list):
        raise SpeculantError(f"{source}: layer_types must be a list")
    if not isinstance(theta, (int, float)) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise SpeculantError(f"{source}: rope_theta / partial_rotary_factor must be numbers (factor in (0, 1])")
    tie = text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    return Qwen35Config(
        n_layers=n_layers, dim=integer("hidden_size", 4096), n_heads=integer("num_attention_heads", 16),
        n_kv_heads=integer("num_key_value_heads", 4), head_dim=head_dim, hidden_dim=integer("intermediate_size", 12288),
        vocab_size=integer("vocab_size", 248320), context_length=integer("max_position_embeddings", 32768),
        layer_types=tuple(layer_types), lin_k_heads=integer("linear_num_key_heads", 16),
        lin_v_heads=integer("linear_num_value_heads", 32), lin_k_dim=integer("linear_key_head_dim", 128),
        lin_v_dim=integer("linear_value_head_dim", 128), conv_kernel=integer("linear_conv_kernel_dim", 4),
        rotary_dim=int(head_dim * factor), rope_base=float(theta), norm_eps=float(text.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(tie), mtp_layers=int(text.get("mtp_num_hidden_layers", 0) or 0))
