"""Context parallelism's sequence split (verl_mega.parallel.context_parallel) against megatron-core's own
`get_batch_on_this_cp_rank`, its inverse, and the gather over real gloo CP groups with the gradient megatron's
data-and-context-parallel average expects."""

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from verl_mega.parallel.context_parallel import gather_sequence, restore_order, sequence_multiple, split_for_rank
from verl_mega.roles.batching import pad_columns_to_multiple

WORLD_SIZE = 4  # one CP group of 4 ranks, and two CP groups of 2


def rows(length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Three rows of `length` columns, as the step's micro-batches hold them."""
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, 1000, (3, length), generator=generator),
            "position_ids": torch.arange(length).repeat(3, 1),
            "attention_mask": torch.ones(3, length, dtype=torch.long)}


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 5, 7, 13, 24])
def test_split_then_restore_is_the_identity_after_the_steps_padding(cp, length):
    batch = pad_columns_to_multiple(rows(length), sequence_multiple(cp))
    padded = batch["input_ids"].shape[1]
    assert padded % sequence_multiple(cp) == 0 and padded - length < sequence_multiple(cp)
    for key, tensor in batch.items():
        pieces = [split_for_rank(tensor, cp, rank) for rank in range(cp)]
        assert {piece.shape[1] for piece in pieces} == {padded // cp}
        restored = restore_order(pieces)
        assert torch.equal(restored, tensor)
        assert torch.equal(restored[:, padded - length:], rows(length)[key])  # the padding went on the left


def test_split_needs_2cp_equal_chunks():
    with pytest.raises(ValueError, match="pad it to a multiple of 4"):
        split_for_rank(torch.zeros(2, 6), 2, 0)


def test_sequence_multiple():
    assert [sequence_multiple(cp) for cp in (1, 2, 3, 8)] == [1, 4, 6, 16]


def check_rank(rank: int, store_path: str) -> None:
    from megatron.core.utils import get_batch_on_this_cp_rank

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD_SIZE)
    try:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = pairs[rank // 2]
        for group in (dist.group.WORLD, pair):
            cp, cp_rank = dist.get_world_size(group), dist.get_rank(group)
            batch = pad_columns_to_multiple(rows(13, seed=rank // 2), sequence_multiple(cp))
            # megatron's attention_mask is [b, 1, s, s]; the step's [b, s] rows of 0/1 go in as a loss mask
            batch["loss_mask"] = batch.pop("attention_mask")
            megatron = get_batch_on_this_cp_rank(dict(batch), cp_group=group)
            for key, tensor in batch.items():
                assert torch.equal(split_for_rank(tensor, cp, cp_rank), megatron[key]), (cp, key)
            # megatron splits the [b, 1, s, s] mask's query dimension
            mask = torch.arange(16 * 16).view(1, 1, 16, 16)
            assert torch.equal(split_for_rank(mask, cp, cp_rank, dim=2),
                               get_batch_on_this_cp_rank({"attention_mask": mask}, cp_group=group)["attention_mask"])
            check_gather_and_loss(group, cp, cp_rank)
    finally:
        dist.destroy_process_group()


def check_gather_and_loss(group, cp: int, cp_rank: int) -> None:
    """A token-mean loss over the whole sequence, computed on each CP rank from its gathered hidden states: its
    value, and the gradients averaged over the CP ranks as megatron's DDP averages them over DP x CP (after the
    schedule's x CP on the loss), are those of one rank holding the whole sequence (fp32)."""
    generator = torch.Generator().manual_seed(7)
    hidden = torch.randn(2 * sequence_multiple(cp), 3, 8, generator=generator, dtype=torch.float32)  # [s, b, h]
    labels = torch.randint(0, 5, (hidden.shape[0], 3), generator=generator)
    mask = (torch.rand(hidden.shape[:2], generator=generator) > 0.3).float()
    head = torch.nn.Linear(8, 5)
    for parameter in head.parameters():  # the same head on every rank
        torch.nn.init.normal_(parameter, generator=generator)

    def token_mean_loss(states):
        losses = torch.nn.functional.cross_entropy(head(states).flatten(0, 1), labels.flatten(), reduction="none")
        return (losses * mask.flatten()).sum() / mask.sum()

    whole_states = hidden.clone().requires_grad_()
    whole_loss = token_mean_loss(whole_states)
    whole_loss.backward()
    whole_head_grad = head.weight.grad.clone()
    head.zero_grad()

    local = split_for_rank(hidden, cp, cp_rank, dim=0).clone().requires_grad_()
    gathered = gather_sequence(local, group, dim=0)
    assert torch.equal(gathered, hidden)  # the original order, on every rank
    loss = token_mean_loss(gathered)
    torch.testing.assert_close(loss, whole_loss, rtol=0, atol=0)
    loss.backward()  # megatron's schedule multiplies it by CP, the step divides it by CP
    head_grad = head.weight.grad.clone()
    dist.all_reduce(head_grad, group=group)
    torch.testing.assert_close(head_grad / cp, whole_head_grad)
    pieces = [torch.empty_like(local.grad) for _ in range(cp)]
    dist.all_gather(pieces, local.grad, group=group)
    torch.testing.assert_close(restore_order(pieces, dim=0) / cp, whole_states.grad)


def test_split_matches_megatron_and_gather_restores_order_over_gloo(tmp_path):
    # Any assertion failing in a rank re-raises here.
    mp.spawn(check_rank, args=(str(tmp_path / "store"),), nprocs=WORLD_SIZE, join=True)
