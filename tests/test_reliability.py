"""Faults and bad settings get a clear answer: threads, draft lengths, vocabularies (issue 15).

Each test here failed before its fix: `--threads 0` silently meant "default", a container's CPU
quota was ignored, the Engine API left torch's thread count alone, `--max-draft-tokens 40` left the
batch-invariant verification path, and a target with padded embedding rows crashed the draft with
an IndexError.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

from conftest import tiny_model, tiny_tokenizer
from speculant import cli, threads
from speculant.decoding.engine import Engine, GenerationConfig
from speculant.methods.config import MethodConfig, parse_method
from speculant.errors import SpeculantError
from speculant.methods.base import MAX_DRAFT_TOKENS, DraftLengthConfig
from speculant.methods.draft_model import DraftModelConfig
from speculant.models.transformer import ROW_WISE_MAX
from speculant.exact.sampler import SamplingConfig

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 1, 4, 1, 5]


@pytest.fixture
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------ threads
@pytest.mark.parametrize("bad", [0, -1, -8])
def test_threads_zero_or_negative_is_an_error(bad, keep_threads):
    with pytest.raises(SpeculantError, match="whole number >= 1"):
        threads.configure_threads(bad)


@pytest.mark.parametrize("env", ["0", "-2", "two", "1.5"])
def test_threads_env_must_be_positive_integer(env, monkeypatch, keep_threads):
    monkeypatch.setenv("SPECULANT_THREADS", env)
    with pytest.raises(SpeculantError, match="SPECULANT_THREADS must be a whole number >= 1"):
        threads.configure_threads()


def test_cli_threads_zero_exits_with_message(capsys):
    # Validated before any model is loaded (the model name here does not even exist).
    rc = cli.main(["generate", "--threads", "0", "--model", "no-such-model", "hello"])
    assert rc == 2
    assert "--threads must be a whole number >= 1" in capsys.readouterr().err


def _cgroup_v2(tmp_path: Path, limits: dict[str, str]) -> tuple[Path, Path]:
    """A fake cgroup v2 tree: `limits` maps group paths ('' = root) to their cpu.max content."""
    root = tmp_path / "cgroup"
    for rel, value in limits.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "proc_cgroup"
    leaf = max(limits, key=len)
    proc.write_text(f"0::/{leaf}\n")
    return root, proc


def test_cpu_quota_cgroup_v2(tmp_path):
    root, proc = _cgroup_v2(tmp_path, {"": "max 100000", "pod": "150000 100000", "pod/app": "max 100000"})
    assert threads.cpu_quota(root, proc) == 1.5  # the parent's limit binds the child
    root, proc = _cgroup_v2(tmp_path / "b", {"": "max 100000", "app": "400000 100000"})
    assert threads.cpu_quota(root, proc) == 4.0
    root, proc = _cgroup_v2(tmp_path / "c", {"": "max 100000", "app": "max 100000"})
    assert threads.cpu_quota(root, proc) is None
    root, proc = _cgroup_v2(tmp_path / "d", {"app": "garbage"})
    assert threads.cpu_quota(root, proc) is None  # malformed: no limit, no crash


def test_cpu_quota_cgroup_v1(tmp_path):
    root = tmp_path / "cgroup"
    group = root / "cpu,cpuacct" / "docker" / "abc"
    group.mkdir(parents=True)
    (group / "cpu.cfs_quota_us").write_text("200000\n")
    (group / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n")
    assert threads.cpu_quota(root, proc) == 2.0
    (group / "cpu.cfs_quota_us").write_text("-1\n")
    assert threads.cpu_quota(root, proc) is None


def test_default_threads_respect_the_cpu_quota(monkeypatch, keep_threads):
    monkeypatch.delenv("SPECULANT_THREADS", raising=False)
    monkeypatch.setattr(threads, "physical_cores", lambda: 16)
    monkeypatch.setattr(threads, "cpu_quota", lambda: 1.5)
    assert threads.default_threads() == 2  # a 1.5-CPU quota: 2 threads, not 16
    assert threads.configure_threads() == 2 and torch.get_num_threads() == 2
    monkeypatch.setattr(threads, "cpu_quota", lambda: 0.2)
    assert threads.default_threads() == 1
    monkeypatch.setattr(threads, "cpu_quota", lambda: None)
    assert threads.default_threads() == 16


def test_engine_api_sets_threads_as_the_cli_does(monkeypatch, keep_threads):
    target = tiny_model(8, seed=1)
    torch.set_num_threads(2)
    assert Engine(target, threads=1).threads == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv("SPECULANT_THREADS", "2")
    assert Engine(target).threads == 2 and torch.get_num_threads() == 2
    monkeypatch.delenv("SPECULANT_THREADS")
    monkeypatch.setattr(threads, "default_threads", lambda: 1)
    assert Engine(target).threads == 1 and torch.get_num_threads() == 1
    with pytest.raises(SpeculantError, match=">= 1"):
        Engine(target, threads=0)


_OPENMP = re.compile(r"lib(gomp|iomp5|omp)[-.\w]*\.so")


_ONE_RUNTIME = """
import ctypes, sys
from pathlib import Path
import torch
from speculant.models import native
torch.ones(1 << 16).sum()  # torch's OpenMP pool is started
if not native.available():
    sys.exit(3)
