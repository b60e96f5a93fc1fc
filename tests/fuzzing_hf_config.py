"""config.json fuzzing for the Hugging Face loader (speculant/models/hf_config.py, load_hf.py).

Seeds are config.json files in the layouts transformers writes (4.x and 5.x keys; llama, qwen2, mistral;
default, linear and llama3 rotary settings; tied and untied), each beside tiny random safetensors
weights that fit it. A case applies one to three mutations: a known field (or any field of the seed)
set to a value of the wrong type or an edge value, a rotary-settings entry changed, a field removed, a
random change deep in the JSON tree, or damaged bytes (truncation, bit flips, NaN/Infinity/1e999,
deep nesting, bad UTF-8). Case i is a pure function of i (`random.Random(i)`).

The case is loaded as speculant loads a folder (HFSource, then a float32 Transformer and a 3-token
forward pass). Outcomes:
- "error": a SpeculantError whose message names one of the mutated fields (or, for damaged bytes,
  the file). An error that names none of them is a finding ("unnamed: ...").
- "ok": loaded, and the logits are finite. A load that accepted a wrong-typed or out-of-range value
  of a field every layout reads is a finding ("accepted: ..."); so are non-finite logits.
Findings are raised as `Finding`, so tests/fuzzing.py's runner counts them with the bugs (any exception
but SpeculantError), beside hangs, crashes and unbounded allocations (MemoryError).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path

_TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256}
_V4_COMMON = {"attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
              "initializer_range": 0.02, "rms_norm_eps": 1e-5, "transformers_version": "4.45.2", "use_cache": True}
_LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# (name, weights: "llama" | "qwen2" (q/k/v biases), tied embeddings, config.json)
SEEDS: list[tuple[str, str, bool, dict]] = [
    ("llama v4 (SmolLM2-like)", "llama", False, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY, **_V4_COMMON, "attention_bias": False,
        "mlp_bias": False, "head_dim": 16, "pretraining_tp": 1, "rope_scaling": None, "rope_theta": 100000.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16"}),
    ("qwen2 v4 tied (Qwen2.5-like)", "qwen2", True, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_TINY, **_V4_COMMON, "max_window_layers": 2,
        "rope_theta": 1000000.0, "sliding_window": 256, "use_sliding_window": False, "tie_word_embeddings": True,
        "torch_dtype": "bfloat16", "rope_scaling": None}),
    ("llama v5 llama3 rope", "llama", False, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY, "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "dtype": "bfloat16", "tie_word_embeddings": False, "head_dim": None, "transformers_version": "5.0.0",
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, **_LLAMA3}}),
    ("mistral v4", "llama", False, {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral", **_TINY, **_V4_COMMON, "sliding_window": None,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32"}),
    ("llama v4 linear rope, tied", "llama", True, {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", **_TINY, **_V4_COMMON,
        "rope_scaling": {"type": "linear", "factor": 2.0}, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "torch_dtype": "float16"}),
    ("qwen2 v5 layer_types", "qwen2", False, {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **_TINY, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "dtype": "float32", "layer_types": ["full_attention", "full_attention"],
        "use_sliding_window": False, "sliding_window": None, "max_window_layers": 28, "tie_word_embeddings": False,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}),
]

# Fields every layout reads, with what a value must be (else the load must fail, naming the field).
_POSITIVE_INTS = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
                  "num_key_value_heads", "vocab_size", "max_position_embeddings", "head_dim")
_POSITIVE_NUMBERS = ("rms_norm_eps", "rope_theta", "partial_rotary_factor")
_BOOLS = ("tie_word_embeddings", "mlp_bias")
_OBJECTS = ("rope_scaling", "rope_parameters")
KEYS = (*_POSITIVE_INTS, *_POSITIVE_NUMBERS, *_BOOLS, *_OBJECTS, "architectures", "model_type", "hidden_act",
        "attention_bias", "torch_dtype", "dtype", "quantization_config", "sliding_window", "use_sliding_window",
        "max_window_layers", "layer_types", "original_max_position_embeddings")
ROPE_KEYS = ("rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
             "rope_theta", "partial_rotary_factor", "full_attention", "sliding_attention")


def _value(rng: random.Random, old: object) -> object:
    """A wrong-typed, edge or hostile value (sometimes a near miss of the old one)."""
    if isinstance(old, (int, float)) and not isinstance(old, bool) and math.isfinite(old) and rng.random() < 0.3:
        return rng.choice([old * 2, old + 1, old - 1, -old, old / 3, int(old) // 2, 0, float(old)])
    return rng.choice([
        None, True, False, 0, 1, -1, 2, 3, 7, 2**31, 2**63, 10**30, -(2**63), 0.5, 1.5, 1e-320, 1e308,
        math.nan, math.inf, -math.inf, "", "12", "true", "false", "silu", "gelu", "llama3", "yarn", "bfloat16",
        "float8_e4m3", "\ufffd" * 3, [], [1, 2], ["full_attention"], ["sliding_attention", "full_attention"],
        ["LlamaForCausalLM"], ["GPT2LMHeadModel"], {}, {"rope_type": "llama3"}, {"factor": 2.0},
        {"quant_method": "awq"}, {"full_attention": {"rope_type": "linear"}}, [[[[[]]]]], {"a": {"b": None}}])


def mutate_tree(value: object, rng: random.Random, leaf: Callable[[random.Random, object], object] = _value,
                depth: int = 0) -> object:
    """One random change somewhere below `value`: a dict entry dropped, or a leaf replaced by `leaf`."""
    if isinstance(value, dict) and value and (depth < 2 or rng.random() < 0.7):
        key = rng.choice(list(value))
        if rng.random() < 0.15:
            return {k: v for k, v in value.items() if k != key}
        return {**value, key: mutate_tree(value[key], rng, leaf, depth + 1)}
    if isinstance(value, list) and value and rng.random() < 0.8:
        i = rng.randrange(len(value))
        return value[:i] + [mutate_tree(value[i], rng, leaf, depth + 1)] + value[i + 1 :]
    return leaf(rng, value)


def mutate(config: dict, rng: random.Random) -> tuple[bytes, set[str], list[tuple[str, object]]]:
    """(config.json bytes, the field names a refusal may name, [(top-level field, new value)]);
    an empty name set means damaged bytes (the file itself is named)."""
    cfg = json.loads(json.dumps(config))
    names: set[str] = set()
    sets: list[tuple[str, object]] = []
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        kind = rng.random()
        if kind < 0.4:  # a known field (present or not) or any of the seed's
            key = rng.choice(KEYS if rng.random() < 0.7 else sorted(cfg))
            cfg[key] = _value(rng, cfg.get(key))
            names.add(key)
            sets.append((key, cfg[key]))
        elif kind < 0.6:  # the rotary settings
            key = rng.choice(_OBJECTS)
            inner = cfg.get(key) if isinstance(cfg.get(key), dict) else {}
            sub = rng.choice(ROPE_KEYS)
            cfg[key] = {**inner, sub: _value(rng, inner.get(sub)) if rng.random() < 0.8 else rng.choice(
                ["default", "linear", "llama3", "dynamic", "yarn"])}
            names |= {key, sub}
        elif kind < 0.7 and cfg:  # a field removed
            key = rng.choice(sorted(cfg))
            del cfg[key]
            names.add(key)
        else:  # a change deep in the tree
            key = rng.choice(sorted(cfg)) if cfg else "x"
            cfg[key] = mutate_tree(cfg.get(key), rng)
            names.add(key)
            if isinstance(cfg[key], dict):
                names |= set(cfg[key])
    text = json.dumps(cfg)
    if rng.random() < 0.15:
        return _damaged(text, rng), set(), []
    return text.encode(), names, sets


def _damaged(text: str, rng: random.Random) -> bytes:
    data = bytearray(text.encode())
    kind = rng.randrange(8)
    if kind == 0:
        return bytes(data[: rng.randrange(len(data) + 1)])
    if kind == 1:
        for _ in range(rng.randint(1, 8)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        return bytes(data)
    if kind == 2:  # numbers Python's json reads as nan / inf
        return text.replace("2,", rng.choice(["NaN,", "Infinity,", "-Infinity,", "1e999,"]), 1).encode()
    if kind == 3:  # nested deeper than Python's recursion limit
        depth = rng.choice([50, 5000, 100000])
        return ("[" * depth + "]" * depth).encode() if rng.random() < 0.5 else \
            text.replace('"model_type": ', '"model_type": ' + '{"a": ' * depth + "1" + "}" * depth + ', "_x": ', 1).encode()
    if kind == 4:
        return b"\xef\xbb\xbf" + bytes(data)  # a UTF-8 byte-order mark
    if kind == 5:
        return bytes(data[:10]) + b"\xff\xfe\x80" + bytes(data[10:])  # not UTF-8
    if kind == 6:
        return rng.choice([b"", b"null", b"[]", b"7", b'"config"', b"{}"])
    return text.replace("{", '{"hidden_size": 32, ', 1).encode()  # a duplicated key (json keeps the last)


# ----------------------------------------------------------------------------------------- target
def _weights(folder: Path, arch: str, tied: bool) -> None:
    """Random float32 tensors of the tiny shapes (HF names) into folder/model.safetensors."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    d, f, v, hd, heads, kv = 64, 96, 97, 16, 4, 2
    shapes = {"model.embed_tokens.weight": (v, d), "model.norm.weight": (d,)}
    if not tied:
        shapes["lm_head.weight"] = (v, d)
    for i in range(2):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                   p + "self_attn.q_proj.weight": (heads * hd, d), p + "self_attn.k_proj.weight": (kv * hd, d),
                   p + "self_attn.v_proj.weight": (kv * hd, d), p + "self_attn.o_proj.weight": (d, heads * hd),
                   p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d), p + "mlp.down_proj.weight": (d, f)}
        if arch == "qwen2":
            shapes |= {p + "self_attn.q_proj.bias": (heads * hd,), p + "self_attn.k_proj.bias": (kv * hd,),
                       p + "self_attn.v_proj.bias": (kv * hd,)}
    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: torch.randn(*s, generator=g) * 0.2 + (1.0 if k.endswith("norm.weight") else 0.0)
               for k, s in shapes.items()}, str(folder / "model.safetensors"))


