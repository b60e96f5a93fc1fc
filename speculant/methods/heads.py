"""Heads at decoding time: the options of the head methods and loading a head for a target.

A head is loaded once per engine: read (any layout formats.py knows), checked against the target,
its output rows attached where it reuses the target's (EAGLE-1/2 layout), and its linear layers put
in a block format (layer.inference_format) so that a draft step reads few bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..errors import SpeculantError
from .base import MAX_DRAFT_TOKENS
from ..heads.dflash import DFlashModel, is_dflash, load_dflash, to_block_format
from ..heads.dflash_gguf import file_blocks, read_dflash_gguf
from ..heads.formats import _read_config, _read_tensors, load_head
from ..heads.gguf_drafter import is_gguf
from ..heads.layer import inference_format
from ..models.formats import QLinear
from ..heads.modules import EagleHead, MedusaHeads, for_inference, init_from_target
from ..heads.store import resolve_heads


@dataclass(frozen=True, slots=True)
class HeadsConfig:
    """`--heads` and the tree the head methods propose each round."""

    name: str | None = None  # NAME under SPECULANT_HOME/heads, a folder, or None: MODEL-METHOD
    # Tree nodes the target checks per round (the pass has 1 + nodes rows). Every extra row costs a
    # part of a step in the block-format kernels (without AMX a pass of 11 rows costs ~4 one-token
    # passes, of 5 rows ~2; `scripts/step_timing.py`), so the tree is small: a larger tree was slower
    # (`bench methods`, docs/measurements.md "Draft heads trained
    # here").
    nodes: int = 4
    depth: int = 4  # EAGLE: draft steps (tree depth) per round
    topk: int = 2  # EAGLE: children per expanded node, and nodes expanded per step
    # the head's weight format (None: q8_0 where the GGML kernels run on the CPU, else float32; a DFlash drafter
    # GGUF's block-typed weights then stay the file's own blocks)
    fmt: str | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= MAX_DRAFT_TOKENS:
            raise SpeculantError(f"tree nodes must be in 1..{MAX_DRAFT_TOKENS} (the target checks 1 + nodes rows in "
                                 f"one batch-invariant pass), got {self.nodes}")
        if self.depth < 1 or self.topk < 1:
            raise SpeculantError(f"tree depth and topk must be >= 1, got {self.depth} and {self.topk}")


def load_heads(target, method: str, cfg: HeadsConfig) -> tuple[MedusaHeads | EagleHead, dict]:
    """The head of `--method method --heads cfg.name` for `target` (a LoadedModel), ready to draft."""
    folder = resolve_heads(cfg.name, target.name, method)
    head, stats = load_head(folder, target.config)
    if head.cfg.method != method:
        raise SpeculantError(f"{folder} holds {head.cfg.method} heads, not {method}; use --method {head.cfg.method}")
    if isinstance(head, EagleHead) and not head.cfg.own_lm_head:
        init_from_target(head, target.model)
    return for_inference(head, _format(target, cfg)).to(target.model.device), stats


def _format(target, cfg: HeadsConfig) -> str:
    device = target.model.device
    fmt = cfg.fmt or (inference_format() if device.type == "cpu" else "float32")
    if device.type != "cpu" and fmt != "float32":
        raise SpeculantError(f"heads in {fmt} run on the CPU only (their kernels are C); the target is on {device}: "
                             "use float32 heads there")
    return fmt


def load_dflash_drafter(target, cfg: HeadsConfig) -> DFlashModel:
    """The DFlash drafter of `--drafter cfg.name` for `target` (a LoadedModel), its linears in the heads' format; a
    GGUF drafter's block-typed linears keep the file's own blocks unless a format is asked for (cfg.fmt)."""
    folder = resolve_heads(cfg.name, target.name, "dflash")
    if is_gguf(folder):  # llama.cpp's DFlash drafter GGUF
        raw, tensors = read_dflash_gguf(folder)
    else:
        raw = _read_config(folder)
        if not is_dflash(raw):
            raise SpeculantError(f"{folder} is not a DFlash drafter (its config.json has no dflash_config); "
                                 "use --method eagle3 or the method its config names")
        tensors = _read_tensors(folder)
    model = load_dflash(folder, target.config, raw, tensors)
    fmt = _format(target, cfg)
    if fmt != "float32":
        to_block_format(model, fmt, file_blocks(folder) if is_gguf(folder) and cfg.fmt is None else {})
    return model.to(target.model.device)


def heads_thread_invariant(head: nn.Module) -> bool:
    """Whether the head's outputs are the same bits with any CPU thread count: every linear a QLinear that is
    (formats/base.py); float32 heads keep torch's nn.Linear, whose sums split by the thread count."""
    linears = [m for m in head.modules() if isinstance(m, (nn.Linear, QLinear))]
    return all(isinstance(m, QLinear) and m.thread_invariant for m in linears)
