"""One Transformer for the Llama family (llama, qwen2, qwen3, smollm3, gemma3: config.py's switches), batch size 1.

The forward pass is the contract every decoding method builds on:

    forward(tokens[S], cache, positions[S] | None, mask[S, L+S] | None, taps) -> Output(logits, taps)

- `tokens` are S new tokens, written to the cache at slots cache.length.. (then length += S).
- `positions` are their rotary positions (default: their slots). Trees of drafts (speculant/exact/tree.py)
  pass explicit positions (base + depth) and a boolean `mask` [S, S] over the pass's own rows (True =
  attend; the L committed slots are always visible). A mask [S, L+S] over every slot is the general
  form (SDPA).
- `taps` asks for the residual stream after given layers (EAGLE's features); FINAL_HIDDEN (-1) for
  the final normed state, the lm_head's input (Medusa's / EAGLE's hidden state).
- `logits` can be limited to some rows (`logit_rows`), e.g. only the last one after a prefill.

The cache is an argument, not model state, so one set of weights can serve several caches (a model
drafting for itself, a server with several sessions). Linear layers are `QLinear`s (models/formats/):
the float32 reference or a block format, swapped without touching this file; the embedding table is
a float tensor or a module that dequantizes rows on lookup (GGML formats).

Which route a forward takes (S = tokens in the pass) is chosen in one place, `Transformer.route` (Gemma 4
inherits it; Qwen3.5's recurrent forward takes only "rows" and "sdpa", by S alone):

| route | when | attention | linear layers |
|---|---|---|---|
| "fused": C blocks (`fused.py`, `kernels/blocks.c`) | S <= ROW_WISE_MAX, no mask or a tree mask [S, S], `fused_blocks()` built: CPU, x86 kernels, all linears GGML, head and row sizes multiples of 8 | row-wise in C | gq.c integer kernel |
| "rows" | S <= ROW_WISE_MAX, no mask or a tree mask, no fused blocks (float32, int8, GPU, Gemma 4) | row-wise: `attn_rows_ex` in C on the CPU where built and head size % 8 == 0 (sliding windows by position), else torch per row | the format's kernel (GGML: `rows`, as M <= SHORT_PASS_MAX) |
| "sdpa" | S > ROW_WISE_MAX, or a mask [S, L+S] | `F.scaled_dot_product_attention` | the format's kernel; GGML by `prefill_routes()` (block types: gq_gemm on x86 builds) |
| "chunked" | causal S > prefill_chunk() on the CPU | passes of prefill_chunk() tokens: ROW_WISE_MAX a pass ("fused") where the fused prefill route leads `prefill_routes()`, else PREFILL_CHUNK ("sdpa") | as that route |

Short passes (the first two rows) are batch-invariant: a token's logits are bit-identical whether it
is scored alone or with drafted tokens, and a tree node's whether it is scored in the tree or on its
path as a chain, which keeps speculative greedy output identical to `ar`. Taps do not change the route.
On a GPU (`--device cuda`, float32 only) short passes take the torch row-wise route, and FloatLinear runs
every short pass as one of SHORT_PASS_MAX rows, so they are batch-invariant there too (scripts/cuda_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .block import ROPE_TABLES, Block
from .cache import KVCache
from .config import ModelConfig
from .formats.base import SHORT_PASS_MAX, QLinear
from .formats.ggml_routes import prefill_routes
from .keys import pass_layout, tree_keys, window_keys
from .rotary import rope_tables
from .row_ops import native_kernels, rms_norm

# Causal passes of up to this many tokens (decoding, speculative verification) attend row by row,
# which makes their logits independent of how many tokens share the pass; longer ones (prefill)
# use one batched attention call.
ROW_WISE_MAX = SHORT_PASS_MAX

# Longer causal passes (prompts) on the CPU go through in chunks of this many tokens where they take the
# SDPA route: a chunk's activations stay in L2 (measured with the earlier int4 AMX kernel, 1.5B, 1024-token
# prompt: 3.2 s in chunks of 384 vs 4.4 s whole; chunks of 256: 3.3 s, 512: 3.9 s), and the activations of a
# long prompt never need more memory than a chunk's. Where the fused route leads (prefill_routes), chunks are
# short passes of ROW_WISE_MAX tokens instead.
PREFILL_CHUNK = 384

FINAL_HIDDEN = -1  # the taps id of the final normed hidden state (the lm_head's input)


@dataclass(slots=True)
class Output:
    logits: Tensor  # [R, V] for the requested rows
    taps: dict[int, Tensor] = field(default_factory=dict)  # layer -> [S, D] residual after it; FINAL_HIDDEN -> normed


class FloatEmbedding(nn.Module):
    """A float32 embedding table [V, D]."""

    def __init__(self, weight: Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.float().contiguous(), requires_grad=False)

    @property
    def num_embeddings(self) -> int:
        return self.weight.shape[0]

    def row_bytes(self) -> int:
        return self.weight.shape[1] * 4

    def forward(self, tokens: Tensor) -> Tensor:  # [S] -> [S, D]
        return F.embedding(tokens, self.weight)


class Transformer(nn.Module):
    recurrent = False  # no recurrent state (models/qwen35.py has one): trees and prompt reuse are open to it
    mtp = None  # no multi-token-prediction layer (Qwen3.5's: models/qwen35_mtp.py)

    def __init__(self, cfg: ModelConfig, embed: Tensor | nn.Module, blocks: list[Block], norm: Tensor,
                 lm_head: QLinear) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = embed if isinstance(embed, nn.Module) else FloatEmbedding(embed)  # tokens [S] -> [S, D]
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.Parameter(norm.float(), requires_grad=False)
        self.lm_head = lm_head
        cos, sin = rope_tables(cfg, cfg.context_length)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        local = any(cfg.local_layers)
        cos, sin = rope_tables(cfg, cfg.context_length, local=True) if local else (cos[:0], sin[:0])
        self.register_buffer("cos_local", cos, persistent=False)
        self.register_buffer("sin_local", sin, persistent=False)
        self._fused = None  # FusedBlocks, False where it does not apply, None until the first short pass
        self.kv_dtype = torch.float32  # of the caches new_cache makes (cache.py: KV_DTYPES)

    def _apply(self, fn, recurse=True):  # .to() & co. may move the weights the fused loop points at
        self._fused = None
        return super()._apply(fn, recurse)

    def __getstate__(self):  # (deep) copies build their own fused loop
        st = self.__dict__.copy()
        st["_fused"] = None
        return st

    def fused_blocks(self):
        """The one-C-call loop over the blocks (models/fused.py), or None where it does not apply."""
        if self._fused is None:
            fused = None
            if self.device.type == "cpu" and native_kernels() is not None:
                from .fused import FusedBlocks

                fused = FusedBlocks.build(list(self.blocks))
            self._fused = fused or False
        return self._fused or None

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def new_cache(self, max_len: int | None = None) -> KVCache:
        c = self.cfg
        n = min(max_len or c.context_length, c.context_length)
        return KVCache(c.n_layers, c.n_kv_heads, c.head_dim, n, self.kv_dtype, self.device)

    def thread_invariant(self) -> bool:
        """Whether every linear gives the same bits with any CPU thread count (formats/base.py)."""
        linears = [self.lm_head] + [m for b in self.blocks for m in (b.qkv, b.o, b.gate_up, b.down)]
        return all(m.thread_invariant for m in linears)

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights one decode step reads (one embedding row, all projections, norms)."""
        n = self.lm_head.weight_bytes() + self.embed.row_bytes()
        for b in self.blocks:
            n += sum(m.weight_bytes() for m in (b.qkv, b.o, b.gate_up, b.down)) + 8 * self.cfg.dim
        return n

    @torch.inference_mode()
    def forward(
        self,
        tokens: Tensor,  # [S] long
        cache: KVCache,
        positions: Tensor | None = None,  # [S] long
        mask: Tensor | None = None,  # [S, S] bool over the pass rows (a tree), or [S, L+S] over all slots
        taps: tuple[int, ...] = (),  # layer ids and/or FINAL_HIDDEN
        logit_rows: slice | Tensor | None = None,  # rows of logits to compute (default: all)
        head: QLinear | None = None,  # output projection to use instead of lm_head (a draft's reduced vocabulary)
    ) -> Output:
        S = tokens.shape[0]
        start, end = cache.reserve(S)
        route = self.route(S, mask, tokens.device)
        if route == "chunked":
            return self._chunked(tokens, cache, positions, taps, logit_rows, head, self.prefill_chunk())
        row_wise = route in ("fused", "rows")
        positions, mask, tree = pass_layout(S, start, end, positions, mask, tokens.device, row_wise)
        cos, sin = self.cos[positions], self.sin[positions]  # [S, hd/2]
        x = self.embed(tokens)  # [S, D]
        if self.cfg.embed_scale is not None:
            x = x * self.cfg.embed_scale
        # the pass's rotary tables, as ROPE_TABLES names them (each block takes its rope_table)
        tables = [(cos, sin)] * len(ROPE_TABLES)
        local = bool(self.cos_local.numel())
        if local:
            tables[ROPE_TABLES.index("local")] = (self.cos_local[positions], self.sin_local[positions])
        if any(self.cfg.nope_layers):  # cos 1, sin 0: the rotary leaves q and k exactly as they are
            tables[ROPE_TABLES.index("none")] = (torch.ones_like(cos), torch.zeros_like(sin))
        if route == "fused":
            x, tapped = self.fused_blocks()(x, cache, start, tables, positions if local else None, mask, taps)
        else:
            tapped = {}
            # the CPU reads the mask row by row for free; a GPU would wait for its queue at every read
            keys = tree_keys(mask, start, x.device) if tree and row_wise and x.device.type != "cpu" else None
            if local:  # the sliding-window layers' mask and keys (torch's attention; C's takes the positions)
                w_mask, w_keys = window_keys(self.cfg.sliding_window, mask, row_wise, start, positions)
            for i, blk in enumerate(self.blocks):
                c, s = tables[blk.rope_table]
                if blk.window is not None:
                    x = blk(x, cache, i, start, c, s, w_mask, row_wise, w_keys, positions)
                else:
                    x = blk(x, cache, i, start, c, s, mask, row_wise, keys)
                if i in taps:
                    tapped[i] = x
        cache.length = end
        return self._output(x, taps, tapped, logit_rows, head)

    def _output(self, x: Tensor, taps: tuple[int, ...], tapped: dict[int, Tensor], logit_rows: slice | Tensor | None,
                head: QLinear | None) -> Output:
        """Output from the last block's residual: final norm, logits (soft-capped if set), the FINAL_HIDDEN tap."""
        if FINAL_HIDDEN in taps:  # rms_norm is row by row: the logit rows are those of the full result
            h = rms_norm(x, self.norm, self.cfg.norm_eps)
            tapped[FINAL_HIDDEN] = h
            h = h if logit_rows is None else h[logit_rows]
        else:
            h = rms_norm(x if logit_rows is None else x[logit_rows], self.norm, self.cfg.norm_eps)
        logits = (head or self.lm_head)(h)
        if self.cfg.final_softcap is not None:
            cap = self.cfg.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return Output(logits, tapped)

    def route(self, S: int, mask: Tensor | None, device: torch.device) -> str:
        """The route of a pass of S tokens: "fused", "rows", "sdpa" or "chunked" (the table in this module's
        docstring). Every condition that picks a forward's route is here; `pass_layout` shapes the mask for it."""
        if mask is None and S > ROW_WISE_MAX and device.type == "cpu" and S > self.prefill_chunk():
            return "chunked"
        if S > ROW_WISE_MAX or (mask is not None and tuple(mask.shape) != (S, S)):
            return "sdpa"
        return "fused" if self.fused_blocks() is not None else "rows"

    def prefill_chunk(self) -> int:
        """Tokens per pass of a long causal pass on the CPU: short passes through the fused blocks where
        that route leads this CPU's prefill routes (formats/ggml_routes.py), else PREFILL_CHUNK."""
        if prefill_routes()[0] == "fused" and self.fused_blocks() is not None:
            return ROW_WISE_MAX
        return PREFILL_CHUNK

    def batch_invariant_prompts(self) -> bool:
        """Whether a prompt's passes compute each row as decoding it token by token would (the fused prefill
        route): the keys/values of any prefix of a prompt, or of tokens decoded after it, are then those a
        prefill of them would write, bit for bit (models/prompt_cache.py reuses them)."""
        return self.device.type == "cpu" and self.prefill_chunk() == ROW_WISE_MAX

    def _chunked(self, tokens: Tensor, cache: KVCache, positions: Tensor | None, taps: tuple[int, ...],
                 logit_rows: slice | Tensor | None, head: QLinear | None, chunk: int) -> Output:
        """A long causal pass as consecutive passes of at most `chunk` tokens (logit_rows ascending)."""
        S = tokens.shape[0]
        rows = None if logit_rows is None else torch.arange(S, device=tokens.device)[logit_rows]
        logits: list[Tensor] = []
        tapped: dict[int, list[Tensor]] = {}
        for s0 in range(0, S, chunk):
            s1 = min(s0 + chunk, S)
            lr: slice | Tensor | None = None
            if rows is not None:
                sel = rows[(rows >= s0) & (rows < s1)] - s0
                lr = sel if sel.numel() else slice(0, 0)
            out = self.forward(tokens[s0:s1], cache, None if positions is None else positions[s0:s1], None, taps,
                               lr, head)
            logits.append(out.logits)
            for layer, t in out.taps.items():
                tapped.setdefault(layer, []).append(t)
        return Output(torch.cat(logits), {layer: torch.cat(ts) for layer, ts in tapped.items()})
