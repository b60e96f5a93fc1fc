"""Running `speculant bench speed`: models x weight formats (+ llama.cpp), then the report tables.

Models are loaded one at a time (the largest in float32 is several GB) and freed before the next;
the fidelity text's logits are kept per model so each quantised format can be compared with float32 afterwards.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from ..errors import SpeculantError
from ..models.cache import default_kv_dtype
from .peers import LLAMA_CPP_CRASH_HINT, LLAMA_CPP_HINT, gguf_weight_info, llama_cpp_available, llama_cpp_speed
from .report import Table, fmt, load_note, machine_info, machine_note
from .speed import (FIDELITY_CTX, Fidelity, SpeedConfig, SpeedRow, bench_ids, compare_logits, fidelity_logits,
                    fidelity_text, measure_bandwidth, measure_model)

FIDELITY_CHUNKS = 4  # chunks of FIDELITY_CTX tokens: 4 x 255 = 1,020 scored positions, as llama-perplexity -c 512


@dataclass(slots=True)
class SpeedResult:
    config: SpeedConfig
    threads: int
    rows: list[SpeedRow] = field(default_factory=list)
    fidelity: list[Fidelity] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    machine: dict[str, object] = field(default_factory=machine_info)
    bandwidths: list[float] = field(default_factory=list)  # GB/s, right before and after each row

    @property
    def bandwidth_gbps(self) -> float:
        return sum(self.bandwidths) / len(self.bandwidths) if self.bandwidths else 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "config": asdict(self.config), "threads": self.threads, "bandwidth_gbps": self.bandwidth_gbps,
            "bandwidths_gbps": self.bandwidths,
            "torch": torch.__version__, "machine": self.machine,
            "rows": [r.to_dict() for r in self.rows], "fidelity": [asdict(f) for f in self.fidelity],
            "notes": self.notes,
        }


def run_speed(cfg: SpeedConfig, *, threads: int, progress: bool = True, err: Console | None = None) -> SpeedResult:
    from ..hub import resolve_model
    from ..models import load_model

    err = err or Console(stderr=True)
    want_llama = "llama-cpp" in cfg.against
    if want_llama and not llama_cpp_available():
        err.print(f"[yellow]{LLAMA_CPP_HINT}[/yellow]")
        want_llama = False
    result = SpeedResult(cfg, threads)
    steps = len(cfg.models) * (len(cfg.dtypes) + int(want_llama))
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=err, disable=not progress, transient=True) as bar:
        task = bar.add_task("loading", total=steps)
        for spec in cfg.models:
            logits: dict[str, torch.Tensor] = {}
            ids: list[int] = []
            for dtype in cfg.dtypes:
                bar.update(task, description=f"{spec} ({dtype}): loading")
                lm = load_model(spec, dtype, progress=False, kv_dtype=cfg.kv_dtype)
                ids = bench_ids(lm.tokenizer.encode, cfg.cache)
                bar.update(task, description=f"{spec} ({dtype}): measuring")
                result.rows.append(_bracketed(cfg, result, lambda: measure_model(lm.model, spec, dtype, ids, cfg)))
                if len(set(cfg.dtypes)) > 1:
                    text = lm.tokenizer.encode(fidelity_text())
                    chunks = min(FIDELITY_CHUNKS, len(text) // FIDELITY_CTX)
                    if chunks:
                        logits[dtype] = fidelity_logits(lm.model, text, chunks, bos=lm.tokenizer.prompt_bos)
                del lm
                gc.collect()
                bar.advance(task)
            for dtype in (d for d in logits if d != "float32" and "float32" in logits):
                result.fidelity.append(compare_logits(spec, dtype, logits["float32"], logits[dtype]))
            if want_llama and ids:
                bar.update(task, description=f"{spec} (llama.cpp): measuring")
                try:
                    path = resolve_model(spec)
                    result.rows.append(_bracketed(cfg, result, lambda: _llama_row(path, spec, ids, cfg, threads)))
                except SpeculantError as e:
                    err.print(f"[yellow]{e}[/yellow]")
                    result.notes.append(f"{spec}: no llama.cpp row ({e})")
                bar.advance(task)
    if want_llama:
        result.notes.append("llama.cpp runs the GGUF file's own quantisation and computes every scored row's logits "
                            "(logits_all), in prefill too.")
    return result


def _bracketed(cfg: SpeedConfig, result: SpeedResult, measure: Callable[[], SpeedRow]) -> SpeedRow:
    """measure() with the memory bandwidth taken right before and after it: the row's "% of bw" is against their
    mean. Memory speed on a shared host swings within minutes (docs/measurements.md "Memory speed"), so one
    measurement at the start compared numbers from different moments."""
    before = measure_bandwidth(cfg.bandwidth_gib, cfg.repeats)
    row = measure()
    after = measure_bandwidth(cfg.bandwidth_gib, cfg.repeats)
    row.bandwidth_gbps = (before + after) / 2
    result.bandwidths += [before, after]
    return row


def _llama_row(path: Path, spec: str, ids: list[int], cfg: SpeedConfig, threads: int) -> SpeedRow:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    nbytes, kind = gguf_weight_info(path)
    # In a child process: a crash inside llama.cpp's native code (seen with its AMX kernels under a
    # VM) then costs this row, not the whole benchmark. Our models are freed by then, so the child
    # has the cores and the memory to itself.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            m = pool.submit(llama_cpp_speed, path, ids, cfg.tokens, cfg.ks, threads, cfg.repeats).result()
        except BrokenProcessPool:
            raise SpeculantError(f"llama.cpp crashed measuring {path.name}; {LLAMA_CPP_CRASH_HINT}") from None
    return SpeedRow(spec, "llama.cpp", kind, m.prefill_tps, m.decode_tps, nbytes, m.curve_ms)


def _span(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "not measured"


def speed_tables(result: SpeedResult) -> list[Table]:
    cfg = result.config
    cols = ("model", "engine", "weights", "prefill tok/s", "decode tok/s", "MB/token", "GB/s", "bw GB/s", "% of bw",
            *(f"k={k} ms (x)" for k in cfg.ks))
    rows = []
    for r in result.rows:
        frac = r.bandwidth_fraction
        curve = tuple(f"{fmt(r.curve_ms.get(k), 1)} ({fmt(r.curve_ratio(k), 2)})" for k in cfg.ks)
        rows.append((r.model, r.engine, r.weights, fmt(r.prefill_tps, 1), fmt(r.decode_tps, 1),
                     fmt(r.bytes_per_token / 1e6, 1), fmt(r.gbps, 2), fmt(r.bandwidth_gbps or None, 1),
                     fmt(None if frac is None else 100 * frac, 0),
                     *curve))
    notes = (
        machine_note(result.machine, result.threads),
        f"our KV caches in "
        f"{cfg.kv_dtype or ', '.join(f'{default_kv_dtype(d)} ({d})' for d in cfg.dtypes)}; "
        "bw = memory bandwidth, the mean of torch.sum "
        f"over {cfg.bandwidth_gib:g} GiB float32 right before and after each row ({_span(result.bandwidths)} GB/s "
        "in this run); % of bw = GB/s against it.",
        f"prefill: one forward over a {cfg.cache}-token prompt; decode: {cfg.tokens} greedy tokens after it, one "
        "forward each; GB/s = weight bytes per token x decode tok/s.",
        f"k=N: ms of one forward scoring N new tokens on a {cfg.cache}-token cache (median of {cfg.repeats}); "
        "(x) = relative to k=1.",
        *result.notes,
        *filter(None, [load_note(result.machine)]),
    )
    tables = [Table("bench speed", cols, tuple(rows), notes)]
    if result.fidelity:
        frows = tuple((f.model, f.weights, str(f.positions), fmt(f.max_abs_logit_diff, 4), fmt(100 * f.top1_agreement, 1),
                       fmt(f.mean_kl, 5)) for f in result.fidelity)
        tables.append(Table("fidelity vs float32", ("model", "weights", "positions", "max |logit diff|", "top-1 agree %",
                                                    "mean KL"),
                            frows, ("logits of both formats at every position of held-out text (Python source and "
                                    "prose from the standard library), scored in passes of 16 tokens.",)))
    return tables
