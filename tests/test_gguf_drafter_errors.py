"""llama.cpp EAGLE-3 drafter GGUFs that speculant cannot run are refused before any weight is used, each with
a message that says what is wrong (heads/gguf_drafter.py). The files are written here with gguf's writer: a
minimal drafter, then one defect at a time; the round trip of a good drafter is tests/test_eagle3_llama_cpp.py."""

from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFWriter

from speculant.errors import SpeculantError
from speculant.heads.gguf_drafter import read_gguf_drafter

D, F, HEADS, VOCAB = 16, 24, 2, 32
META = {"block_count": 1, "embedding_length": D, "feed_forward_length": F, "attention.head_count": HEADS,
        "target_layers": [0, 1, 2], "attention.layer_norm_rms_epsilon": 1e-6}


def _tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = {"fc.weight": (D, 3 * D), "output.weight": (VOCAB, D), "output_norm.weight": (D,),
              "enc_output_norm.weight": (D,), "blk.0.attn_norm.weight": (D,), "blk.0.attn_norm_2.weight": (D,),
              "blk.0.ffn_norm.weight": (D,), "blk.0.attn_q.weight": (D, 2 * D), "blk.0.attn_k.weight": (D, 2 * D),
              "blk.0.attn_v.weight": (D, 2 * D), "blk.0.attn_output.weight": (D, D),
              "blk.0.ffn_gate.weight": (F, D), "blk.0.ffn_up.weight": (F, D), "blk.0.ffn_down.weight": (D, F)}
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}


def _write(path: Path, *, arch: str = "eagle3", meta: dict | None = None, drop: tuple[str, ...] = (),
           extra: dict[str, np.ndarray] | None = None) -> Path:
    w = GGUFWriter(str(path), arch)
    for key, value in (META if meta is None else meta).items():
        full = f"{arch}.{key}"
        if isinstance(value, list):
            w.add_array(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        else:
            w.add_uint32(full, value)
    for name, t in {**_tensors(), **(extra or {})}.items():
        if name not in drop:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_minimal_drafter_reads(tmp_path):
    config, tensors = read_gguf_drafter(_write(tmp_path / "ok.gguf"))
    assert config["hidden_size"] == D and config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]
    assert tensors["lm_head.weight"].shape == (VOCAB, D) and "d2t" not in tensors


def test_another_architecture(tmp_path):
    with pytest.raises(SpeculantError, match="architecture 'llama'.*EAGLE-3 or DFlash drafter.*--draft MODEL"):
        read_gguf_drafter(_write(tmp_path / "m.gguf", arch="llama"))
    with pytest.raises(SpeculantError, match="a DFlash drafter; run it with --method dflash"):
        read_gguf_drafter(_write(tmp_path / "d.gguf", arch="dflash"))


def test_missing_metadata(tmp_path):
    meta = {k: v for k, v in META.items() if k != "target_layers"}
    with pytest.raises(SpeculantError, match=r"lacks metadata \['eagle3.target_layers'\].*--target-model-dir"):
        read_gguf_drafter(_write(tmp_path / "m.gguf", meta=meta))


def test_partial_rotary(tmp_path):
    with pytest.raises(SpeculantError, match="rotates 4 of its 8 head dimensions"):
        read_gguf_drafter(_write(tmp_path / "m.gguf", meta={**META, "rope.dimension_count": 4}))


def test_unknown_tensors(tmp_path):
    extra = {"blk.0.attn_q.bias": np.zeros(D, np.float32)}
    with pytest.raises(SpeculantError, match=r"tensors \['blk.0.attn_q.bias'\] are not part of the EAGLE-3 drafter"):
        read_gguf_drafter(_write(tmp_path / "m.gguf", extra=extra))


def test_no_output_layer_of_its_own(tmp_path):
    with pytest.raises(SpeculantError, match="no output.weight.*their own lm_head"):
        read_gguf_drafter(_write(tmp_path / "m.gguf", drop=("output.weight",)))


def test_d2t_not_int64(tmp_path):
    extra = {"d2t": np.arange(VOCAB, dtype=np.int32)}
    with pytest.raises(SpeculantError, match="d2t has type I32; llama.cpp writes it as I64"):
        read_gguf_drafter(_write(tmp_path / "m.gguf", extra=extra))


def test_d2t_as_llama_cpp_writes_it(tmp_path):
    ids = (np.arange(VOCAB, dtype=np.int64) * 3) % 97
    _, tensors = read_gguf_drafter(_write(tmp_path / "m.gguf", extra={"d2t": ids}))
    assert tensors["d2t"].tolist() == [int(i) - j for j, i in enumerate(ids)]  # offsets, as the HF layouts keep them
