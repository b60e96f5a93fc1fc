"""Peers: other engines running the benchmark's workload on the same model files, where installed.

- llama.cpp (PyPI `llama-cpp-python`, module `llama_cpp`) for `bench speed`: the same GGUF file in
  its native quantisation; decode tok/s (prompt through `eval`, then greedy one token per `eval`) and
  the batch cost curve (`eval` of k tokens after rolling back with `n_tokens = saved`; `eval`
  drops the KV entries past `n_tokens` itself).
- Hugging Face transformers for `bench methods`: the same GGUF dequantised to float32; plain greedy
  `generate`, assisted generation with the draft model, and prompt lookup, on our prompt ids.

Both are optional dependencies: imported inside functions, and a missing one is a clear message.
"""

from __future__ import annotations

import importlib.util
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import SpeculantError

LLAMA_CPP_HINT = ("llama.cpp comparison skipped: the llama_cpp module is not installed; install it with "
                  "`pip install llama-cpp-python` (it compiles llama.cpp, which takes several minutes)")
LLAMA_CPP_CRASH_HINT = ("on CPUs with AMX its AMX kernels have crashed under a VM: rebuild it without them, "
                        "`CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON "
                        "-DGGML_AVX_VNNI=ON -DGGML_FMA=ON -DGGML_F16C=ON\" pip install --force-reinstall --no-deps "
                        "--no-cache-dir llama-cpp-python`")
TRANSFORMERS_HINT = "--against transformers needs transformers; install it with `pip install 'transformers>=4.45' gguf`"
HF_METHODS = ("hf-ar", "hf-assisted", "hf-lookup")
PROMPT_LOOKUP_TOKENS = 10


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def gguf_weight_info(path: Path) -> tuple[int, str]:
    """(bytes of weights one decode step reads, the file's main tensor type) from GGUF metadata:
    every tensor but the token embedding, of which one row is read (unless it doubles as lm_head)."""
    from ..gguf_file import GGUFFile

    tensors = GGUFFile(path).tensors
    names = {t.name for t in tensors}
    total, kinds = 0, Counter()
    for t in tensors:
        nbytes = int(t.n_bytes)
        if t.name == "token_embd.weight" and "output.weight" in names:
            nbytes = nbytes // max(1, int(t.shape[-1]))  # one row of [dim, vocab] (GGUF order)
        total += nbytes
        if len(t.shape) == 2:
            kinds[t.tensor_type.name] += int(t.n_elements)
    main = kinds.most_common(1)[0][0] if kinds else "?"
    return total, main


@dataclass(frozen=True, slots=True)
class LlamaCppSpeed:
    prefill_tps: float
    decode_tps: float
    curve_ms: dict[int, float]
    tokens: list[int]


def llama_cpp_speed(path: Path, prompt: Sequence[int], tokens: int, ks: Sequence[int], threads: int,
                    repeats: int, warmup: int = 4) -> LlamaCppSpeed:
    """The speed-mode measurements for llama.cpp on `path`, with the same prompt ids and counts."""
    import statistics

    import numpy as np

    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise SpeculantError(LLAMA_CPP_HINT) from e
    n_ctx = max(512, len(prompt) + max(tokens, warmup, max(ks)) + 8)
    # logits_all: verification needs the logits of every scored token, so the cost curve computes them
    # (as ours does); it also makes prefill compute every row's logits.
    llm = Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, n_batch=n_ctx,
                logits_all=True, verbose=False)
    if not hasattr(llm, "n_tokens"):
        raise SpeculantError("this llama-cpp-python is too old (no Llama.n_tokens); upgrade it with "
                             "`pip install -U llama-cpp-python`")
    ids = [int(t) for t in prompt]

    def last_argmax() -> int:
        return int(np.argmax(llm.scores[llm.n_tokens - 1]))

    def prefill() -> None:
        llm.reset()
        llm.eval(ids)

    prefill()  # warm-up
    times = []
    for _ in range(min(repeats, 3)):
        t = time.perf_counter()
        prefill()
        times.append(time.perf_counter() - t)
    first, base = last_argmax(), llm.n_tokens

    def decode(n: int) -> list[int]:
        llm.n_tokens = base
        tok, out = first, []
        for _ in range(n):
            llm.eval([tok])
            tok = last_argmax()
            out.append(tok)
        return out

    decode(warmup)
    t = time.perf_counter()
    out = decode(tokens)
    decode_tps = tokens / (time.perf_counter() - t)
    samples: dict[int, list[float]] = {k: [] for k in ks}
    for i in range(repeats + 1):  # round-robin over k (as ours); the first round is a warm-up
        for k in ks:
            llm.n_tokens = base
            t = time.perf_counter()
            llm.eval((ids * (k // len(ids) + 1))[:k])
            if i:
                samples[k].append(time.perf_counter() - t)
    curve = {k: statistics.median(v) * 1000 for k, v in samples.items()}
    llm.n_tokens = base
    return LlamaCppSpeed(len(ids) / statistics.median(times), decode_tps, curve, [first, *out])


class TransformersPeers:
    """The target (and draft) loaded in transformers from the same files, float32, for `generate`."""

    def __init__(self, target: Path, draft: Path | None, pad_token_id: int | None) -> None:
        try:
            from transformers.utils import logging as hf_logging
        except ImportError as e:
            raise SpeculantError(TRANSFORMERS_HINT) from e
        hf_logging.set_verbosity_error()  # its deprecation chatter would drown the benchmark's progress
        hf_logging.disable_progress_bar()
        self.target = _load_hf(target)
        self.draft = _load_hf(draft) if draft is not None else None
        self.pad_token_id = pad_token_id

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(m for m in HF_METHODS if m != "hf-assisted" or self.draft is not None)

    def generate(self, method: str, ids: Sequence[int], max_new_tokens: int) -> tuple[list[int], float]:
        """(new token ids, seconds) of one greedy, fixed-length generation."""
        import torch

        x = torch.tensor([list(ids)], dtype=torch.long)
        kw: dict[str, object] = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=False,
                                     attention_mask=torch.ones_like(x), pad_token_id=self.pad_token_id,
                                     temperature=None, top_p=None, top_k=None)
        if method == "hf-assisted":
            if self.draft is None:
                raise SpeculantError("hf-assisted needs a draft model (--draft)")
            kw["assistant_model"] = self.draft
        elif method == "hf-lookup":
            kw["prompt_lookup_num_tokens"] = PROMPT_LOOKUP_TOKENS
        elif method != "hf-ar":
            raise SpeculantError(f"unknown transformers method {method!r}; choose one of {', '.join(HF_METHODS)}")
        with torch.inference_mode():
            t = time.perf_counter()
            out = self.target.generate(x, **kw)
            seconds = time.perf_counter() - t
        return out[0, x.shape[1]:].tolist(), seconds


def _load_hf(path: Path):
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise SpeculantError(TRANSFORMERS_HINT) from e
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype_kw = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    kw: dict[str, object] = {dtype_kw: torch.float32}
    if path.is_file():
        kw["gguf_file"] = path.name
        folder = path.parent
    else:
        folder = path
    try:
        model = AutoModelForCausalLM.from_pretrained(str(folder), **kw)
    except ImportError as e:  # GGUF loading needs the gguf package (and a recent transformers)
        raise SpeculantError(f"transformers could not load {path}: {e}") from e
    return model.eval()
