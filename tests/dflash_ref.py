"""A reference DFlash drafter for tests/test_dflash.py, written out from z-lab's `dflash==0.1.0` (dflash/model.py:
DFlashDraftModel, Qwen3DFlashAttention, Qwen3DFlashDecoderLayer, dflash_generate) on transformers' own Qwen3RMSNorm,
Qwen3MLP, Qwen3RotaryEmbedding and rotate_half. `dflash` pins datasets/requests/tqdm exactly, which a test extra
cannot install beside the project's own pins, so the suite carries this copy; test_dflash.py checks it against the
package where that is installed (`pip install --no-deps dflash==0.1.0`).

The reference recomputes everything from scratch each call (no cache): context features [C, n*D] at positions
0..C-1 and a block at C..C+b-1, as dflash_generate's cropped cache holds them."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ReferenceDFlash:
    def __init__(self, folder):
        import json

        from safetensors.torch import load_file
        from transformers import Qwen3Config
        from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding

        raw = json.loads((folder / "config.json").read_text())
        self.dc = raw["dflash_config"]
        cfg = Qwen3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "dflash_config", "model_type")})
        self.cfg = cfg
        t = load_file(str(folder / "model.safetensors"))
        self.t = t
        self.hd = cfg.head_dim
        self.rotary = Qwen3RotaryEmbedding(cfg)

        def norm(key, width):
            n = Qwen3RMSNorm(width, eps=cfg.rms_norm_eps)
            n.weight.data.copy_(t[key])
            return n

        self.layers = []
        for i in range(cfg.num_hidden_layers):
            p = f"layers.{i}."
            mlp = Qwen3MLP(cfg)
            for n in ("gate", "up", "down"):
                getattr(mlp, f"{n}_proj").weight.data.copy_(t[f"{p}mlp.{n}_proj.weight"])
            self.layers.append({"in": norm(p + "input_layernorm.weight", cfg.hidden_size),
                                "post": norm(p + "post_attention_layernorm.weight", cfg.hidden_size),
                                "q_norm": norm(p + "self_attn.q_norm.weight", self.hd),
                                "k_norm": norm(p + "self_attn.k_norm.weight", self.hd), "mlp": mlp, "p": p})
        self.hidden_norm = norm("hidden_norm.weight", cfg.hidden_size)
        self.norm = norm("norm.weight", cfg.hidden_size)

    @torch.no_grad()
    def hidden(self, feats: torch.Tensor, noise: torch.Tensor, start: int) -> torch.Tensor:
        """DFlashDraftModel.forward: context features [C, n*D] at positions start-C..start-1, the block's
        embeddings noise [b, D] at start..start+b-1 -> the block's normed outputs [b, D]."""
        from transformers.models.qwen3.modeling_qwen3 import rotate_half

        t, cfg, hd = self.t, self.cfg, self.hd
        C, b = feats.shape[0], noise.shape[0]
        ctx = self.hidden_norm(feats @ t["fc.weight"].T)[None]  # [1, C, D]
        pos = torch.arange(start - C, start + b)[None]
        cos, sin = self.rotary(noise[None], pos)
        cos, sin = cos[:, None], sin[:, None]  # apply_rotary_pos_emb's unsqueeze_dim=1
        h = noise[None]
        H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads
        for L in self.layers:
            p = L["p"]
            residual = h
            x = L["in"](h)
            q = L["q_norm"]((x @ t[p + "self_attn.q_proj.weight"].T).view(1, b, H, hd)).transpose(1, 2)
            kv_in = torch.cat([ctx, x], 1)
            k = L["k_norm"]((kv_in @ t[p + "self_attn.k_proj.weight"].T).view(1, C + b, Hkv, hd)).transpose(1, 2)
            v = (kv_in @ t[p + "self_attn.v_proj.weight"].T).view(1, C + b, Hkv, hd).transpose(1, 2)
            q = q * cos[..., -b:, :] + rotate_half(q) * sin[..., -b:, :]
            k = k * cos + rotate_half(k) * sin
            k, v = (z.repeat_interleave(H // Hkv, 1) for z in (k, v))
            a = F.softmax(q @ k.transpose(-1, -2) * hd ** -0.5, -1) @ v  # non-causal: no mask
            h = residual + a.transpose(1, 2).reshape(1, b, H * hd) @ t[p + "self_attn.o_proj.weight"].T
            h = h + L["mlp"](L["post"](h))
        return self.norm(h)[0]

    @torch.no_grad()
    def logits(self, feats, block_ids, start, embed, lm_head) -> torch.Tensor:
        """The draft logits of the block's rows 1..b-1 (compute_logits), the embedding raw and scaled as
        dflash_generate's _raw_input_embeddings."""
        noise = F.embedding(torch.tensor(block_ids), embed) * float(self.dc.get("input_embedding_scale", 1.0))
        h = self.hidden(feats, noise, start)[1:]
        out = (h @ lm_head.T) * float(self.dc.get("output_multiplier", 1.0))
        cap = self.dc.get("final_logit_softcapping")
        return torch.tanh(out / cap) * cap if cap else out


def features(hidden_states, layer_ids) -> torch.Tensor:
    """dflash's extract_context_feature: HF hidden_states[i + 1] of each layer id, concatenated -> [S, n*D]."""
    return torch.cat([hidden_states[i + 1][0] for i in layer_ids], -1)


@torch.no_grad()
def greedy_rounds(ref: ReferenceDFlash, target, prompt: list[int], n_new: int, block: int) -> tuple[list[int], list[int]]:
    """dflash_generate's greedy loop without caches (every forward from scratch): (tokens after the prompt,
    accepted drafts per round). Blocks are always `block` rows; n_new counts tokens after the first."""
    mask = ref.dc["mask_token_id"]
    ids = list(prompt)
    out = target(torch.tensor([ids]), output_hidden_states=True)
    ids.append(int(out.logits[0, -1].argmax()))
    accepted = []
    embed, head = target.model.embed_tokens.weight, target.lm_head.weight
    while len(ids) - len(prompt) - 1 < n_new:
        start = len(ids) - 1  # the anchor's position
        feats = features(target(torch.tensor([ids[:start]]), output_hidden_states=True).hidden_states,
                         ref.dc["target_layer_ids"])
        drafts = ref.logits(feats, [ids[-1]] + [mask] * (block - 1), start, embed, head).argmax(-1).tolist()
        posterior = target(torch.tensor([ids + drafts])).logits[0, start:].argmax(-1).tolist()
        n = 0
        while n < len(drafts) and drafts[n] == posterior[n]:
            n += 1
        ids += drafts[:n] + [posterior[n]]
        accepted.append(n)
    return ids[len(prompt):], accepted
