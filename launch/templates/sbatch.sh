#!/bin/bash
# Rendered by verl_mega.launch.slurm; template lines whose placeholder had no value are left out.
#SBATCH --job-name={{job_name}}
#SBATCH --nodes={{nodes}}
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task={{cpus_per_task}}
#SBATCH --gpus-per-node={{gpus_per_node}}
#SBATCH --partition={{partition}}
#SBATCH --time={{time}}
#SBATCH --account={{account}}
#SBATCH --qos={{qos}}
#SBATCH --output={{output}}
# Append so the log of a requeued run follows the one before it instead of replacing it.
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@{{signal_seconds}}
#SBATCH --requeue
#SBATCH --dependency={{dependency}}

# Requeue protocol: the warning signal (USR1, {{signal_seconds}} s before the time limit) reaches the batch
# shell only; the trap below forwards it to srun, srun to each node's torchrun, torchrun to every rank.
# The trainer then saves a checkpoint and, once every rank has saved (requeueing ends the job at once),
# runs `scontrol requeue $SLURM_JOB_ID` itself. Slurm holds the requeued job for about two minutes, then
# starts this script again from the top; the trainer resumes from that checkpoint (SLURM_RESTART_COUNT > 0).

set -euo pipefail

# The user's --env exports (NCCL_SOCKET_IFNAME and the like) come first so they win over the defaults below.
{{env_exports}}
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# torchrun and every rank import nothing from the folder the job starts in (verl_mega.parallel.safe_path).
export PYTHONSAFEPATH=1

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# Derived from the job id so that two jobs sharing a first node do not collide, and from the restart count so
# that a requeued run never meets its predecessor's rendezvous (verl_mega.parallel.world.slurm_port); export
# MASTER_PORT to pin it.
restart=${SLURM_RESTART_COUNT:-0}
MASTER_PORT=${MASTER_PORT:-$((15000 + (SLURM_JOB_ID + 10007 * restart) % 20000))}
export MASTER_ADDR MASTER_PORT

srun_args=(--ntasks-per-node=1 --kill-on-bad-exit=1)
srun_args+=(--container-image={{container_image}})
srun_args+=(--container-mounts={{container_mounts}})

step_pid=
forwarded=0
forward() {
    forwarded=1
    [ -z "$step_pid" ] || kill -s "$1" "$step_pid" 2>/dev/null || true
}
# Without these traps the batch shell would die of USR1 and leave the step running unwarned.
trap 'forward USR1' USR1
trap 'forward TERM' TERM

# torchrun forwards USR1 to its workers only when told to, and gives them the whole warning window
# to save before it kills them.
srun "${srun_args[@]}" {{python}} -m torch.distributed.run \
    --nnodes="$SLURM_NNODES" --nproc-per-node={{procs_per_node}} \
    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID.$restart" \
    --signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1 --shutdown-timeout={{signal_seconds}} \
    -m {{payload}} &
step_pid=$!

# A trapped signal makes `wait` return early; keep waiting until the step itself has ended.
while :; do
    forwarded=0
    status=0
    wait "$step_pid" || status=$?
    [ "$forwarded" = 1 ] || break
done
exit "$status"
