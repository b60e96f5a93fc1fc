"""DFlash block drafters (z-lab, `DFlashDraftModel` of the `dflash` package) as they are published.

A folder: config.json (a Qwen3 config, `architectures: [DFlashDraftModel]`, `dflash_config`: block_size,
target_layer_ids, mask_token_id; optional input_embedding_scale, output_multiplier,
final_logit_softcapping) and safetensors with `fc.weight` [D, n*D], `hidden_norm.weight`, `norm.weight`
and `layers.{i}.*` (Qwen3 decoder layers: q/k/v/o_proj, q_norm/k_norm, input/post_attention_layernorm,
mlp.gate/up/down_proj). No embedding and no output layer: the drafter borrows the target's.

The math (dflash/model.py): the target's hidden states of the context tokens at `target_layer_ids`
(HF hidden_states[i + 1]: the output of layer i, the final normed state for the last layer) are
concatenated and projected, c = hidden_norm(fc(concat)), once for all layers. A draft pass scores the
block [anchor, MASK x (b-1)] at positions P..P+b-1 (P: the anchor's position, right after the context):
each layer takes x = input_layernorm(h), q = q_norm(q_proj(x)), and keys/values over the context and the
block, k = k_norm(k_proj([c; x])), v = v_proj([c; x]), all rotated at their own positions; the block
attends to every context row and to all its own rows (non-causal), then the Qwen3 residual/MLP. The
drafts are the target's lm_head over norm(h) of rows 1..b-1. Only the context rows' keys/values are
kept between rounds (the reference crops its cache to the context), so a round's block leaves nothing.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor, nn

from ..errors import SpeculantError
from ..models.cache import KVCache
from ..models.formats import GGMLLinear, make_linear
from ..models.formats.ggml import Part
from ..models.hf_config import config_from_hf
from ..models.rotary import _rope
from ..models.transformer import FINAL_HIDDEN
from .layer import quantize_linears, rms

ARCH = "DFlashDraftModel"


def is_dflash(raw: dict) -> bool:
    """Whether a config.json is a DFlash drafter's."""
    return "dflash_config" in raw or ARCH in (raw.get("architectures") or [])


@dataclass(frozen=True, slots=True)
class DFlashConfig:
    block_size: int
    layer_ids: tuple[int, ...]  # DFlash's target_layer_ids: HF hidden_states[i + 1], the output of layer i
    mask_token_id: int
    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    rope_inv_freq: tuple[float, ...]
    attention_bias: bool = False
    embed_scale: float = 1.0  # dflash_config.input_embedding_scale
    logit_scale: float = 1.0  # dflash_config.output_multiplier
    softcap: float | None = None  # dflash_config.final_logit_softcapping

    def taps(self, n_target_layers: int) -> tuple[int, ...]:
        """speculant's taps (models/transformer.py) of the layer ids: the residual after layer i, and for the
        last layer the final normed state (what HF's hidden_states[-1] holds)."""
        return tuple(FINAL_HIDDEN if i == n_target_layers - 1 else i for i in self.layer_ids)


def dflash_config(raw: dict, tensors: dict[str, Tensor], target_cfg, folder: Path) -> DFlashConfig:
    """The drafter's config, checked against its tensors and the target (a models.ModelConfig)."""
    dc = raw.get("dflash_config")
    if not isinstance(dc, dict):
        raise SpeculantError(f"{folder}/config.json: a DFlash drafter needs a `dflash_config` object (block_size, "
                             "target_layer_ids, mask_token_id)")
    missing = [k for k in ("block_size", "target_layer_ids", "mask_token_id") if dc.get(k) is None]
    if missing:
        raise SpeculantError(f"{folder}/config.json: dflash_config lacks {', '.join(missing)}")
    if raw.get("is_causal") or "sliding_attention" in (raw.get("layer_types") or []):
        raise SpeculantError(f"{folder}/config.json: causal or sliding-window DFlash layers are not supported "
                             "(speculant runs the published non-causal drafters)")
    src = f"{folder}/config.json"
    layer = config_from_hf({k: v for k, v in raw.items() if k not in ("dflash_config", "architectures", "model_type")}
                           | {"architectures": ["Qwen3ForCausalLM"]}, source=src, has_lm_head=True)
    block, mask = dc["block_size"], dc["mask_token_id"]
    ids = dc["target_layer_ids"]
    if not (isinstance(block, int) and 2 <= block <= 1024):
        raise SpeculantError(f"{src}: dflash_config.block_size must be an integer in 2..1024, got {block!r}")
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids)):
        raise SpeculantError(f"{src}: dflash_config.target_layer_ids must be a non-empty list of layer ids, "
                             f"got {ids!r}")
    n = target_cfg.n_layers
    if any(not 0 <= i < n for i in ids):
        raise SpeculantError(f"{folder}: the drafter reads target layers {ids}, the target has {n} layers "
                             f"(0..{n - 1}): it was made for another target")
    if not (isinstance(mask, int) and 0 <= mask < target_cfg.vocab_size):
        raise SpeculantError(f"{folder}: mask_token_id {mask!r} is not a token id of the target "
                             f"(0..{target_cfg.vocab_size - 1}): it was made for another target")
    D = target_cfg.dim
    if layer.dim != D:
        raise SpeculantError(f"{folder}: the drafter's hidden_size is {layer.dim}, the target's hidden size is {D}: it "
                             "was made for another target")
    fc = tensors.get("fc.weight")
    if fc is None:
        raise SpeculantError(f"{folder}: tensor fc.weight is missing")
    if tuple(fc.shape) != (D, len(ids) * D):
        raise SpeculantError(f"{folder}: fc.weight has shape {tuple(fc.shape)}; {len(ids)} target layers of width {D} "
                             f"need ({D}, {len(ids) * D})")
    return DFlashConfig(block, tuple(ids), mask, layer.n_layers, D, layer.n_heads, layer.n_kv_heads, layer.head_dim,
                        layer.hidden_dim, layer.norm_eps, tuple(layer.inv_freq()),
                        attention_bias=bool(raw.get("attention_bias", False)),
                        embed_scale=float(dc.get("input_embedding_scale", 1.0)),
                        logit_scale=float(dc.get("output_multiplier", 1.0)),
                        softcap=float(dc["final_logit_softcapping"]) if dc.get("final_logit_softcapping") else None)


