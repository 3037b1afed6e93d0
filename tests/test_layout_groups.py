"""`LayoutGroups` (in process, a world of one): megatron's groups of a second layout are its own while the block
runs, and the running layout's are back after it, the same objects, an error inside included; creating them leaves
the running layout's groups untouched."""
import pytest
import torch
import torch.distributed as dist

from verl_mega.parallel.layout_groups import LayoutGroups


def running_groups():
    from megatron.core import parallel_state as ps

    return (ps.get_tensor_model_parallel_group(), ps.get_pipeline_model_parallel_group(),
            ps.get_data_parallel_group(), ps.get_data_parallel_group(with_context_parallel=True),
            ps.get_embedding_group(), ps.get_model_parallel_group())


def test_the_second_layout_s_groups_inside_the_block_and_the_running_ones_after(one_rank):
    before = running_groups()
    groups = LayoutGroups(1, 1)
    assert running_groups() == before
    with groups.active() as layout:
        inside = running_groups()
        assert (layout.tp, layout.pp, layout.dp) == (1, 1, 1)
        assert all(group is not None for group in inside)
        assert not set(map(id, inside)) & set(map(id, before))  # groups of their own, not the running layout's
        dist.all_reduce(torch.ones(1), group=inside[0])  # usable
    assert running_groups() == before
    with pytest.raises(RuntimeError), groups.active():
        raise RuntimeError("a teacher's pass fails")
    assert running_groups() == before
    with groups.active():  # the same groups each time
        assert running_groups() == inside
