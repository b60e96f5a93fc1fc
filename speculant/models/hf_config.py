"""A Hugging Face `config.json` -> `ModelConfig`, in every layout transformers has written.

transformers 4 writes the rotary settings as top-level `rope_theta` + `rope_scaling`; transformers 5
writes them as one `rope_parameters` dict (possibly nested by layer type), and renamed `torch_dtype`
to `dtype`. Both are read here, the way transformers itself reads them, with its per-class defaults
for absent fields (a llama config without `rms_norm_eps` means 1e-6, not 1e-5). Anything that would
change the model's output and that speculant does not run (other rotary scalings, sliding-window
layers, biases the block lacks, quantized checkpoints) is an error naming the field; a value stated
twice, differently, is an error too, so no setting is ever silently dropped or defaulted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import SpeculantError
from .config import ModelConfig, RopeScaling

# Architecture class (or model_type) -> (engine arch, transformers' class defaults for absent fields).
_ARCHS: Mapping[str, str] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                             "llama": "llama", "qwen2": "qwen2", "mistral": "mistral"}
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    # transformers' LlamaConfig / Qwen2Config / MistralConfig defaults (the same in 4.45 and 5.x)
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "sliding_window": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
}
_DEFAULT_THETA = 10000.0
_RMS_EPS = 1e-6
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "auto")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")


def config_from_hf(raw: Mapping[str, Any], *, source: str, has_lm_head: bool) -> ModelConfig:
    """Parse a config.json dict (`source` names the file in errors; `has_lm_head`: the weights hold
    `lm_head.weight`, so an untied model can be told from a folder missing its output layer)."""
    c = _Fields(raw, source)
    kind = _arch(raw, source)
    defaults = _DEFAULTS[kind]
    c.refuse_set("quantization_config", "quantized checkpoints are not loaded; use the unquantized folder "
                 "(speculant quantizes it itself with --dtype int8/int4) or a GGUF file")
    act = c.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise SpeculantError(f"{source}: hidden_act {act!r} is not supported; the llama/qwen2 block uses silu")
    if c.get("mlp_bias", False):
        raise SpeculantError(f"{source}: mlp_bias=true (biases on the MLP projections) is not supported")
    if kind != "qwen2" and c.get("attention_bias", False):
        raise SpeculantError(f"{source}: attention_bias=true (biases on q/k/v and o_proj) is not supported; "
                             "speculant runs q/k/v biases only, as qwen2 has them")
    _check_dtype(c)

    n_layers, dim, n_heads = c.need_int("num_hidden_layers"), c.need_int("hidden_size"), c.need_int("num_attention_heads")
    n_kv = c.get("num_key_value_heads", defaults["num_key_value_heads"])
    head_dim = c.get("head_dim", None)
    context = int(c.get("max_position_embeddings", defaults["max_position_embeddings"]))
    rope_base, scaling, freq_factors = _rope(c, context, head_dim or (dim // n_heads if n_heads else 0))
    _check_attention_layers(c, kind, n_layers, context, defaults["sliding_window"])

    tie = c.get("tie_word_embeddings", False)
    if not tie and not has_lm_head:
        said = ("says tie_word_embeddings false" if "tie_word_embeddings" in raw
                else "leaves out tie_word_embeddings (which means false)")
        raise SpeculantError(f"{source} {said}, so the model has its own output layer, but the weights have "
                             "no lm_head.weight; the folder is incomplete")
    return ModelConfig(
        arch="qwen2" if kind == "qwen2" else "llama",
        n_layers=n_layers, dim=dim, n_heads=n_heads,
        n_kv_heads=int(n_kv if n_kv is not None else n_heads),
        hidden_dim=c.need_int("intermediate_size"),
        vocab_size=c.need_int("vocab_size"),
        context_length=context,
        norm_eps=float(c.get("rms_norm_eps", _RMS_EPS)),
        rope_base=rope_base, rope_scaling=scaling, rope_freq_factors=freq_factors,
        head_dim=int(head_dim or 0),
        qkv_bias=kind == "qwen2",
        tie_embeddings=bool(tie),
    )


class _Fields:
    """config.json values, with null read as absent (transformers writes `"head_dim": null`)."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def need_int(self, key: str) -> int:
        value = self.raw.get(key)
        if isinstance(value, bool) or not isinstance(value, int):
            raise SpeculantError(f"{self.source} has no integer {key} (got {value!r}); it is not a complete model config")
        return value

    def refuse_set(self, key: str, why: str) -> None:
        value = self.raw.get(key)
        if value:
            what = value.get("quant_method", value) if isinstance(value, dict) else value
            raise SpeculantError(f"{self.source} has {key} ({what}): {why}")


