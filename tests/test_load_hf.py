"""Hugging Face model folders: every config.json layout transformers writes, sharded and single-file
weights in float32/bfloat16/float16, and what is refused.

Fast tests build tiny random models with transformers itself (its own `save_pretrained`) and compare
logits with it; config layouts are checked field by field against transformers' own parse of the same
dict (its rotary embedding's inverse frequencies, head_dim, kv heads, eps). Real-model parity lives in
tests/test_load_hf_real.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speculant.errors import SpeculantError
from speculant.models.build import build_transformer
from speculant.models.hf_config import config_from_hf
from speculant.models.load_hf import HFSource

TINY = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 97, "max_position_embeddings": 256}
LLAMA3_SCALING = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}


def v4(arch: str = "LlamaForCausalLM", **extra: object) -> dict:
    """A transformers 4 style config: top-level rope_theta (and rope_scaling), torch_dtype."""
    model_type = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}[arch]
    return {"architectures": [arch], "model_type": model_type, **TINY, "rope_theta": 500000.0,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **extra}


def v5(arch: str = "LlamaForCausalLM", rope: dict | None = None, **extra: object) -> dict:
    """The same in transformers 5's layout: rope_parameters, dtype."""
    raw = v4(arch, **extra)
    del raw["rope_theta"], raw["torch_dtype"]
    return {**raw, "dtype": "bfloat16", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default", **(rope or {})}}


def parse(raw: dict, *, has_lm_head: bool = True):
    return config_from_hf(raw, source="config.json", has_lm_head=has_lm_head)


def reference(raw: dict):
    """transformers' own reading of the dict: its config object and its rotary inverse frequencies."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
    module = __import__(f"transformers.models.{raw['model_type']}.modeling_{raw['model_type']}", fromlist=["x"])
    rotary = getattr(module, {"llama": "Llama", "qwen2": "Qwen2", "mistral": "Mistral"}[raw["model_type"]]
                     + "RotaryEmbedding")(config=cfg)
    return cfg, rotary.inv_freq.double()


# layout name -> config.json dict; each is accepted and must read as transformers reads it
LAYOUTS = {
    "v4 llama": v4(),
    "v4 llama, rope_scaling llama3": v4(rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING}),
    "v4 llama, rope_scaling llama3 (old 'type' key)": v4(rope_scaling={"type": "llama3", **LLAMA3_SCALING}),
    "v4 llama, rope_scaling linear": v4(rope_scaling={"type": "linear", "factor": 4.0}),
    "v4 llama, rope_scaling null, head_dim null": v4(rope_scaling=None, head_dim=None),
    "v4 llama, no rope_theta (class default 10000), no rms_norm_eps (1e-6)":
        {k: v for k, v in v4().items() if k not in ("rope_theta", "rms_norm_eps")},
    "v4 llama, head_dim 32 (not hidden/heads)": v4(head_dim=32),
    "v4 qwen2, use_sliding_window false": v4("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=4096,
                                             max_window_layers=1),
    "v4 qwen2, sliding window >= context": v4("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=256,
                                              max_window_layers=1),
    "v4 mistral, sliding_window null": v4("MistralForCausalLM", sliding_window=None),
    "v5 llama": v5(),
    "v5 llama, llama3 in rope_parameters": v5(rope={"rope_type": "llama3", **LLAMA3_SCALING}),
    "v5 llama, llama3 without original_max (context)": v5(rope={"rope_type": "llama3", "factor": 8.0,
                                                                "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    "v5 llama, rope_parameters + equal top-level rope_theta": v5() | {"rope_theta": 500000.0},
    "v5 qwen2, layer_types all full": v5("Qwen2ForCausalLM", layer_types=["full_attention"] * 2,
                                         use_sliding_window=False, sliding_window=None),
    "v5 llama, tied embeddings": v5(tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_reads_as_transformers_reads_it(name: str) -> None:
    raw = LAYOUTS[name]
    ours = parse(raw)
    ref, inv_freq = reference(raw)
    assert ours.head_dim == (getattr(ref, "head_dim", None) or ref.hidden_size // ref.num_attention_heads)
    assert ours.n_kv_heads == ref.num_key_value_heads
    assert ours.norm_eps == ref.rms_norm_eps
    assert ours.context_length == ref.max_position_embeddings
    assert ours.tie_embeddings == ref.tie_word_embeddings
    ours_freq = torch.tensor(ours.inv_freq(), dtype=torch.float64)
    assert torch.allclose(ours_freq, inv_freq, rtol=1e-6, atol=0), name
    print(f"\n{name}: rope_base={ours.rope_base:g} scaling={ours.rope_scaling} "
          f"freq_factors={'yes' if ours.rope_freq_factors else 'no'} head_dim={ours.head_dim} "
          f"eps={ours.norm_eps:g} tie={ours.tie_embeddings} -> as transformers")


def test_v4_and_v5_layouts_give_the_same_config() -> None:
    assert parse(v4()) == parse(v5())
    assert parse(v4(rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})) == \
        parse(v5(rope={"rope_type": "llama3", **LLAMA3_SCALING}))
    cfg = parse(v5())
    assert cfg.rope_base == 500000.0 and cfg.rope_scaling is None  # not the 10000 fallback of issue 17


# layout -> (config.json dict, words the error must contain)
REFUSED = {
    "rope_theta stated twice, differently": (v5() | {"rope_theta": 10000.0}, "rope_theta"),
    "rope_scaling and rope_parameters disagree": (
        v5(rope={"rope_type": "llama3", **LLAMA3_SCALING}, rope_scaling={"rope_type": "linear", "factor": 2.0}),
        "rope_type"),
    "yarn rotary scaling": (v4(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    "dynamic rotary scaling": (v5(rope={"rope_type": "dynamic", "factor": 2.0}), "dynamic"),
    "llama3 without factor": (v5(rope={"rope_type": "llama3", "low_freq_factor": 1.0}), "factor"),
    "partial_rotary_factor": (v5(rope={"partial_rotary_factor": 0.5}), "partial_rotary_factor"),
    "rope nested by a sliding layer type": (
        v5() | {"rope_parameters": {"full_attention": {"rope_theta": 1e6}, "sliding_attention": {"rope_theta": 1e4}}},
        "sliding_attention"),
    "qwen2 sliding layers shorter than the context": (
        v4("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=64, max_window_layers=1), "layer 1.*sliding"),
    "qwen2 sliding on, window left out (4096 default) < context 32768": (
        {k: v for k, v in v4("Qwen2ForCausalLM", use_sliding_window=True, max_window_layers=0).items()
         if k != "max_position_embeddings"}, "sliding_window 4096"),
    "layer_types with a sliding layer": (
        v5("Qwen2ForCausalLM", layer_types=["full_attention", "sliding_attention"], sliding_window=128),
        "layer 1"),
    "layer_types with an unknown type": (v5(layer_types=["full_attention", "chunked_attention"]), "chunked_attention"),
    "layer_types of the wrong length": (v5(layer_types=["full_attention"]), "one type per layer"),
    "mistral without sliding_window (4096 default)": ({k: v for k, v in v4("MistralForCausalLM").items()
                                                      if k != "max_position_embeddings"}, "sliding_window 4096"),
    "llama with a stated sliding_window": (v4(sliding_window=16), "sliding_window 16"),
    "gelu activation": (v4(hidden_act="gelu"), "hidden_act"),
    "mlp_bias": (v4(mlp_bias=True), "mlp_bias"),
    "llama attention_bias (o_proj bias too)": (v4(attention_bias=True), "attention_bias"),
    "quantization_config": (v4(quantization_config={"quant_method": "gptq", "bits": 4}), "quantization_config.*gptq"),
    "int8 dtype": (v5() | {"dtype": "int8"}, "dtype 'int8'"),
    "untied without lm_head": (v4(), "lm_head"),
    "unknown architecture": (v4() | {"architectures": ["GemmaForCausalLM"], "model_type": "gemma"}, "GemmaForCausalLM"),
    "missing hidden_size": ({k: v for k, v in v4().items() if k != "hidden_size"}, "hidden_size"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_layout_that_changes_output_and_is_not_run_is_refused(name: str) -> None:
    raw, words = REFUSED[name]
    with pytest.raises(SpeculantError, match=words) as e:
        parse(raw, has_lm_head=name != "untied without lm_head")
    print(f"\n{name}: {e.value}")


# ------------------------------------------------------------------ tiny real folders written by transformers
def save_tiny(folder: Path, arch: str, dtype: torch.dtype, *, shard: str | None = None, **extra: object) -> Path:
    """A random tiny model written by transformers' own save_pretrained (so its layout is the installed version's)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = v4(arch, **extra)
    cfg = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items()
                                                     if k not in ("model_type", "torch_dtype")})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    model.save_pretrained(folder, **({"max_shard_size": shard} if shard else {}))
    return folder


