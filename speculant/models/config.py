"""The shape of a Llama-family decoder, independent of where its weights come from.

One `ModelConfig` covers llama (Llama 2/3, SmolLM2), qwen2 (biases on q/k/v), qwen3 (per-head q/k
RMSNorms, explicit head_dim), smollm3 (llama without the rotary in every fourth layer) and gemma3 (q/k norms, norms after attention and MLP, GeGLU, embeddings
scaled by sqrt(dim), sliding-window layers with their own rotary base, logit soft-capping). The
architectures differ only in these switches; loaders fill them from GGUF metadata or an HF
`config.json`, and the Transformer only ever reads this dataclass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import SpeculantError

SUPPORTED_ARCHS = ("llama", "qwen2", "qwen3", "gemma3", "smollm3", "gemma4")  # gemma4: models/gemma4.py
ACTIVATIONS = ("silu", "gelu_tanh")  # the gate of the gated MLP: SwiGLU, GeGLU with tanh GELU


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama 3.x frequency scaling (HF `rope_type: llama3`)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True, slots=True)
class ModelConfig:
    arch: str
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float = 1e-5
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rope_freq_factors: tuple[float, ...] | None = None  # GGUF llama3: per-frequency divisors
    head_dim: int = 0  # 0: dim // n_heads
    qkv_bias: bool = False
    tie_embeddings: bool = False
    qk_norm: bool = False  # RMSNorm of each query and key head (weights [head_dim]) before the rotary
    post_norms: bool = False  # RMSNorms of the attention's and the MLP's outputs before the residual add
    activation: str = "silu"
    embed_scale: float | None = None  # embeddings times this (gemma: sqrt(dim), in float32)
    attn_scale: float | None = None  # query scale; None: head_dim ** -0.5
    sliding_window: int | None = None  # local layers attend to the last `sliding_window` positions only
    local_layers: tuple[bool, ...] = ()  # per layer: a sliding-window layer (empty: none)
    rope_local_base: float | None = None  # rotary base of local layers (default rotary, no scaling); None: rope_base
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    nope_layers: tuple[bool, ...] = ()  # per layer: no rotary embedding there (SmolLM3's NoPE layers; empty: none)

    def __post_init__(self) -> None:
        if self.arch not in SUPPORTED_ARCHS:
            raise SpeculantError(
                f"unsupported architecture {self.arch!r}: speculant runs {', '.join(SUPPORTED_ARCHS)} models"
            )
        for name in ("n_layers", "dim", "n_heads", "n_kv_heads", "hidden_dim", "vocab_size", "context_length"):
            if getattr(self, name) < 1:
                raise SpeculantError(f"model config has {name}={getattr(self, name)}; it must be >= 1")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise SpeculantError(f"dim {self.dim} is not divisible by n_heads {self.n_heads}")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.n_heads % self.n_kv_heads:
            raise SpeculantError(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads}")
        if self.activation not in ACTIVATIONS:
            raise SpeculantError(f"activation {self.activation!r} is not supported (speculant runs {', '.join(ACTIVATIONS)})")
        if self.local_layers and len(self.local_layers) != self.n_layers:
            raise SpeculantError(f"local_layers lists {len(self.local_layers)} layers, the model has {self.n_layers}")
        if self.nope_layers and len(self.nope_layers) != self.n_layers:
            raise SpeculantError(f"nope_layers lists {len(self.nope_layers)} layers, the model has {self.n_layers}")
        if any(self.local_layers) and (self.sliding_window is None or self.sliding_window < 1):
            raise SpeculantError("sliding-window layers need a sliding_window >= 1")

    def is_local(self, layer: int) -> bool:
        """Whether `layer` is a sliding-window layer (attends to the last sliding_window positions)."""
        return bool(self.local_layers) and self.local_layers[layer]

    @property
    def plain(self) -> bool:
        """The llama/qwen2 block exactly: what int8 calibration runs (the fused C loop runs every switch)."""
        return not (self.qk_norm or self.post_norms or self.activation != "silu" or self.embed_scale is not None
                    or self.attn_scale is not None or any(self.local_layers) or self.final_softcap is not None
                    or any(self.nope_layers))

    def local_inv_freq(self) -> list[float]:
        """Rotary inverse frequencies of the sliding-window layers (default rotary at rope_local_base)."""
        base = self.rope_local_base if self.rope_local_base is not None else self.rope_base
        return [1.0 / base ** (2 * i / self.head_dim) for i in range(self.head_dim // 2)]

    def inv_freq(self) -> list[float]:
        """Rotary inverse frequencies (head_dim/2 of them), with Llama 3 scaling when configured."""
        half = self.head_dim // 2
        freqs = [1.0 / self.rope_base ** (2 * i / self.head_dim) for i in range(half)]
        if self.rope_freq_factors is not None:
            return [f / d for f, d in zip(freqs, self.rope_freq_factors)]
        s = self.rope_scaling
        if s is None:
            return freqs
        # Llama 3.1 scheme: long wavelengths are slowed by `factor`, short ones kept, smooth in between.
        low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
        high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
        out = []
        for f in freqs:
            wavelen = 2 * math.pi / f
            if wavelen < high_wavelen:
                out.append(f)
            elif wavelen > low_wavelen:
                out.append(f / s.factor)
            else:
                smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
                    s.high_freq_factor - s.low_freq_factor
                )
                out.append((1 - smooth) * f / s.factor + smooth * f)
        return out
