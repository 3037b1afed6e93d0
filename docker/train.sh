#!/usr/bin/env bash
# The training image's entry point: train the HF model MODEL_ID on DATASET_PATH with the RL_CONFIG YAML.
#
#   MODEL_ID      HF model folder (config.json, safetensors weights, tokenizer), or a Hub id org/name[@revision]
#                 downloaded once into the HF cache (HF_HOME, HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE; docs/hub.md)
#   DATASET_PATH  parquet or jsonl file, a folder written by HF datasets' save_to_disk (one split), or Hub data
#                 hf://datasets/org/name[@revision]/path (a file, a folder or a split such as train)
#   RL_CONFIG     training config (YAML, as examples/*.yaml); its job may be ppo (PPO, GRPO, ...), sft or dpo
#   RUN_DIR       run folder: checkpoints, metrics, provenance.json (default: RL_CONFIG's trainer.run_dir if it
#                 sets one, else /workspace/runs/<RL_CONFIG's name>); a run started again on the same folder resumes
#   CACHE_DIR     converted checkpoints shared by runs, one per model sha256, layout and dtype
#                 (default /workspace/cache): the model is converted once and reused
#   NPROC         processes on this node (default 1; torchrun when more than 1)
#   MODEL_SHA256  refuse a model whose sha256 differs (the image may bake one in)
#   PYTHON        the interpreter (default python)
# Arguments are further dotted config overrides (trainer.total_steps=100 ...). Every value reaches the config as
# the exact string given (spaces, '#', quotes and '${' included; the config's override rules type it by its key).
# A missing or bad variable exits 2 naming it; so does any config problem the trainer finds.
set -euo pipefail

fail() {
    echo "train.sh: $*" >&2
    exit 2
}

PYTHON=${PYTHON:-python}
[[ -n "${MODEL_ID:-}" ]] || fail "MODEL_ID is not set: point it at an HF model folder (config.json, weights, tokenizer)"
MODEL_PATH=$MODEL_ID
if [[ ! -e "$MODEL_ID" && "$MODEL_ID" =~ ^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*(@.+)?$ ]]; then
    # A Hub id: downloaded here, once for this node, before any rank starts; the ranks read the snapshot.
    MODEL_PATH=$("$PYTHON" -m verl_mega.hub "$MODEL_ID") || fail "MODEL_ID=$MODEL_ID cannot be had (the error above)"
fi
[[ -f "$MODEL_PATH/config.json" ]] || fail "MODEL_ID=$MODEL_ID has no config.json: point it at an HF model folder"
[[ -n "${DATASET_PATH:-}" ]] || fail "DATASET_PATH is not set: point it at a parquet or jsonl file or a datasets folder"
[[ "$DATASET_PATH" == hf://datasets/* || -e "$DATASET_PATH" ]] || fail "DATASET_PATH=$DATASET_PATH does not exist"
[[ -n "${RL_CONFIG:-}" ]] || fail "RL_CONFIG is not set: point it at a YAML training config"
[[ -f "$RL_CONFIG" ]] || fail "RL_CONFIG=$RL_CONFIG is not a file"
NPROC=${NPROC:-1}
# Every Python process below (and torchrun's ranks, the reward worker) imports nothing from the folder the
# container starts in (verl_mega.parallel.safe_path).
export PYTHONSAFEPATH=1
[[ "$NPROC" =~ ^[1-9][0-9]{0,3}$ ]] || fail "NPROC=$NPROC must be a number of processes (1 or more)"
if [[ -z "${RUN_DIR:-}" ]]; then
    # The config's own trainer.run_dir wins over this default (read as YAML, as the trainer reads the file).
    RUN_DIR=$("$PYTHON" -c 'import sys, yaml
config = yaml.safe_load(open(sys.argv[1])) or {}
trainer = config.get("trainer") if isinstance(config, dict) else None
print((trainer or {}).get("run_dir") or "", end="")' "$RL_CONFIG") || fail "RL_CONFIG=$RL_CONFIG is not valid YAML"
    RUN_DIR=${RUN_DIR:-/workspace/runs/$(basename "$RL_CONFIG" .yaml)}
fi
CACHE_DIR=${CACHE_DIR:-/workspace/cache}
MODEL_SHA256=${MODEL_SHA256:-}
[[ -z "$MODEL_SHA256" || "$MODEL_SHA256" =~ ^[0-9a-fA-F]{64}$ ]] || fail "MODEL_SHA256=$MODEL_SHA256 is not a sha256 (64 hex digits)"
mkdir -p "$RUN_DIR" 2>/dev/null || fail "RUN_DIR=$RUN_DIR cannot be created"
mkdir -p "$CACHE_DIR" 2>/dev/null || fail "CACHE_DIR=$CACHE_DIR cannot be created"

overrides=(
    "model.hf_path=$MODEL_PATH"
    "data.train_files=$DATASET_PATH"
    "trainer.run_dir=$RUN_DIR"
    "model.conversion_cache=$CACHE_DIR"
    ${MODEL_SHA256:+"model.sha256=$MODEL_SHA256"}
    "$@"
)
echo "train.sh: MODEL_ID=$MODEL_ID DATASET_PATH=$DATASET_PATH RL_CONFIG=$RL_CONFIG RUN_DIR=$RUN_DIR" \
    "CACHE_DIR=$CACHE_DIR NPROC=$NPROC commit=${VERL_MEGA_COMMIT:-from the package}"
# exec: the trainer (or torchrun) gets the container's signals itself, so a SIGTERM saves and stops cleanly.
if ((NPROC > 1)); then
    exec "$PYTHON" -m verl_mega.cli launch local --nproc "$NPROC" "$RL_CONFIG" "${overrides[@]}"
fi
exec "$PYTHON" -m verl_mega.cli train --config "$RL_CONFIG" "${overrides[@]}"
