"""A Hugging Face `config.json` -> `ModelConfig`, in every layout transformers has written.

transformers 4 writes the rotary settings as top-level `rope_theta` + `rope_scaling`; transformers 5
writes them as one `rope_parameters` dict (possibly nested by layer type), and renamed `torch_dtype`
to `dtype`. Both are read here, the way transformers itself reads them, with its per-class defaults
for absent fields (a llama config without `rms_norm_eps` means 1e-6, not 1e-5). Anything that would
change the model's output and that speculant does not run (other rotary scalings, sliding-window
layers, biases the block lacks, quantized checkpoints) is an error naming the field; a value stated
twice, differently, is an error too, so no setting is ever silently dropped or defaulted. Every value
read is type-checked and bounded (a "false" string is not a boolean, a float is not a head count, a
context of 2**40 would allocate rotary tables without end): an error names the field (found by the
config.json fuzzer, tests/fuzzing_hf_config.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ..errors import SpeculantError
from .config import ModelConfig, RopeScaling

# Architecture class (or model_type) -> (engine arch, transformers' class defaults for absent fields).
_ARCHS: Mapping[str, str] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral",
                             "Qwen3ForCausalLM": "qwen3", "Gemma3ForCausalLM": "gemma3", "SmolLM3ForCausalLM": "smollm3",
                             "smollm3": "smollm3",
                             "llama": "llama", "qwen2": "qwen2", "mistral": "mistral", "qwen3": "qwen3",
                             "gemma3_text": "gemma3"}
_DEFAULTS: Mapping[str, Mapping[str, Any]] = {
    # transformers' LlamaConfig / Qwen2Config / MistralConfig defaults (the same in 4.45 and 5.x)
    "llama": {"max_position_embeddings": 2048, "num_key_value_heads": None, "sliding_window": None},
    "qwen2": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096},
    "mistral": {"max_position_embeddings": 131072, "num_key_value_heads": 8, "sliding_window": 4096},
    "qwen3": {"max_position_embeddings": 32768, "num_key_value_heads": 32, "sliding_window": 4096, "head_dim": 128},
    "smollm3": {"max_position_embeddings": 32768, "num_key_value_heads": 4, "sliding_window": None,
                "tie_word_embeddings": True},
    "gemma3": {"max_position_embeddings": 131072, "num_key_value_heads": 4, "sliding_window": 4096, "head_dim": 256,
               "rope_theta": 1_000_000.0, "tie_word_embeddings": True},
}
_GEMMA_LOCAL_THETA = 10000.0  # transformers' Gemma3TextConfig default for the sliding-window layers
_GEMMA_PATTERN = 6  # its default sliding_window_pattern: every 6th layer is global
_DEFAULT_THETA = 10000.0
_RMS_EPS = 1e-6
_FLOAT_DTYPES = ("float32", "bfloat16", "float16", "auto")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_MAX_SIZE = 1 << 24  # any width, head or vocabulary count: far above real models (shapes are checked on the weights)
_MAX_LAYERS = 4096  # Llama 3.1 405B has 126
_FLOAT32_MAX = 3.4028234663852886e38
REQUIRED = object()  # _Fields.integer's default for a field that must be present
_MAX_CONTEXT = 1 << 22  # rotary tables are built for the whole context: 4M positions is 1 GB at head_dim 128


def config_from_hf(raw: Mapping[str, Any], *, source: str, has_lm_head: bool) -> ModelConfig:
    """Parse a config.json dict (`source` names the file in errors; `has_lm_head`: the weights hold
    `lm_head.weight`, so an untied model can be told from a folder missing its output layer)."""
    c = _Fields(raw, source)
    kind = _arch(raw, source)
    defaults = _DEFAULTS[kind]
    c.refuse_set("quantization_config", "quantized checkpoints are not loaded; use the unquantized folder "
                 "(speculant quantizes it itself on load: --dtype q8_0, q4_0, int8, ...) or a GGUF file")
    gemma = kind == "gemma3"
    act_key = "hidden_activation" if gemma else "hidden_act"
    act = c.get(act_key, "gelu_pytorch_tanh" if gemma else "silu")
    if act not in (("gelu_pytorch_tanh",) if gemma else ("silu", "swish")):
        raise SpeculantError(f"{source}: {act_key} {_show(act)} is not supported; the {kind} block uses "
                             f"{'gelu_pytorch_tanh' if gemma else 'silu'}")
    if c.flag("mlp_bias", False):
        raise SpeculantError(f"{source}: mlp_bias=true (biases on the MLP projections) is not supported")
    if gemma:
        c.refuse_set("attn_logit_softcapping", "soft-capping of attention scores is not supported")
        if c.flag("use_bidirectional_attention", False):
            raise SpeculantError(f"{source}: use_bidirectional_attention=true (an encoder) is not supported")
    if kind != "qwen2" and c.flag("attention_bias", False):
        raise SpeculantError(f"{source}: attention_bias=true (biases on q/k/v and o_proj) is not supported; "
                             "speculant runs q/k/v biases only, as qwen2 has them")
    _check_dtype(c)

    n_layers = c.integer("num_hidden_layers", hi=_MAX_LAYERS)
    dim, n_heads = c.integer("hidden_size"), c.integer("num_attention_heads")
    n_kv = c.integer("num_key_value_heads", defaults["num_key_value_heads"] or n_heads)
    head_dim = c.integer("head_dim", defaults.get("head_dim", 0))
    if not head_dim and dim % n_heads:
        raise SpeculantError(f"{source}: hidden_size {dim} is not divisible by num_attention_heads {n_heads} "
                             "(and no head_dim is given)")
    if (head_dim or dim // n_heads) % 2:
        raise SpeculantError(f"{source}: the head size (head_dim, or hidden_size / num_attention_heads) is "
                             f"{head_dim or dim // n_heads}; rotary embeddings need an even one")
    if n_heads % n_kv:
        raise SpeculantError(f"{source}: num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
    context = c.integer("max_position_embeddings", defaults["max_position_embeddings"], hi=_MAX_CONTEXT)
    rope_base, scaling, freq_factors = _rope(c, context, head_dim or dim // n_heads, defaults.get("rope_theta"), gemma)
    local_layers, window = _check_attention_layers(c, kind, n_layers, context, defaults["sliding_window"])
    local_base = _local_rope_base(c) if gemma else None

    tie = c.flag("tie_word_embeddings", defaults.get("tie_word_embeddings", False))
    if not tie and not has_lm_head:
        said = ("says tie_word_embeddings false" if "tie_word_embeddings" in raw
                else "leaves out tie_word_embeddings (which means false)")
        raise SpeculantError(f"{source} {said}, so the model has its own output layer, but the weights have "
                             "no lm_head.weight; the folder is incomplete")
    extra: dict[str, Any] = {}
    if kind in ("qwen3", "gemma3"):
        extra["qk_norm"] = True
    if gemma:
        # transformers: embed_scale is a float32 tensor of hidden_size ** 0.5, cast to the weights' dtype
        extra |= {"post_norms": True, "activation": "gelu_tanh", "embed_scale": float(dim**0.5),
                  "attn_scale": c.number("query_pre_attn_scalar", 256.0) ** -0.5,
                  "final_softcap": c.number("final_logit_softcapping", 0.0) or None,
                  "rope_local_base": local_base}
    if any(local_layers):
        extra |= {"local_layers": local_layers, "sliding_window": window}
    if kind == "smollm3":
        extra["nope_layers"] = _nope_layers(c, n_layers)
    cfg = ModelConfig(
        arch="llama" if kind == "mistral" else kind,
        n_layers=n_layers, dim=dim, n_heads=n_heads, n_kv_heads=n_kv,
        hidden_dim=c.integer("intermediate_size"),
        vocab_size=c.integer("vocab_size"),
        context_length=context,
        norm_eps=c.number("rms_norm_eps", _RMS_EPS),
        rope_base=rope_base, rope_scaling=scaling, rope_freq_factors=freq_factors,
        head_dim=head_dim,
        qkv_bias=kind == "qwen2",
        tie_embeddings=tie,
        **extra,
    )
    if not all(0.0 < f < _FLOAT32_MAX for f in cfg.inv_freq()):  # e.g. rope_theta 1e-320 (the tables are float32)
        raise SpeculantError(f"{source}: the rotary settings (rope_theta {rope_base}, rope_scaling / rope_parameters "
                             f"{scaling or freq_factors}) give frequencies that are zero or not finite in float32")
    return cfg


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _int(value: Any, name: str, source: str, lo: int = 1, hi: int = _MAX_SIZE) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpeculantError(f"{source}: {name} must be an integer, got {_show(value)}")
    if not lo <= value <= hi:
        raise SpeculantError(f"{source}: {name} is {_show(value)}; it must be in [{lo}, {hi}]")
    return value


def _positive(value: Any, name: str, source: str) -> float:
    """A finite number > 0 (JSON's 1e999 reads as inf, NaN as nan)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < math.inf):
        raise SpeculantError(f"{source}: {name} must be a finite number > 0, got {_show(value)}")
    return float(value)


class _Fields:
    """config.json values, with null read as absent (transformers writes `"head_dim": null`)."""

    def __init__(self, raw: Mapping[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def get(self, key: str, default: Any) -> Any:
        value = self.raw.get(key)
        return default if value is None else value

    def integer(self, key: str, default: Any = REQUIRED, *, lo: int = 1, hi: int = _MAX_SIZE) -> Any:
        """An integer in [lo, hi], else `default` where absent (an error if REQUIRED)."""
        value = self.raw.get(key)
        if value is None:
            if default is REQUIRED:
                raise SpeculantError(f"{self.source} has no integer {key}; it is not a complete model config")
            return default
        return _int(value, key, self.source, lo, hi)

    def number(self, key: str, default: float) -> float:
        value = self.raw.get(key)
        return default if value is None else _positive(value, key, self.source)

    def flag(self, key: str, default: bool) -> bool:
        value = self.raw.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise SpeculantError(f"{self.source}: {key} must be true or false, got {_show(value)}")
        return value

    def refuse_set(self, key: str, why: str) -> None:
        value = self.raw.get(key)
        if value:
            what = value.get("quant_method", value) if isinstance(value, dict) else value
            raise SpeculantError(f"{self.source} has {key} ({_show(what)}): {why}")


def _arch(raw: Mapping[str, Any], source: str) -> str:
    archs = raw.get("architectures") or []
    name = archs[0] if isinstance(archs, list) and archs else raw.get("model_type")
    kind = _ARCHS.get(name) if isinstance(name, str) else None
    if kind is None:
        raise SpeculantError(f"unsupported architecture {_show(name)} (architectures / model_type) in {source}: "
                             "speculant runs Llama, Mistral, Qwen2, Qwen3, SmolLM3 and Gemma 3 text decoders (LlamaForCausalLM, "
                             "MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, SmolLM3ForCausalLM, "
                             "Gemma3ForCausalLM)")
    return kind


def _check_dtype(c: _Fields) -> None:
    # transformers 5 writes `dtype`, 4 `torch_dtype`; the tensors are read in whatever they hold, but a
    # non-float checkpoint dtype means a quantized or exotic file.
    for key in ("dtype", "torch_dtype"):
        value = c.get(key, "auto")
        if value not in _FLOAT_DTYPES:
            raise SpeculantError(f"{c.source}: {key} {_show(value)} is not supported; speculant reads float32, "
                                 "bfloat16 and float16 checkpoints")


def _rope(c: _Fields, context: int, head_dim: int,
          default_theta: float | None = None,
          local_ok: bool = False) -> tuple[float, RopeScaling | None, tuple[float, ...] | None]:
    """(base, Llama 3 scaling, per-frequency divisors) of the full-attention layers from either layout,
    as transformers merges them."""
    params, where = _rope_dict(c, local_ok)
    src = c.source
    theta = c.number("rope_theta", 0.0) or None
    base = theta or default_theta or _DEFAULT_THETA
    if "rope_theta" in params:
        base = _positive(params["rope_theta"], where["rope_theta"], src)
        if theta is not None and base != theta:
            raise SpeculantError(f"{src} states the rotary base twice, differently: rope_theta {theta} and "
                                 f"{where['rope_theta']} {base}; remove one")
    if "partial_rotary_factor" in params:
        partial = _positive(params["partial_rotary_factor"], where["partial_rotary_factor"], src)
    else:
        partial = c.number("partial_rotary_factor", 1.0)
    if partial != 1.0:
        raise SpeculantError(f"{src}: partial_rotary_factor {partial} (rotary on part of each head) is not supported")
    kind = params.get("rope_type", "default")
    if not isinstance(kind, str):
        raise SpeculantError(f"{src}: {where['rope_type']} must be a string, got {_show(kind)}")
    if kind == "default":
        return base, None, None
    if kind == "linear":  # positions divided by `factor` == every inverse frequency divided by it
        factor = _positive(_need(params, "factor", where, src, kind), where["factor"], src)
        return base, None, (factor,) * (head_dim // 2)
    if kind == "llama3":
        factor, low, high = (_positive(_need(params, k, where, src, kind), where[k], src) for k in _LLAMA3_KEYS)
        if high <= low:  # transformers' llama3 scaling divides by (high - low)
            raise SpeculantError(f"{src}: {where['high_freq_factor']} ({high}) must be greater than "
                                 f"{where['low_freq_factor']} ({low})")
        # transformers 5 prefers a top-level original_max_position_embeddings, then the dict's, then the context
        top = c.integer("original_max_position_embeddings", None, hi=_MAX_CONTEXT)
        key = "original_max_position_embeddings"
        inner = _int(params[key], where[key], src, hi=_MAX_CONTEXT) if key in params else None
        if top is not None and inner is not None and top != inner:
            raise SpeculantError(f"{src} states original_max_position_embeddings twice, differently: "
                                 f"{top} and {inner} in {where[key]}; remove one")
        return base, RopeScaling(factor, low, high, top or inner or context), None
    raise SpeculantError(f"{src}: rotary scaling {_show(kind)} ({where['rope_type']}) is not supported (speculant "
                         "runs default, linear and llama3 rotary embeddings); remove it from config.json only if "
                         "the model was not trained with it")


def _rope_dict(c: _Fields, local_ok: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """The one rotary settings dict: transformers 5 `rope_parameters` (flat, or nested by layer type) and
    transformers 4 `rope_scaling`, which must agree where both are present; and where each value came
    from (`rope_scaling.factor`), for errors. Null values count as absent."""
    merged: dict[str, Any] = {}
    where: dict[str, str] = {}
    for key in ("rope_parameters", "rope_scaling"):
        value = c.get(key, {})
        if not isinstance(value, dict):
            raise SpeculantError(f"{c.source}: {key} must be an object, got {_show(value)}")
        if value and all(isinstance(v, dict) or v is None for v in value.values()):
            # nested by layer type ({"full_attention": {...}}); only full-attention layers are run, but for
            # gemma3 (local_ok), whose sliding-window layers' settings _local_rope_base reads
            unknown = sorted(k for k in value if k != "full_attention" and not (local_ok and k == "sliding_attention"))
            if unknown:
                raise SpeculantError(f"{c.source}: {key} has rotary settings for layer types {_show(unknown)}; "
                                     "speculant runs full-attention layers only")
            value, key = value.get("full_attention") or {}, f"{key}.full_attention"
        for k, v in value.items():
            name = f"{key}.{k}"
            k = "rope_type" if k == "type" else k
            if v is None:
                continue
            if k in merged and merged[k] != v:
                raise SpeculantError(f"{c.source} states {k} twice, differently: {_show(merged[k])} in {where[k]} "
                                     f"and {_show(v)} in {name}; remove one")
            merged[k], where[k] = v, name
    where.setdefault("rope_type", "rope_scaling.rope_type")
    return merged, where


def _local_rope_base(c: _Fields) -> float:
    """The rotary base of gemma3's sliding-window layers: rope_parameters.sliding_attention.rope_theta
    (transformers 5), else rope_local_base_freq (4), else 10000; only the default rotary is run there."""
    nested = c.get("rope_parameters", {})
    local = nested.get("sliding_attention") if isinstance(nested, dict) else None
    top = c.number("rope_local_base_freq", 0.0) or None
    if not isinstance(local, dict):
        return top or _GEMMA_LOCAL_THETA
    kind = local.get("rope_type", local.get("type", "default"))
    if kind != "default":
        raise SpeculantError(f"{c.source}: rope_parameters.sliding_attention.rope_type {_show(kind)} is not "
                             "supported (the sliding-window layers run the default rotary)")
    if local.get("rope_theta") is None:
        return top or _GEMMA_LOCAL_THETA
    base = _positive(local["rope_theta"], "rope_parameters.sliding_attention.rope_theta", c.source)
    if top is not None and top != base:
        raise SpeculantError(f"{c.source} states the local rotary base twice, differently: rope_local_base_freq "
                             f"{top} and rope_parameters.sliding_attention.rope_theta {base}; remove one")
    return base


def _nope_layers(c: _Fields, n_layers: int) -> tuple[bool, ...]:
    """SmolLM3's layers without rotary: no_rope_layers (1 = rotary, 0 = none, one per layer), else every
    no_rope_layer_interval-th layer (transformers' default 4, llama.cpp's fixed step)."""
    flags = c.get("no_rope_layers", None)
    if flags is None:
        step = c.integer("no_rope_layer_interval", 4, hi=_MAX_LAYERS)
        return tuple((i + 1) % step == 0 for i in range(n_layers))
    if not isinstance(flags, list) or len(flags) != n_layers or any(f not in (0, 1) or isinstance(f, float) for f in flags):
        raise SpeculantError(f"{c.source}: no_rope_layers must list 0 or 1 for each of the {n_layers} layers, "
                             f"got {_show(flags)}")
    return tuple(f == 0 for f in flags)


def _need(params: Mapping[str, Any], key: str, where: Mapping[str, str], source: str, kind: str) -> Any:
    if params.get(key) is None:
        container = where["rope_type"].rsplit(".", 1)[0]
        raise SpeculantError(f"{source}: {kind} rotary scaling ({container}) needs {key}, which is missing")
    return params[key]


def _check_attention_layers(c: _Fields, kind: str, n_layers: int, context: int,
                            default_window: int | None) -> tuple[tuple[bool, ...], int | None]:
    """(per layer: sliding-window layer, the window). gemma3 runs its sliding-window layers; for the other
    archs every layer must be full attention over the whole context: a sliding window shorter than the
    context changes attention from that length on, and speculant never silently attends to everything."""
    types = c.get("layer_types", None)
    if types is not None and (not isinstance(types, list) or len(types) != n_layers
                              or not all(isinstance(t, str) for t in types)):
        raise SpeculantError(f"{c.source}: layer_types must list one type per layer (num_hidden_layers {n_layers}) by name, "
                             f"got {_show(types)}")
    big = 1 << 62  # a window at least the context long is full attention, however long
    if kind == "gemma3":
        window = c.integer("sliding_window", default_window, hi=big)
        if types is None:  # transformers' rule: every sliding_window_pattern-th layer is global
            pattern = c.integer("sliding_window_pattern", _GEMMA_PATTERN, hi=big)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        bad = [t for t in types if t not in ("full_attention", "sliding_attention")]
        if bad:
            raise SpeculantError(f"{c.source}: layer type {_show(bad[0])} is not supported (full_attention, "
                                 "sliding_attention)")
        local = tuple(t == "sliding_attention" for t in types)
        if any(local) and window is None:
            raise SpeculantError(f"{c.source}: sliding-window layers need a sliding_window")
        return local, window if any(local) else None
    if kind in ("qwen2", "qwen3", "smollm3"):
        window = c.integer("sliding_window", default_window, hi=big) if c.flag("use_sliding_window", False) else None
        if types is None:  # transformers' rule: layers from max_window_layers on slide, if sliding is on
            first = c.integer("max_window_layers", 28, lo=0, hi=big)
            types = ["sliding_attention" if window is not None and i >= first else "full_attention"
                     for i in range(n_layers)]
    else:  # llama has no window field (a stated one is still honoured); mistral slides on every layer
        window = c.integer("sliding_window", default_window, hi=big)
        if types is None:
            types = ["sliding_attention" if window is not None else "full_attention"] * n_layers
    for i, t in enumerate(types):
        if t == "full_attention":
            continue
        if t != "sliding_attention":
            raise SpeculantError(f"{c.source}: layer_types[{i}] is {_show(t)}; speculant runs full-attention "
                                 "layers only")
        if window is None:
            window = c.integer("sliding_window", default_window, hi=big)
        if window is not None and window < context:
            raise SpeculantError(
                f"{c.source}: layer {i} uses sliding-window attention (sliding_window {window} < context "
                f"{context}), which speculant does not run: it runs full attention, which equals a sliding "
                "window only when the window is at least max_position_embeddings long")
    return (), None
