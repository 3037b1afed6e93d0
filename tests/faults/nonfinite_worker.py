"""One process (a world of one): a NaN in the accumulated gradients makes TrainableModel.step refuse, with the
weights and optimizer untouched and the gradients cleared; finite gradients then step as usual.

    python tests/faults/nonfinite_worker.py WORK_DIR fp32|bf16
"""
import sys
from pathlib import Path

import torch


def main(work: Path, dtype: str) -> None:
    from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
    from verl_mega.config import OptimConfig
    from verl_mega.config.errors import NonFiniteError
    from verl_mega.models.tiny import make_tiny_hf_model
    from verl_mega.parallel.state import destroy_parallel, init_parallel
    from verl_mega.roles.actor import Actor

    init_parallel(1, 1)
    hf = make_tiny_hf_model(work / "hf", "qwen2", vocab_size=64, num_hidden_layers=2)
    convert_hf_to_mcore(hf, work / "ckpt", dtype=dtype)
    engine = Actor(work / "ckpt", OptimConfig(lr=1e-2), schedule_steps=2).trainable
    params = [p for p in engine.model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]

    def fill_grads(poisoned=None) -> None:
        for param in params:
            param.main_grad.fill_(0.01)
        if poisoned is not None:
            poisoned.main_grad.view(-1)[-1] = float("nan")

    for poisoned in (params[0], params[-1]):  # the two ends of DDP's gradient buffer
        fill_grads(poisoned)
        try:
            engine.step()
            raise AssertionError("a NaN gradient was applied")
        except NonFiniteError as err:
            assert "gradients are NaN/inf" in str(err)
        assert all(torch.equal(p, b) for p, b in zip(params, before)), "weights changed"
        assert all(not p.main_grad.any() for p in params), "gradients not cleared"

    fill_grads()
    metrics = engine.step()
    assert metrics["update_successful"] == 1.0 and any(not torch.equal(p, b) for p, b in zip(params, before))
    print("gradients refused, weights unchanged")
    destroy_parallel()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
