"""Gemma 4 dense text models (gemma4_config.py says what differs from Gemma 3), on the torch route.

`Gemma4Model` keeps Transformer's forward contract (tokens, cache, positions, mask, taps, logit_rows, head) so
every decoding method runs on it unchanged; the fused C loop does not apply (per-layer head sizes, shared
keys/values, per-layer inputs), so short passes take the row-wise torch route, which is batch-invariant (each
query row attends with the calls one-token decoding makes; FloatLinear and the block formats give a row the
same bits in any pass), and long passes SDPA.

The cache is one KVCache with a slot per layer that writes keys/values (the KV-shared layers read their source
layer's slot), each slot as wide as the widest layer (heads and head size): a layer stores its rows zero-padded
and reads back its own part. Padding keeps rollback/keep/prefix copies those of every other model; shared layers
read their source's keys of the current pass, which the source wrote earlier in the same pass, so speculation
rolls them back with the rest.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .cache import KVCache, q8_0_values
from .formats.base import QLinear
from .gemma4_config import Gemma4Config
from .keys import pass_layout, tree_keys, window_keys
from .rotary import _rope, tables
from .row_ops import geglu, rms_norm
from .transformer import Output, Transformer


def _param(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.float(), requires_grad=False)


class Gemma4Block(nn.Module):
    """One Gemma 4 decoder layer. `kv` (k | v, or k alone where values are keys) is None in a KV-shared layer."""

    def __init__(self, g: Gemma4Config, layer: int, w: dict[str, Tensor], q: QLinear, kv: QLinear | None,
                 o: QLinear, gate_up: QLinear, down: QLinear, ple_gate: QLinear | None,
                 ple_proj: QLinear | None) -> None:
        super().__init__()
        c = g.base
        self.hd, self.n_heads, self.n_kv = g.head_dims[layer], c.n_heads, g.kv_heads[layer]
        self.eps, self.hidden = c.norm_eps, g.mlp_hidden[layer]
        self.window = c.sliding_window if c.is_local(layer) else None
        self.k_eq_v = g.k_eq_v[layer]
        self.q, self.kv, self.o, self.gate_up, self.down = q, kv, o, gate_up, down
        self.ple_gate, self.ple_proj = ple_gate, ple_proj
        for n in ("attn_norm", "post_attn_norm", "ffn_norm", "post_ffn_norm", "q_norm", "scalar"):
            setattr(self, n, _param(w[n]))
        self.k_norm = _param(w["k_norm"]) if kv is not None else None
        self.ple_norm = _param(w["ple_norm"]) if ple_gate is not None else None
        self.register_buffer("v_ones", torch.ones(self.hd), persistent=False)  # the values' RMSNorm has no weight

    def linears(self) -> list[QLinear]:
        return [m for m in (self.q, self.kv, self.o, self.gate_up, self.down, self.ple_gate, self.ple_proj)
                if m is not None]

    def forward(self, x: Tensor, ple: Tensor | None, cache: KVCache, slot: int, start: int, cos: Tensor,
                sin: Tensor, mask: Tensor | None, row_wise: bool, seen: list | None) -> Tensor:
        h = self._attention(rms_norm(x, self.attn_norm, self.eps), cache, slot, start, cos, sin, mask, row_wise, seen)
        x = x + rms_norm(h, self.post_attn_norm, self.eps)
        h = self.down(geglu(self.gate_up(rms_norm(x, self.ffn_norm, self.eps)), self.hidden))
        x = x + rms_norm(h, self.post_ffn_norm, self.eps)
        if ple is not None:
            # gelu(gate) * ple through geglu's row kernel: torch's vectorized gelu rounds a tensor's tail
            # differently, so a row's bits would depend on the rows beside it
            h = geglu(torch.cat([self.ple_gate(x), ple], 1), ple.shape[1])
            x = x + rms_norm(self.ple_proj(h), self.ple_norm, self.eps)
        return x * self.scalar

    def _heads(self, t: Tensor, n: int, weight: Tensor) -> Tensor:
        """t [S, n * hd] RMS-normed per head -> [S, n, hd]."""
        S = t.shape[0]
        return rms_norm(t.reshape(S * n, self.hd).contiguous(), weight, self.eps).view(S, n, self.hd)

    def _attention(self, x: Tensor, cache: KVCache, slot: int, start: int, cos: Tensor, sin: Tensor,
                   mask: Tensor | None, row_wise: bool, seen: list | None) -> Tensor:
        S, H, Hkv, hd = x.shape[0], self.n_heads, self.n_kv, self.hd
        q = _rope(self._heads(self.q(x), H, self.q_norm), cos, sin)  # [S, H, hd]
        end = start + S
        if self.kv is not None:
            kv = self.kv(x)
            k = _rope(self._heads(kv[:, : Hkv * hd], Hkv, self.k_norm), cos, sin)
            v = self._heads(kv[:, : Hkv * hd] if self.k_eq_v else kv[:, Hkv * hd :], Hkv, self.v_ones)
            k, v = write_padded(cache, slot, start, k.transpose(0, 1), v.transpose(0, 1))
        else:
            k, v = read_slot(cache, slot, end)
        k, v = k[:Hkv, :, :hd].to(q.dtype), v[:Hkv, :, :hd].to(q.dtype)  # [Hkv, L+S, hd]
        if row_wise:  # as Block._attention: each row with the calls one-token decoding makes
            qs = q.reshape(S, Hkv, H // Hkv, hd)
            rows = seen if seen is not None else [slice(0, start + i + 1) for i in range(S)]
            out = torch.cat([torch.bmm(torch.bmm(qs[i], k[:, idx].transpose(1, 2)).softmax(-1), v[:, idx])
                             .view(1, H * hd) for i, idx in enumerate(rows)])
        else:
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k[None], v[None], attn_mask=mask,
                                                 enable_gqa=True, scale=1.0)
            out = out[0].transpose(0, 1).reshape(S, H * hd)
        return self.o(out)


def write_padded(cache: KVCache, slot: int, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """Store k, v [Hkv, S, hd] in `slot`, zero-padded to the cache's heads and head size; the slot's keys/values."""
    Hkv, S, hd = k.shape
    H, D = cache.k.shape[1], cache.head_dim
    if (Hkv, hd) != (H, D):
        k, v = (F.pad(t, (0, D - hd, 0, 0, 0, 0)) for t in (k, v))
        if Hkv < H:
            z = k.new_zeros(H - Hkv, S, D)
            k, v = torch.cat([k, z]), torch.cat([v, z])
    return cache.write(slot, start, k, v)


def read_slot(cache: KVCache, slot: int, end: int) -> tuple[Tensor, Tensor]:
    """A slot's keys/values up to `end`, as KVCache.write returns them."""
    k, v = cache.k[slot, :, :end], cache.v[slot, :, :end]
    if cache.dtype == torch.int8:
        return q8_0_values(k), q8_0_values(v)
    return k, v