def dtype_kwarg() -> str:
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def transformers_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), **{dtype_kwarg(): torch.float32}).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def our_logits(folder: Path, ids: list[int]) -> torch.Tensor:
    model = build_transformer(HFSource(folder), "float32", cache_dir=None, progress=False)
    return model(torch.tensor(ids), model.new_cache(len(ids))).logits


@pytest.mark.parametrize(("arch", "dtype", "shard", "extra"), [
    ("LlamaForCausalLM", torch.float32, None, {}),
    ("LlamaForCausalLM", torch.bfloat16, "40KB", {"rope_scaling": {"rope_type": "llama3", **LLAMA3_SCALING}}),
    ("LlamaForCausalLM", torch.float16, None, {"tie_word_embeddings": True, "head_dim": 32}),
    ("Qwen2ForCausalLM", torch.bfloat16, "40KB", {"rope_theta": 1e6}),
    ("MistralForCausalLM", torch.float16, None, {"sliding_window": None}),
])
def test_tiny_folder_logits_match_transformers(tmp_path: Path, arch, dtype, shard, extra) -> None:
    folder = save_tiny(tmp_path, arch, dtype, shard=shard, **extra)
    assert (folder / "model.safetensors.index.json").is_file() == bool(shard)
    ids = [3, 17, 42, 5, 96, 0, 11, 64, 8, 8, 30]
    worst = float((our_logits(folder, ids) - transformers_logits(folder, ids)).abs().max())
    assert worst < 1e-4, worst


