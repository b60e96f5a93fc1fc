"""Real Hugging Face folders, written by transformers from the cached GGUF models, against transformers
loading the same folder: config, tokenizer and chat template, logits and 32-token greedy continuations.

Folders are built once per session: transformers dequantizes the GGUF model, its state dict goes into a
model made from its config (a GGUF-quantized model refuses `save_pretrained`), which is saved as the
installed transformers writes it: SmolLM2 in float32 and sharded (model.safetensors.index.json),
Qwen2.5-0.5B in bfloat16 in one file, as issue 17's user had it. Each also gets a twin whose config.json
is rewritten in the other transformers major version's layout (v5 `rope_parameters` <-> v4 top-level
`rope_theta`), sharing the weight files.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from parity import greedy_mismatch, hf_gguf_loading, logit_gap, no_weight_init

from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig
from speculant.hub import resolve_model
from speculant.models import load_model

pytestmark = [pytest.mark.real, pytest.mark.heavy]

CHAT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    CHAT,  # rendered by each side's own chat template code
]
BUILDS = {  # preset -> (weights dtype, max_shard_size)
    "smollm2-135m-instruct": (torch.float32, "200MB"),
    "qwen2.5-coder-0.5b-instruct": (torch.bfloat16, None),
}


def _dtype_kw() -> str:
    import transformers

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def build_folder(preset: str, dest: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype, shard = BUILDS[preset]
    gguf = resolve_model(preset)
    with hf_gguf_loading():
        quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, **{_dtype_kw(): torch.float32})
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights saved are plain floats
    with no_weight_init():  # every weight is loaded from the state dict next
        model = AutoModelForCausalLM.from_config(config).to(dtype)
    model.load_state_dict(quantized.state_dict())
    model.generation_config = quantized.generation_config
    model.save_pretrained(dest, **({"max_shard_size": shard} if shard else {}))
    tokenizer.save_pretrained(dest)
    return dest


def other_layout(folder: Path, dest: Path) -> Path:
    """A twin of `folder` whose config.json is in the other transformers major version's layout."""
    dest.mkdir()
    for f in folder.iterdir():
        if f.name != "config.json":
            os.symlink(f, dest / f.name)
    raw = json.loads((folder / "config.json").read_text())
    if "rope_parameters" in raw:  # v5 -> v4
        rope = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = rope.pop("rope_theta")
        raw["rope_scaling"] = None if rope.get("rope_type", "default") == "default" else rope
        raw["torch_dtype"] = raw.pop("dtype")
        raw.pop("layer_types", None)
    else:  # v4 -> v5
        rope = {"rope_type": "default", **(raw.pop("rope_scaling", None) or {})}
        raw["rope_parameters"] = {**rope, "rope_theta": raw.pop("rope_theta")}
        raw["dtype"] = raw.pop("torch_dtype")
    (dest / "config.json").write_text(json.dumps(raw, indent=2))
    return dest


@pytest.fixture(scope="session")
def hf_folders(tmp_path_factory):
    """preset -> (folder as the installed transformers writes it, twin in the other layout); built once."""
    built: dict[str, tuple[Path, Path]] = {}

    def get(preset: str) -> tuple[Path, Path]:
        if preset not in built:
            root = tmp_path_factory.mktemp(preset)
            folder = build_folder(preset, root / "written")
            built[preset] = (folder, other_layout(folder, root / "other-layout"))
        return built[preset]

    return get


@pytest.fixture(scope="module", params=list(BUILDS))
def pair(request, hf_folders):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, twin = hf_folders(request.param)
    ours = load_model(str(folder), "float32", progress=False, use_cache=False)
    ref = AutoModelForCausalLM.from_pretrained(str(folder), **{_dtype_kw(): torch.float32}).eval()
    yield request.param, folder, twin, ours, ref, AutoTokenizer.from_pretrained(str(folder))
    del ref


