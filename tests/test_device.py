"""Device placement, checked without a GPU: `--device` errors, models on different devices, heads on a
target off the CPU (the meta device stands in for a GPU), and a tree pass's attention rows read from
the mask once (what the cuda path uses) equal to reading it row by row. scripts/cuda_check.py runs the
rest on a real GPU."""

import copy

import pytest
import torch

from speculant.cli import main
from speculant.decoding.engine import Engine
from speculant.errors import SpeculantError
from speculant.methods.heads import HeadsConfig, load_heads
from speculant.methods.config import MethodConfig
from speculant.methods.medusa import MedusaDrafter
from speculant.models import LoadedModel, resolve_device
from speculant.models.keys import tree_keys
from speculant.exact.tree import DraftTree

from conftest import tiny_model
from test_heads import random_head


def on_meta(loaded: LoadedModel) -> LoadedModel:
    """A copy of the model on the meta device (module.to() moves in place)."""
    return LoadedModel(loaded.name, loaded.path, copy.deepcopy(loaded.model).to("meta"), loaded.tokenizer, loaded.dtype)


def test_device_names_are_checked_before_loading():
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(SpeculantError, match="unknown --device 'gpu0'"):
        resolve_device("gpu0")
    with pytest.raises(SpeculantError, match="--device mps is not supported"):
        resolve_device("mps")
    if not torch.cuda.is_available():
        with pytest.raises(SpeculantError, match="sees no CUDA GPU"):
            resolve_device("cuda")
    else:
        with pytest.raises(SpeculantError, match="there is no GPU"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


def test_cli_device_error_is_one_line(capsys):
    rc = main(["generate", "--device", "mps", "--no-progress", "hello"])  # before any model is resolved
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--device mps is not supported" in err[0]


def test_draft_model_on_another_device_is_refused():
    target = tiny_model(16, seed=1)
    draft = on_meta(tiny_model(16, seed=2))
    with pytest.raises(SpeculantError, match="draft model is on meta but the target on cpu"):
        Engine(target, draft, MethodConfig("draft"))


def test_heads_follow_the_target_off_the_cpu(tmp_path):
    target = tiny_model(32, seed=1)
    folder = random_head(target, "medusa", tmp_path)
    meta = on_meta(target)
    head, _ = load_heads(meta, "medusa", HeadsConfig(name=str(folder)))  # the default format off the CPU: float32
    assert {p.device.type for p in head.parameters()} == {"meta"} and head.d2t.device.type == "meta"
    assert all(type(m).__name__ != "GGMLLinear" for m in head.modules())
    assert MedusaDrafter(head, HeadsConfig()).index.device.type == "meta"
    with pytest.raises(SpeculantError, match="heads in q8_0 run on the CPU only"):
        load_heads(meta, "medusa", HeadsConfig(name=str(folder), fmt="q8_0"))
    head, _ = load_heads(target, "medusa", HeadsConfig(name=str(folder), fmt="float32"))
    assert head.d2t.device.type == "cpu"


def test_tree_keys_are_the_slots_each_row_attends_to():
    tree = DraftTree(torch.arange(6), [-1, 0, -1, 1, 2, 3])
    keys = tree_keys(tree.ancestor_mask(), 5, torch.device("cpu"))
    committed = list(range(5))
    # pass rows: 0 = pending (slot 5), node i at row 1 + i (slot 6 + i); each sees pending and its ancestors
    assert [k.tolist() for k in keys] == [committed + [5], committed + [5, 6], committed + [5, 6, 7],
                                          committed + [5, 8], committed + [5, 6, 7, 9], committed + [5, 8, 10],
                                          committed + [5, 6, 7, 9, 11]]


def test_a_tree_pass_attends_alike_with_keys_read_once(native_kernels_as):
    native_kernels_as(None)  # the torch path, which the keys feed off the CPU
    model = tiny_model(40, seed=4, dim=64, heads=4, kv_heads=2, hidden=128, layers=2).model
    g = torch.Generator().manual_seed(0)
    cache = model.new_cache(64)
    model(torch.randint(0, 40, (9,), generator=g), cache, logit_rows=slice(0, 0))
    start = cache.length
    tree = DraftTree(torch.randint(0, 40, (7,), generator=g), [-1, 0, 0, 1, -1, 4, 3])
    mask = tree.ancestor_mask()
    pos = tree.positions(start)
    x = torch.randn(8, 64, generator=g)
    blk = model.blocks[0]
    outs = []
    for keys in (None, tree_keys(mask, start, torch.device("cpu"))):
        c = model.new_cache(64)
        c.k.copy_(cache.k), c.v.copy_(cache.v)
        c.length = start
        outs.append(blk(x, c, 0, start, model.cos[pos], model.sin[pos], mask, True, keys))
    assert torch.equal(outs[0], outs[1])
