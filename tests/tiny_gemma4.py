"""Tiny random Gemma 4 text models written by transformers' own save_pretrained (Gemma4ForCausalLM).

Two variants cover the dense family's switches: "ple" (per-layer input embeddings, two KV-shared layers, a
global head twice the sliding one with a proportional rotary turning half of it, logit soft-capping) and "keqv"
(global layers whose values are their keys with their own number of key/value heads, double-wide MLPs in
the KV-shared layers, no PLE). Norm weights and the per-layer scalars are randomized (transformers initializes
them to 1, which would hide a missing norm or scalar); the window (8) is a fifth of the 40-token test prompts.
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
_TYPES = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "sliding_attention",
          "full_attention"]
_BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=256,
             rms_norm_eps=1e-6, layer_types=_TYPES, num_kv_shared_layers=2,
             rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                              "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                 "rope_theta": 1e6}})
VARIANTS: dict[str, dict] = {
    "ple": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, final_logit_softcapping=5.0),
    "keqv": dict(hidden_size_per_layer_input=0, attention_k_eq_v=True, num_global_key_value_heads=1,
                 use_double_wide_mlp=True, tie_word_embeddings=False),
}


def save_gemma4(folder: Path, name: str, **extra) -> Path:
    """The tiny Gemma 4 `name` of VARIANTS as an HF folder (float32), once per folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    cfg = AutoConfig.for_model("gemma4_text", **(_BASE | VARIANTS[name] | extra))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
        for key, b in model.named_buffers():
            if key.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
    model.save_pretrained(folder)
    return folder


def save_assistant(folder: Path, ordered: bool = True) -> Path:
    """A tiny Gemma4AssistantForCausalLM for the "ple"/"keqv" targets (width 64, heads of 16 and 32 values, 2 key
    heads in sliding layers): its layers read the target's keys/values; `ordered`: the clustered output layer (16
    clusters of 8 tokens, top 4 searched) with a random token ordering (transformers initializes it to zeros)."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    if (folder / "config.json").is_file():
        return folder
    text = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=8, max_position_embeddings=256,
                rms_norm_eps=1e-6, layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=2,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                rope_parameters=_BASE["rope_parameters"], model_type="gemma4_text")
    cfg = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=64, use_ordered_embeddings=ordered,
                                num_centroids=16, centroid_intermediate_top_k=4)
    torch.manual_seed(1)
    model = Gemma4AssistantForCausalLM(cfg).float()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:
                p.copy_(torch.randn_like(p) * 0.3 + 1.0)
        for key, b in model.named_buffers():
            if key.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.5)
            if key.endswith("token_ordering"):
                b.copy_(torch.randperm(VOCAB))
    model.save_pretrained(folder)
    return folder


# ------------------------------------------------------------------ for llama.cpp's converter (tests/test_gemma4_gguf.py)
# llama.cpp's KV-shared layers read layers first-2 and first-1 (first: the first shared layer) and its assistant the
# target's last two layers, as a sliding-window then a global layer: the published models' order, which this one has
GGUF_TYPES = ["sliding_attention"] * 3 + ["full_attention", "sliding_attention", "full_attention"]
SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>")  # ids 0..3, as Gemma's
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789\u2581\n"


def tokenizer_vocab() -> dict[str, int]:
    """The tiny tokenizer's tokens: the specials, then one token per character (CHARS, then Greek letters), and one
    merge (two Greek letters) because llama.cpp's gemma4 tokenizer needs merges. A text of CHARS is one id a
    character, BOS first, in llama.cpp."""
    greek = [chr(0x3B1 + i) for i in range(VOCAB - len(SPECIALS) - len(CHARS) - 1)]
    return {t: i for i, t in enumerate([*SPECIALS, *CHARS, *greek, "\u03b1\u03b2"])}


def save_tokenizer(folder: Path) -> None:
    """A tokenizer.json the converter's Gemma 4 vocabulary reader (gguf's LlamaHfVocab: BPE with byte fallback, a
    Sequence decoder) takes, with exactly VOCAB tokens so the embedding table keeps its rows."""
    import json

    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    vocab = tokenizer_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("\u03b1", "\u03b2")], unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True) for t in SPECIALS])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<bos>", "eos_token": "<eos>",
        "pad_token": "<pad>", "unk_token": "<unk>"}))


def save_repeat_assistant(folder: Path, target: Path) -> Path:
    """An assistant (no clustered output layer) built to draft the pending token again, so that some drafts are
    accepted: its pre-projection passes the target's embedding through P (orthonormal rows), its output layer
    is the target's embeddings through P, and its layers add little (post norms of 0.05), so its top token is
    the pending one; the attention and MLPs still shape the rest of its distribution."""
    from safetensors.torch import load_file, save_file

    if (folder / "config.json").is_file():
        return folder
    save_assistant(folder, ordered=False)
    w = load_file(str(folder / "model.safetensors"))
    table = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]  # [V, 64]
    d, D = w["model.norm.weight"].shape[0], table.shape[1]
    q, _ = torch.linalg.qr(torch.randn(D, d, generator=torch.Generator().manual_seed(3)))  # [D, d] orthonormal columns
    w["pre_projection.weight"] = torch.cat([q.T.contiguous(), torch.zeros(d, D)], 1)
    w["model.embed_tokens.weight"] = (table @ q).contiguous()
    w["model.norm.weight"] = torch.ones(d)
    for k in w:
        if k.endswith(("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")):
            w[k] = torch.full_like(w[k], 0.05)
    save_file(w, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