lib = native.library()  # builds and loads the kernels (x86 with AVX2 and gcc)
address = ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value  # dlsym in the kernels' own dependencies
for line in Path("/proc/self/maps").read_text().splitlines():
    low, high = (int(v, 16) for v in line.split()[0].split("-"))
    if low <= address < high:
        print(line.split()[-1])
print(Path(torch.__file__).parent)
"""


def test_kernels_and_torch_share_one_openmp_runtime():
    """Two OpenMP runtimes in one process would each start a thread pool of their own and fight for the
    cores. The native kernels are built with -fopenmp after torch has loaded its libgomp, so the loader
    resolves theirs to torch's: the kernels' GOMP_parallel lies in the OpenMP library in torch's folder.
    (Another idle runtime may be mapped: the gguf package imports sentencepiece where it is installed,
    which ships a libgomp of its own under another name; no kernel or torch call reaches it.) In a process
    of its own, so that what other tests import does not count."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _ONE_RUNTIME], capture_output=True, text=True, timeout=300)
    if run.returncode == 3:
        pytest.skip("the native kernels do not build on this host (x86 with AVX2 and gcc)")
    assert run.returncode == 0, run.stderr[-2000:]
    runtime_file, torch_dir = run.stdout.split()
    assert _OPENMP.search(runtime_file) and runtime_file.startswith(torch_dir + "/"), run.stdout


# -------------------------------------------------------------------------------------- draft lengths
def test_draft_length_is_capped_below_the_row_wise_limit():
    assert MAX_DRAFT_TOKENS == ROW_WISE_MAX - 1
    DraftLengthConfig(MAX_DRAFT_TOKENS, "fixed", MAX_DRAFT_TOKENS)  # the cap itself is accepted
    with pytest.raises(SpeculantError, match=f"at most {MAX_DRAFT_TOKENS} draft tokens"):
        DraftLengthConfig(4, "heuristic", MAX_DRAFT_TOKENS + 1)
    with pytest.raises(SpeculantError, match=f"at most {MAX_DRAFT_TOKENS} draft tokens"):
        parse_method(f"draft:k={MAX_DRAFT_TOKENS + 1}")


@pytest.mark.parametrize("flags", [["--max-draft-tokens", "40"], ["--draft-tokens", "32"]])
def test_cli_draft_length_over_cap_exits_with_message(flags, capsys):
    rc = cli.main(["generate", "--method", "lookup", *flags, "--model", "no-such-model", "hello"])
    assert rc == 2
    assert f"at most {MAX_DRAFT_TOKENS} draft tokens" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["float32", "int8", "q8_0"])
