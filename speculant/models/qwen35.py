"""The Qwen3.5 text model (dense): Gated DeltaNet linear-attention layers and gated full-attention layers.

Its forward is Transformer.forward's contract (transformer.py): tokens [S] at cache slots cache.length.., taps by
layer id or FINAL_HIDDEN, logit_rows, head; trees (a mask) are refused: the recurrent state is a chain's.

Batch invariance, which keeps speculative greedy output identical to `ar`: every op of a pass is row by row or a
per-token loop with the same shapes for any S. The linears are the formats' (short passes batch-invariant, as for
the Transformer); the convolution sums its taps in one fixed order per row; the delta rule runs token by token
(transformers' recurrent form, not its chunked one), so a k-row verification pass leaves the same logits and states,
bit for bit, as k one-token passes; full attention on short passes attends row by row. Passes longer than
ROW_WISE_MAX (prompts) take SDPA for attention and keep only their final recurrent state.

Where the x86 kernels run (CPU, float32), a DeltaNet layer's work between its two linears (convolution, gates, the
rule, the gated norm) is one C call, and so is a short pass's gated attention (norms, partial rotary, cache write,
row-wise attention, output gate): kernels/delta.c, row by row with the same instructions for any S. That saves
some 40 torch dispatches a layer; its bits are close to, not equal to, the torch ops below, which serve elsewhere.

Norm weights arrive with the 1 already added (the loader's job), so every RMSNorm is row_ops.rms_norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import SpeculantError
from .formats.base import QLinear
from .delta_rule import MAX_V, deltanet_layer, delta_rule, layer_kernels
from .qwen35_config import Qwen35Config
from .recurrent_cache import HybridCache
from .rotary import tables
from .row_ops import rms_norm, swiglu
from .transformer import FINAL_HIDDEN, ROW_WISE_MAX, FloatEmbedding, Output


def _param(t: Tensor) -> nn.Parameter:
    return nn.Parameter(t.float().contiguous(), requires_grad=False)


def _rows(f, x: Tensor) -> Tensor:
    """An elementwise f over x [S, W] with each row's bits independent of S: whole where W is a multiple of 16
    (every row then starts a vector of torch's loops), else row by row (see DeltaNet's gates)."""
    if x.shape[-1] % 16 == 0 or x.shape[0] == 1:
        return f(x)
    return torch.cat([f(x[i : i + 1]) for i in range(x.shape[0])])


class DeltaNet(nn.Module):
    """A Gated DeltaNet layer's token mixer. in_proj fuses transformers' in_proj_qkv | in_proj_z | in_proj_b |
    in_proj_a (rows in that order); conv [conv_dim, kernel]; neg_a (-exp(A_log)), dt_bias [v_heads]; norm [v_dim]
    (plain weight). `tiled`: the value heads in llama.cpp's order (its converter's, so a GGUF's tensors are used as
    stored): value head i served by key head i % k_heads, not transformers' i // (v_heads / k_heads)."""

    def __init__(self, cfg: Qwen35Config, in_proj: QLinear, out_proj: QLinear, conv: Tensor, neg_a: Tensor,
                 dt_bias: Tensor, norm: Tensor, tiled: bool = False) -> None:
        super().__init__()
        self.in_proj, self.out_proj = in_proj, out_proj
        self.conv = _param(conv.reshape(cfg.conv_dim, cfg.conv_kernel).t())  # [kernel, C]: tap j is a row
        self.neg_a = _param(neg_a)
        self.dt_bias = _param(dt_bias)
        self.norm = _param(norm)
        self.hk, self.hv, self.dk, self.dv = cfg.lin_k_heads, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim
        self.c, self.eps, self.tiled = cfg.conv_dim, cfg.norm_eps, tiled
        self.c_shape = self.c % 8 == 0 and self.dv % 8 == 0 and self.dv <= MAX_V  # what delta.c's layer call takes

    def forward(self, x: Tensor, cache: HybridCache, li: int) -> Tensor:
        S, C, hk, hv, dk, dv = x.shape[0], self.c, self.hk, self.hv, self.dk, self.dv
        p = self.in_proj(x)
        lib = layer_kernels()
        if lib is not None and self.c_shape and p.device.type == "cpu" and p.dtype == torch.float32:  # one C call
            p = p.contiguous()
            xs = torch.cat([cache.conv[li], p[:, :C]])
            every = S <= ROW_WISE_MAX
            states, o = deltanet_layer(lib, p, xs, self.conv, cache.state[li].contiguous(), (hk, hv, dk, dv),
                                       self.tiled, self.neg_a, self.dt_bias, self.norm, self.eps, every)
            cache.record(li, xs, [cache.state[li], *states], every)
            return self.out_proj(o)
        vd = hv * dv
        z, b, a = p[:, C : C + vd], p[:, C + vd : C + vd + hv], p[:, C + vd + hv :]
        xs = torch.cat([cache.conv[li], p[:, :C]])  # [window + S, C]: the window, then this pass's inputs
        K = self.conv.shape[0]
        acc = xs[0:S] * self.conv[0]
        for j in range(1, K):  # one fixed order of taps for every row
            acc = acc + xs[j : j + S] * self.conv[j]
        mixed = _rows(F.silu, acc)
        q = mixed[:, : hk * dk].reshape(S, hk, dk)
        k = mixed[:, hk * dk : 2 * hk * dk].reshape(S, hk, dk)
        v = mixed[:, 2 * hk * dk :].reshape(S, hv, dv)
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * (dk**-0.5)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
        if hv != hk and self.tiled:  # key head j serves value heads j, j + hk, j + 2 hk, ...
            q, k = q.repeat(1, hv // hk, 1), k.repeat(1, hv // hk, 1)
        elif hv != hk:  # each key head serves hv / hk consecutive value heads (a copy: repeat_interleave's
            # index arithmetic costs more than the copy on a decode step)
            q, k = (x[:, :, None].expand(S, hk, hv // hk, dk).reshape(S, hv, dk) for x in (q, k))
        beta, decay = [], []
        for t in range(S):
            # the gates of one token at a time: torch's elementwise ops round a few-value tensor (scalar loop)
            # unlike a longer one (vector loop), so the gates of S tokens at once would differ from decoding's
            beta.append(b[t].sigmoid())  # [hv]
            decay.append((self.neg_a * F.softplus(a[t] + self.dt_bias)).exp())
        every = S <= ROW_WISE_MAX
        states, outs = delta_rule(cache.state[li], q, k, v, torch.stack(beta), torch.stack(decay), every)
        cache.record(li, xs, [cache.state[li], *states], every)
        o = rms_norm(outs.reshape(S * hv, dv), self.norm, self.eps)
        o = (o.view(S, vd) * _rows(F.silu, z)).reshape(S, vd)
        return self.out_proj(o)


class GatedAttention(nn.Module):
    """Full attention with an output gate. qkv fuses q_proj (per head: query, then gate) | k_proj | v_proj; q_norm and
    k_norm [head_dim] per head; the rotary turns the first rotary_dim values of each head."""

    def __init__(self, cfg: Qwen35Config, qkv: QLinear, o: QLinear, q_norm: Tensor, k_norm: Tensor) -> None:
        super().__init__()
        self.qkv, self.o = qkv, o
        self.q_norm, self.k_norm = _param(q_norm), _param(k_norm)
        self.h, self.hkv, self.hd, self.rd, self.eps = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rotary_dim, cfg.norm_eps

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x [S, heads, hd], cos/sin [S, rd/2]
        half = self.rd // 2
        x1, x2, rest = x[..., :half], x[..., half : self.rd], x[..., self.rd :]
        c, s = cos[:, None], sin[:, None]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s, rest], -1)

    def forward(self, x: Tensor, cache: HybridCache, ai: int, start: int, cos: Tensor, sin: Tensor) -> Tensor:
        S, H, Hkv, hd = x.shape[0], self.h, self.hkv, self.hd
        p = self.qkv(x)
        kv = cache.kv if isinstance(cache, HybridCache) else cache  # the MTP layer's is a plain KVCache
        lib = layer_kernels()
        native = lib is not None and p.device.type == "cpu" and p.dtype == torch.float32 and hd % 32 == 0
        if S <= ROW_WISE_MAX and native:  # short passes: one C call (a q8_0 cache needs whole 32-value blocks)
            return self.o(self._attend_native(lib, p.contiguous(), kv, ai, start, cos, sin))
        qg = p[:, : 2 * H * hd].reshape(S, H, 2 * hd)
        gate = qg[..., hd:].reshape(S, H * hd)
        q = rms_norm(qg[..., :hd].reshape(S * H, hd), self.q_norm, self.eps).view(S, H, hd)
        k = rms_norm(p[:, 2 * H * hd : (2 * H + Hkv) * hd].reshape(S * Hkv, hd), self.k_norm, self.eps).view(S, Hkv, hd)
        v = p[:, (2 * H + Hkv) * hd :].reshape(S, Hkv, hd)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        keys, vals = kv.write(ai, start, k.transpose(0, 1), v.transpose(0, 1))  # [Hkv, L+S, hd]
        keys, vals = keys.to(q.dtype), vals.to(q.dtype)
        if S <= ROW_WISE_MAX:  # row by row: a verification pass attends exactly as one-token decoding
            qs = (q * hd**-0.5).view(S, Hkv, H // Hkv, hd)
            out = torch.cat([
                torch.bmm(torch.bmm(qs[i], keys[:, : start + i + 1].transpose(1, 2)).softmax(-1),
                          vals[:, : start + i + 1]).view(1, H * hd)
                for i in range(S)])
        else:
            mask = torch.ones(S, start + S, dtype=torch.bool, device=x.device).tril_(start)
            out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], vals[None], attn_mask=mask,
                                                 enable_gqa=True)
            out = out[0].transpose(0, 1).reshape(S, H * hd)
        return self.o(out * _rows(torch.sigmoid, gate))

    def _attend_native(self, lib, p: Tensor, kv, ai: int, start: int, cos: Tensor, sin: Tensor) -> Tensor:
        """delta.c's qwen35_attention: norms, rotary, cache write, row-wise attention and gate in one call."""
        S, H = p.shape[0], self.h
        out = torch.empty(S, H * self.hd)
        cos, sin = cos.contiguous(), sin.contiguous()
        rc = lib.qwen35_attention(p.data_ptr(), S, H, self.hkv, self.hd, self.rd, self.q_norm.data_ptr(),
                                  self.k_norm.data_ptr(), self.eps, cos.data_ptr(), sin.data_ptr(), kv.k[ai].data_ptr(),
                                  kv.v[ai].data_ptr(), kv.max_len, start, kv.c_type, out.data_ptr(),
                                  torch.get_num_threads())
        if rc:
            raise MemoryError(f"the gated attention kernel failed ({rc})")
        return out


