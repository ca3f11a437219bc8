#!/usr/bin/env bash
# Build a Python venv at DIR that serves SGLang 0.5.23 on a CPU (no GPU, no AMX needed).
#
#   scripts/sglang_cpu_env.sh DIR        # last line printed: DIR/bin/python
#
# Then point arbor at it with `engine.python: DIR/bin/python`, or serve by hand:
#   SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=1 DIR/bin/python -m sglang.launch_server \
#     --model-path models/tiny-arith --device cpu --attention-backend torch_native \
#     --dtype float32 --disable-overlap-schedule --max-total-tokens 4096
#
# What it installs (every version pinned by scripts/sglang_cpu_constraints.txt):
# - torch 2.14.1 + torchvision 0.29.1: SGLang 0.5.23's pins (it imports torchvision at start-up);
# - sglang 0.5.23 with --no-deps: its declared dependencies include GPU kernel wheels
#   (sglang-kernel, flashinfer, flash-attn, deep-gemm, ...) that a CPU cannot use;
# - the pure-Python packages its server imports (found by launching it and fixing ImportErrors);
# - a stand-in `sgl_kernel` module (scripts/sgl_kernel_cpu_standin.py): SGLang's CPU path
#   imports eight `*_cpu` kernel names at load time, none called without speculative decoding;
#   the module's docstring lists each name, the file that imports it and why it is never called.
#
# Idempotent: on a DIR it already built (same constraints, same stand-in) it checks and exits in
# seconds without changing anything. Any failure stops the script with the reason (set -e).
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 DIR   (DIR: where to create the SGLang venv)" >&2
    exit 2
fi
DIR=$1
HERE=$(cd "$(dirname "$0")" && pwd)
CONSTRAINTS=$HERE/sglang_cpu_constraints.txt
STANDIN=$HERE/sgl_kernel_cpu_standin.py
BASE_PYTHON=${ARBOR_SGLANG_BASE_PYTHON:-python3}
SGLANG_VERSION=0.5.23
# The packages SGLang's HTTP server, tokenizer manager, scheduler and CPU model runner import.
SERVER_PACKAGES=(
    transformers tokenizers xgrammar apache-tvm-ffi compressed-tensors openai msgspec fastapi
    uvicorn uvloop pyzmq orjson pybase64 setproctitle soundfile gguf IPython partial_json_parser
    einops python-multipart prometheus-client xxhash sentencepiece dill jsonschema aiohttp
    requests psutil pillow scipy packaging pydantic interegular tqdm regex
)

fail() { echo "sglang_cpu_env.sh: $*" >&2; exit 1; }
[ -f "$CONSTRAINTS" ] || fail "missing $CONSTRAINTS"
[ -f "$STANDIN" ] || fail "missing $STANDIN"

# A fingerprint of what this script installs: a ready DIR carries it in its marker file.
fingerprint=$(cat "$0" "$CONSTRAINTS" "$STANDIN" | sha256sum | cut -d' ' -f1)
marker=$DIR/.arbor-sglang-cpu-env
if [ -x "$DIR/bin/python" ] && [ -f "$marker" ] && [ "$(cat "$marker")" = "$fingerprint" ]; then
    if "$DIR/bin/python" - "$SGLANG_VERSION" <<'PY'
import importlib.metadata as md, importlib.util, sys
assert md.version("sglang") == sys.argv[1] and md.version("torch").startswith("2.14.1")
assert importlib.util.find_spec("sgl_kernel") is not None
PY
    then
        echo "$DIR is ready (marker matches; nothing changed)" >&2
        echo "$DIR/bin/python"
        exit 0
    fi
    echo "$DIR has the marker but fails the version check: reinstalling" >&2
fi

command -v "$BASE_PYTHON" >/dev/null || fail "no $BASE_PYTHON to create the venv with (set ARBOR_SGLANG_BASE_PYTHON)"
"$BASE_PYTHON" -c 'import sys; assert sys.version_info[:2] >= (3, 10), sys.version' \
    || fail "$BASE_PYTHON is older than Python 3.10 (SGLang $SGLANG_VERSION needs >= 3.10)"
rm -f "$marker"
[ -x "$DIR/bin/python" ] || "$BASE_PYTHON" -m venv "$DIR" || fail "could not create a venv at $DIR"
PY=$DIR/bin/python
pip_install() { "$PY" -m pip install -q --disable-pip-version-check -c "$CONSTRAINTS" "$@"; }

echo "== torch 2.14.1 + torchvision 0.29.1 (SGLang's pins)" >&2
pip_install torch==2.14.1 torchvision==0.29.1 || fail "pip could not install torch 2.14.1 / torchvision 0.29.1"
echo "== sglang $SGLANG_VERSION (--no-deps: its GPU kernel wheels cannot serve on a CPU)" >&2
pip_install --no-deps "sglang==$SGLANG_VERSION" || fail "pip could not install sglang==$SGLANG_VERSION"
echo "== the pure-Python packages SGLang's server imports" >&2
pip_install "${SERVER_PACKAGES[@]}" || fail "pip could not install SGLang's server packages"

echo "== stand-in sgl_kernel (eight *_cpu names imported at load, never called on this path)" >&2
site=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$site/sgl_kernel"
cp "$STANDIN" "$site/sgl_kernel/__init__.py"

echo "== checking that SGLang's CPU server modules import" >&2
SGLANG_USE_CPU_ENGINE=1 OMP_NUM_THREADS=1 "$PY" - <<'PY' || fail "SGLang's server modules do not import in $DIR (see the traceback above)"
import importlib
for name in (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
    "sglang.srt.mem_cache.allocation",
    "sglang.kernels.ops.kvcache.cache_move",
    "sglang.kernels.ops.speculative.cache_locs",
    "sglang.kernels.ops.speculative.eagle",
    "sglang.kernels.ops.speculative.spec_tree",
):
    importlib.import_module(name)
PY

echo "$fingerprint" > "$marker"
echo "$DIR is ready" >&2
echo "$PY"
