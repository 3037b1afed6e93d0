"""A role's training state (model, optimizer, LR schedule) as a megatron dist checkpoint, loadable at any layout.

    DIRECTORY/metadata.json, .metadata, common.pt, __*_*.distcp   (megatron `dist_checkpointing`, torch_dist)

Both functions are collective: every rank of the job calls them with the same directory. Tensors are stored
by their global (TP/PP/DP-merged) keys, so a state saved at one (TP, PP, DP) loads at another. The optimizer
state is stored per model parameter in both optimizer kinds: the plain optimizer's own format, and the
distributed optimizer's `fully_reshardable` one (its `dp_reshardable` format reshards only over DP).
"""
from __future__ import annotations

from pathlib import Path

import torch

DISTRIBUTED_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable"}


def save_engine_state(engine, directory: str | Path) -> None:
    """Save `engine`'s model weights, optimizer state and LR schedule into the existing, empty `directory`."""
    from megatron.core import dist_checkpointing

    _ensure_optimizer_state(engine.optimizer)
    torch.distributed.barrier()  # the caller may have created `directory` on one rank only
    dist_checkpointing.save(_sharded_state(engine, is_loading=False), str(directory))
    torch.distributed.barrier()


def load_engine_state(engine, directory: str | Path) -> None:
    """Restore what `save_engine_state` wrote into `engine`, whatever layout either job runs at.

    Raises FileNotFoundError if `directory` is not a complete checkpoint, and ValueError (naming the first
    differing tensor) if it was written for another model or another optimizer kind.
    """
    from megatron.core import dist_checkpointing

    directory = Path(directory)
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise FileNotFoundError(
            f"{directory} is not a complete training-state checkpoint (its metadata.json is missing or unreadable); "
            "the save that wrote it did not finish: resume from an earlier checkpoint"
        )
    _check_optimizer_kind(engine, directory)
    _ensure_optimizer_state(engine.optimizer)
    # Loading into the optimizer's tensors in place fails on views of leaf parameters with autograd on.
    with torch.no_grad():
        request = _sharded_state(engine, is_loading=True)
        _check_matches_checkpoint(request, directory)
        loaded = dist_checkpointing.load(request, str(directory))
        engine.model.module.load_state_dict(loaded["model"])
        for optimizer, state in zip(_sub_optimizers(engine.optimizer), loaded["optimizer"]):
            _load_optimizer_state(optimizer, state)
        engine.scheduler.load_state_dict(loaded["scheduler"])


def _sharded_state(engine, is_loading: bool) -> dict:
    # The bare model's keys (not the DDP wrapper's `module.` ones), as in the model-only dist checkpoints.
    model_state = engine.model.module.sharded_state_dict()
    return {
        "model": model_state,
        # One entry per sub-optimizer (dense and expert parameters of MoE models get one each).
        "optimizer": [optimizer.sharded_state_dict(model_state, is_loading=is_loading,
                                                   metadata=DISTRIBUTED_OPTIMIZER_FORMAT)
                      for optimizer in _sub_optimizers(engine.optimizer)],
        "scheduler": engine.scheduler.state_dict(),
        "use_distributed_optimizer": _is_distributed(engine.optimizer),
    }


def _sub_optimizers(optimizer) -> list:
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))


def _is_distributed(optimizer) -> bool:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(sub, DistributedOptimizer) for sub in _sub_optimizers(optimizer))


def _inner_states(optimizer):
    """(torch parameter, its Adam state) over every sub-optimizer's torch optimizer."""
    for sub in _sub_optimizers(optimizer):
        inner = sub.optimizer
        for group in inner.param_groups:
            for param in group["params"]:
                yield param, inner.state[param]


def _ensure_optimizer_state(optimizer) -> None:
    """Give Adam its (zero) state before the first step: the distributed optimizer's state dict asserts
    without it. Zero moments at step 0 are exactly what Adam's first step creates itself."""
    for param, state in _inner_states(optimizer):
        if not state:
            state.update(exp_avg=torch.zeros_like(param), exp_avg_sq=torch.zeros_like(param),
                         step=torch.tensor(0.0, dtype=torch.float32))


def _load_optimizer_state(optimizer, state: dict) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        # Its fully_reshardable loader copies every entry of a parameter's state from the checkpoint,
        # 'step' too, which the checkpoint keeps in the param groups instead (KeyError: 'step'): load the
        # param groups and step first, then the tensors with the steps set aside.
        param_state = state.pop("param_state")
        state.pop("param_state_sharding_type")
        optimizer.load_state_dict(state)
        states = [param_state_ for _, param_state_ in _inner_states(optimizer)]
        steps = [param_state_.pop("step") for param_state_ in states]
        optimizer.load_parameter_state_from_fully_reshardable(param_state)
        for param_state_, step in zip(states, steps):
            param_state_["step"] = step
    else:
        optimizer.load_state_dict(state)
    # Loading may leave one `step` tensor shared by all parameters: Adam would then advance it once per
    # parameter per step and the resumed run would drift. Each parameter gets its own copy.
    for _, param_state_ in _inner_states(optimizer):
        param_state_["step"] = param_state_["step"].clone() if "step" in param_state_ else torch.tensor(0.0)


def _check_optimizer_kind(engine, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(directory)).get("use_distributed_optimizer")
    running = _is_distributed(engine.optimizer)
    if saved is not None and saved != running:
        raise ValueError(
            f"{directory} was saved with use_distributed_optimizer={saved} but this job runs "
            f"use_distributed_optimizer={running}: resume with the setting it was saved with"
        )


def _check_matches_checkpoint(request: dict, directory: Path) -> None:
    """Raise on every rank, before any tensor is read, if some rank's tensors are missing from the checkpoint
    or have other global shapes (a checkpoint of another model), or the checkpoint holds tensors no rank asks for."""
    from megatron.core import dist_checkpointing

    stored = dist_checkpointing.load_tensors_metadata(str(directory))
    expected = dict(_expected_shapes(request))
    problem = None
    for key, shape in expected.items():
        if key not in stored:
            problem = f"tensor '{key}' of this model is not in the checkpoint"
        elif tuple(stored[key].global_shape) != shape:
            problem = f"tensor '{key}' has shape {tuple(stored[key].global_shape)} in the checkpoint but {shape} here"
        if problem:
            break
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, (problem, sorted(expected)))
    problems = [rank_problem for rank_problem, _ in gathered if rank_problem]
    unexpected = sorted(set(stored) - {key for _, keys in gathered for key in keys})
    if not problems and unexpected:
        problems = [f"the checkpoint holds tensor '{unexpected[0]}', which this model lacks"]
    if problems:
        raise ValueError(f"{directory} was written for another model: {problems[0]}")


def _expected_shapes(request: dict):
    """(stored key, global shape) of every tensor the request reads, factories expanded."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for item in nested_values(request):
        built = nested_values(item.build()) if isinstance(item, ShardedTensorFactory) else [item]
        for tensor in built:
            if isinstance(tensor, ShardedTensor):
                yield tensor.key, tuple(tensor.global_shape)
