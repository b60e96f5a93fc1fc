"""`speculant bench speed`: raw model throughput per weight format, and the cost of verification.

Batch-1 decoding reads every weight once per token, so decode speed is bounded by memory
bandwidth: we report the weight bytes one token reads, the GB/s that implies and its fraction of
the machine's bandwidth (`torch.sum` over a large float32 array with the same threads, right before
and after each row: memory speed on a shared host drifts within minutes). Speculative decoding pays
off only if scoring k tokens costs little more than scoring one: the cost curve times one forward
over k new tokens on a filled cache (median of repeats, rolled back between them). All timings use
raw `Transformer.forward` calls, no engine.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from ..models.cache import kv_dtype
from ..models.formats import WEIGHT_FORMATS
from ..models.transformer import Transformer
from ..exact.sampler import top_token

DEFAULT_MODELS = ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")
DEFAULT_DTYPES = ("gguf", "int8", "float32")  # gguf only where its kernels build (see default_dtypes)
KS = (1, 2, 4, 8, 16)
PEERS = ("llama-cpp",)
WARMUP_STEPS = 4

BENCH_TEXT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list in linear time."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

Speculative decoding lets a small, fast model propose several tokens that a large model then
checks in a single forward pass. Because the large model verifies every proposal, the output is
exactly what it would have produced alone; only the time it takes changes.
'''


@dataclass(frozen=True, slots=True)
class SpeedConfig:
    models: tuple[str, ...] = DEFAULT_MODELS
    dtypes: tuple[str, ...] = DEFAULT_DTYPES
    tokens: int = 64  # greedy decode steps timed
    cache: int = 256  # prompt length of the prefill, and the cache the cost curve scores on
    repeats: int = 5
    ks: tuple[int, ...] = KS
    against: tuple[str, ...] = ()
    bandwidth_gib: float = 1.0
    kv_dtype: str | None = None  # of our KV caches (cache.KV_DTYPES; None: cache.default_kv_dtype per format)

    def __post_init__(self) -> None:
        if self.kv_dtype is not None:
            kv_dtype(self.kv_dtype)  # a clear error for anything but cache.KV_DTYPES
        if not self.models:
            raise SpeculantError("--models needs at least one model")
        bad = [d for d in self.dtypes if d not in WEIGHT_FORMATS]
        if bad or not self.dtypes:
            raise SpeculantError(f"--dtypes must be among {', '.join(WEIGHT_FORMATS)} (got {' '.join(bad) or 'none'})")
        if self.tokens < 1 or self.cache < 1 or self.repeats < 1:
            raise SpeculantError("--tokens, --cache and --repeats must be >= 1")
        if not self.ks or min(self.ks) < 1:
            raise SpeculantError("cost-curve k values must be >= 1")
        if not 0.01 <= self.bandwidth_gib <= 64:
            raise SpeculantError(f"--bandwidth-gib must be in [0.01, 64], got {self.bandwidth_gib}")
        for p in self.against:
            if p not in PEERS:
                raise SpeculantError(f"unknown --against {p!r}; choose {', '.join(PEERS)}")


@dataclass(slots=True)
class SpeedRow:
    model: str
    engine: str  # "speculant" or a peer
    weights: str  # weight format
    prefill_tps: float
    decode_tps: float
    bytes_per_token: int
    curve_ms: dict[int, float] = field(default_factory=dict)
    bandwidth_gbps: float = 0.0  # the machine's, for the fraction

    @property
    def gbps(self) -> float:
        return self.bytes_per_token * self.decode_tps / 1e9

    @property
    def bandwidth_fraction(self) -> float | None:
        return self.gbps / self.bandwidth_gbps if self.bandwidth_gbps > 0 else None

    def curve_ratio(self, k: int) -> float | None:
        base = self.curve_ms.get(1)
        return self.curve_ms[k] / base if base and k in self.curve_ms else None

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d.update(gbps=self.gbps, bandwidth_fraction=self.bandwidth_fraction,
                 curve_ratio={k: self.curve_ratio(k) for k in self.curve_ms})
        return d


@dataclass(frozen=True, slots=True)
class Fidelity:
    model: str
    weights: str  # the quantised format compared with float32
    positions: int
    max_abs_logit_diff: float
    top1_agreement: float  # fraction of positions whose argmax agrees
    mean_kl: float  # mean KL(float32 || format) over positions, in nats


def _median_seconds(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Read bandwidth in GB/s: `torch.sum` over a gib-GiB float32 array (current torch threads)."""
    x = torch.ones(int(gib * (1 << 30)) // 4, dtype=torch.float32)  # touched, so pages are resident
    x.sum()
    sec = _median_seconds(x.sum, repeats)
    return x.numel() * 4 / sec / 1e9


def bench_ids(encode: Callable[[str], list[int]], n: int) -> list[int]:
    """n token ids of the fixed benchmark text (repeated as needed)."""
    base = encode(BENCH_TEXT)
    if not base:
        raise SpeculantError("the tokenizer returned no tokens for the benchmark text")
    return (base * (n // len(base) + 1))[:n]


def prefill_tps(model: Transformer, ids: Sequence[int], repeats: int = 3) -> float:
    """Prompt tokens per second of one forward over all of `ids` (last row's logits only)."""
    cache = model.new_cache(len(ids))
    x = torch.tensor(list(ids), device=model.device)

    def run() -> None:
        cache.rollback(0)
        model(x, cache, logit_rows=slice(-1, None))

    run()  # warm-up
    return len(ids) / _median_seconds(run, repeats)


def decode_tps(model: Transformer, ids: Sequence[int], tokens: int, warmup: int = WARMUP_STEPS) -> tuple[float, list[int]]:
    """Greedy decode of `tokens` tokens after the prompt `ids`, one forward per token.

    Returns (tok/s, the greedy continuation: the prefill's token, then the `tokens` decoded ones). The warm-up and
    the timed run each start from their own prefill: a recurrent model's cache (Qwen3.5's) cannot roll back across
    the warm-up's one-token passes."""
    prompt = torch.tensor(list(ids), device=model.device)

    def prefill() -> tuple[object, int]:
        cache = model.new_cache(len(ids) + max(tokens, warmup) + 1)
        return cache, int(top_token(model(prompt, cache, logit_rows=slice(-1, None)).logits[0]))

    def run(n: int, cache, first: int) -> list[int]:
        tok, out = first, []
        for _ in range(n):
            tok = int(top_token(model(torch.tensor([tok], device=model.device), cache).logits[-1]))
            out.append(tok)
        return out

    run(warmup, *prefill())
    cache, first = prefill()
    t = time.perf_counter()
    out = run(tokens, cache, first)
    return tokens / (time.perf_counter() - t), [first, *out]


def cost_curve(model: Transformer, ids: Sequence[int], ks: Sequence[int] = KS, repeats: int = 5) -> dict[int, float]:
    """Median ms of one forward scoring k new tokens (all logits, as verification does) on a cache
    holding `ids`; the cache is rolled back after every forward. The repeats go round-robin over
    the k values, so a burst of load on the machine hits all of them alike."""
    kmax = max(ks)
    cache = model.new_cache(len(ids) + kmax)
    model(torch.tensor(list(ids), device=model.device), cache, logit_rows=slice(0, 0))
    base = cache.length
    new = torch.tensor(list(ids[:kmax]) * (kmax // max(1, len(ids)) + 1), device=model.device)[:kmax]
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for i in range(repeats + 1):  # the first round is a warm-up
        for k in ks:
            t = time.perf_counter()
            model(new[:k], cache)
            dt = time.perf_counter() - t
            cache.rollback(base)
            if i:
                samples[k].append(dt)
    return {k: statistics.median(v) * 1000 for k, v in samples.items()}


FIDELITY_PASS = 16  # tokens per forward when scoring the fidelity text: the decode/verify path
# Fidelity follows llama.cpp's `llama-perplexity --kl-divergence` protocol, so the two compare on the same
# positions: the text in chunks of FIDELITY_CTX tokens, each from an empty cache, logits scored at the
# chunk's second half only (every scored position sees >= FIDELITY_CTX / 2 tokens of context). Scoring
# from position 0 instead weighs in the first tokens of a context, whose distributions are the least
# stable under quantization: 1.5B Q4_K_M on the same text, mean KL 0.0052 from position 0 vs 0.0014 here.
FIDELITY_CTX = 512


def text_logits(model: Transformer, ids: Sequence[int], pass_len: int = FIDELITY_PASS, first: int = 0) -> Tensor:
    """Logits [T - first, V] at the positions of `ids` from `first` on, scored in passes of `pass_len` tokens: by
    default the short-pass route that decoding and verification take (a prompt's prefill may take another). The
    positions before `first` are passed through (their keys and values) without their logits."""
    cache = model.new_cache(len(ids))
    t = torch.tensor(list(ids), device=model.device)
    return torch.cat([model(t[i:i + pass_len], cache, logit_rows=slice(max(first - i, 0), None)).logits.float().cpu()
                      for i in range(0, len(ids), pass_len)])


def fidelity_chunks(ids: Sequence[int], chunks: int, ctx: int = FIDELITY_CTX,
                    bos: int | None = None) -> list[list[int]]:
    """The first `chunks` chunks of `ids`, ctx tokens each, as llama-perplexity scores them: where the model adds a
    BOS token (`bos`: its id, else None), each chunk's first token is replaced by BOS, so that every chunk starts
    as a prompt does. Gemma expects BOS at position 0: a chunk that starts mid-text without it is far from
    anything it was trained on, and quantization moves its logits further (Gemma 3 270M Q4_K_M against float32,
    chunks 2-4 of the short text: mean KL 0.0140 without BOS, 0.0058 with it, llama.cpp's 0.0063)."""
    if len(ids) < chunks * ctx:
        raise SpeculantError(f"fidelity needs {chunks * ctx} tokens of text, got {len(ids)}")
    parts = [list(ids[c * ctx:(c + 1) * ctx]) for c in range(chunks)]
    if bos is not None:
        for part in parts:
            part[0] = bos
    return parts


def fidelity_logits(model: Transformer, ids: Sequence[int], chunks: int, ctx: int = FIDELITY_CTX,
                    pass_len: int = FIDELITY_PASS, bos: int | None = None) -> Tensor:
    """Logits [chunks * (ctx / 2 - 1), V] at the scored positions of llama-perplexity's protocol (see
    FIDELITY_CTX), each chunk of `fidelity_chunks` scored by `text_logits` from an empty cache."""
    return torch.cat([text_logits(model, part, pass_len, first=ctx // 2)[:ctx // 2 - 1]
                      for part in fidelity_chunks(ids, chunks, ctx, bos)])


def fidelity_text(long: bool = False) -> str:
    """Held-out text for fidelity (no benchmark prompt): Python source and English prose from the standard
    library of the Python running this (textwrap.py and the documentation topics of pydoc_data): 5,000
    characters of each (4 chunks of FIDELITY_CTX tokens), or with `long` about 40,000 (~20 chunks; its
    first chunks differ from the short text's: textwrap.py goes on past 5,000 characters)."""
    import shlex
    import textwrap

    from pydoc_data import topics

    if not long:
        return Path(textwrap.__file__).read_text()[:5000] + "\n\n" + topics.topics["assignment"][:5000]
    code = Path(textwrap.__file__).read_text() + "\n\n" + Path(shlex.__file__).read_text()[:1000]
    prose = topics.topics["assignment"] + "\n\n" + topics.topics["compound"][:8500]
    return code + "\n\n" + prose


def compare_logits(model: str, weights: str, reference: Tensor, other: Tensor, rows: int = 32) -> Fidelity:
    """Max |logit difference|, top-1 agreement and mean KL(reference || other) in float64 over positions, a block
    of `rows` positions at a time (a whole vocabulary's float64 copies of both, several times over, would be
    gigabytes). KL is sum p (a - b) - lse(a) + lse(b) for logits a, b: log p - log q without either
    log-softmax, one exp pass a side."""
    if reference.shape != other.shape:
        raise SpeculantError(f"logit shapes differ: {tuple(reference.shape)} vs {tuple(other.shape)}")
    diff, agree, kl = 0.0, 0, 0.0
    for i in range(0, reference.shape[0], rows):
        a, b = reference[i:i + rows], other[i:i + rows]
        diff = max(diff, float((a - b).abs().max()))
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        a, b = a.double(), b.double()
        top = a.amax(-1, keepdim=True)
        e = (a - top).exp_()
        total = e.sum(-1, keepdim=True)
        kl += float(((e * (a - b)).sum(-1, keepdim=True) / total - top - total.log()
                     + torch.logsumexp(b, -1, keepdim=True)).sum())
    n = reference.shape[0]
    return Fidelity(model, weights, n, diff, agree / n, kl / n)


def measure_model(model: Transformer, name: str, weights: str, ids: Sequence[int], cfg: SpeedConfig) -> SpeedRow:
    """Everything one row of the table needs, for one loaded model (its bandwidth_gbps is the caller's to set:
    speed_run.py measures it right before and after)."""
    return SpeedRow(
        model=name, engine="speculant", weights=weights,
        prefill_tps=prefill_tps(model, ids, min(cfg.repeats, 3)),
        decode_tps=decode_tps(model, ids, cfg.tokens)[0],
        bytes_per_token=model.weight_bytes_per_token(),
        curve_ms=cost_curve(model, ids, cfg.ks, cfg.repeats),
    )