def _arch(raw: Mapping[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    name = archs[0] if isinstance(archs, list) and archs else raw.get("model_type")
    kind = _ARCHS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise SpeculantError(f"unsupported architecture {name!r} in {source}: speculant runs Llama, Mistral and "
                             "Qwen2 decoders (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM)")
    return kind


def _check_dtype(c: _Fields) -> None:
    # transformers 5 writes `dtype`, 4 `torch_dtype`; the tensors are read in whatever they hold, but a
    # non-float checkpoint dtype means a quantized or exotic file.
    for key in ("dtype", "torch_dtype"):
        value = c.get(key, "auto")
        if value not in _FLOAT_DTYPES:
            raise SpeculantError(f"{c.source}: {key} {value!r} is not supported; speculant reads float32, "
                                 "bfloat16 and float16 checkpoints")


def _rope(c: _Fields, context: int, head_dim: int) -> tuple[float, RopeScaling | None, tuple[float, ...] | None]:
    """(base, Llama 3 scaling, per-frequency divisors) from either layout, as transformers merges them."""
    params = _rope_dict(c)
    theta = c.get("rope_theta", None)
    if "rope_theta" in params and theta is not None and float(params["rope_theta"]) != float(theta):
        raise SpeculantError(f"{c.source} states the rotary base twice, differently: rope_theta {theta} and "
                             f"rope_parameters.rope_theta {params['rope_theta']}; remove one")
    base = float(params.get("rope_theta", theta if theta is not None else _DEFAULT_THETA))
    partial = params.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
    if float(partial) != 1.0:
        raise SpeculantError(f"{c.source}: partial_rotary_factor {partial} (rotary on part of each head) is not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return base, None, None
    if kind == "linear":  # positions divided by `factor` == every inverse frequency divided by it
        factor = float(_need(params, "factor", c.source, kind))
        return base, None, (factor,) * (head_dim // 2)
    if kind == "llama3":
        values = [float(_need(params, k, c.source, kind)) for k in _LLAMA3_KEYS]
        # transformers 5 prefers a top-level original_max_position_embeddings, then the dict's, then the context
        top, inner = c.get("original_max_position_embeddings", None), params.get("original_max_position_embeddings")
        if top is not None and inner is not None and int(top) != int(inner):
            raise SpeculantError(f"{c.source} states original_max_position_embeddings twice, differently: "
                                 f"{top} and {inner} in the rotary settings; remove one")
        original = int(top or inner or context)
        return base, RopeScaling(values[0], values[1], values[2], original), None
    raise SpeculantError(f"{c.source}: rotary scaling {kind!r} is not supported (speculant runs default, linear "
                         "and llama3 rotary embeddings); remove it from config.json only if the model was not "
                         "trained with it")


def _rope_dict(c: _Fields) -> dict[str, Any]:
    """The one rotary settings dict: transformers 5 `rope_parameters` (flat, or nested by layer type) and
    transformers 4 `rope_scaling`, which must agree where both are present."""
    merged: dict[str, Any] = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = c.get(key, {})
        if not isinstance(value, dict):
            raise SpeculantError(f"{c.source}: {key} must be an object, got {value!r}")
        if value and all(isinstance(v, dict) or v is None for v in value.values()):
            # nested by layer type ({"full_attention": {...}}); only full-attention layers are run
            unknown = sorted(k for k in value if k != "full_attention")
            if unknown:
                raise SpeculantError(f"{c.source}: {key} has rotary settings for layer types {unknown}; "
                                     "speculant runs full-attention layers only")
            value = value.get("full_attention") or {}
        for k, v in value.items():
            k = "rope_type" if k == "type" else k
            if k in merged and merged[k] != v:
                raise SpeculantError(f"{c.source} states {k} twice, differently: {merged[k]!r} in rope_parameters "
                                     f"and {v!r} in rope_scaling; remove one")
            merged[k] = v
    return merged


def _need(params: Mapping[str, Any], key: str, source: str, kind: str) -> Any:
    if params.get(key) is None:
        raise SpeculantError(f"{source}: {kind} rotary scaling needs {key}, which is missing")
    return params[key]


def _check_attention_layers(c: _Fields, kind: str, n_layers: int, context: int, default_window: int | None) -> None:
    """Every layer must be full attention over the whole context: a sliding window shorter than the
    context changes attention from that length on, and speculant never silently attends to everything."""
    types = c.get("layer_types", None)
    if kind == "qwen2":
        window = c.get("sliding_window", default_window) if c.get("use_sliding_window", False) else None
        if types is None:  # transformers' rule: layers from max_window_layers on slide, if sliding is on
            first = int(c.get("max_window_layers", 28))
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(n_layers)]
    else:  # llama has no window field (a stated one is still honoured); mistral slides on every layer
        window = c.get("sliding_window", default_window)
        if types is None:
            types = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    if not isinstance(types, list) or len(types) != n_layers:
        raise SpeculantError(f"{c.source}: layer_types must list one type per layer ({n_layers}), got {types!r}")
    for i, t in enumerate(types):
        if t == "full_attention":
            continue
        if t != "sliding_attention":
            raise SpeculantError(f"{c.source}: layer {i} is of type {t!r}; speculant runs full-attention layers only")
        if window is None:
            window = c.get("sliding_window", default_window)
        if window is not None and int(window) < context:
            raise SpeculantError(
                f"{c.source}: layer {i} uses sliding-window attention (sliding_window {window} < context "
                f"{context}), which speculant does not run: it runs full attention, which equals a sliding "
                "window only when the window is at least max_position_embeddings long")
