"""Fuzzing: damaged GGUF headers (from the real files' headers), HF tokenizer files and HF config.json
files end in a SpeculantError (for config.json, one naming a damaged field) or a correct load.

CI runs a fast subset; the full run is the same test with more cases:

    SPECULANT_FUZZ_CASES=10000 SPECULANT_FUZZ_WORKERS=2 .venv/bin/pytest -q -s tests/test_fuzz.py

Each case runs in a watched worker process (tests/fuzzing.py): a case over its time bound counts as
a hang, a dead worker as a crash, any exception but SpeculantError (MemoryError from the workers'
address-space limit included) as a bug. The summary line is printed with -s.
"""

from __future__ import annotations

import os

import pytest

import fuzzing

CASES = int(os.environ.get("SPECULANT_FUZZ_CASES", "1000"))
WORKERS = int(os.environ.get("SPECULANT_FUZZ_WORKERS", "1"))


@pytest.mark.real
def test_gguf_header_fuzz():
    if not fuzzing.seed_files():
        from speculant.hub import pull

        pull("smollm2-135m-instruct", progress=False)  # the model whose header seeds the cases
    seeds = fuzzing.seed_files()
    assert seeds, "no cached GGUF file to take seed headers from"
    report = fuzzing.run("gguf", range(CASES), workers=WORKERS)
    print("\n" + fuzzing.summary("gguf", report))
    assert report.bugs == [] and report.hangs == [] and report.crashes == [], (report.bugs[:5], report.hangs,
                                                                               report.crashes)
    assert report.cases == CASES
    # Both ends are reached: damaged headers are refused, and intact or harmlessly changed ones load.
    assert report.outcomes.get("error", 0) > CASES // 4 and report.outcomes.get("ok", 0) > CASES // 20


@pytest.mark.real
def test_hf_tokenizer_json_fuzz():
    """Damaged tokenizer.json / tokenizer_config.json (JSON-tree edits, truncations, bit flips) of
    tokenizers rebuilt from the real GGUF files."""
    n = max(200, CASES // 3)
    report = fuzzing.run("hf-tokenizer", range(n), workers=WORKERS)
    print("\n" + fuzzing.summary("hf-tokenizer", report))
    assert report.bugs == [] and report.hangs == [] and report.crashes == [], report.bugs[:5]
    assert report.cases == n and report.outcomes.get("error", 0) > n // 4 and report.outcomes.get("ok", 0) > n // 10


@pytest.mark.real
def test_gguf_config_fuzz():
    report = fuzzing.run("gguf-config", range(min(CASES, 500)), workers=WORKERS)
    print("\n" + fuzzing.summary("gguf-config", report), report.bugs[:3])
    assert report.bugs == [] and report.hangs == [] and report.crashes == []


def test_hf_config_json_fuzz():
    """Damaged config.json files beside tiny safetensors weights (fuzzing_hf_config.py): each ends in a
    SpeculantError that names a damaged field, or a load whose forward pass gives finite logits; never
    another exception, a value of the wrong type accepted, a hang or an unbounded allocation."""
    n = CASES if "SPECULANT_FUZZ_CASES" in os.environ else 300
    report = fuzzing.run("hf-config", range(n), workers=WORKERS)
    print("\n" + fuzzing.summary("hf-config", report))
    assert report.bugs == [] and report.hangs == [] and report.crashes == [], report.bugs[:5]
    assert report.cases == n and report.outcomes.get("error", 0) > n // 2 and report.outcomes.get("ok", 0) > n // 10


# Values the config.json fuzzer found (each was a raw exception, a hang or allocation without end, a silently
# misread value or NaN logits before hf_config.py checked it), as (field, value, words of the error).
CONFIG_FINDINGS = [
    ("num_key_value_heads", "gelu", "num_key_value_heads must be an integer"),  # ValueError from int()
    ("num_key_value_heads", 0, "num_key_value_heads is 0"),  # named n_kv_heads, not the field
    ("head_dim", 16.0, "head_dim must be an integer"),  # accepted: int(16.0)
    ("head_dim", 15, "even"),  # odd head sizes break the rotary halves
    ("max_position_embeddings", float("inf"), "max_position_embeddings must be an integer"),  # OverflowError
    ("max_position_embeddings", -(2**63), "max_position_embeddings is"),  # RuntimeError from torch.arange
    ("max_position_embeddings", 2**40, "max_position_embeddings is"),  # rotary tables without end
    ("num_hidden_layers", 2**62, "num_hidden_layers is"),  # a list of 2**62 layer types
    ("rope_theta", -1.0, "rope_theta must be a finite number > 0"),  # complex frequencies: TypeError
    ("rope_theta", 0, "rope_theta must be a finite number > 0"),  # ZeroDivisionError
    ("rope_theta", 1e-320, "rope_theta"),  # frequencies past float32: NaN logits
    ("rms_norm_eps", float("nan"), "rms_norm_eps must be a finite number > 0"),  # NaN logits
    ("tie_word_embeddings", "false", "tie_word_embeddings must be true or false"),  # read as true
    ("mlp_bias", "no", "mlp_bias must be true or false"),  # read as true: a wrong refusal
    ("rope_scaling", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 2.0},
     "high_freq_factor"),  # ZeroDivisionError in the llama3 smoothing
    ("rope_scaling", {"type": "linear", "factor": "2"}, "rope_scaling.factor must be a finite number"),  # ValueError
    ("rope_scaling", {"type": ["linear"]}, "rope_scaling.type must be a string"),
    ("sliding_window", "4096", "sliding_window must be an integer"),  # ValueError from int()
    ("layer_types", [["full_attention"], "full_attention"], "layer_types"),  # TypeError: unhashable
    ("architectures", [None], "architectures"),
]


