"""A role's training state (model, optimizer, LR schedule) as a megatron dist checkpoint, loadable at any layout.

    DIRECTORY/metadata.json, .metadata, common.pt, __*_*.distcp   (megatron `dist_checkpointing`, torch_dist)

Both functions are collective: every rank of the job calls them with the same directory. Tensors are stored
by their global (TP/PP/DP-merged) keys, so a state saved at one (TP, PP, DP) loads at another. The optimizer
state is stored per model parameter in both optimizer kinds: the plain optimizer's own format, and for the
distributed optimizer a model-space one assembled here. megatron's own formats don't serve: `dp_reshardable`
reshards only over DP, and in megatron-core 0.16 `fully_reshardable` misplaces state where the grad buffer
pads parameters (seen at TP=2: "param range exceeds unpadded buffer"), `fully_sharded_model_space` cannot be
saved (flattened ranges unsupported).

With LoRA (`models.lora`), the state holds what trains: the adapters (and a LoRA critic's value head), their
optimizer state and the LR schedule; not the frozen base, which the run reloads from the checkpoint it started
from (named by checksum in the step's trainer_state.json). Adapters are stored TP-merged like their base layer's
weight (a column layer's B split with its rows, gate|up halves apart as megatron stores linear_fc1; a row
layer's A split with its columns), so they too load at any layout. `lora` in the common state records rank,
targets and scale; a checkpoint of another kind (full-parameter vs LoRA, another rank or targets) is refused.
"""
from __future__ import annotations

import queue
from pathlib import Path

import torch

from verl_mega.models.builder import unwrap_model
from verl_mega.models.lora import LORA_PARAMETER_NAMES, has_lora, lora_modules
from verl_mega.parallel.shims import use_fused_adam

from verl_mega.checkpoint.safe_unpickle import guard_dist_checkpoint_reads

MAIN_STATE_NAMES = ("param", "exp_avg", "exp_avg_sq")  # the distributed optimizer's per-parameter tensors


def save_training_state(trainable, directory: str | Path) -> None:
    """Save `trainable`'s model weights, optimizer state and LR schedule into the existing, empty `directory`."""
    from megatron.core import dist_checkpointing

    _ensure_optimizer_state(trainable.optimizer)
    _collect_write_results_in_process()
    torch.distributed.barrier()  # the caller may have created `directory` on one rank only
    dist_checkpointing.save(_sharded_state(trainable, is_loading=False), str(directory))
    torch.distributed.barrier()


