"""A Gemma 4 dense text model from a GGUF file of arch `gemma4`, as llama.cpp's convert_hf_to_gguf.py writes it
and llama.cpp runs it (src/models/gemma4.cpp), into the same Gemma4Model as an HF folder.

What the conversion changes, undone here:
- names: llama.cpp's (`blk.{i}.attn_q.weight`, `blk.{i}.inp_gate.weight` ...), mapped to gemma4_load's canonical
  ones; matrices are stored [in, out] (GGUF order) with q/k rows not permuted (llama.cpp's NEOX rotary is the
  rotate-half one); norms as transformers has them (Gemma 4's norms multiply by their weight: no 1 added);
- layer types: `attention.sliding_window_pattern` lists them (llama.cpp takes it as given);
- head sizes: `key_length` is the global layers', `key_length_swa` the sliding ones'; `head_count_kv` a number or
  one per layer; `feed_forward_length` a number or one per layer (double-wide MLPs);
- KV sharing: the last `shared_kv_layers` layers read the keys/values of layer first-2 (sliding) or first-1
  (global), first being the first shared layer (llama-model.cpp's reuse rule), which is transformers' "last
  earlier layer of the same type" only where those two layers are a sliding then a global one: other files
  are refused;
- the global layers' proportional rotary: rotary over the whole head with `rope_freqs` dividing the frequencies
  of the unrotated pairs by 1e30 (the converter's trick), read back as the share of pairs that turn;
- values equal to keys (attention_k_eq_v): a KV layer without attn_v (llama.cpp uses the keys then).
Mixture-of-experts files (ffn_gate_inp, expert tensors) and fused attn_qkv tensors are refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import SpeculantError
from ..gguf_file import GGUFFile
from .config import ModelConfig
from .formats.ggml_blocks import dequantize
from .gemma4 import Gemma4Model
from .gemma4_config import Gemma4Config
from .gemma4_load import build_gemma4, expected_shapes
from .transformer import FloatEmbedding

ARCH = "gemma4"
_LAYER = {"attn_norm": "attn_norm", "post_attn_norm": "post_attention_norm", "ffn_norm": "ffn_norm",
          "post_ffn_norm": "post_ffw_norm", "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
          "scalar": "layer_output_scale", "q": "attn_q", "k": "attn_k", "v": "attn_v", "o": "attn_output",
          "gate": "ffn_gate", "up": "ffn_up", "down": "ffn_down", "ple_gate": "inp_gate", "ple_proj": "proj",
          "ple_norm": "post_norm"}
_GLOBAL = {"embed": "token_embd", "norm": "output_norm", "lm_head": "output", "ple_embed": "per_layer_token_embd",
           "ple_model_proj": "per_layer_model_proj", "ple_proj_norm": "per_layer_proj_norm"}
_UNROTATED = 1e29  # the converter's frequency factor of a pair that does not turn is 1e30


def gguf_name(name: str) -> str:
    """The GGUF tensor name of a canonical one (gemma4_load.expected_shapes' names)."""
    if name.startswith("layers."):
        _, i, part = name.split(".")
        return f"blk.{i}.{_LAYER[part]}.weight"
    return f"{_GLOBAL[name]}.weight"


def per_layer(v: object, n: int, what: str, where: str) -> tuple[int, ...]:
    """A metadata value that is one number or a list of one per layer."""
    if isinstance(v, (list, tuple)):
        if len(v) != n:
            raise SpeculantError(f"GGUF file {where}: {what} lists {len(v)} values for {n} layers")
        return tuple(int(x) for x in v)
    return (int(v),) * n


def kv_sources(local: tuple[bool, ...], shared: int, where: str, arch: str = ARCH) -> tuple[int, ...]:
    """Each layer's key/value layer under llama.cpp's reuse rule, which must match its own type."""
    n = len(local)
    first = n - shared
    if not 0 <= shared < n or first < 2 and shared:
        raise SpeculantError(f"GGUF file {where}: {arch}.attention.shared_kv_layers is {shared} for {n} layers")
    out = tuple(i if i < first else first - (2 if local[i] else 1) for i in range(n))
    if shared and (not local[first - 2] or local[first - 1]):
        raise SpeculantError(f"GGUF file {where}: llama.cpp's KV-shared layers read layers {first - 2} and {first - 1} "
                             "as a sliding-window and a global layer, but the sliding_window_pattern makes them "
                             f"{'sliding' if local[first - 2] else 'global'} and "
                             f"{'sliding' if local[first - 1] else 'global'}; this file does not run as converted")
    return out


def gemma4_gguf_config(f: dict, tensors: dict, freqs: np.ndarray | None, where: str, arch: str = ARCH) -> Gemma4Config:
    """The Gemma4Config of a `gemma4` (or, with arch, `gemma4-assistant`) file's metadata, tensor table and
    rope_freqs values."""

    def need(key: str) -> object:
        if f"{arch}.{key}" not in f:
            raise SpeculantError(f"GGUF file {where} lacks metadata {arch}.{key}; it is not a complete {arch} file")
        return f[f"{arch}.{key}"]

    moe = [n for n in tensors if "_exps" in n or ".ffn_gate_inp." in n]
    if moe or int(f.get(f"{arch}.expert_count", 0) or 0):
        raise SpeculantError(f"GGUF file {where} is a mixture-of-experts Gemma 4 (it has "
                             f"{moe[0] if moe else 'expert_count'}); speculant runs the dense Gemma 4 models "
                             "(E2B, E4B, 31B)")
    if any(".attn_qkv." in n for n in tensors):
        raise SpeculantError(f"GGUF file {where} stores fused attn_qkv tensors; speculant reads separate attn_q/k/v")
    n, dim, heads = int(need("block_count")), int(need("embedding_length")), need("attention.head_count")
    if isinstance(heads, (list, tuple)):
        raise SpeculantError(f"GGUF file {where}: a head count per layer is not supported")
    heads = int(heads)
    pattern = need("attention.sliding_window_pattern")
    if not isinstance(pattern, (list, tuple)) or len(pattern) != n:
        raise SpeculantError(f"GGUF file {where}: {arch}.attention.sliding_window_pattern must list {n} layers")
    local = tuple(bool(x) for x in pattern)
    g_hd, l_hd = int(need("attention.key_length")), int(need("attention.key_length_swa"))
    if (int(f.get(f"{arch}.attention.value_length", g_hd)), int(f.get(f"{arch}.attention.value_length_swa", l_hd))) \
            != (g_hd, l_hd) or min(g_hd, l_hd, heads, dim, n) < 1:
        raise SpeculantError(f"GGUF file {where}: head sizes {g_hd}/{l_hd} (values as keys) and {heads} heads "
                             "are not a Gemma 4 attention")
    if int(f.get(f"{arch}.rope.dimension_count", g_hd)) != g_hd or \
            int(f.get(f"{arch}.rope.dimension_count_swa", l_hd)) != l_hd:
        raise SpeculantError(f"GGUF file {where}: a rotary over part of a head (rope.dimension_count) is not "
                             "supported; Gemma 4 turns whole heads, the global layers' unturned pairs marked by "
                             "rope_freqs")
    if str(f.get(f"{arch}.rope.scaling.type", "none")) != "none":
        raise SpeculantError(f"GGUF file {where}: rotary scaling is not supported for Gemma 4")
    kv = per_layer(need("attention.head_count_kv"), n, "head_count_kv", where)
    ff = per_layer(need("feed_forward_length"), n, "feed_forward_length", where)
    shared = int(f.get(f"{arch}.attention.shared_kv_layers", 0) or 0)
    source = kv_sources(local, shared, where, arch)
    hds = tuple(l_hd if loc else g_hd for loc in local)
    k_eq_v = tuple(source[i] == i and f"blk.{i}.attn_v.weight" not in tensors for i in range(n))
    partial = 1.0
    if freqs is not None:
        fac = np.asarray(freqs, dtype=np.float64).reshape(-1)
        turned = int((fac < _UNROTATED).sum())
        if fac.shape[0] != g_hd // 2 or not (np.all(fac[:turned] == 1.0) and np.all(fac[turned:] >= _UNROTATED)):
            raise SpeculantError(f"GGUF file {where}: rope_freqs must be 1 for the turning pairs then 1e30 for the "
                                 f"rest ({g_hd // 2} values: Gemma 4's proportional rotary); other factors are "
                                 "not supported")
        partial = 2 * turned / g_hd
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise SpeculantError(f"GGUF file {where} has no token_embd.weight tensor")
    theta = float(f.get(f"{arch}.rope.freq_base", 1e6))
    softcap = float(f.get(f"{arch}.final_logit_softcapping", 0.0) or 0.0)
    if f.get(f"{arch}.attn_logit_softcapping"):
        raise SpeculantError(f"GGUF file {where}: soft-capping of attention scores is not supported")
    first_local = next((i for i in range(n) if local[i]), 0)
    base = ModelConfig(
        arch="gemma4", n_layers=n, dim=dim, n_heads=heads, n_kv_heads=kv[first_local], hidden_dim=max(ff),
        vocab_size=int(emb.shape[-1]), context_length=int(need("context_length")),
        norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)), rope_base=theta, head_dim=l_hd,
        tie_embeddings="output.weight" not in tensors, qk_norm=True, post_norms=True, activation="gelu_tanh",
        embed_scale=float(np.float32(dim**0.5)), attn_scale=1.0, sliding_window=int(need("attention.sliding_window")),
        local_layers=local, rope_local_base=float(f.get(f"{arch}.rope.freq_base_swa", theta)),
        final_softcap=softcap or None)
    ple = int(f.get(f"{arch}.embedding_length_per_layer_input", 0) or 0)
    return Gemma4Config(base, hds, kv, source, k_eq_v, ff, ple, base.rope_local_base, theta, partial, 1.0)