class Qwen35Block(nn.Module):
    def __init__(self, cfg: Qwen35Config, mixer: DeltaNet | GatedAttention, attn_norm: Tensor, ffn_norm: Tensor,
                 gate_up: QLinear, down: QLinear) -> None:
        super().__init__()
        self.mixer, self.gate_up, self.down = mixer, gate_up, down
        self.attn_norm, self.ffn_norm = _param(attn_norm), _param(ffn_norm)
        self.eps, self.hidden = cfg.norm_eps, cfg.hidden_dim

    def forward(self, x: Tensor, cache: HybridCache, index: int, start: int, cos: Tensor, sin: Tensor) -> Tensor:
        h = rms_norm(x, self.attn_norm, self.eps)
        if isinstance(self.mixer, DeltaNet):
            x = x + self.mixer(h, cache, index)
        else:
            x = x + self.mixer(h, cache, index, start, cos, sin)
        return x + self.down(swiglu(self.gate_up(rms_norm(x, self.ffn_norm, self.eps)), self.hidden))

    def linears(self) -> list[QLinear]:
        m = self.mixer
        return [self.gate_up, self.down] + ([m.in_proj, m.out_proj] if isinstance(m, DeltaNet) else [m.qkv, m.o])


class Qwen35Model(nn.Module):
    """Transformer's interface (forward, new_cache, device, lm_head, embed, ...) over Qwen3.5's blocks."""

    recurrent = True  # its cache holds recurrent states: chains only, no prompt reuse (models/prompt_cache.py)

    def __init__(self, cfg: Qwen35Config, embed: Tensor | nn.Module, blocks: list[Qwen35Block], norm: Tensor,
                 lm_head: QLinear) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = embed if isinstance(embed, nn.Module) else FloatEmbedding(embed)
        self.blocks = nn.ModuleList(blocks)
        self.norm = _param(norm)
        self.lm_head = lm_head
        cos, sin = tables(cfg.inv_freq(), cfg.context_length)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        # which cache slot each layer uses: attention layers index the KV cache, linear ones the states
        self._slot = [(cfg.linear_layers if cfg.is_linear(i) else cfg.attn_layers).index(i) for i in range(cfg.n_layers)]
        self.kv_dtype = torch.float32
        self.mtp = None  # the MTP layer (models/qwen35_mtp.py) where the checkpoint ships one

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def new_cache(self, max_len: int | None = None) -> HybridCache:
        c = self.cfg
        n = min(max_len or c.context_length, c.context_length)
        return HybridCache(len(c.attn_layers), c.n_kv_heads, c.head_dim, n, self.kv_dtype, self.device,
                           len(c.linear_layers), c.conv_dim, c.conv_kernel, c.lin_v_heads, c.lin_k_dim, c.lin_v_dim)

    def fused_blocks(self):  # the fused C loop runs Llama-like blocks only
        return None

    def batch_invariant_prompts(self) -> bool:
        return False

    def thread_invariant(self) -> bool:
        return all(m.thread_invariant for b in self.blocks for m in b.linears()) and self.lm_head.thread_invariant

    def weight_bytes_per_token(self) -> int:
        n = self.lm_head.weight_bytes() + self.embed.row_bytes()
        return n + sum(m.weight_bytes() for b in self.blocks for m in b.linears())

    @torch.inference_mode()
    def forward(self, tokens: Tensor, cache: HybridCache, positions: Tensor | None = None, mask: Tensor | None = None,
                taps: tuple[int, ...] = (), logit_rows: slice | Tensor | None = None,
                head: QLinear | None = None) -> Output:
        if mask is not None:
            raise SpeculantError("Qwen3.5's linear-attention layers carry a recurrent state along one chain: draft "
                                 "trees are not supported on it; choose a chain method")
        S = tokens.shape[0]
        start, end = cache.reserve(S)
        if positions is None:
            positions = torch.arange(start, end, device=tokens.device)
        cos, sin = self.cos[positions], self.sin[positions]
        x = self.embed(tokens)
        tapped: dict[int, Tensor] = {}
        for i, blk in enumerate(self.blocks):
            x = blk(x, cache, self._slot[i], start, cos, sin)
            if i in taps:
                tapped[i] = x
        cache.length = end
        h = rms_norm(x, self.norm, self.cfg.norm_eps)
        if FINAL_HIDDEN in taps:
            tapped[FINAL_HIDDEN] = h
        logits = (head or self.lm_head)(h if logit_rows is None else h[logit_rows])
        return Output(logits, tapped)
