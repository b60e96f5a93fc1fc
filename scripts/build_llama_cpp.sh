#!/bin/bash
# llama.cpp's reference tools, built once from the llama-cpp-python sdist (its vendor/llama.cpp) with the
# CPU's native flags, and cached: the tests' reference (tests/llama_cpp_ref.py) and scripts/vs_llama_cpp.sh.
#
# Usage: PYTHON=.venv/bin/python bash scripts/build_llama_cpp.sh
# Prints the cache folder on its last stdout line. It holds bin/ (llama-simple, llama-speculative-simple,
# llama-perplexity, llama-quantize, llama-bench, llama-tokenize, and llama-greedy-HASH built from
# scripts/llama_greedy.cpp) and src/ (convert_hf_to_gguf.py with the conversion/ and gguf-py/ it imports).
# The folder is $SPECULANT_HOME/llama.cpp/VERSION-CPUKEY (CPUKEY: a hash of the CPU's flags, as a
# native build only runs on the CPU it was built for). Concurrent callers (pytest-xdist workers) wait on
# one lock; the finished folder appears by an atomic rename, so a half-built folder is never used.
# LLAMA_CPP_ISA=avx2 builds llama.cpp's AVX2 kernels instead (GGML_NATIVE off, AVX-512 and AVX-VNNI off) into
# $SPECULANT_HOME/llama.cpp/VERSION-avx2: the peer of SPECULANT_ISA=avx2 on a CPU that has more
# (scripts/decode_vs_llama_cpp.py --llama-cpp-bin FOLDER/bin). LLAMA_CPP_ISA=avxvnni adds AVX-VNNI to those
# (VERSION-avxvnni), the peer of SPECULANT_ISA=avxvnni.
# Exit status: 0 built or cached; 2 an unknown LLAMA_CPP_ISA; 3 cmake or a compiler missing; 4 download failed;
# 5 build failed (the log is kept beside the folder and a later call repeats the failure at once until it is
# deleted).
set -euo pipefail
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-.venv/bin/python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
JOBS=${JOBS:-$(nproc)}

for tool in cmake cc c++; do
    command -v "$tool" >/dev/null || { echo "llama.cpp build: '$tool' not found on PATH" >&2; exit 3; }
done
read -r HOMEDIR CPUKEY AMX < <(cd "$ROOT" && "$PY" -c "
import hashlib
from speculant.hub import speculant_home
from speculant.models.native import cpu_flags
f = cpu_flags()
print(speculant_home(), hashlib.sha256(' '.join(sorted(f)).encode()).hexdigest()[:12], int('amx_int8' in f))")
BASE="$HOMEDIR/llama.cpp"
case "${LLAMA_CPP_ISA:-native}" in
    native) ISA_FLAGS=(-DGGML_NATIVE=ON)
            # ggml's AMX kernels (the extra buffer type of a native build on a CPU with AMX) died of SIGILL at
            # their first tilezero in prompt passes on a VM where AMX itself runs (llama-greedy on SmolLM2 and the
            # Q8_0 test files; docs/measurements.md): there the reference is built without them, in its own folder
            if [ "$AMX" = 1 ]; then
                ISA_FLAGS+=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
                            -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
                CPUKEY="$CPUKEY-noamx"
            fi ;;
    avx2) CPUKEY=avx2
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX512=OFF -DGGML_AVX_VNNI=OFF) ;;
    avxvnni) CPUKEY=avxvnni
          ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
                     -DGGML_AVX512=OFF -DGGML_AVX_VNNI=ON) ;;
    *) echo "LLAMA_CPP_ISA=$LLAMA_CPP_ISA: choose native, avx2 or avxvnni" >&2; exit 2 ;;
esac
DEST="$BASE/$VERSION-$CPUKEY"
FAILED="$DEST.failed.log"
GREEDY_HASH=$(sha256sum "$ROOT/scripts/llama_greedy.cpp" | cut -c1-12)
mkdir -p "$BASE"

exec 9>"$BASE/.$VERSION-$CPUKEY.lock"
flock 9  # held until this script exits

if [ ! -d "$DEST" ]; then
    if [ -f "$FAILED" ]; then
        tail -n 30 "$FAILED" >&2
        echo "llama.cpp build failed before (log: $FAILED); delete that file to try again" >&2
        exit 5
    fi
    rm -rf "$BASE/.work-$VERSION-$CPUKEY-"*  # a killed build's leftovers (the lock says none is running)
    WORK=$(mktemp -d "$BASE/.work-$VERSION-$CPUKEY-XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
    LOG="$WORK/build.log"
    echo "building llama.cpp (llama-cpp-python $VERSION) into $DEST; log: $LOG" >&2
    # --no-binary on this one package only: ':all:' would also build pip's build tools from source
    if ! "$PY" -m pip download --no-deps --no-binary llama-cpp-python "llama-cpp-python==$VERSION" \
            -d "$WORK/dl" >"$LOG" 2>&1; then
        tail -n 20 "$LOG" >&2
        echo "llama.cpp build: downloading the llama-cpp-python $VERSION sdist failed" >&2
        exit 4
    fi
    tar xzf "$WORK"/dl/llama_cpp_python-*.tar.gz -C "$WORK"
    SRC=$(echo "$WORK"/llama_cpp_python-*/vendor/llama.cpp)
    START=$(date +%s)
    # LLAMA_CURL is a deprecated no-op in this version (it warns when set); OpenSSL is only for downloads.
    # The tools find their shared libraries beside them ($ORIGIN): the build tree is deleted.
    if ! { nice -n 10 cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" \
                -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF \
                -DCMAKE_BUILD_RPATH='$ORIGIN' \
            && nice -n 10 cmake --build "$WORK/build" -j "$JOBS" --target llama-simple llama-speculative-simple \
                llama-perplexity llama-quantize llama-bench llama-tokenize; } >>"$LOG" 2>&1; then
        cp "$LOG" "$FAILED"
        tail -n 30 "$LOG" >&2
        echo "llama.cpp build failed (log: $FAILED)" >&2
        exit 5
    fi
    echo "build took $(( $(date +%s) - START )) s" >>"$LOG"
    OUT="$WORK/out"
    mkdir -p "$OUT/src"
    cp -a "$WORK/build/bin" "$OUT/bin"
    cp -a "$SRC/convert_hf_to_gguf.py" "$SRC/conversion" "$SRC/gguf-py" "$SRC/include" "$SRC/LICENSE" "$OUT/src/"
    mkdir -p "$OUT/src/ggml" && cp -a "$SRC/ggml/include" "$OUT/src/ggml/"
    cp "$LOG" "$OUT/build.log"
    mv -T "$OUT" "$DEST"
fi

# the greedy-ids tool: seconds to build, so keyed by its source's hash rather than rebuilding everything
GREEDY="$DEST/bin/llama-greedy-$GREEDY_HASH"
if [ ! -x "$GREEDY" ]; then
    TMP=$(mktemp "$DEST/bin/.llama-greedy-XXXXXX")
    if ! nice -n 10 c++ -O2 -std=c++17 -I"$DEST/src/include" -I"$DEST/src/ggml/include" \
            "$ROOT/scripts/llama_greedy.cpp" -o "$TMP" -L"$DEST/bin" -lllama -lggml -lggml-base \
            -Wl,-rpath,'$ORIGIN'; then
        rm -f "$TMP"
        echo "llama.cpp build: compiling scripts/llama_greedy.cpp failed" >&2
        exit 5
    fi
    chmod 755 "$TMP" && mv "$TMP" "$GREEDY"
fi
echo "$DEST"