@pytest.mark.parametrize("field, value, words", CONFIG_FINDINGS, ids=[f"{f}={v!r}"[:40] for f, v, _ in CONFIG_FINDINGS])
def test_config_values_the_fuzzer_found(tmp_path, field, value, words):
    import json

    from fuzzing_hf_config import SEEDS, _weights
    from speculant.errors import SpeculantError
    from speculant.models.load_hf import HFSource

    name, arch, tied, config = SEEDS[0]  # llama v4, untied
    _weights(tmp_path, arch, tied)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert HFSource(tmp_path).config.n_layers == 2  # the seed itself loads
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(SpeculantError, match=words.replace(".", r"\.").replace("(", r"\(")):
        HFSource(tmp_path)


def test_config_json_nested_too_deeply(tmp_path):
    from fuzzing_hf_config import _weights
    from speculant.errors import SpeculantError
    from speculant.models.load_hf import HFSource

    _weights(tmp_path, "llama", False)
    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)  # was a RecursionError from json
    with pytest.raises(SpeculantError, match="nested too deeply"):
        HFSource(tmp_path)


def test_parser_limits_refuse_hostile_counts(tmp_path):
    """Counts that the bytes left could hold, but that would decode into hundreds of millions of objects."""
    import struct

    from speculant.errors import SpeculantError
    from speculant.gguf_file import GGUFFile

    def header(kvs: bytes, n_kv: int) -> bytes:
        return b"GGUF" + struct.pack("<IQQ", 3, 0, n_kv) + kvs

    key = struct.pack("<Q", 5) + b"vocab"
    cases = {
        "array count": header(key + struct.pack("<IIQ", 9, 8, (1 << 23) + 10), 1),  # 8.4 M empty strings
        "string length": header(key + struct.pack("<IQ", 8, 32 << 20), 1),  # a 32 MB string
        "key count": header(b"", 1 << 60),
        "nesting": header(key + struct.pack("<II", 9, 9) + (struct.pack("<QI", 1, 9)) * 20, 1),
    }
    for name, data in cases.items():
        path = tmp_path / f"{name.replace(' ', '_')}.gguf"
        path.write_bytes(data)
        with open(path, "r+b") as f:
            f.truncate(128 << 20)  # 128 MB of zeros: room enough for the counts above to fit
        with pytest.raises(SpeculantError, match="corrupt or truncated"):
            GGUFFile(path)
