"""One entry point for torch.distributed and megatron's parallel_state.

Device and backend come from the environment: CUDA + NCCL where there is a GPU, CPU + gloo otherwise.
Every role, converter and test sets up its process groups through `init_parallel`.
"""
from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from .host_heap import keep_freed_host_memory
from .layout import ParallelLayout, data_parallel_size
from .shims import apply_shims
from .torchrun import exit_with_agent
from .world import World, read_world


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def select_local_device(local_rank: int) -> None:
    """This rank's GPU, where there is one: its local rank among the GPUs it sees. A task the scheduler binds to
    its own GPUs (`srun --gpus-per-task`, a per-task CUDA_VISIBLE_DEVICES) sees fewer than the node's ranks, so
    the index wraps around what it sees instead of naming a device that does not exist there.

    It first sets CUDA_DEVICE_MAX_CONNECTIONS, which megatron's linear layers expect so that their async all-reduce
    overlaps with compute (they warn otherwise). The variable must exist before the CUDA context, and this is every
    rank's first CUDA call (a training rank's, or a disaggregated rollout rank's bridge's). A rank without a GPU
    keeps its freed tensors' memory for the next step instead (`host_heap`)."""
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
    else:
        keep_freed_host_memory()


def init_parallel(tp: int = 1, pp: int = 1, ep: int = 1, seed: int = 1234, timeout_minutes: int = 30,
                  cp: int = 1, vpp: int = 1) -> ParallelLayout:
    """Initialise torch.distributed from the torchrun/Slurm environment (`world.read_world`) and megatron's
    parallel groups (`cp`: context parallelism, megatron's context_parallel_size; `vpp`: virtual pipeline
    stages, its virtual_pipeline_model_parallel_size). The world is exported as
    torchrun's variables for as long as the group lives: vLLM's external launcher reads RANK and LOCAL_RANK,
    which a plain process or an `srun` task would otherwise lack."""
    from megatron.core import parallel_state, tensor_parallel

    if not dist.is_initialized():
        exit_with_agent()
        world = read_world()
        export_world(world)
        select_local_device(world.local_rank)
        dist.init_process_group(
            backend(), rank=world.rank, world_size=world.size, timeout=datetime.timedelta(minutes=timeout_minutes)
        )
    apply_shims()
    world_size = dist.get_world_size()
    data_parallel_size(world_size, tp, pp, ep, cp=cp)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        expert_model_parallel_size=ep,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        distributed_timeout_minutes=timeout_minutes,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return current_layout()


def current_layout() -> ParallelLayout:
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        tp=ps.get_tensor_model_parallel_world_size(),
        pp=ps.get_pipeline_model_parallel_world_size(),
        dp=ps.get_data_parallel_world_size(),
        ep=ps.get_expert_model_parallel_world_size(),
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        cp=ps.get_context_parallel_world_size(),
        cp_rank=ps.get_context_parallel_rank(),
        vpp=ps.get_virtual_pipeline_model_parallel_world_size() or 1,
    )


def destroy_parallel() -> None:
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    _restore_environment()


# The variables `init_parallel` replaced and their earlier values (None: unset), put back with the group.
_ENVIRONMENT_BEFORE: dict[str, str | None] = {}


def export_world(world: World) -> None:
    """Export `world` as torchrun's variables until `destroy_parallel` puts the earlier values back."""
    exported = world.torchrun_environment()
    _ENVIRONMENT_BEFORE.update({name: os.environ.get(name) for name in exported if name not in _ENVIRONMENT_BEFORE})
    os.environ.update(exported)


def _restore_environment() -> None:
    """A process that trains again (the Python API) or then starts torchrun reads its own environment, not the
    last group's: a later world of one picks a fresh port, and nothing takes it for a torchrun rank."""
    for name, value in _ENVIRONMENT_BEFORE.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    _ENVIRONMENT_BEFORE.clear()