class DFlashLayer(nn.Module):
    """One Qwen3 decoder layer whose keys/values also cover the projected context (the module docstring)."""

    def __init__(self, c: DFlashConfig) -> None:
        super().__init__()
        D, H, Hkv, hd = c.hidden, c.n_heads, c.n_kv_heads, c.head_dim
        self.H, self.Hkv, self.hd, self.eps = H, Hkv, hd, c.norm_eps
        self.q_proj, self.k_proj = nn.Linear(D, H * hd, c.attention_bias), nn.Linear(D, Hkv * hd, c.attention_bias)
        self.v_proj, self.o_proj = nn.Linear(D, Hkv * hd, c.attention_bias), nn.Linear(H * hd, D, c.attention_bias)
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(hd)), nn.Parameter(torch.ones(hd))
        self.input_layernorm, self.post_attention_layernorm = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))
        self.gate_proj, self.up_proj = nn.Linear(D, c.intermediate, False), nn.Linear(D, c.intermediate, False)
        self.down_proj = nn.Linear(c.intermediate, D, False)

    def kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [..., S, D] -> rotated keys and values [..., Hkv, S, hd]."""
        lead = x.shape[:-1]
        k = _rope(rms(self.k_proj(x).view(*lead, self.Hkv, self.hd), self.k_norm, self.eps), cos, sin)
        return k.transpose(-2, -3), self.v_proj(x).view(*lead, self.Hkv, self.hd).transpose(-2, -3)

    def project(self, h: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The block's rows h [..., S, D] -> rotated queries [..., H, S, hd], keys and values [..., Hkv, S, hd].
        Split from the attention so that training (training/dflash.py) attends over its own pattern."""
        lead = h.shape[:-1]
        x = rms(h, self.input_layernorm, self.eps)
        q = _rope(rms(self.q_proj(x).view(*lead, self.H, self.hd), self.q_norm, self.eps), cos, sin).transpose(-2, -3)
        return q, *self.kv(x, cos, sin)

    def finish(self, h: Tensor, out: Tensor, keep: slice | None = None) -> Tensor:
        """The attention's output out [..., H, S, hd] -> the layer's output rows (residual, o_proj, MLP); `keep`: of
        those rows alone."""
        out = out.transpose(-2, -3)
        out = out.reshape(*out.shape[:-2], self.H * self.hd)
        if keep is not None:
            h, out = h[keep], out[keep]
        h = h + self.o_proj(out)
        x = rms(h, self.post_attention_layernorm, self.eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def forward(self, h: Tensor, cache: KVCache, layer: int, cos: Tensor, sin: Tensor, keep: slice | None = None) -> Tensor:
        """The block's rows h [S, D] at the rotary rows cos/sin [S, hd/2], after the cache's context; `keep`: the rows
        whose outputs are wanted, o_proj and the MLP then run on those alone (the attention still on all: torch's
        attention rounds differently with fewer query rows)."""
        q, k, v = self.project(h, cos, sin)
        keys, values = cache.write(layer, cache.length, k, v)  # context + block; the caller never counts the block in
        out = F.scaled_dot_product_attention(q[None], keys[None], values[None], enable_gqa=True)[0]  # [H, S, hd]
        return self.finish(h, out, keep)


class DFlashModel(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.cfg = cfg
        D = cfg.hidden
        self.layers = nn.ModuleList(DFlashLayer(cfg) for _ in range(cfg.n_layers))
        self.fc = nn.Linear(len(cfg.layer_ids) * D, D, False)
        self.hidden_norm, self.norm = nn.Parameter(torch.ones(D)), nn.Parameter(torch.ones(D))

    def add_context(self, feats: Tensor, cache: KVCache, cos: Tensor, sin: Tensor) -> None:
        """Append the context rows of the target's concatenated features feats [R, n*D] (rotary rows cos/sin)
        to every layer's keys/values in `cache`."""
        c = rms(self.fc(feats), self.hidden_norm, self.cfg.norm_eps)
        start, end = cache.reserve(c.shape[0])
        for i, layer in enumerate(self.layers):
            cache.write(i, start, *layer.kv(c, cos, sin))
        cache.length = end

    def block(self, x: Tensor, cache: KVCache, cos: Tensor, sin: Tensor, keep: slice | None = None) -> Tensor:
        """The block's embeddings x [b, D] -> the normed outputs [b, D], or of the rows `keep` alone (the last layer's
        o_proj and MLP run on those only). The cache keeps only the context."""
        cache.reserve(x.shape[0])  # room for the block's own keys/values, written past the context
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            x = layer(x, cache, i, cos, sin, keep if i == last else None)
        return rms(x, self.norm, self.cfg.norm_eps)

    def rows_invariant(self) -> bool:
        """Whether each row's outputs are the same bits whatever rows pass with it: every linear a GGML layer (its
        integer kernel's rows are batch-invariant at short passes); torch's float matmul is not."""
        linears = [m for m in self.modules() if isinstance(m, (nn.Linear, GGMLLinear))]
        return all(isinstance(m, GGMLLinear) for m in linears)


def _own_name(hf: str) -> str:
    """An HF tensor name as this module's (no self_attn./mlp. level)."""
    return hf.replace("self_attn.", "").replace("mlp.", "")


def to_block_format(model: DFlashModel, fmt: str, blocks: dict[str, Part]) -> None:
    """Every linear of `model` in a block format: a GGUF file's own blocks where `blocks` (HF weight name -> the
    file's part) has them, else its float weights quantized to `fmt`. The GGML layers are repacked into 16-row
    tiles now, the file's blocks and those quantized here alike: a round multiplies the block's 16 rows, which the
    tiles' kernel does faster than the rows' layout (docs/measurements.md, "The DFlash round"; the kernels repack
    a file's blocks only by default, since blocks held in memory stay beside their tiles)."""
    own = {_own_name(hf): part for hf, part in blocks.items()}

    def make(name: str, lin: nn.Linear) -> nn.Module:
        bias = None if lin.bias is None else lin.bias.detach()
        part = own.get(f"{name}.weight")
        if part is not None:
            new = GGMLLinear([part], lin.in_features, bias)
        else:
            new = make_linear(lin.weight.detach(), bias, fmt)
            if isinstance(new, GGMLLinear):
                new = GGMLLinear(new.parts, new.in_features, new.bias, pack=True)
        if isinstance(new, GGMLLinear):
            new.tiles()
        return new

    quantize_linears(model, fmt, make)


def load_dflash(folder: Path, target_cfg, raw: dict, tensors: dict[str, Tensor]) -> DFlashModel:
    """A DFlashModel in float32 from a folder's config and tensors, every tensor checked by name and shape."""
    cfg = dflash_config(raw, tensors, target_cfg, folder)
    model = DFlashModel(cfg)
    own = model.state_dict()
    # HF names -> this module's: no self_attn./mlp. level, norms are bare parameters
    mapped = {}
    for k, v in tensors.items():
        if k in ("embed_tokens.weight", "lm_head.weight"):  # the target's own are used, as the reference does
            continue
        key = _own_name(k)
        mapped[key.removesuffix(".weight") if key.endswith("norm.weight") else key] = v
    missing = [k for k in own if k not in mapped]
    unexpected = [k for k in mapped if k not in own]
    if missing or unexpected:
        raise SpeculantError(f"{folder}: tensors do not match a DFlash drafter of {cfg.n_layers} layers (missing "
                             f"{missing[:4]}, unexpected {unexpected[:4]})")
    for k, v in own.items():
        if tuple(mapped[k].shape) != tuple(v.shape):
            raise SpeculantError(f"{folder}: tensor {k} has shape {tuple(mapped[k].shape)}, the config says "
                                 f"{tuple(v.shape)}")
    model.load_state_dict({k: mapped[k].float() for k in own})
    return model.eval().requires_grad_(False)


_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _hf_name(own: str) -> str:
    """This module's tensor name as z-lab's (load_dflash's mapping backwards)."""
    parts = own.split(".")
    if parts[0] == "layers":
        sub = parts[2]
        parts[2] = ("self_attn." if sub in _ATTENTION else "mlp." if sub in _MLP else "") + sub
    name = ".".join(parts)
    return name if name.endswith((".weight", ".bias")) else name + ".weight"


def save_dflash(model: DFlashModel, raw: dict, folder: Path, stats: dict | None = None) -> Path:
    """Write a float DFlashModel in z-lab's layout (what load_dflash, the reference DFlashDraftModel and llama.cpp's
    converter read): config.json is `raw` (the config the model was built from) with the training's `stats`."""
    folder.mkdir(parents=True, exist_ok=True)
    state = {_hf_name(k): v.detach().float().contiguous() for k, v in model.state_dict().items()}
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    tmp.replace(folder / "model.safetensors")
    cfg = folder / "config.tmp"
    cfg.write_text(json.dumps({**raw, "stats": stats or {}}, indent=1))
    cfg.replace(folder / "config.json")
    return folder
