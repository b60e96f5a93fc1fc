"""Qwen3.5 (models/qwen35.py) from a GGUF file of architecture `qwen35`, as llama.cpp's convert_hf_to_gguf.py writes it.

The source answers the names load_qwen35.layer asks an HF folder for (`layers.3.linear_attn.in_proj_z.weight`, `mtp.*`)
from the file's tensors, so one builder serves both. What the converter changed, and how it is read back:

- norm weights: stored with the 1 already added (all but the DeltaNet's gated `ssm_norm`), in float32 as the HF
  loader adds it: used as stored;
- A_log: stored as `ssm_a` = -exp(A_log), what DeltaNet multiplies by: used as stored (no log/exp round trip);
- dt_bias is `ssm_dt.bias`; conv1d [C, 1, K] is squeezed to `ssm_conv1d` [C, K];
- the value heads of every linear-attention tensor (the V rows of in_proj_qkv and the conv, in_proj_z, in_proj_a/b,
  A, dt_bias, out_proj's columns) are reordered from grouped by key head to tiled (llama.cpp's broadcast order):
  kept so, with the DeltaNet told to pair value head i with key head i % k_heads (DeltaNet `tiled`). That is the same
  function, and quantized blocks need no row or column shuffle;
- q/k rows are not permuted (the rotary is NeoX-style); the MTP layer `mtp.*` is block N (N = trunk layers) with
  `nextn.eh_proj` (fc), `nextn.enorm`, `nextn.hnorm`, `nextn.shared_head_norm` (mtp.norm; llama.cpp falls back to
  output_norm without it).

The rotary: llama.cpp turns `rope.dimension_count` values of each head by interleaved M-RoPE over the file's
`rope.dimension_sections`; for text all its position streams but the fourth are the token's position, so it is the
plain rotary where every rotary pair falls in the first three sections (checked: otherwise refused).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from ..errors import SpeculantError
from ..gguf_file import GGUFFile, GGUFTensor, architecture
from .formats.base import QLinear
from .formats.ggml_blocks import dequantize
from .qwen35_config import Qwen35Config

ARCH = "qwen35"
MOE_ARCHS = ("qwen35moe", "qwen3next")
_LAYER = {  # HF name below `layers.N.` -> GGUF name below `blk.N.`
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.neg_A": "ssm_a", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
}
_MTP = {"mtp.fc.weight": "nextn.eh_proj.weight", "mtp.pre_fc_norm_embedding.weight": "nextn.enorm.weight",
        "mtp.pre_fc_norm_hidden.weight": "nextn.hnorm.weight", "mtp.norm.weight": "nextn.shared_head_norm.weight"}
_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def is_qwen35_gguf(path: Path) -> bool:
    """Whether `path` is a qwen35 GGUF file (refusing the MoE relatives with a clear message)."""
    if not path.is_file():
        return False
    arch = architecture(path)
    if arch in MOE_ARCHS:
        raise SpeculantError(f"{path} is a {arch} GGUF (mixture of experts); speculant runs the dense Qwen3.5 models "
                             "(architecture qwen35)")
    return arch == ARCH


def gguf_ships_mtp(path: Path) -> bool:
    """Whether `path` is a qwen35 GGUF file carrying its MTP layer (`blk.N.nextn.eh_proj.weight`)."""
    return is_qwen35_gguf(path) and Qwen35GGUFSource(path).has("mtp.fc.weight")


class Qwen35GGUFSource:
    """Float32 tensors (`get`) and block-format linears (`linear`, `embedding`) of a qwen35 GGUF file by the HF names
    load_qwen35.layer uses."""

    native = True  # --dtype gguf: the file's own blocks
    v_tiled = True  # the converter's value-head order, kept (module docstring)

    def __init__(self, path: Path) -> None:
        self.path = path
        self.file = GGUFFile(path)
        self.tensors = self.file.by_name
        self.fields = self.file.fields
        try:
            self.config = self._config()
        except (TypeError, ValueError, OverflowError) as e:
            raise SpeculantError(f"GGUF file {path} has malformed qwen35 metadata ({e}); it is not a usable model "
                                 "file") from None
        self._check_tensors()

    # ------------------------------------------------------------------ header
    def _need(self, key: str) -> object:
        if f"{ARCH}.{key}" not in self.fields:
            raise SpeculantError(f"GGUF file {self.path} lacks metadata {ARCH}.{key}; it is not a complete qwen35 file")
        return self.fields[f"{ARCH}.{key}"]

    def _config(self) -> Qwen35Config:
        f, arch = self.fields, str(self.fields.get("general.architecture"))
        if arch != ARCH:
            raise SpeculantError(f"GGUF file {self.path} is architecture {arch!r}, not {ARCH}")
        if f.get(f"{ARCH}.expert_count") or any(".ffn_gate_inp." in n or "_exps." in n for n in self.tensors):
            raise SpeculantError(f"GGUF file {self.path} holds mixture-of-experts layers; speculant runs the dense "
                                 "Qwen3.5 models")
        nextn = int(f.get(f"{ARCH}.nextn_predict_layers", 0) or 0)
        n_all = int(self._need("block_count"))
        n_layers = n_all - nextn
        if n_layers < 1 or nextn < 0:
            raise SpeculantError(f"GGUF file {self.path}: block_count {n_all} with nextn_predict_layers {nextn} "
                                 "leaves no decoder layer")
        recurrent = f.get(f"{ARCH}.attention.recurrent_layers")
        if recurrent is not None:
            if not isinstance(recurrent, list) or len(recurrent) != n_all:
                raise SpeculantError(f"GGUF file {self.path}: {ARCH}.attention.recurrent_layers must list {n_all} "
                                     "layers")
            linear = [bool(x) for x in recurrent[:n_layers]]
        else:  # llama.cpp's fallback: every full_attention_interval-th layer is full attention
            every = int(f.get(f"{ARCH}.full_attention_interval", 4))
            linear = [(i + 1) % every != 0 for i in range(n_layers)]
        n_heads = int(self._need("attention.head_count"))
        head_dim = int(self._need("attention.key_length"))
        if int(f.get(f"{ARCH}.attention.value_length", head_dim)) != head_dim:
            raise SpeculantError(f"GGUF file {self.path}: attention key and value lengths differ; Qwen3.5 has one "
                                 "head size")
        v_heads = int(self._need("ssm.time_step_rank"))
        inner = int(self._need("ssm.inner_size"))
        if v_heads < 1 or inner % v_heads:
            raise SpeculantError(f"GGUF file {self.path}: ssm.inner_size {inner} is not a whole number of "
                                 f"ssm.time_step_rank {v_heads} value heads")
        embd = self.tensors.get("token_embd.weight")
        if embd is None or len(embd.shape) != 2:
            raise SpeculantError(f"GGUF file {self.path} has no 2-D token_embd.weight tensor")
        rotary_dim = int(self._need("rope.dimension_count"))
        self._check_sections(rotary_dim)
        return Qwen35Config(
            n_layers=n_layers, dim=int(self._need("embedding_length")), n_heads=n_heads,
            n_kv_heads=int(f.get(f"{ARCH}.attention.head_count_kv", n_heads)), head_dim=head_dim,
            hidden_dim=int(self._need("feed_forward_length")), vocab_size=int(embd.shape[1]),
            context_length=int(self._need("context_length")),
            layer_types=tuple("linear_attention" if x else "full_attention" for x in linear),
            lin_k_heads=int(self._need("ssm.group_count")), lin_v_heads=v_heads,
            lin_k_dim=int(self._need("ssm.state_size")), lin_v_dim=inner // v_heads,
            conv_kernel=int(self._need("ssm.conv_kernel")), rotary_dim=rotary_dim,
            rope_base=float(f.get(f"{ARCH}.rope.freq_base", 10000.0)),
            norm_eps=float(self._need("attention.layer_norm_rms_epsilon")),
            tie_embeddings="output.weight" not in self.tensors, mtp_layers=nextn)

    def _check_sections(self, rotary_dim: int) -> None:
        """Every rotary pair in the text position's streams of llama.cpp's interleaved M-RoPE (ggml's
        ggml_mrope_cache_init): else llama.cpp turns some by the fourth stream, which is not the position."""
        sections = self._need("rope.dimension_sections")
        if not isinstance(sections, list) or len(sections) < 3:
            raise SpeculantError(f"GGUF file {self.path}: {ARCH}.rope.dimension_sections must list 4 numbers")
        sec = [int(x) for x in sections[:4]] + [0] * (4 - len(sections[:4]))
        total = sum(sec)
        if rotary_dim % 2 or total < 1:
            raise SpeculantError(f"GGUF file {self.path}: rotary dimension {rotary_dim} / sections {sec} are invalid")
        for pair in range(rotary_dim // 2):
            s = pair % total
            if not s < 3 * sec[s % 3]:
                raise SpeculantError(f"GGUF file {self.path}: rope.dimension_sections {sec} leave rotary pair {pair} "
                                     f"of {rotary_dim // 2} to M-RoPE's extra stream; speculant runs text M-RoPE "
                                     "whose sections cover the rotary dimensions (as Qwen3.5's [11, 11, 10])")

    # ------------------------------------------------------------------ tensors
    def _expected(self) -> dict[str, tuple[int, ...]]:
        """GGUF name -> shape in numpy order ([out, in]) of every tensor the model reads (the MTP layer's where the
        file declares one)."""
        c = self.config
        D, H, Hkv, hd, ff = c.dim, c.n_heads, c.n_kv_heads, c.head_dim, c.hidden_dim
        vd = c.lin_v_heads * c.lin_v_dim
        out = {"token_embd.weight": (c.vocab_size, D), "output_norm.weight": (D,)}
        if not c.tie_embeddings:
            out["output.weight"] = (c.vocab_size, D)

        def block(i: int, linear: bool) -> None:
            p = f"blk.{i}."
            out.update({p + "attn_norm.weight": (D,), p + "post_attention_norm.weight": (D,),
                        p + "ffn_gate.weight": (ff, D), p + "ffn_up.weight": (ff, D), p + "ffn_down.weight": (D, ff)})
            if linear:
                out.update({p + "attn_qkv.weight": (c.conv_dim, D), p + "attn_gate.weight": (vd, D),
                            p + "ssm_beta.weight": (c.lin_v_heads, D), p + "ssm_alpha.weight": (c.lin_v_heads, D),
                            p + "ssm_conv1d.weight": (c.conv_dim, c.conv_kernel), p + "ssm_dt.bias": (c.lin_v_heads,),
                            p + "ssm_a": (c.lin_v_heads,), p + "ssm_norm.weight": (c.lin_v_dim,),
                            p + "ssm_out.weight": (D, vd)})
            else:
                out.update({p + "attn_q.weight": (2 * H * hd, D), p + "attn_k.weight": (Hkv * hd, D),
                            p + "attn_v.weight": (Hkv * hd, D), p + "attn_output.weight": (D, H * hd),
                            p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})

        for i in range(c.n_layers):
            block(i, c.is_linear(i))
        if c.mtp_layers:
            n = c.n_layers
            block(n, False)
            out.update({f"blk.{n}.nextn.eh_proj.weight": (D, 2 * D), f"blk.{n}.nextn.enorm.weight": (D,),
                        f"blk.{n}.nextn.hnorm.weight": (D,)})
        return out

    def _check_tensors(self) -> None:
        c = self.config
        if c.mtp_layers > 1:
            raise SpeculantError(f"GGUF file {self.path}: {c.mtp_layers} MTP (nextn) layers; speculant runs one")
        expected = self._expected()
        optional = {f"blk.{c.n_layers}.nextn.shared_head_norm.weight": (c.dim,)} if c.mtp_layers else {}
        for name, shape in expected.items():
            if name not in self.tensors:
                raise SpeculantError(f"GGUF file {self.path} has no tensor {name}, which a qwen35 model with these "
                                     "settings needs; the file is incomplete")
        for name, t in self.tensors.items():
            shape = expected.get(name, optional.get(name))
            if shape is None:
                raise SpeculantError(f"GGUF file {self.path} has tensor {name}, which a dense qwen35 model with "
                                     f"{c.n_layers} layers has no place for (nextn embed_tokens / shared_head_head "
                                     "and mixture-of-experts tensors are not supported)")
            if tuple(reversed(t.shape)) != shape:
                raise SpeculantError(f"GGUF file {self.path}: tensor {name} has shape {tuple(reversed(t.shape))}, a "
                                     f"qwen35 model with these settings needs {shape}")

    def _gguf_name(self, name: str) -> str:
        if name in _TOP:
            return _TOP[name]
        n = self.config.n_layers
        if name in _MTP:
            if name == "mtp.norm.weight" and f"blk.{n}.{_MTP[name]}" not in self.tensors:
                return "output_norm.weight"  # as llama.cpp's MTP graph falls back
            return f"blk.{n}.{_MTP[name]}"
        parts = name.split(".", 3)
        if parts[0] == "mtp" and parts[1:3] == ["layers", "0"] and parts[3] in _LAYER:
            return f"blk.{n}.{_LAYER[parts[3]]}"
        if parts[0] == "layers" and len(parts) >= 3:
            rest = name.split(".", 2)[2]
            if rest in _LAYER:
                return f"blk.{parts[1]}.{_LAYER[rest]}"
        raise SpeculantError(f"no qwen35 GGUF tensor corresponds to {name}")

    def _tensor(self, name: str) -> GGUFTensor:
        gname = self._gguf_name(name)
        t = self.tensors.get(gname)
        if t is None:
            raise SpeculantError(f"GGUF file {self.path} has no tensor {gname}; the file is incomplete")
        return t

    def has(self, name: str) -> bool:
        return self._gguf_name(name) in self.tensors

    def get(self, name: str) -> Tensor:
        """Float32 tensor by HF name, in HF layout ([out, in]; the conv [C, K])."""
        return torch.from_numpy(dequantize(self.file, self._tensor(name)))

    def neg_a(self, prefix: str) -> Tensor:
        return self.get(prefix + "neg_A")

    def _part(self, name: str):
        from .formats.ggml_blocks import Part, check_type, row_bytes

        t = self._tensor(name)
        qtype = check_type(int(t.tensor_type), t.name)
        k, rows = t.shape
        rb = row_bytes(qtype, k)
        if rb * rows != t.n_bytes:
            raise SpeculantError(f"tensor {t.name} in {self.path}: {t.n_bytes} bytes do not hold {rows} rows of {k} "
                                 f"{qtype.name} values; the file is corrupt")
        return Part(int(qtype), self.file.raw(t).reshape(rows, rb))

    def linear(self, names: list[str]) -> QLinear:
        """One block-format linear over the rows of `names` in the types the file stores them."""
        from .formats.ggml import GGMLLinear

        parts = [self._part(n) for n in names]
        return GGMLLinear(parts, int(self._tensor(names[0]).shape[0]))

    def embedding(self):
        from .formats.ggml import GGMLEmbedding

        return GGMLEmbedding(self._part("embed_tokens.weight"), self.config.dim)

    def fingerprint(self) -> str:
        st = self.path.stat()
        return f"gguf:{self.path.resolve()}:{st.st_size}:{st.st_mtime_ns}"