class Gemma4GGUFSource:
    """gemma4_load's source interface (config, get by canonical name) over a GGUF file, plus its blocks."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GGUFFile(path)
        self.fields = self.file.fields
        self.tensors = self.file.by_name
        freqs = self.tensors.get("rope_freqs.weight")
        try:
            self.config = gemma4_gguf_config(self.fields, self.tensors,
                                             None if freqs is None else self.file.dequantize(freqs), str(path))
        except (TypeError, ValueError, OverflowError) as e:
            raise SpeculantError(f"GGUF file {path} has malformed gemma4 metadata ({e})") from None
        self._check()

    def _check(self) -> None:
        shapes = expected_shapes(self.config)
        known = {gguf_name(k): s for k, s in shapes.items()}
        for name, t in self.tensors.items():
            if name == "rope_freqs.weight":
                continue
            if name not in known:
                raise SpeculantError(f"GGUF file {self.path} has tensor {name}, which this Gemma 4 model has no place "
                                     "for (ignoring it would change the model's output)")
            shape, want = tuple(int(x) for x in reversed(t.shape)), known[name]
            if shape != want:
                raise SpeculantError(f"GGUF file {self.path}: tensor {name} has shape {shape}, its metadata implies "
                                     f"{want}; the file is inconsistent")
        missing = [k for k in known if k not in self.tensors]
        if missing:
            raise SpeculantError(f"GGUF file {self.path} lacks {len(missing)} tensor(s) its gemma4 metadata needs, "
                                 f"e.g. {missing[0]}; the file is incomplete")

    def fingerprint(self) -> str:
        st = self.path.stat()
        return f"gguf:{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}"

    def get(self, name: str) -> Tensor:
        """Float32 tensor by canonical name, [out, in] for matrices (GGUF stores [in, out] innermost first)."""
        return torch.from_numpy(dequantize(self.file, self.tensors[gguf_name(name)]))

    def part(self, name: str):
        """A matrix's raw blocks (formats.ggml_blocks.Part), rows = output features, memory-mapped."""
        from .formats.ggml_blocks import Part, check_type, row_bytes

        t = self.tensors[gguf_name(name)]
        qtype = check_type(int(t.tensor_type), t.name)
        k, rows = t.shape
        return Part(int(qtype), self.file.raw(t).reshape(rows, row_bytes(qtype, k)))

    def linear(self, names: tuple[str, ...]):
        """The concatenated matrices in the file's own block types, or float32 where the kernels cannot take
        them: a type they do not read, or rows not whole 32-value blocks (the per-layer projection's P inputs;
        llama-quantize keeps such tensors in a float type)."""
        from .formats import GGMLLinear, make_linear

        k = int(self.tensors[gguf_name(names[0])].shape[0])
        try:
            if k % 32 == 0:
                return GGMLLinear([self.part(n) for n in names], k)
        except SpeculantError:
            pass
        return make_linear(torch.cat([self.get(n) for n in names]), None, "float32")

    def ple_table(self):
        """The per-layer embedding table, its rows dequantized on lookup (F16 in llama-quantize's files: rows of
        layers * P values are seldom whole blocks), or float32 where the kernels do not read its type."""
        from .formats import GGMLEmbedding

        try:
            return GGMLEmbedding(self.part("ple_embed"), self.config.n_layers * self.config.ple_dim)
        except SpeculantError:
            return self.get("ple_embed")

    def embedding(self):
        from .formats import GGMLEmbedding

        try:
            return GGMLEmbedding(self.part("embed"), self.config.base.dim)
        except SpeculantError:
            return FloatEmbedding(self.get("embed"))


def load_gemma4_gguf(path: Path, fmt: str) -> tuple[Gemma4Model, dict]:
    """The model of a gemma4 GGUF file in `fmt` (gguf: its own block types) and the file's metadata."""
    from .formats import CALIBRATED

    if fmt in CALIBRATED:
        raise SpeculantError(f"--dtype {fmt} is not available for Gemma 4; choose gguf, float32, bf16, f16, q8_0, "
                             "q6_k, q5_1, q5_0, q4_k, q4_1 or q4_0")
    src = Gemma4GGUFSource(path)
    return build_gemma4(src, fmt), src.fields