def test_greedy_identical_to_ar_at_the_draft_length_cap(fmt):
    """k = 31 drafts per round: the target verifies 32-token passes, the longest still row-wise."""
    target = tiny_model(32, seed=1, logit_scale=3.0, fmt=fmt)
    draft = tiny_model(32, seed=2, logit_scale=3.0, layers=1, fmt=fmt)
    cap = DraftLengthConfig(MAX_DRAFT_TOKENS, "fixed", MAX_DRAFT_TOKENS)
    gen = GenerationConfig(max_new_tokens=100, ignore_eos=True)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    assert len(ref) == 100
    always = DraftModelConfig(min_confidence=0.0)  # draft all 31, however unsure
    selfdraft = Engine(target, target, MethodConfig("draft", cap, draft_model=always)).generate(PROMPT, gen)
    assert selfdraft.token_ids == ref
    assert selfdraft.stats.accepted_length_histogram[MAX_DRAFT_TOKENS] >= 2  # rounds verifying 32-token passes
    assert selfdraft.stats.target_forwards <= 1 + -(-99 // (MAX_DRAFT_TOKENS + 1))
    for name in ("draft", "lookup", "hybrid"):
        e = Engine(target, draft if name != "lookup" else None, MethodConfig(name, cap))
        assert e.generate(PROMPT, gen).token_ids == ref, name


# ---------------------------------------------------------------------------------------- vocabularies
@pytest.fixture(scope="module")
def padded_pair():
    """Target: 40 embedding rows for a 32-token tokenizer (ids 32..39 are padding, like Qwen2.5's
    151,936 rows for 151,665 tokens); draft: exactly 32 rows."""
    target = dataclasses.replace(tiny_model(40, seed=5, logit_scale=0.5), tokenizer=tiny_tokenizer(32))
    draft = tiny_model(32, seed=6, logit_scale=3.0, dim=16, layers=1)
    return target, draft


def test_draft_with_fewer_rows_than_target_stays_exact(padded_pair):
    target, draft = padded_pair
    gen = GenerationConfig(max_new_tokens=120, ignore_eos=True)
    ref = Engine(target).generate(PROMPT, gen).token_ids
    assert any(t >= 32 for t in ref)  # the target does emit padding ids: the draft must read them
    for name in ("draft", "hybrid"):
        done = Engine(target, draft, MethodConfig(name)).generate(PROMPT, gen)
        assert done.token_ids == ref, name
    sampled = GenerationConfig(max_new_tokens=120, ignore_eos=True, sampling=SamplingConfig(1.0, seed=3))
    for name in ("draft", "hybrid"):  # sampling: q over the target's 40 ids, zero on the padding
        done = Engine(target, draft, MethodConfig(name)).generate(PROMPT, sampled)
        assert len(done.token_ids) == 120 and max(done.token_ids) < 40


@pytest.mark.parametrize("method", ["ar", "draft", "hybrid"])
def test_prompt_id_in_padding_range_is_a_clear_error(padded_pair, method):
    target, draft = padded_pair
    e = Engine(target, draft if method != "ar" else None, MethodConfig(method))
    with pytest.raises(SpeculantError, match=r"prompt token id 35 is not a token: the tokenizer has 32"):
        e.generate([1, 2, 35], GenerationConfig(max_new_tokens=4))
    with pytest.raises(SpeculantError, match=r"prompt token id 40 is out of range: the model has 40 token ids"):
        e.generate([1, 40], GenerationConfig(max_new_tokens=4))
    with pytest.raises(SpeculantError, match=r"prompt token id -1 is out of range"):
        e.generate([-1, 2], GenerationConfig(max_new_tokens=4))


# ------------------------------------------------------------------------------------------- torch bound
def test_torch_lower_bound_is_the_tested_version():
    """pyproject's torch bound is the version the suite runs on (setup.sh's pin), and this torch meets it."""
    root = Path(__file__).resolve().parent.parent
    bound = re.search(r'"torch>=([\d.]+)"', (root / "pyproject.toml").read_text()).group(1)
    pin = re.search(r'torch==\$\{SPECULANT_TORCH:-([\d.]+)\}', (root / "scripts" / "setup.sh").read_text()).group(1)
    assert tuple(map(int, bound.split("."))) == tuple(map(int, pin.split(".")))[: len(bound.split("."))]
    installed = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
    assert installed >= tuple(map(int, bound.split(".")))[:2]
