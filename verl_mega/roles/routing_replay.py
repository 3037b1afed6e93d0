"""Routing replay (R3): the actor's and the reference's MoE layers route every token as the rollout did.

A batch may carry `routed_experts` [B, L, moe_layers, top_k] int: for each column of `input_ids` (prompt and
response, the same padded layout) the experts each MoE layer (in layer order) chose for that token in the
rollout; `NOT_RECORDED` (-1) where the engine ran no such token: padding, and each response's last token,
which it never fed back (its output predicts nothing the loss reads). The micro-batches slice it with the
tokens (`roles.batching.SEQUENCE_KEYS`), and `megatron_step.model_rows` lays it out as the rows go through
the model (rotated, packed), sequence-first as the router flattens them.

The patch point is megatron-core's own: its `TopKRouter` hands the top-k choice to
`router.router_replay.get_replay_topk(scores, topk, num_groups, group_topk, compute_topk)` whenever that
attribute is set (`moe_utils.topk_routing_with_score_function`, megatron-core 0.16's routing-replay call
site). megatron's `RouterReplay` there keeps one process-wide list of every router built (the actor's, the
reference's and the critic's together, to be fed all layers at once) and replays whole tensors only, so
`RolloutRoutes`, one per router of one model, stands in at that call site instead: it replays the recorded
tokens, lets the router choose for the others, and counts how often the router's own choice differs from the
rollout's, with replay on or off (`actor/router_mismatch`).

Full activation recompute runs a layer's forward again in the backward, after `replaying` has ended: each
router keeps the routes of its checkpointed forwards (megatron's `tensor_parallel.random.IS_CHECKPOINTING`,
without gradients) in order, and the recompute (the same flag, with gradients) takes them back in that order,
which is the backward's order of the micro-batches in every pipeline schedule. Under sequence parallelism a
router sees its TP rank's part of the sequence, and takes that part of the routes.
"""
from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist

from verl_mega.config import ConfigError
from verl_mega.models.builder import unwrap_model
from verl_mega.models.chunks import model_chunks
from verl_mega.parallel.state import device

NOT_RECORDED = -1
ROUTED_EXPERTS = "routed_experts"  # the batch key
REPLAY_SETTINGS = ("off", "rollout")  # actor.router_replay
_ROUTES = "rollout_routes"  # the attribute of a GPTModel holding its routers' RolloutRoutes


class RolloutRoutes:
    """One router's stand-in for megatron's `RouterReplay`: `target` [tokens, top_k] is the rollout's choice for
    the tokens of the forward about to run (None: no recorded routing, the router chooses)."""

    def __init__(self, moe_index: int, replay: bool):
        self.moe_index, self.replay = moe_index, replay
        self.target: torch.Tensor | None = None
        self.mismatched = self.recorded = 0
        # The targets of checkpointed forwards whose recompute is still to come, oldest first.
        self.kept_for_recompute: collections.deque[torch.Tensor | None] = collections.deque()

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups=None, group_topk=None,
                        default_compute_topk=None) -> tuple[torch.Tensor, torch.Tensor]:
        probs, chosen = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target, first_run = self._target_of_this_run()
        if target is None:
            return probs, chosen
        if target.shape != chosen.shape:
            raise ValueError(f"routing replay: MoE layer {self.moe_index} routes {tuple(chosen.shape)} (tokens, top-k) "
                             f"but the batch's routed_experts give {tuple(target.shape)}")
        target = target.to(scores.device, torch.long)
        recorded = target[:, 0] != NOT_RECORDED
        if first_run:  # a recompute would count its tokens twice
            differs = (chosen.sort(dim=-1).values != target.sort(dim=-1).values).any(dim=-1) & recorded
            self.mismatched = self.mismatched + differs.sum()
            self.recorded = self.recorded + recorded.sum()
        if not self.replay:
            return probs, chosen
        # The replayed experts' scores, gathered as megatron's own replay does, so the router still gets gradients.
        replayed = torch.where(recorded[:, None], target, chosen)
        return scores.gather(1, replayed), replayed

    def _target_of_this_run(self) -> tuple[torch.Tensor | None, bool]:
        """The routes for the forward now running, and whether it is the first run of it (not a recompute)."""
        from megatron.core.tensor_parallel import random as mp_random

        if not mp_random.IS_CHECKPOINTING:
            return self.target, True
        if not torch.is_grad_enabled():  # a checkpointed forward: its backward runs it again
            self.kept_for_recompute.append(self.target)
            return self.target, True
        return self.kept_for_recompute.popleft(), False


