"""Comparisons with a transformers model (the independent reference) shared by the parity tests."""

from __future__ import annotations

import contextlib
import functools
import types

import numpy as np
import torch


def _in_memory_numpy() -> types.ModuleType:
    """numpy, as gguf's reader module sees it, with a read-only `memmap` that reads the whole file into an
    ordinary array: the reader slices the file a few values at a time (millions of slices for a vocabulary),
    and each slice of a memmap runs numpy's Python-level subclass hooks; the bytes are the same."""

    def memmap(path, mode="r"):
        if mode != "r":
            return np.memmap(path, mode=mode)
        data = np.fromfile(path, dtype=np.uint8)
        data.flags.writeable = False
        return data

    module = types.ModuleType("numpy")
    module.__dict__.update(np.__dict__)
    module.memmap = memmap
    return module


@contextlib.contextmanager
def hf_gguf_loading():
    """transformers, loading from a GGUF file, parses the whole file (every vocabulary string) once for the
    config, again for the weights and again for a tokenizer, and builds gguf's TensorNameMap anew for each of
    the model's hundreds of submodules; both depend on their arguments alone and are only read, so while this
    context lasts each is built once, and the reader parses the file from memory (_in_memory_numpy). What
    transformers reads and computes is unchanged."""
    import gguf
    from gguf import gguf_reader

    reader, name_map, numpy = gguf.GGUFReader, gguf.get_tensor_name_map, gguf_reader.np
    readers: dict[tuple, object] = {}

    def read(path, mode="r"):
        key = (str(path), mode)
        if key not in readers:
            readers[key] = reader(path, mode)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map, gguf_reader.np = read, functools.cache(name_map), _in_memory_numpy()
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, gguf_reader.np = reader, name_map, numpy


def no_weight_init():
    """transformers' context that skips the random initialization of a model whose weights are loaded next
    (transformers.initialization in v5, modeling_utils before)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def logit_gap(ours, ref, id_lists: list[list[int]]) -> tuple[float, int, int]:
    """(max |logit difference|, positions whose top-1 token agrees, positions) of our float32 model
    (a LoadedModel) against a transformers model over whole prompts."""
    worst, agree, total = 0.0, 0, 0
    for ids in id_lists:
        a = ours.model(torch.tensor(ids), ours.model.new_cache(len(ids))).logits
        with torch.no_grad():
            b = ref(torch.tensor([ids])).logits[0].float()
        worst = max(worst, float((a - b).abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += len(ids)
    return worst, agree, total


def reference_greedy(ref, ids: list[int], n: int) -> list[int]:
    """n greedy tokens from the reference's own incremental decoding (its KV cache, as its generate()
    runs it), without logits processors or stop tokens."""
    out, tokens = None, []
    with torch.no_grad():
        x = torch.tensor([ids])
        for _ in range(n):
            out = ref(x, past_key_values=None if out is None else out.past_key_values, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
            x = torch.tensor([[tokens[-1]]])
    return tokens


def greedy_mismatch(ref, ids: list[int], tokens: list[int]) -> int | None:
    """Where `tokens` (our greedy continuation of `ids`) first differs from the reference's greedy choice given
    the same prefix, or None if every token is the reference's argmax. One pass over ids + tokens scores all of
    them: the reference decoding greedily would emit exactly `tokens` iff each is its argmax after the ones
    before, so this checks what `reference_greedy` does at a fraction of its incremental steps' cost."""
    with torch.no_grad():
        logits = ref(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :].float()
    bad = (logits.argmax(-1) != torch.tensor(tokens)).nonzero()
    return int(bad[0]) if len(bad) else None
