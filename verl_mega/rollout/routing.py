"""The experts a transformers MoE model routes each token to, recorded while the embedded engine generates.

Routing replay (`actor.router_replay`) trains on the rollout's routing, so the engine must say, per token and
MoE layer, which top-k experts it chose. transformers 5 gives every MoE family a router module that returns
`(router_logits, weights, top_k_indices)` and names its class in the model's `_can_record_outputs`
("router_logits"); a forward hook on each such router, in layer order, takes the indices it returned, the
very experts the layer then ran. No family is named here.

What one forward of a [rows, tokens] batch leaves is `RouterRecorder.take()`: [rows, tokens, moe_layers,
top_k] int16 (expert ids fit: no supported model has 32768 experts).
"""
from __future__ import annotations

import torch

ROUTE_DTYPE = torch.int16


def router_class(model: torch.nn.Module) -> type | None:
    """The class of the model's MoE routers, as transformers records their outputs; None for a dense model."""
    for module in model.modules():
        recorder = getattr(module, "_can_record_outputs", None) or {}
        target = recorder.get("router_logits")
        if target is not None:
            return getattr(target, "target_class", target)
    return None


class RouterRecorder:
    """Forward hooks on the model's routers while entered; `take()` hands over the last forward's routing."""

    def __init__(self, model: torch.nn.Module):
        cls = router_class(model)
        self.routers = [module for module in model.modules() if cls is not None and isinstance(module, cls)]
        if not self.routers:
            raise ValueError(f"{type(model).__name__} has no MoE router to record: routing replay needs an MoE "
                             "model (set actor.router_replay=off)")
        self._taken: list[torch.Tensor | None] = [None] * len(self.routers)
        self._handles = []

    @property
    def moe_layers(self) -> int:
        return len(self.routers)

    def __enter__(self) -> RouterRecorder:
        self._handles = [router.register_forward_hook(self._hook(layer)) for layer, router in enumerate(self.routers)]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _hook(self, layer: int):
        def keep_indices(module, args, output):
            indices = output[-1] if isinstance(output, tuple) else None
            if indices is None or indices.dim() != 2 or indices.dtype.is_floating_point:
                raise TypeError(f"{type(module).__name__} returned no [tokens, top_k] expert indices last: its "
                                "routing cannot be recorded")
            self._taken[layer] = indices.to(ROUTE_DTYPE)

        return keep_indices

    def take(self, rows: int, tokens: int) -> torch.Tensor:
        """[rows, tokens, moe_layers, top_k] of the forward just run over `rows` x `tokens` inputs."""
        if any(indices is None for indices in self._taken):
            raise RuntimeError("a forward ran without reaching every MoE router")
        routes = torch.stack(self._taken, dim=1)  # [rows * tokens, moe_layers, top_k]
        self._taken = [None] * len(self.routers)
        return routes.view(rows, tokens, *routes.shape[1:])