def moe_layer_numbers(config) -> list[int]:
    """The 1-based numbers (megatron's `layer_number`, over all pipeline stages) of the MoE layers, in order."""
    freq = config.moe_layer_freq
    pattern = [layer % freq == 0 for layer in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [layer + 1 for layer, is_moe in enumerate(pattern) if is_moe]


def replays(setting: str) -> bool:
    """Whether `actor.router_replay` (off | rollout) replays the rollout's routing."""
    if setting not in REPLAY_SETTINGS:
        raise ConfigError(f"actor.router_replay={setting!r} must be one of {', '.join(REPLAY_SETTINGS)}")
    return setting == "rollout"


def is_moe(model) -> bool:
    return unwrap_model(model).config.num_moe_experts is not None


def attach_routing_replay(model, replay: bool) -> None:
    """Give every MoE router of this rank's model (`models.chunks`) a `RolloutRoutes`: it replays the batch's
    `routed_experts` when `replay` (actor.router_replay=rollout), else only counts the mismatch. A dense model
    is left alone; replay on one is refused."""
    from megatron.core.transformer.moe.router import TopKRouter

    model = unwrap_model(model)
    config = model.config
    if config.num_moe_experts is None:
        if replay:
            raise ConfigError("actor.router_replay=rollout replays the routing of MoE layers and this model is dense: "
                              "set actor.router_replay=off")
        return
    if config.moe_router_fusion or config.moe_router_load_balancing_type == "sinkhorn":
        raise ConfigError("routing replay needs megatron's unfused top-k router: unset moe_router_fusion and sinkhorn "
                          "load balancing")
    numbers = moe_layer_numbers(config)
    for chunk in model_chunks(model):  # each model chunk knows its own: the schedules run one at a time
        routes = []
        for module in chunk.modules():
            if isinstance(module, TopKRouter):
                module.router_replay = RolloutRoutes(numbers.index(module.layer_number), replay)
                routes.append(module.router_replay)
        setattr(chunk, _ROUTES, routes)


def _routes_of(model) -> list[RolloutRoutes]:
    """The routers' `RolloutRoutes` of a rank's model (all of its chunks), or of one model chunk."""
    return [routes for chunk in model_chunks(unwrap_model(model)) for routes in getattr(chunk, _ROUTES, [])]


def sequence_first(routes: torch.Tensor) -> torch.Tensor:
    """[b, s, moe_layers, top_k] in the rows' order -> [s * b, moe_layers, top_k], the order a router sees the
    tokens of megatron's sequence-first [s, b, h] hidden states."""
    return routes.transpose(0, 1).flatten(0, 1)


@contextlib.contextmanager
def replaying(stage_model, routes: torch.Tensor | None):
    """The stage's routers take `routes` [tokens, moe_layers, top_k] (see `sequence_first`) for the forward in the
    body; None leaves them to choose."""
    stage_routes = _routes_of(stage_model) if routes is not None else []
    if stage_routes:
        routes = _this_rank_s_tokens(stage_model, routes)
    for router in stage_routes:
        router.target = routes[:, router.moe_index]
    try:
        yield
    finally:
        for router in stage_routes:
            router.target = None


def _this_rank_s_tokens(stage_model, routes: torch.Tensor) -> torch.Tensor:
    """Under sequence parallelism the routers of each TP rank see its consecutive part of the sequence-first
    tokens (the sequence is a multiple of the TP size: `megatron_step.sequence_split`)."""
    from megatron.core import parallel_state as ps

    if not unwrap_model(stage_model).config.sequence_parallel:
        return routes
    return routes.chunk(ps.get_tensor_model_parallel_world_size())[ps.get_tensor_model_parallel_rank()]


def forget_kept_routes(model) -> None:
    """Drop the routes kept for recomputes that never came (a checkpointed forward without a backward); called
    before each forward-backward pass."""
    for router in _routes_of(model):
        router.kept_for_recompute.clear()


def check_routed_experts(model, batch: dict) -> None:
    """Refuse a batch's `routed_experts` that do not fit `model` (every rank checks the same global batch before
    any forward, so none is left waiting in a collective)."""
    routes = batch.get(ROUTED_EXPERTS)
    if routes is None or not _routes_of(model):
        return
    config = unwrap_model(model).config
    shape = (*batch["input_ids"].shape, len(moe_layer_numbers(config)), config.moe_router_topk)
    if tuple(routes.shape) != shape or routes.dtype.is_floating_point:
        raise ValueError(f"the batch's routed_experts are {routes.dtype} {tuple(routes.shape)}; this model takes integer "
                         f"[rows, columns, moe_layers, top_k] = {shape}")
    if routes.numel() and (routes.min() < NOT_RECORDED or routes.max() >= config.num_moe_experts):
        raise ValueError(f"the batch's routed_experts hold expert ids outside [0, {config.num_moe_experts}) (and "
                         f"{NOT_RECORDED} for no record): {int(routes.min())} .. {int(routes.max())}")


def reset_mismatch(model) -> None:
    for router in _routes_of(model):
        router.mismatched = router.recorded = 0


def router_mismatch(model) -> float | None:
    """Collective (every rank, with an MoE model): the share of recorded (token, MoE layer) pairs whose top-k set,
    as the router chose it, differs from the rollout's, over the forwards since `reset_mismatch`; None when no
    recorded token went through. Each token is counted once: on the first TP rank of its DP rank (on its own TP
    rank under sequence parallelism), on the pipeline stage of each layer."""
    from megatron.core import parallel_state as ps

    counts = torch.zeros(2, dtype=torch.float64, device=device())
    if ps.get_tensor_model_parallel_rank() == 0 or unwrap_model(model).config.sequence_parallel:
        for router in _routes_of(model):
            counts += torch.stack([torch.as_tensor(router.mismatched), torch.as_tensor(router.recorded)]).to(counts)
    dist.all_reduce(counts)
    mismatched, recorded = counts.tolist()
    return mismatched / recorded if recorded else None
