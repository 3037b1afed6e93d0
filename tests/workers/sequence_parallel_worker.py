"""torchrun worker (2 processes, TP 2) for tests/test_recompute.py: each case's actor or critic with and without
sequence parallelism, on the same batch: forward-only outputs, and one forward-backward's loss and gradients.

Run as `sequence_parallel_worker ROOT CASE [CASE ...]`; a case is `MODEL` (ROOT/ckpt/MODEL converted at TP 2) or
`MODEL:replay` (an MoE actor; the batch carries routes for every token, replayed). Each rank saves
ROOT/out/{MODEL[_replay]}_{ROLE}_sp{0,1}_rank{R}.pt: {'outputs', 'loss', 'grads' (this rank's shards, by parameter
name)}; megatron trains an MoE layer at TP > 1 only with sequence parallelism, so without it that case runs the
forward-only pass alone (loss None, no gradients).
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tests.workers.roles_worker import fixed_batch
from verl_mega.parallel.process_exit import exit_process


def replayed_routes(batch: dict, moe_layers: int, top_k: int, experts: int) -> torch.Tensor:
    """A distinct pair of experts for every (token, MoE layer), drawn at random (the router would choose others):
    [B, L, moe_layers, top_k], NOT_RECORDED at padding."""
    from verl_mega.roles.routing_replay import NOT_RECORDED

    generator = torch.Generator().manual_seed(3)
    shape = (*batch["input_ids"].shape, moe_layers)
    routes = torch.rand(*shape, experts, generator=generator).argsort(-1)[..., :top_k]
    return routes.masked_fill(~batch["attention_mask"].bool()[..., None, None], NOT_RECORDED).to(torch.int16)


def run_cases_on_two_ranks(root: Path, worker: str, num_layers: int, tp: int, pp: int) -> Path:
    """Convert a tiny Qwen2 and Mixtral of `num_layers` layers at (tp, pp) into ROOT/ckpt/MODEL, run `worker`
    (a module of tests.workers) on 2 ranks for the cases `qwen2` and `mixtral:replay`; returns ROOT/out."""
    import os

    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.parallel.spawn import run_torchrun

    for model in ("qwen2", "mixtral"):
        hf_dir = make_tiny_hf_model(root / "hf" / model, model, num_hidden_layers=num_layers)
        convert_hf_to_mcore(hf_dir, root / "ckpt" / model, tp=tp, pp=pp, ep=1)
    (root / "out").mkdir()
    repo = Path(__file__).resolve().parents[2]
    env = {"PYTHONPATH": ":".join(filter(None, [str(repo), os.environ.get("PYTHONPATH", "")]))}
    run_torchrun(2, f"tests.workers.{worker}", [str(root), "qwen2", "mixtral:replay"], env=env)
    return root / "out"


def case_roles(case: str) -> tuple[str, bool, tuple[str, ...]]:
    """A worker's case, `MODEL` or `MODEL:replay` -> (model, whether routes are replayed, the roles it runs)."""
    model, _, option = case.partition(":")
    replay = option == "replay"
    return model, replay, ("actor",) if replay else ("actor", "critic")


def save_case(root: str | Path, case: str, role: str, setting: str, rank: int, result: dict) -> None:
    """ROOT/out/{MODEL[_replay]}_{ROLE}_{SETTING}_rank{R}.pt."""
    torch.save(result, Path(root) / "out" / f"{case.replace(':', '_')}_{role}_{setting}_rank{rank}.pt")


def role_pass(role: str, ckpt: Path, replay: bool, train: bool, **overrides) -> dict:
    """The role's forward-only outputs, then (`train`) one forward-backward of the token-mean of its outputs on
    `fixed_batch`; the loss and this rank's gradients (DDP's main_grad, as the optimizer reads them)."""
    from verl_mega.config import OptimConfig
    from verl_mega.models.builder import unwrap_model
    from verl_mega.roles.actor import Actor, response_logprobs
    from verl_mega.roles.critic import Critic, _response_values
    from verl_mega.roles.megatron_step import forward_backward
    from verl_mega.roles.routing_replay import ROUTED_EXPERTS, moe_layer_numbers

    if role == "actor":
        model_role = Actor(ckpt, OptimConfig(), schedule_steps=1, router_replay="rollout" if replay else "off",
                           **overrides)
    else:
        model_role = Critic(ckpt, OptimConfig(), schedule_steps=1, **overrides)
    model = model_role.model
    config = unwrap_model(model).config
    batch = fixed_batch(300, 0)
    if replay:
        batch[ROUTED_EXPERTS] = replayed_routes(batch, len(moe_layer_numbers(config)), config.moe_router_topk,
                                                config.num_moe_experts)
    if role == "actor":
        outputs = model_role.compute_log_prob(batch, 2)["log_probs"]
        score = lambda output, micro_batch: response_logprobs(output, micro_batch, model_role.vocab_size, False)  # noqa: E731
    else:
        outputs = model_role.compute_values(batch, 2)
        score = lambda output, micro_batch: _response_values(output)  # noqa: E731

    if not train:
        return {"outputs": outputs.cpu(), "loss": None, "grads": {}}

    def loss_fn(output, micro_batch, share):
        mask = micro_batch["response_mask"].to(output.device)
        loss = (score(output, micro_batch).float() * mask).sum() / mask.sum().clamp_min(1) * share.loss
        return loss, {"loss": loss}

    model.train()
    metrics = forward_backward(model, batch, 2, "token-mean", ["loss"], loss_fn)
    grads = {name: param.main_grad.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    return {"outputs": outputs.cpu(), "loss": metrics["loss"], "grads": grads}


def main(argv: list[str]) -> None:
    from verl_mega.parallel.state import destroy_parallel, init_parallel

    root, *cases = argv
    layout = init_parallel(2, 1)
    for case in cases:
        model, replay, roles = case_roles(case)
        for role in roles:
            for sequence_parallel in (False, True):
                result = role_pass(role, Path(root) / "ckpt" / model, replay, sequence_parallel or not replay,
                                   sequence_parallel=sequence_parallel)
                save_case(root, case, role, f"sp{int(sequence_parallel)}", layout.rank, result)
    dist.barrier()
    destroy_parallel()


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