@pytest.mark.parametrize(("dtype", "fmt"), [(torch.float16, "f16"), (torch.bfloat16, "bf16")])
def test_half_folder_runs_in_its_own_half_format(tmp_path: Path, dtype, fmt) -> None:
    """--dtype f16 / bf16 on a folder stored in that type keeps the weights as stored: the logits are the
    float32 run's up to the half-precision products. (f16 failed: the quantizer returns float16 values,
    not the bytes of the rows.)"""
    folder = save_tiny(tmp_path, "LlamaForCausalLM", dtype)
    ids = [3, 17, 42, 5, 96, 0, 11]
    model = build_transformer(HFSource(folder), fmt, cache_dir=None, progress=False)
    half = model(torch.tensor(ids), model.new_cache(len(ids))).logits
    worst = float((half - our_logits(folder, ids)).abs().max())
    assert worst < 1e-4, worst  # (1.2e-7 here: the products are summed in float32)


def test_sharded_folder_reads_only_indexed_files(tmp_path: Path) -> None:
    folder = save_tiny(tmp_path, "LlamaForCausalLM", torch.float32, shard="40KB")
    ids = [1, 2, 3]
    before = our_logits(folder, ids)
    # a stray file beside the shards (e.g. Mistral's consolidated.safetensors) is not mixed in
    from safetensors.torch import save_file

    save_file({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, str(folder / "consolidated.safetensors"))
    assert torch.equal(our_logits(folder, ids), before)
    shards = sorted(folder.glob("model-*.safetensors"))
    shards[-1].rename(folder / "gone.bin")
    with pytest.raises(SpeculantError, match=f"lacks shard.*{shards[-1].name}"):
        HFSource(folder)


@pytest.mark.parametrize(("tensors", "words"), [
    ({"model.layers.0.self_attn.o_proj.bias": torch.zeros(64)}, "o_proj.bias.*no place"),
    ({"model.layers.2.mlp.up_proj.weight": torch.zeros(96, 64)}, "layers.2.*no place"),
    ({"model.layers.0.self_attn.q_norm.weight": torch.zeros(16)}, "q_norm"),
])
def test_tensor_the_block_does_not_run_is_refused(tmp_path: Path, tensors, words) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_tiny(tmp_path, "LlamaForCausalLM", torch.float32)
    state = load_file(str(folder / "model.safetensors")) | tensors
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SpeculantError, match=words):
        HFSource(folder)


@pytest.mark.parametrize(("change", "words"), [
    (lambda s: s | {"model.norm.weight": s["model.norm.weight"].to(torch.int8)}, "model.norm.weight.*I8"),
    (lambda s: s | {"model.layers.1.mlp.down_proj.weight": torch.zeros(64, 95)}, r"down_proj.*\(64, 95\).*\(64, 96\)"),
    (lambda s: {k: v for k, v in s.items() if "layers.1.post_attention" not in k}, "lacks.*post_attention"),
    (lambda s: {k: v for k, v in s.items() if k != "lm_head.weight"}, "tie_word_embeddings.*lm_head"),
])
def test_weights_that_do_not_fit_the_config_are_refused(tmp_path: Path, change, words) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_tiny(tmp_path, "LlamaForCausalLM", torch.float32)
    save_file(change(load_file(str(folder / "model.safetensors"))), str(folder / "model.safetensors"))
    with pytest.raises(SpeculantError, match=words):
        HFSource(folder)


