"""speculant.gguf_file reads what gguf.GGUFWriter writes exactly as gguf.GGUFReader does, and rejects damage."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType

from speculant.errors import SpeculantError
from speculant.gguf_file import GGUFFile


def _write(path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 1e6)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_int64("test.i64", -(2**40))
    w.add_string("test.unicode", "héllo ✓ 世界")
    w.add_array("test.strings", ["a", "", "ünï", "Ġthe"] * 50)
    w.add_array("test.ints", [1, -2, 3])
    w.add_array("test.floats", [0.5, -1.25])
    tensors = {
        "f32": rng.standard_normal((4, 64)).astype(np.float32),
        "f16": rng.standard_normal((3, 32)).astype(np.float16),
        "vec": rng.standard_normal(7).astype(np.float32),
    }
    for name, arr in tensors.items():
        w.add_tensor(name, arr)
    q8 = rng.standard_normal((2, 64)).astype(np.float32)
    w.add_tensor("q8", gguf.quants.quantize(q8, GGMLQuantizationType.Q8_0), raw_dtype=GGMLQuantizationType.Q8_0)
    tensors["q8"] = gguf.quants.dequantize(gguf.quants.quantize(q8, GGMLQuantizationType.Q8_0),
                                           GGMLQuantizationType.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def test_matches_gguf_reader(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    expected = _write(path)
    ours, ref = GGUFFile(path), GGUFReader(str(path))
    assert ours.fields["llama.block_count"] == 3 and ours.fields["tokenizer.ggml.add_bos_token"] is True
    assert ours.fields["test.i64"] == -(2**40) and ours.fields["test.unicode"] == "héllo ✓ 世界"
    assert ours.fields["test.strings"] == ["a", "", "ünï", "Ġthe"] * 50
    assert ours.fields["test.ints"] == [1, -2, 3] and ours.fields["test.floats"] == [0.5, -1.25]
    assert ours.fields["llama.rope.freq_base"] == 1e6
    for key, field in ref.fields.items():  # every scalar the reference decodes, we decode the same
        if not key.startswith("GGUF.") and field.types[0] not in (GGUFValueType.ARRAY, GGUFValueType.STRING):
            assert ours.fields[key] == field.parts[-1].tolist()[0], key
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for a, b in zip(ref.tensors, ours.tensors):
        assert (a.data_offset, int(a.n_bytes), tuple(int(d) for d in a.shape), a.tensor_type) == \
            (b.data_offset, b.n_bytes, b.shape, b.tensor_type)
        got = ours.dequantize(b)
        np.testing.assert_array_equal(got, expected[b.name].astype(np.float32), err_msg=b.name)
        assert got.dtype == np.float32 and got.flags.writeable


def test_damaged_files_are_user_errors(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    _write(path)
    data = path.read_bytes()
    last = GGUFFile(path).tensors[-1]
    cases = {
        "not_gguf": (b"GGML" + data[4:], "corrupt"),
        "cut_header": (data[:200], "corrupt or truncated"),
        "cut_tensors": (data[: last.data_offset + last.n_bytes - 1], "truncated"),
        "empty": (b"", "corrupt"),
        "version": (data[:4] + (9).to_bytes(4, "little") + data[8:], "version 9"),
    }
    for name, (blob, needle) in cases.items():
        bad = tmp_path / f"{name}.gguf"
        bad.write_bytes(blob)
        with pytest.raises(SpeculantError, match=needle) as e:
            GGUFFile(bad)
        assert str(bad) in str(e.value), name
