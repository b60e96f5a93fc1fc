"""A reference EAGLE-3 drafter for tests/test_eagle3_published.py, built from a drafter's published tensors with
transformers' own LlamaAttention / Qwen3Attention / LlamaMLP / LlamaRMSNorm, its DynamicCache and its rotary
formulas; the EAGLE-3 first-layer forward written out as speculators' `eagle3/model_definitions.py`
(Eagle3FirstLayerMixin.forward) and SpecForge's `llama3_eagle.py` (LlamaDecoderLayer.forward) have it, and the
fc input norms and fed-back output as speculators' `eagle3/core.py` (Eagle3DraftModel.forward)."""

from __future__ import annotations

import math

import torch

def _inv_freq(rope: dict, hd: int) -> torch.Tensor:
    """transformers' default and llama3 rotary inverse frequencies (modeling_rope_utils)."""
    inv = 1.0 / rope["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd)
    s = rope.get("rope_scaling")
    if not s:
        return inv
    old = s["original_max_position_embeddings"]
    low_wl, high_wl = old / s["low_freq_factor"], old / s["high_freq_factor"]
    wl = 2 * math.pi / inv
    out = torch.where(wl > low_wl, inv / s["factor"], inv)
    smooth = (old / wl - s["low_freq_factor"]) / (s["high_freq_factor"] - s["low_freq_factor"])
    smoothed = (1 - smooth) * out / s["factor"] + smooth * out
    return torch.where(~(wl < high_wl) & ~(wl > low_wl), smoothed, out)


class ReferenceEagle3:
    """An EAGLE-3 drafter from the raw tensors, with transformers' LlamaAttention / LlamaMLP / LlamaRMSNorm and its
    DynamicCache; the first-layer forward as speculators' Eagle3FirstLayerMixin.forward."""

    def __init__(self, t: dict, layer: dict, options: dict):
        """`t`: the drafter's tensors as published; `layer`: its layer config (hidden_size, ..., rope_theta,
        rope_scaling); `options`: speculators' flags (norm_before_residual, norm_before_fc, fc_norm, norm_output)."""
        from transformers import LlamaConfig, Qwen3Config
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaMLP, LlamaRMSNorm
        from transformers.models.qwen3.modeling_qwen3 import Qwen3Attention

        p = "midlayer." if "midlayer.hidden_norm.weight" in t else "layers.0."
        D, H, HKV, HD, DFF = (layer[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                                 "intermediate_size"))
        vocab = layer["vocab_size"]
        cfg = LlamaConfig(hidden_size=D, intermediate_size=DFF, num_attention_heads=H, num_key_value_heads=HKV,
                          head_dim=HD, rms_norm_eps=1e-6, vocab_size=vocab)
        cfg._attn_implementation = "eager"
        self.attn = LlamaAttention(cfg, layer_idx=0)
        if f"{p}self_attn.q_norm.weight" in t:  # speculators' Qwen3DecoderEagle3FirstLayer
            qcfg = Qwen3Config(hidden_size=D, intermediate_size=DFF, num_attention_heads=H, num_key_value_heads=HKV,
                               head_dim=HD, rms_norm_eps=1e-6, vocab_size=vocab, num_hidden_layers=1)
            qcfg._attn_implementation = "eager"
            self.attn = Qwen3Attention(qcfg, layer_idx=0)
            self.attn.q_norm.weight.data.copy_(t[f"{p}self_attn.q_norm.weight"])
            self.attn.k_norm.weight.data.copy_(t[f"{p}self_attn.k_norm.weight"])
        for n in "qkvo":  # q/k/v read 2D: [embeds; hidden]
            w = t[f"{p}self_attn.{n}_proj.weight"]
            setattr(self.attn, f"{n}_proj", torch.nn.Linear(w.shape[1], w.shape[0], bias=False))
            getattr(self.attn, f"{n}_proj").weight.data.copy_(w)
        self.mlp = LlamaMLP(cfg)
        for n in ("gate", "up", "down"):
            getattr(self.mlp, f"{n}_proj").weight.data.copy_(t[f"{p}mlp.{n}_proj.weight"])
        self.norms = {}
        for name, key in (("input", f"{p}input_layernorm"), ("hidden", f"{p}hidden_norm"),
                          ("post", f"{p}post_attention_layernorm"), ("final", "norm")):
            self.norms[name] = LlamaRMSNorm(D, eps=1e-6)
            self.norms[name].weight.data.copy_(t[f"{key}.weight"])
        self.t, self.D, self.nbr, self.options = t, D, bool(options.get("norm_before_residual")), options
        self.inv_freq = _inv_freq(layer, HD)

    def layer(self, embeds, hidden, positions, cache):
        """Eagle3FirstLayerMixin.forward on [1, S, D] rows at `positions` (keys and values kept in `cache`)."""
        residual = hidden
        embeds, hidden = self.norms["input"](embeds), self.norms["hidden"](hidden)
        if self.nbr:
            residual = hidden
        x = torch.cat([embeds, hidden], -1)
        freqs = torch.outer(positions.float(), self.inv_freq)
        emb = torch.cat([freqs, freqs], -1)
        S, L = x.shape[1], cache.get_seq_length() + x.shape[1]
        mask = torch.full((S, L), -torch.inf).triu(L - S + 1)[None, None]
        a, _ = self.attn(x, (emb.cos()[None], emb.sin()[None]), mask, cache)
        h = residual + a
        return h + self.mlp(self.norms["post"](h))

    def draft_chain(self, feats, embed, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor]:
        """Greedy drafts: rows (feature of position p, token p+1), then k steps feeding back the layer's output."""
        from transformers import DynamicCache

        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        cache = DynamicCache()
        if self.options.get("norm_before_fc"):  # speculators' Eagle3DraftModel.forward: input_norm, fc_norm, fc
            norm = LlamaRMSNorm(3 * self.D, eps=1e-6)
            norm.weight.data.copy_(self.t["input_norm.weight"])
            feats = norm(feats)
        if self.options.get("fc_norm"):
            chunks = []
            for i, c in enumerate(feats.chunk(3, -1)):
                norm = LlamaRMSNorm(self.D, eps=1e-6)
                norm.weight.data.copy_(self.t[f"fc_norm.{i}.weight"])
                chunks.append(norm(c))
            feats = torch.cat(chunks, -1)
        hidden = feats @ self.t["fc.weight"].T
        ids = self.t["d2t"] + torch.arange(self.t["d2t"].numel())
        pos = torch.arange(len(tokens))
        drafts, first = [], None
        for _ in range(k):
            o = self.layer(embed[torch.tensor(tokens)][None], hidden[None], pos, cache)[0]
            logits = self.norms["final"](o[-1]) @ self.t["lm_head.weight"].T
            first = logits if first is None else first
            nxt = int(ids[int(logits.argmax())])
            drafts.append(nxt)
            hidden = self.norms["final"](o[-1:]) if self.options.get("norm_output") else o[-1:]
            tokens, pos = [nxt], pos[-1:] + 1
        return drafts, first