def test_tied_config_with_a_different_lm_head_is_refused(tmp_path: Path) -> None:
    """transformers 4 would tie the head to the embeddings, 5 keeps the file's head: ambiguous, so refused;
    a head equal to the embeddings is fine."""
    from safetensors.torch import load_file, save_file

    folder = save_tiny(tmp_path, "LlamaForCausalLM", torch.float32, tie_word_embeddings=True)
    state = load_file(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in state
    save_file(state | {"lm_head.weight": state["model.embed_tokens.weight"].clone()}, str(folder / "model.safetensors"))
    assert HFSource(folder).config.tie_embeddings
    save_file(state | {"lm_head.weight": state["model.embed_tokens.weight"] + 1}, str(folder / "model.safetensors"))
    with pytest.raises(SpeculantError, match="tie_word_embeddings true.*differs"):
        HFSource(folder)


def test_duplicate_tensors_without_index_are_refused(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = save_tiny(tmp_path, "LlamaForCausalLM", torch.float32)
    state = load_file(str(folder / "model.safetensors"))
    (folder / "model.safetensors").unlink()
    save_file(state, str(folder / "a.safetensors"))
    save_file({"model.norm.weight": state["model.norm.weight"]}, str(folder / "b.safetensors"))
    with pytest.raises(SpeculantError, match="model.norm.weight.*more than one file"):
        HFSource(folder)


def test_fingerprint_follows_config(tmp_path: Path) -> None:
    """An edited config.json (say, a corrected rope_theta) must not reuse conversions of the old one."""
    folder = save_tiny(tmp_path, "LlamaForCausalLM", torch.float32)
    before = HFSource(folder).fingerprint()
    raw = json.loads((folder / "config.json").read_text())
    raw.pop("rope_theta", None)
    raw["rope_parameters"] = {"rope_theta": 1234.0, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(raw))
    assert HFSource(folder).config.rope_base == 1234.0
    assert HFSource(folder).fingerprint() != before


# ------------------------------------------------------------------ tokenizer files of a folder
def _tokenizer_folder(folder: Path, **files: dict) -> Path:
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as Backend
    from tokenizers import models, pre_tokenizers

    backend = Backend(models.WordLevel({f"t{i}": i for i in range(6)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<s>", "</s>", "<|im_end|>")])  # 6, 7, 8
    folder.mkdir(exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    for name, content in files.items():
        (folder / name.replace("__", ".")).write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


def test_eos_ids_from_generation_config_else_model_config(tmp_path: Path) -> None:
    from speculant.text.tokenizer import Tokenizer

    both = _tokenizer_folder(tmp_path / "a", config__json={"eos_token_id": 8},
                             generation_config__json={"eos_token_id": [7, 8]})
    assert Tokenizer.from_hf_dir(both).eos_ids == {7, 8}
    # no generation_config.json: transformers generates with config.json's eos ids, and so do we
    only_config = _tokenizer_folder(tmp_path / "b", config__json={"eos_token_id": [7, 8]})
    tok = Tokenizer.from_hf_dir(only_config)
    assert (tok.eos_id, tok.eos_ids) == (7, {7, 8})


def test_special_tokens_map_and_template_files(tmp_path: Path) -> None:
    from speculant.text.tokenizer import Tokenizer

    # transformers 4 layout: special tokens in special_tokens_map.json, template inside tokenizer_config.json
    old = _tokenizer_folder(tmp_path / "v4", special_tokens_map__json={"bos_token": "<s>", "eos_token": {"content": "</s>"}},
                            tokenizer_config__json={"chat_template": "v4 {{ bos_token }}"})
    tok = Tokenizer.from_hf_dir(old)
    assert (tok.bos_id, tok.eos_id) == (6, 7)
    assert tok.apply_chat_template([]) == "v4 <s>"
    # transformers 5 layout: chat_template.jinja beside the tokenizer files wins
    new = _tokenizer_folder(tmp_path / "v5", tokenizer_config__json={"bos_token": "<s>", "eos_token": "<|im_end|>"},
                            chat_template__jinja="v5 {{ eos_token }}")
    tok = Tokenizer.from_hf_dir(new)
    assert (tok.bos_id, tok.eos_id) == (6, 8)
    assert tok.apply_chat_template([]) == "v5 <|im_end|>"