def _badly_typed(key: str, value: object) -> bool:
    """Would transformers' own (strict) config classes refuse this value of a field every layout reads?"""
    if value is None:
        return False
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key in _POSITIVE_INTS:
        return not (number and isinstance(value, int) and value >= 1)
    if key in _POSITIVE_NUMBERS:
        return not (number and 0 < value < math.inf)
    if key in _BOOLS:
        return not isinstance(value, bool)
    if key in _OBJECTS:
        return not isinstance(value, dict)
    return False


def config_seeds() -> list[tuple[str, str, bool, dict]]:
    return SEEDS


def config_target(seeds: list, i: int, folder: Path) -> str:
    import torch

    from speculant.errors import SpeculantError
    from speculant.models.build import build_transformer
    from speculant.models.load_hf import HFSource

    rng = random.Random(i)
    k = i % len(seeds)
    _, arch, tied, config = seeds[k]
    where = folder / f"seed{k}"
    if not (where / "model.safetensors").exists():
        _weights(where, arch, tied)
    data, names, sets = mutate(config, rng)
    (where / "config.json").write_bytes(data)
    try:
        src = HFSource(where)
        model = build_transformer(src, "float32", cache_dir=None, progress=False)
        n = min(3, src.config.context_length)  # (a context shorter than that is the model's, not an error)
        logits = model(torch.tensor([1, 5, 9][:n]), model.new_cache(n)).logits
    except SpeculantError as e:
        message = str(e)
        if names and not any(n in message for n in names):
            raise Finding(f"unnamed: mutated {sorted(names)} -> {message[:200]}") from None
        if not names and "config.json" not in message:
            raise Finding(f"unnamed: damaged bytes -> {message[:200]}") from None
        return "error"
    final = json.loads(data)
    bad = [(key, value) for key, value in sets if _badly_typed(key, value) and _same(final.get(key), value)]
    if bad:
        raise Finding(f"accepted: {bad[0][0]}={bad[0][1]!r}")
    if not torch.isfinite(logits).all():
        raise Finding(f"non-finite logits: mutated {sorted(names)}")
    return "ok"


class Finding(AssertionError):
    """A load that ended wrongly without an exception of its own (the runner counts it as a bug)."""


def _same(a: object, b: object) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