def _ids(ours, tok, prompt) -> list[int]:
    """Token ids of a prompt on our side, checked equal to transformers' (text or chat-rendered)."""
    if isinstance(prompt, list):
        text = ours.tokenizer.apply_chat_template(prompt)
        assert text == tok.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    ids = ours.tokenizer.encode(text)
    assert ids == tok(text)["input_ids"], text
    return ids


def test_config_and_tokenizer_as_transformers_reads_them(pair):
    name, folder, twin, ours, ref, tok = pair
    cfg, hf = ours.config, ref.config
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert cfg.rope_base == rope["rope_theta"] and cfg.rope_base != 10000.0
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads  # qwen2 has none
    assert (cfg.head_dim, cfg.n_kv_heads, cfg.norm_eps, cfg.tie_embeddings, cfg.context_length) == \
        (head_dim, hf.num_key_value_heads, hf.rms_norm_eps, hf.tie_word_embeddings, hf.max_position_embeddings)
    eos = ref.generation_config.eos_token_id
    assert set(eos if isinstance(eos, list) else [eos]) <= ours.tokenizer.eos_ids
    assert ours.tokenizer.eos_id == tok.eos_token_id and ours.tokenizer.bos_id == tok.bos_token_id
    print(f"\n{name}: {folder} ({sorted(p.name for p in folder.iterdir())}) -> {cfg}")


def test_other_layout_reads_the_same(pair):
    """The twin in the other transformers major version's config layout gives the same model config
    (transformers too reads it as the same model)."""
    from transformers import AutoConfig

    name, folder, twin, ours, ref, tok = pair
    from speculant.models.load_hf import HFSource

    assert HFSource(twin).config == HFSource(folder).config == ours.config
    other = AutoConfig.from_pretrained(str(twin))
    assert (getattr(other, "rope_parameters", None) or {"rope_theta": other.rope_theta})["rope_theta"] == \
        ours.config.rope_base


def test_logits_match_transformers(pair):
    name, folder, twin, ours, ref, tok = pair
    worst, agree, total = logit_gap(ours, ref, [_ids(ours, tok, p) for p in PROMPTS])
    print(f"\n{name} HF folder: max |logit diff| = {worst:.2e}, top-1 agreement = {agree}/{total}")
    assert worst < 2e-3
    assert agree == total


def test_greedy_continuation_matches_transformers(pair):
    name, folder, twin, ours, ref, tok = pair
    engine = Engine(ours)
    for prompt in PROMPTS:
        ids = _ids(ours, tok, prompt)
        done = engine.generate(ids, GenerationConfig(max_new_tokens=32, ignore_eos=True))
        assert len(done.token_ids) == 32 and greedy_mismatch(ref, ids, done.token_ids) is None, (name, prompt)
        print(f"\n{name} {str(prompt)[:30]!r}: {ours.tokenizer.decode(done.token_ids)!r}")


def test_hf_folder_drafts_for_the_gguf_target(hf_folders, real_model_cache):
    """Qwen2.5-0.5B as an HF folder drafts for the 1.5B GGUF target in its default format: the tokenizer
    check passes and greedy output is the target's own. (The draft runs in float32 here: converting
    the folder to int4 takes the same path as a GGUF file's conversion, tested elsewhere.)"""
    folder, _ = hf_folders("qwen2.5-coder-0.5b-instruct")
    target = real_model_cache("qwen2.5-coder-1.5b-instruct", None)
    draft = load_model(str(folder), "float32", progress=False, use_cache=False)
    prompt = target.tokenizer.apply_chat_template(CHAT)
    gen = GenerationConfig(max_new_tokens=32, ignore_eos=True)
    ar = Engine(target).generate(prompt, gen)
    spec = Engine(target, draft, MethodConfig("draft")).generate(prompt, gen)
    assert spec.token_ids == ar.token_ids
    assert spec.stats.accepted_tokens > 0
    print(f"\nHF draft for GGUF target: {spec.stats}")