class Gemma4Model(Transformer):
    def __init__(self, g: Gemma4Config, embed: nn.Module, blocks: list[Gemma4Block], norm: Tensor, lm_head: QLinear,
                 ple_embed: Tensor | nn.Module | None, ple_model_proj: QLinear | None,
                 ple_proj_norm: Tensor | None) -> None:
        nn.Module.__init__(self)  # Transformer's own tables and fused loop do not apply
        self.cfg, self.g = g.base, g
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.norm = _param(norm)
        self.lm_head = lm_head
        # a table [V, layers * P] (an HF folder's, in its stored float type) or a GGUF file's rows dequantized on
        # lookup (formats.GGMLEmbedding: the published files' table is the model's largest tensor)
        self.ple_embed = ple_embed if ple_embed is None or isinstance(ple_embed, nn.Module) \
            else nn.Parameter(ple_embed, requires_grad=False)
        self.ple_model_proj = ple_model_proj
        self.ple_proj_norm = None if ple_proj_norm is None else _param(ple_proj_norm)
        self.slots = g.kv_slots()
        n = g.base.context_length
        for name, local in (("", False), ("_local", True)):
            cos, sin = tables(g.inv_freq(local), n)
            self.register_buffer("cos" + name, cos, persistent=False)
            self.register_buffer("sin" + name, sin, persistent=False)
        self._fused = False
        self.kv_dtype = torch.float32

    def fused_blocks(self):
        return None  # blocks.c has no place for per-layer head sizes, shared keys/values or per-layer inputs

    def new_cache(self, max_len: int | None = None) -> KVCache:
        g = self.g
        n = min(max_len or g.base.context_length, g.base.context_length)
        owners = list(self.slots)
        return KVCache(len(owners), max(g.kv_heads[i] for i in owners), max(g.head_dims[i] for i in owners), n,
                       self.kv_dtype, self.device)

    def thread_invariant(self) -> bool:
        linears = [self.lm_head] + [m for b in self.blocks for m in b.linears()]
        if self.ple_model_proj is not None:
            linears.append(self.ple_model_proj)
        return all(m.thread_invariant for m in linears)

    def weight_bytes_per_token(self) -> int:
        n = self.lm_head.weight_bytes() + self.embed.row_bytes()
        if self.ple_embed is not None:
            t = self.ple_embed
            n += (t.row_bytes() if isinstance(t, nn.Module) else t.shape[1] * t.element_size()) \
                + self.ple_model_proj.weight_bytes()
        return n + sum(m.weight_bytes() for b in self.blocks for m in b.linears())

    def per_layer_inputs(self, tokens: Tensor, x: Tensor) -> Tensor | None:
        """The PLE inputs [S, layers, P] of the pass (transformers' get_ + project_per_layer_inputs)."""
        if self.ple_embed is None:
            return None
        S, L, P = tokens.shape[0], self.g.n_layers, self.g.ple_dim
        t = self.ple_embed
        tok = (t(tokens) if isinstance(t, nn.Module) else F.embedding(tokens, t)).float() * torch.tensor(P**0.5)
        proj = self.ple_model_proj(x) * self.cfg.dim**-0.5
        proj = rms_norm(proj.reshape(S * L, P).contiguous(), self.ple_proj_norm, self.cfg.norm_eps).view(S, L, P)
        return (proj + tok.view(S, L, P)) * 2.0**-0.5

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: KVCache, positions: Tensor | None = None, mask: Tensor | None = None,
                taps: tuple[int, ...] = (), logit_rows: slice | Tensor | None = None,
                head: QLinear | None = None) -> Output:
        S = tokens.shape[0]
        start, end = cache.reserve(S)
        route = self.route(S, mask, tokens.device)  # no fused blocks: "rows", "sdpa" or "chunked"
        if route == "chunked":
            return self._chunked(tokens, cache, positions, taps, logit_rows, head, self.prefill_chunk())
        row_wise = route == "rows"
        positions, mask, tree = pass_layout(S, start, end, positions, mask, tokens.device, row_wise)
        full_seen = tree_keys(mask, start, tokens.device) if tree and row_wise else None
        w_mask, w_seen = window_keys(self.cfg.sliding_window, mask, row_wise, start, positions)
        rope = {False: (self.cos[positions], self.sin[positions]),
                True: (self.cos_local[positions], self.sin_local[positions])}
        x = self.embed(tokens) * self.cfg.embed_scale
        ple = self.per_layer_inputs(tokens, x)
        tapped: dict[int, Tensor] = {}
        for i, blk in enumerate(self.blocks):
            local = blk.window is not None
            c, s = rope[local]
            x = blk(x, None if ple is None else ple[:, i], cache, self.slots[self.g.kv_source[i]], start, c, s,
                    w_mask if local else mask, row_wise, w_seen if local else full_seen)
            if i in taps:
                tapped[i] = x
        cache.length = end
        return self._output(x, taps, tapped, logit_rows, head)
