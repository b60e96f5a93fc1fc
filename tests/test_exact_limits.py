"""Exactness at the edges: generations that run into the end of the context end like `ar` for every
tree method (the CLI and the engine), EAGLE trees stay inside the rotary table when a near-certain head
keeps expanding, and load-following thread counts only where every model and head is thread-invariant."""

import json

import pytest
import torch

from conftest import tiny_model
from speculant.cli import main
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig, parse_method
from speculant.methods.base import DraftLengthConfig
from speculant.methods.draft_tree import DraftTreeConfig
from speculant.methods.heads import HeadsConfig
from speculant.exact.sampler import SamplingConfig
from test_cli import write_gguf
from test_engine import PROMPT
from test_heads import random_head


@pytest.mark.parametrize("method", ["draft_tree", "lookup_tree", "hybrid"])
def test_cli_generate_past_the_context_ends_like_ar(capsys, tmp_path, monkeypatch, method):
    """A 32-token context, 60 tokens asked for: the same text as ar, finish_reason length, exit 0."""
    from speculant.models.native import kernel_dir

    home = tmp_path / "home"
    home.mkdir()
    (home / "kernels").symlink_to(kernel_dir())  # the built kernels (compiling them again costs minutes)
    monkeypatch.setenv("SPECULANT_HOME", str(home))
    path = str(write_gguf(tmp_path / "tiny.gguf"))

    def generate(*extra: str) -> tuple[str, dict]:
        rc = main(["generate", "--model", path, "--dtype", "float32", "-n", "60", "--temperature", "0", "--stats",
                   "--no-progress", *extra, "cab"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        return out, json.loads(err.strip().splitlines()[-1])

    ar, ar_stats = generate("--method", "ar")
    assert ar_stats["finish_reason"] == "length" and ar_stats["generated_tokens"] < 60  # the context ended it
    draft = ["--draft", path] if method != "lookup_tree" else []
    out, stats = generate("--method", method, *draft)
    assert (out, stats["finish_reason"], stats["generated_tokens"]) == (ar, "length", ar_stats["generated_tokens"])
    assert stats["drafted_tokens"] > 0


@pytest.mark.parametrize("width", [2, 3, 5])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_tree_never_drafts_past_its_budget(width, temperature):
    """Near the context's end the engine's budget k falls below the tree's width: the tree must fit in k."""
    target = tiny_model(32, seed=1, logit_scale=3.0, context=24)
    draft = tiny_model(32, seed=1, fmt="q4_0", context=24)
    gen = GenerationConfig(max_new_tokens=40, sampling=SamplingConfig(temperature, seed=3))
    ref = Engine(target).generate(PROMPT, gen)
    m = MethodConfig("draft_tree", DraftLengthConfig(k=4, max_k=4), draft_tree=DraftTreeConfig(width))
    done = Engine(target, draft, m).generate(PROMPT, gen)
    assert done.finish_reason == ref.finish_reason == "length"
    assert len(done.token_ids) == len(ref.token_ids)
    if temperature == 0.0:
        assert done.token_ids == ref.token_ids


@pytest.mark.parametrize("method", ["eagle2", "eagle3"])
def test_eagle_trees_stay_inside_the_context_when_the_head_is_certain(method, tmp_path):
    """A head whose top token has log-probability 0 ties parent and child scores, so the early stop never
    fires and the tree grows to its full depth; near the context's end that ran past the rotary table."""
    target = tiny_model(32, seed=2, logit_scale=3.0, layers=3, context=24)
    e = Engine(target, method=MethodConfig(method, heads=HeadsConfig(
        name=str(random_head(target, method, tmp_path, seed=1)), nodes=6, depth=8, topk=2)))
    vd = e._head.cfg.draft_vocab

    def certain(h: torch.Tensor) -> torch.Tensor:
        out = torch.full((*h.shape[:-1], vd), -1e4)
        out[..., 0] = 1e4
        return out

    e._head.logits = certain
    gen = GenerationConfig(max_new_tokens=40)
    ref = Engine(target).generate(PROMPT, gen)
    done = e.generate(PROMPT, gen)
    assert (done.token_ids, done.finish_reason) == (ref.token_ids, "length")
    assert done.stats.drafted_tokens > 0


def test_thread_counts_follow_load_only_where_every_model_is_thread_invariant(monkeypatch, tmp_path, prefill_route):
    """A float32 draft or head sums by the thread count: its q and trees would change under load."""
    monkeypatch.delenv("SPECULANT_THREADS", raising=False)
    prefill_route("rows")  # the integer kernels' prompts on any host (AMX puts oneDNN's bf16 route first)
    target = tiny_model(32, seed=1, fmt="q8_0")
    assert Engine(target)._share is not None  # the control: a thread-invariant target alone follows the load
    assert Engine(target, tiny_model(32, seed=2, fmt="q4_0"), MethodConfig("draft"))._share is not None
    assert Engine(target, tiny_model(32, seed=2), MethodConfig("draft"))._share is None
    assert Engine(target, tiny_model(32, seed=2), parse_method("hybrid"))._share is None
    for fmt, follows in (("q8_0", True), ("float32", False)):
        folder = random_head(target, "eagle3", tmp_path, seed=1)
        e = Engine(target, method=MethodConfig("eagle3", heads=HeadsConfig(name=str(folder), fmt=fmt)))
        assert (e._share is not None) == follows, fmt
    assert Engine(target, tiny_model(32, seed=2), MethodConfig("draft"), threads=1)._share is None  # fixed


def test_float32_results_do_not_depend_on_where_the_weights_start():
    """MKL's one-row product sums in an order set by the weight's address: the same weights read from a
    safetensors cache entry (8-byte aligned) and converted in memory gave different last bits. FloatLinear
    keeps its weight 64-byte aligned, so every copy of a model gives the same logits."""
    from speculant.models.formats.base import FloatLinear

    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(192, 72, generator=g), torch.randn(1, 72, generator=g)
    reference = FloatLinear(w, None)(x)
    for offset in range(1, 16):  # the weight at 4-byte steps past a 64-byte boundary
        view = torch.empty(w.numel() + 16)[offset:offset + w.numel()].view_as(w)
        view.copy_(w)
        # (on an AVX2 host the raw product, raw(x, view), differs from the reference at 12 of the 15 offsets)
        assert torch.equal(FloatLinear(view, None)(x), reference), offset
