"""Tiny random Qwen3.5 models written by transformers' save_pretrained, with `mtp.*` tensors of the published names
(transformers ignores them on load) so that `--method mtp` has a layer to run.

Norm weights are randomized (transformers initializes the zero-centred ones to 0), so a missing `1 +` shows in the
logits. head_dim 256 for the attention layers: the rotary then covers 64 values, the default M-RoPE sections'
(llama.cpp writes them when the config has none). A 1:3 pattern of full and linear layers (the family's).
"""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 128
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=2,
              num_key_value_heads=1, head_dim=256, linear_num_key_heads=2, linear_num_value_heads=4,
              linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=512,
              rms_norm_eps=1e-6, tie_word_embeddings=False, mtp_num_hidden_layers=1,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


def save_qwen35(folder: Path, *, mtp: bool = True, seed: int = 0, **overrides) -> Path:
    """The tiny model as an HF folder (float32), once per folder; `mtp`: with an MTP layer in the safetensors."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder / "config.json").is_file():
        return folder
    cfg = AutoConfig.for_model("qwen3_5_text", **(CONFIG | overrides))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).float()
    with torch.no_grad():
        for key, p in model.named_parameters():
            if "norm" in key:  # zero-centred (1 + w) but the DeltaNet's gated norm (plain w)
                p.copy_(torch.randn_like(p) * 0.3 + (1.0 if "linear_attn.norm" in key else 0.0))
    model.save_pretrained(folder)
    _save_tokenizer(folder)
    if mtp:
        f = folder / "model.safetensors"
        tensors = load_file(str(f))
        tensors |= mtp_tensors(model, seed)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return folder


def mtp_tensors(model, seed: int) -> dict[str, torch.Tensor]:
    """`mtp.*` as Qwen3.5 checkpoints publish them: fc [D, 2D], pre_fc_norm_embedding / pre_fc_norm_hidden [D], one
    full-attention decoder layer `mtp.layers.0.*` and mtp.norm [D] (zero-centred norms). The layer's weights are a
    copy of the model's last full-attention layer, scaled, so that the drafter agrees with the model often."""
    g = torch.Generator().manual_seed(seed + 1)
    cfg = model.config
    D = cfg.hidden_size
    last = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    out = {"mtp.fc.weight": torch.randn(D, 2 * D, generator=g) * (2 * D) ** -0.5,
           "mtp.pre_fc_norm_embedding.weight": torch.randn(D, generator=g) * 0.3,
           "mtp.pre_fc_norm_hidden.weight": torch.randn(D, generator=g) * 0.3,
           "mtp.norm.weight": torch.randn(D, generator=g) * 0.3}
    for k, v in model.model.layers[last].state_dict().items():
        out[f"mtp.layers.0.{k}"] = (v + torch.randn(v.shape, generator=g) * 0.02).contiguous()
    return out


def _save_tokenizer(folder: Path) -> None:
    """A word-level tokenizer over t0 .. t{VOCAB-1} (conftest.tiny_tokenizer's), so load_model reads the folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    backend = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.save(str(folder / "tokenizer.json"))


def reference(folder: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def prompt(n: int, seed: int = 1) -> list[int]:
    return [int(t) for t in torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))]
