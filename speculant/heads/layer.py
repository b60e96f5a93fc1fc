"""One Llama decoder layer for draft heads, in plain torch: trainable, and swappable to block formats.

The layer is split where the attention pattern differs between uses:
`project` (rms-normed input -> rotated q, k, v) and `finish` (attention output -> o-projection,
residual, MLP). The caller attends in between: causally over a KV cache while drafting (`attend`),
or over EAGLE-3's training-time-test pattern while training (train.py). Linear layers are fused
(q|k|v, gate|up) so that a draft step makes four matmul calls; `quantize` turns them into the
block-format `QLinear`s the target runs on (gq.c), which is what makes a draft step cheap.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.cache import KVCache
from ..models.formats import ggml_available, make_linear
from ..models.rotary import _rope, tables
from .config import HeadConfig

INIT_STD = 0.02  # HF's initializer_range for Llama layers


def rms(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)


def linear(n_in: int, n_out: int, bias: bool, std: float = INIT_STD) -> nn.Linear:
    lin = nn.Linear(n_in, n_out, bias=bias)
    nn.init.normal_(lin.weight, std=std)
    if bias:
        nn.init.zeros_(lin.bias)
    return lin


class DraftLayer(nn.Module):
    def __init__(self, cfg: HeadConfig, in_dim: int) -> None:
        super().__init__()
        D, H, Hkv, hd = cfg.hidden, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.H, self.Hkv, self.hd, self.F, self.eps = H, Hkv, hd, cfg.intermediate, cfg.norm_eps
        self.qkv = linear(in_dim, (H + 2 * Hkv) * hd, cfg.qkv_bias)  # [in] -> q | k | v
        self.o = linear(H * hd, D, False)
        self.gate_up = linear(D, 2 * cfg.intermediate, False)  # [D] -> gate | up
        self.down = linear(cfg.intermediate, D, False)
        self.post_norm = nn.Parameter(torch.ones(D))
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm = nn.Parameter(torch.ones(hd))
            self.k_norm = nn.Parameter(torch.ones(hd))

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., S, in] -> q [..., H, S, hd], k and v [..., Hkv, S, hd]; cos/sin [S, hd/2] of each row."""
        H, Hkv, hd = self.H, self.Hkv, self.hd
        qkv = self.qkv(x)
        lead = qkv.shape[:-1]  # (..., S)
        qk = qkv[..., : (H + Hkv) * hd].reshape(*lead, H + Hkv, hd)
        if self.qk_norm:
            qk = torch.cat([rms(qk[..., :H, :], self.q_norm, self.eps), rms(qk[..., H:, :], self.k_norm, self.eps)], -2)
        qk = _rope(qk, cos, sin)  # [..., S, H+Hkv, hd]
        v = qkv[..., (H + Hkv) * hd:].reshape(*lead, Hkv, hd)
        return qk[..., :H, :].transpose(-2, -3), qk[..., H:, :].transpose(-2, -3), v.transpose(-2, -3)

    def finish(self, attn: Tensor, residual: Tensor) -> Tensor:
        """attn [..., H, S, hd] (attention output), residual [..., S, D] -> the layer's output [..., S, D]."""
        a = attn.transpose(-2, -3)
        x = residual + self.o(a.reshape(*a.shape[:-2], self.H * self.hd))
        h = self.gate_up(rms(x, self.post_norm, self.eps))
        return x + self.down(F.silu(h[..., : self.F]) * h[..., self.F:])


def attend(layer: DraftLayer, x: Tensor, residual: Tensor, cache: KVCache, positions: Tensor, mask: Tensor | None,
           cos_table: Tensor, sin_table: Tensor) -> Tensor:
    """A drafting pass: S rows x [S, in] at `positions`, written to the head's cache at cache.length..;
    each row attends to the cache under `mask` [S, L+S] (True = attend; None = causal). -> [S, D]"""
    S = x.shape[0]
    start, end = cache.reserve(S)
    q, k, v = layer.project(x, cos_table[positions], sin_table[positions])
    keys, values = cache.write(0, start, k, v)  # [Hkv, L+S, hd]
    cache.length = end
    if mask is None:
        mask = torch.ones(S, end, dtype=torch.bool, device=x.device).tril_(start)
    out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask[None, None],
                                         enable_gqa=True)[0]  # [H, S, hd]
    return layer.finish(out, residual)


def rope_tables_for(cfg: HeadConfig, target) -> tuple[Tensor, Tensor]:
    """cos, sin [n, hd/2] the head rotates with, for the target's positions (`target` a Transformer):
    the target's own tables, or the head's frequencies (a published drafter's rope_theta / scaling)."""
    if not cfg.rope_inv_freq:
        return target.cos, target.sin
    cos, sin = tables(cfg.rope_inv_freq, target.cos.shape[0])
    return cos.to(target.cos.device), sin.to(target.cos.device)


def inference_format() -> str:
    """The block format heads run in: q8_0 where the GGML kernels are built (4x fewer bytes a step
    than float32 at ~0.1% relative error), else float32."""
    return "q8_0" if ggml_available() else "float32"


def quantize_linears(module: nn.Module, fmt: str, make=None) -> None:
    """Replace every nn.Linear under `module` by a QLinear in `fmt` (inference only: no gradients); where given,
    `make(name, linear)` builds each one instead (name: the layer's path under `module`)."""
    for name, child in list(module.named_modules(remove_duplicate=False)):
        if name and isinstance(child, nn.Linear):
            parent, _, attr = name.rpartition(".")
            new = make(name, child) if make else \
                make_linear(child.weight.detach(), None if child.bias is None else child.bias.detach(), fmt)
            setattr(module.get_submodule(parent), attr, new)
