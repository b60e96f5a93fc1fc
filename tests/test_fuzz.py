"""Fuzzing: damaged GGUF headers (from the real files' headers) and HF tokenizer files end in a
SpeculantError or a correct load.

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
