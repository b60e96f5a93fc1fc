"""Shared fixtures: tiny random models built in-process, and the real default models (pulled once).

Tiny models have a vocabulary of a few tokens so that distributions can be checked exactly; they
run through the same Transformer, KV cache, engine and verification code as the real models.
"""

from __future__ import annotations

import os

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from speculant.models import LoadedModel
from speculant.models.block import Block
from speculant.models.cache import kv_dtype as kv_dtype_of
from speculant.models.config import ModelConfig
from speculant.models.formats import make_linear
from speculant.models.transformer import Transformer
from speculant.text.tokenizer import Tokenizer

# One torch (and kernel) thread per test process unless $SPECULANT_THREADS says otherwise. The tiny models'
# passes are far too small to split: each op's threads wait for one another, and on a shared or busy host a
# descheduled thread stalls the rest, so two threads cost many times the CPU of one for the engine-heavy
# distribution tests. Parallelism comes from pytest-xdist workers instead (scripts/test.sh), one thread each.
# Engines and CLI subprocesses read the variable; tests of the thread logic set or unset it themselves.
_THREADS_GIVEN = "SPECULANT_THREADS" in os.environ or "PYTEST_XDIST_WORKER" in os.environ
os.environ.setdefault("SPECULANT_THREADS", "1")
torch.set_num_threads(int(os.environ["SPECULANT_THREADS"]))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The files marked `heavy` first, each file's tests kept together and in order. scripts/test.sh runs the
    files on two pytest-xdist workers in this order (--dist loadfile --no-loadscope-reorder): a file of minutes
    handed out last would leave one worker running it alone while the other sits idle."""
    items.sort(key=lambda item: item.get_closest_marker("heavy") is None)  # stable: files stay together


@pytest.fixture(autouse=True)
def _real_models_use_every_core(request, monkeypatch):
    """Tests of the real default models (a 1.5B's passes split well) run on the engine's default threads, unless
    the count was given or several pytest-xdist workers share the cores."""
    if request.node.get_closest_marker("real") is not None and not _THREADS_GIVEN:
        monkeypatch.delenv("SPECULANT_THREADS")
    yield


def tiny_tokenizer(vocab: int, eos: int | None = None) -> Tokenizer:
    """Word-level tokenizer over the words t0 .. t{vocab-1} (text 't3 t1' <-> ids [3, 1])."""
    backend = Backend(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return Tokenizer(backend, bos_id=None, eos_id=eos, eos_ids=frozenset(), add_bos=False, chat_template=None)


def tiny_model(vocab: int = 8, *, seed: int = 0, dim: int = 32, layers: int = 2, heads: int = 4, kv_heads: int = 2,
               hidden: int = 64, context: int = 256, arch: str = "qwen2", fmt: str = "float32",
               logit_scale: float = 1.0, eos: int | None = None, kv_dtype: str = "f32") -> LoadedModel:
    """A random-weight Transformer wrapped like a loaded model. `logit_scale` sharpens its distributions;
    `kv_dtype` (f32, f16, q8_0) is that of the KV caches it makes."""
    g = torch.Generator().manual_seed(seed)
    cfg = ModelConfig(arch=arch, n_layers=layers, dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=hidden,
                      vocab_size=vocab, context_length=context, qkv_bias=arch == "qwen2", rope_base=10000.0)
    hd = cfg.head_dim

    def rnd(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    blocks = []
    for _ in range(layers):
        qkv_out = (heads + 2 * kv_heads) * hd
        blocks.append(Block(
            cfg, 1 + rnd(dim, std=0.1),
            make_linear(rnd(qkv_out, dim), rnd(qkv_out, std=0.1) if cfg.qkv_bias else None, fmt),
            make_linear(rnd(dim, heads * hd), None, fmt),
            1 + rnd(dim, std=0.1),
            make_linear(rnd(2 * hidden, dim), None, fmt),
            make_linear(rnd(dim, hidden), None, fmt),
        ))
    embed = rnd(vocab, dim, std=1.0)
    head = make_linear(rnd(vocab, dim, std=logit_scale), None, fmt)
    model = Transformer(cfg, embed, blocks, 1 + rnd(dim, std=0.1), head)
    model.kv_dtype = kv_dtype_of(kv_dtype)
    return LoadedModel(name=f"tiny-{seed}", path=None, model=model, tokenizer=tiny_tokenizer(vocab, eos), dtype=fmt)


REAL_MODELS_KEPT = 2  # a target and its draft (tests/test_real_spec.py) are the most one test uses at once


@pytest.fixture(scope="session")
def real_model_cache():
    """Loaded real models by (preset, dtype), shared across the session (loading costs seconds). Only the
    REAL_MODELS_KEPT most recently used stay loaded: the float32 and int8 copies of the 0.5B and 1.5B take
    gigabytes each, and a worker that kept every one could exhaust a small host's memory."""
    import gc
    from collections import OrderedDict

    from speculant.models import load_model
    from speculant.threads import configure_threads

    configure_threads()
    loaded: OrderedDict[tuple[str, str], LoadedModel] = OrderedDict()

    def get(name: str, dtype: str) -> LoadedModel:
        key = (name, dtype)
        if key not in loaded:
            while len(loaded) >= REAL_MODELS_KEPT:
                loaded.popitem(last=False)
                gc.collect()
            loaded[key] = load_model(name, dtype, progress=False)
        loaded.move_to_end(key)
        return loaded[key]

    return get


@pytest.fixture
def native_kernels_as(monkeypatch):
    """use(lib): native_kernels() returns `lib` (None: the torch path) for the test, in every speculant module that
    calls it (row_ops.py's per-row ops, block.py's attention, transformer.py's fused loop)."""
    import sys

    from speculant.models import row_ops

    real = row_ops.native_kernels
    holders = [m for name, m in list(sys.modules.items())
               if name.startswith("speculant.") and vars(m).get("native_kernels") is real]

    def use(lib) -> None:
        for m in holders:
            monkeypatch.setattr(m, "native_kernels", lambda: lib)
    return use


@pytest.fixture
def prefill_route(monkeypatch):
    """Sets $SPECULANT_PREFILL (None: unset) for the test, prefill_routes() re-read; unset after."""
    from speculant.models.formats import ggml_routes

    def use(value: str | None) -> tuple[str, ...]:
        if value is None:
            monkeypatch.delenv("SPECULANT_PREFILL", raising=False)
        else:
            monkeypatch.setenv("SPECULANT_PREFILL", value)
        ggml_routes.prefill_routes.cache_clear()
        return ggml_routes.prefill_routes()
    yield use
    monkeypatch.delenv("SPECULANT_PREFILL", raising=False)
    ggml_routes.prefill_routes.cache_clear()