def _collect_write_results_in_process() -> None:
    """megatron's torch_dist writer hands its write results over a queue that it makes on first use through a
    multiprocessing Manager started with "spawn": a fresh interpreter that re-imports the trainer's main module
    (torch, megatron), 5-13 s of a run's first checkpoint on a tiny model. The saves here are synchronous, so
    the results are put and taken in this process and a plain queue carries them."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def load_training_state(trainable, directory: str | Path) -> None:
    """Restore what `save_training_state` wrote into `trainable`, whatever layout either job runs at.

    Raises FileNotFoundError if `directory` is not a complete checkpoint, and ValueError (naming the first
    differing tensor) if it was written for another model or another optimizer kind.
    """
    from megatron.core import dist_checkpointing

    guard_dist_checkpoint_reads()
    directory = Path(directory)
    if not dist_checkpointing.check_is_distributed_checkpoint(str(directory)):
        raise FileNotFoundError(
            f"{directory} is not a complete training-state checkpoint (its metadata.json is missing or unreadable); "
            "the save that wrote it did not finish: resume from an earlier checkpoint"
        )
    _check_optimizer_kind(trainable, directory)
    _check_lora_matches(trainable, directory)
    _ensure_optimizer_state(trainable.optimizer)
    # Loading into the optimizer's tensors in place fails on views of leaf parameters with autograd on.
    with torch.no_grad():
        request = _sharded_state(trainable, is_loading=True)
        _check_matches_checkpoint(request, directory)
        loaded = dist_checkpointing.load(request, str(directory))
        _check_finite(loaded, directory)
        _load_model_state(trainable.model.module, loaded["model"])
        for optimizer, state in zip(_sub_optimizers(trainable.optimizer), loaded["optimizer"]):
            _load_optimizer_state(optimizer, state)
        trainable.scheduler.load_state_dict(loaded["scheduler"])
    use_fused_adam(trainable.optimizer)


def _sharded_state(trainable, is_loading: bool) -> dict:
    # The bare model's keys (not the DDP wrapper's `module.` ones), as in the model-only dist checkpoints.
    model_state = trainable.model.module.sharded_state_dict()
    if has_lora(trainable.model):
        model_state = _trained_part(trainable.model.module, model_state)
    return {
        "lora": lora_record(trainable.model),
        "model": model_state,
        # One entry per sub-optimizer (dense and expert parameters of MoE models get one each).
        "optimizer": [_optimizer_sharded_state(optimizer, model_state, is_loading)
                      for optimizer in _sub_optimizers(trainable.optimizer)],
        "scheduler": trainable.scheduler.state_dict(),
        "use_distributed_optimizer": _is_distributed(trainable.optimizer),
    }


def lora_record(model) -> dict | None:
    """What a LoRA checkpoint must match to be resumed: rank, targets (megatron's linear names) and scale; None
    for a model that trains every parameter."""
    modules = lora_modules(model)
    if not modules:
        return None
    first = unwrap_model(model).get_submodule(modules[0].name)
    return {"rank": int(first.lora_a.shape[0]), "targets": sorted({m.name.rpartition(".")[2] for m in modules}),
            "scale": modules[0].scale}


def _trained_part(module, model_state: dict) -> dict:
    """The sharded entries of the parameters that train (adapters, a critic's head), adapters split like their
    base layer; the frozen base and its extra state are left out."""
    trained = {id(param): param for param in module.parameters() if param.requires_grad}
    return {key: _split_like_base(item, trained[id(item.data)], module.config.gated_linear_unit)
            for key, item in model_state.items() if id(getattr(item, "data", None)) in trained}


def _split_like_base(item, param, gated: bool):
    """An adapter matrix megatron would store replicated (it knows only `weight` and `bias`) as the TP-merged
    tensor it is a shard of: along `partition_dim` (lora-core's TP attributes), and for a gated linear_fc1's B
    with gate and up halves apart, as megatron stores that layer's weight."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    adapter = item.key.rpartition(".")[2] in LORA_PARAMETER_NAMES if isinstance(item, ShardedTensor) else False
    if not adapter or not getattr(param, "tensor_model_parallel", False):
        return item
    tp_rank, tp = _tensor_parallel_coordinates(param)
    prepended = [(axis, item.global_offset[axis], item.axis_fragmentations[axis]) for axis in range(item.prepend_axis_num)]
    split = ShardedTensor.from_rank_offsets(
        item.key, item.data, *prepended, (item.prepend_axis_num + param.partition_dim, tp_rank, tp),
        replica_id=(item.replica_id[0], 0, *item.replica_id[2:]), prepend_axis_num=item.prepend_axis_num)
    if gated and item.key.endswith("linear_fc1.lora_b"):
        return apply_swiglu_sharded_factory(split, tuple(prepended))
    return split


def _tensor_parallel_coordinates(param) -> tuple[int, int]:
    """(rank, size) in the TP group the parameter is split over: the experts' own for an expert's linear (megatron
    marks those parameters allreduce=False, and lora-core copies the mark onto their adapters)."""
    from megatron.core import parallel_state as ps

    if getattr(param, "allreduce", True) is False:
        return ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size()
    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


def _load_model_state(module, state: dict) -> None:
    """Load the model part; a LoRA state holds the trained parameters alone, the frozen base stays as loaded."""
    if not has_lora(module):
        module.load_state_dict(state)
        return
    result = module.load_state_dict(state, strict=False)
    trained = {name for name, param in module.named_parameters() if param.requires_grad}
    missing = sorted(trained & set(result.missing_keys))
    if result.unexpected_keys:
        raise ValueError(f"the LoRA state holds '{result.unexpected_keys[0]}', which this model lacks")
    if missing:
        raise ValueError(f"the LoRA state lacks '{missing[0]}', which this model trains")


def _check_finite(loaded: dict, directory: Path) -> None:
    """Raise on every rank, before anything is applied, if a loaded weight or optimizer moment holds NaN/inf: the
    run that saved it had diverged, and resuming would only fail later with the blame on the learning rate."""
    weights_first = {"model": loaded["model"], "optimizer": loaded["optimizer"]}  # the clearer name to give
    problem = next((f"'{name}' holds NaN/inf" for name, tensor in _nested_tensors(weights_first)
                    if tensor.is_floating_point() and not torch.isfinite(tensor).all()), None)
    gathered = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, problem)
    problems = [rank_problem for rank_problem in gathered if rank_problem]
    if problems:
        raise ValueError(f"{directory}: {problems[0]}; the run that saved it had diverged: resume from an earlier "
                         "checkpoint")


def _nested_tensors(value, name: str = ""):
    """(dotted path, tensor) of every tensor in nested dicts and lists."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _nested_tensors(item, f"{name}.{key}" if name else str(key))
    elif isinstance(value, (list, tuple)):
        for position, item in enumerate(value):
            yield from _nested_tensors(item, f"{name}.{position}" if name else str(position))


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
    use_fused_adam(optimizer)


def _optimizer_sharded_state(optimizer, model_state: dict, is_loading: bool) -> dict:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if not isinstance(optimizer, DistributedOptimizer):
        return optimizer.sharded_state_dict(model_state, is_loading=is_loading)
    from dataclasses import replace

    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.dist_checkpointing.utils import extract_sharded_tensors_and_factories

    sharded_params = {item.data: item for item in nested_values(extract_sharded_tensors_and_factories(model_state)[0])}
    param_state = {}
    for index, (model_param, owned) in enumerate(_model_params_and_owned_ranges(optimizer)):
        # Each DP rank holds one range of the flattened parameter's state; summing the zero-padded ranges
        # over DP gives every rank the whole (TP-local) tensors, exactly.
        full = {name: torch.zeros(model_param.shape, dtype=torch.float32, device=model_param.device)
                for name in MAIN_STATE_NAMES}
        if not is_loading:
            if owned is not None:
                local = optimizer._get_main_param_and_optimizer_states(model_param)
                for name, tensor in full.items():
                    tensor.view(-1)[owned.start:owned.end] = local[name]
            for tensor in full.values():
                torch.distributed.all_reduce(tensor, group=optimizer.data_parallel_group)
        sharded = sharded_params[model_param]
        # Stored beside the weight, with its sharding and replica coordinates (so DP rank 0 writes it).
        param_state[index] = {
            name: replace(sharded, key=f"optimizer.state.{name}.{sharded.key}", data=tensor,
                          **({} if isinstance(sharded, ShardedTensorFactory) else {"dtype": tensor.dtype}))
            for name, tensor in full.items()
        }
    return {"param_groups_and_step": optimizer.state_dict(), "param_state": param_state}


def _model_params_and_owned_ranges(optimizer):
    """(model parameter, the range of its flattened elements this DP rank owns or None), in the same order on
    every DP rank."""
    for buffer_index, buffer in enumerate(optimizer.buffers):
        owned = {param: ranges["param"] for per_dtype in optimizer.gbuf_ranges[buffer_index].values()
                 for bucket in per_dtype for param, ranges in bucket["param_map"].items()}
        for model_param in buffer.param_index_map:
            yield model_param, owned.get(model_param)


def _load_optimizer_state(optimizer, state: dict) -> None:
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    if isinstance(optimizer, DistributedOptimizer):
        optimizer.load_state_dict(state["param_groups_and_step"])
        for index, (model_param, owned) in enumerate(_model_params_and_owned_ranges(optimizer)):
            if owned is None:
                continue
            current = optimizer._get_main_param_and_optimizer_states(model_param)
            loaded = {name: state["param_state"][index][name].reshape(-1)[owned.start:owned.end]
                      for name in MAIN_STATE_NAMES}
            optimizer._set_main_param_and_optimizer_states(model_param, {**loaded, "step": current["step"]})
    else:
        optimizer.load_state_dict(state)
    # Loading may leave one `step` tensor shared by all parameters: Adam would then advance it once per
    # parameter per step and the resumed run would drift. Each parameter gets its own copy.
    for _, param_state in _inner_states(optimizer):
        param_state["step"] = param_state["step"].clone() if "step" in param_state else torch.tensor(0.0)


def _check_optimizer_kind(trainable, directory: Path) -> None:
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(directory)).get("use_distributed_optimizer")
    running = _is_distributed(trainable.optimizer)
    if saved is not None and saved != running:
        raise ValueError(
            f"{directory} was saved with use_distributed_optimizer={saved} but this job runs "
            f"use_distributed_optimizer={running}: resume with the setting it was saved with"
        )


def _check_lora_matches(trainable, directory: Path) -> None:
    """Refuse, before any tensor is read, a checkpoint of the other kind (full-parameter vs LoRA) or of adapters
    with another rank or targets (their scale may change: it is the config's alpha, applied on top)."""
    from megatron.core import dist_checkpointing

    saved = dist_checkpointing.load_common_state_dict(str(directory)).get("lora")
    running = lora_record(trainable.model)
    role = directory.name
    if saved is not None and not (isinstance(saved, dict) and type(saved.get("rank")) is int
                                  and isinstance(saved.get("targets"), list)
                                  and all(isinstance(target, str) for target in saved["targets"])):
        raise ValueError(f"{directory}: its LoRA record {saved!r} is not rank and targets; the checkpoint is damaged")
    if saved is None and running is not None:
        raise ValueError(f"{directory} was saved by a run that trains every parameter, but this job trains LoRA "
                         f"adapters ({role}.lora.rank={running['rank']}): resume with {role}.lora.rank=0, or start "
                         "a new run folder")
    if saved is not None and running is None:
        raise ValueError(f"{directory} holds LoRA adapters (rank {saved['rank']} on {','.join(saved['targets'])}) "
                         f"but this job trains every parameter: resume with {role}.lora.rank={saved['rank']}")
    if saved is not None and (saved["rank"], saved["targets"]) != (running["rank"], running["targets"]):
        raise ValueError(f"{directory} holds LoRA adapters of rank {saved['rank']} on {','.join(saved['targets'])}, "
                         f"this job has rank {running['rank']} on {','.join(running['targets'])}: resume with "
                         f"{role}.lora.rank={saved['rank']} and {role}.lora.targets=[{','.join(saved['targets'])}]")


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
        elif shape is not None and tuple(stored[key].global_shape) != shape:
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
    """(stored key, global shape) of every tensor the request reads, factories expanded; the shape is None where
    megatron pads or trims on load (the vocabulary, padded to a multiple of TP)."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    for item in nested_values(request):
        built = nested_values(item.build()) if isinstance(item, ShardedTensorFactory) else [item]
        for tensor in built:
            if isinstance(tensor, ShardedTensor):
                yield tensor.key, None if tensor.allow_shape_mismatch else tuple(tensor.global_shape)
