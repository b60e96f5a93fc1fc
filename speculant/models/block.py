"""One decoder layer of the Llama family (transformer.py runs them): attention, in C row by row (kernels/attention.c)
or in torch, and the gated MLP, with the norms of the architectures that have them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpeculantError
from .cache import KVCache
from .config import ModelConfig
from .formats.base import QLinear
from .fused import attend_rows
from .keys import tree_keys
from .rotary import _rope
from .row_ops import geglu, native_kernels, rms_norm, swiglu

# The rotary tables of a pass, by a block's rope_table: the model's own, the sliding-window layers' (their own
# base), and the identity (cos 1, sin 0) of layers without a rotary (SmolLM3's NoPE layers).
ROPE_TABLES = ("global", "local", "none")


class Block(nn.Module):
    """One decoder layer. `extra` holds the norms of the architectures that have them (ModelConfig's
    switches): q_norm / k_norm [head_dim] (qk_norm), post_attn_norm / post_ffn_norm [D] (post_norms)."""

    def __init__(self, cfg: ModelConfig, attn_norm: Tensor, qkv: QLinear, o: QLinear,
                 ffn_norm: Tensor, gate_up: QLinear, down: QLinear, *, layer: int = 0,
                 extra: dict[str, Tensor] | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.Parameter(attn_norm.float(), requires_grad=False)
        self.ffn_norm = nn.Parameter(ffn_norm.float(), requires_grad=False)
        self.qkv, self.o, self.gate_up, self.down = qkv, o, gate_up, down
        self.n_heads, self.n_kv, self.hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.eps = cfg.norm_eps
        self.hidden_dim = cfg.hidden_dim
        self.gelu = cfg.activation == "gelu_tanh"
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else self.hd**-0.5
        self.window = cfg.sliding_window if cfg.is_local(layer) else None
        # which of a pass's rotary tables the layer takes (Transformer.forward: ROPE_TABLES)
        nope = bool(cfg.nope_layers and cfg.nope_layers[layer])
        self.rope_table = ROPE_TABLES.index("none" if nope else "local" if self.window is not None else "global")
        extra = extra or {}
        needed = (("q_norm", "k_norm") if cfg.qk_norm else ()) + (("post_attn_norm", "post_ffn_norm") if cfg.post_norms else ())
        missing = [n for n in needed if n not in extra]
        if missing:
            raise SpeculantError(f"layer {layer} lacks its {', '.join(missing)} weights")
        for n in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm"):
            setattr(self, n, nn.Parameter(extra[n].float(), requires_grad=False) if n in needed else None)

    def extras(self) -> dict[str, Tensor]:
        """The norms beyond attn_norm / ffn_norm, by name (what `extra` took)."""
        return {n: getattr(self, n) for n in ("q_norm", "k_norm", "post_attn_norm", "post_ffn_norm")
                if getattr(self, n) is not None}

    def forward(self, x: Tensor, cache: KVCache, layer: int, start: int, cos: Tensor, sin: Tensor,
                mask: Tensor | None, row_wise: bool, keys: list[Tensor] | None = None,
                positions: Tensor | None = None) -> Tensor:
        """x [S, D] -> [S, D]; writes this layer's keys/values at cache slots start..start+S-1.

        mask: row-wise, the [S, S] tree mask over the pass rows or None (causal); else SDPA's [1, 1, S, L+S].
        keys (torch's row-wise attention): the cache slots each row attends to, where given (a tree pass off the
        CPU, a sliding-window layer: Transformer.forward reads them once per pass, not per layer).
        positions [S] (C's attention): the rows' positions, by which a sliding-window layer's window applies."""
        h = self._attention(rms_norm(x, self.attn_norm, self.eps), cache, layer, start, cos, sin, mask, row_wise, keys,
                            positions)
        if self.post_attn_norm is not None:
            h = rms_norm(h, self.post_attn_norm, self.eps)
        x = x + h
        h = self.gate_up(rms_norm(x, self.ffn_norm, self.eps))  # [S, 2F]
        h = self.down(geglu(h, self.hidden_dim) if self.gelu else swiglu(h, self.hidden_dim))
        if self.post_ffn_norm is not None:
            h = rms_norm(h, self.post_ffn_norm, self.eps)
        return x + h

    def _qk_norm(self, qkv: Tensor, S: int) -> Tensor:
        """qkv with each query and key head RMS-normed (row by row, so batch-invariant)."""
        H, Hkv, hd = self.n_heads, self.n_kv, self.hd
        q = rms_norm(qkv[:, : H * hd].reshape(S * H, hd), self.q_norm, self.eps).view(S, H * hd)
        k = rms_norm(qkv[:, H * hd : (H + Hkv) * hd].reshape(S * Hkv, hd), self.k_norm, self.eps).view(S, Hkv * hd)
        return torch.cat([q, k, qkv[:, (H + Hkv) * hd :]], 1)

    def _attention(self, x: Tensor, cache: KVCache, layer: int, start: int, cos: Tensor, sin: Tensor,
                   mask: Tensor | None, row_wise: bool, keys: list[Tensor] | None = None,
                   positions: Tensor | None = None) -> Tensor:
        S, H, Hkv, hd = x.shape[0], self.n_heads, self.n_kv, self.hd
        qkv = self.qkv(x)  # [S, (H + 2 Hkv) hd]
        if self.q_norm is not None:
            qkv = self._qk_norm(qkv, S)
        lib = native_kernels() if row_wise and x.device.type == "cpu" and hd % 8 == 0 else None
        if lib is not None:  # rope, cache write and row-wise attention in one C call (kernels/attention.c)
            return self.o(attend_rows(lib, self, qkv, cache, layer, start, cos, sin, mask, positions))
        qk = _rope(qkv[:, : (H + Hkv) * hd].view(S, H + Hkv, hd), cos, sin)  # [S, H+Hkv, hd]
        q = qk[:, :H].transpose(0, 1)  # [H, S, hd]
        k_new = qk[:, H:].transpose(0, 1)  # [Hkv, S, hd]
        v_new = qkv[:, (H + Hkv) * hd :].view(S, Hkv, hd).transpose(0, 1)
        k, v = cache.write(layer, start, k_new, v_new)  # [Hkv, L+S, hd]
        k, v = k.to(q.dtype), v.to(q.dtype)  # a float16 cache is widened for torch's float32 ops (no copy otherwise)
        if row_wise:
            # Each query row attends with exactly the calls plain decoding makes for that position, so
            # a verification pass over k drafts reproduces one-token decoding bit for bit (batched
            # attention reduces in a different order, and 8-bit activations turn such 1e-7 noise into
            # real flips). Three plain ops per row: for one query SDPA's flash kernel costs more.
            # A tree row attends to its ancestors: gathered after the committed slots, they are the keys
            # of the chain that ends at it, in the same order.
            qs = (qk[:, :H] * self.scale).view(S, Hkv, H // Hkv, hd)  # [S, Hkv, H/Hkv, hd], contiguous rows
            if keys is not None:
                seen = keys
            elif mask is None:
                seen = [slice(0, start + i + 1) for i in range(S)]
            else:
                seen = tree_keys(mask, start, x.device)
            out = torch.cat([
                torch.bmm(torch.bmm(qs[i], k[:, idx].transpose(1, 2)).softmax(-1), v[:, idx])
                .view(1, H * hd)  # [Hkv, H/Hkv, hd] -> [1, H hd], heads in order
                for i, idx in enumerate(seen)
            ])
        else:
            out = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, enable_gqa=True,
                                                 scale=None if self.scale == hd**-0.5 else self.scale)
            out = out[0].transpose(0, 1).reshape(S, H * hd)
        return self.o(out)
