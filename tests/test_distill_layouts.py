"""The teacher's scores and the vocabulary-parallel top-k and gathered log-probs behind GKD are the same at TP 1 and
TP 2 (torchrun, gloo), and equal the full-vocabulary results: transformers' forward for the teacher, plain
log_softmax for the split logits (values and gradient)."""
import pytest
import torch

from verl_mega.converters.hf_to_mcore import convert_hf_to_mcore
from verl_mega.models.tiny import make_tiny_hf_model
from verl_mega.parallel.spawn import run_torchrun

from tests.workers.roles_worker import RESPONSE, fixed_batch
from tests.workers.teacher_worker import TOP_K, VOCAB

pytestmark = pytest.mark.slow  # two torchrun launches


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    root = tmp_path_factory.mktemp("teacher_layouts")
    hf = make_tiny_hf_model(root / "hf", "qwen2", vocab_size=64, num_hidden_layers=2, seed=2)
    ckpt = root / "ckpt"
    convert_hf_to_mcore(hf, ckpt, fmt="torch_dist")
    results = {}
    for tp in (1, 2):
        run_torchrun(tp, "tests.workers.teacher_worker", [str(ckpt), str(root / f"tp{tp}.pt"), str(tp)])
        results[tp] = torch.load(root / f"tp{tp}.pt")
    return hf, results


def hf_logits(hf_dir, batch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    return torch.log_softmax(logits[:, -RESPONSE - 1:-1].float(), dim=-1)


def test_teacher_scores_match_transformers_at_tp1_and_tp2(layouts):
    hf, results = layouts
    batch = fixed_batch(64, pad_id=0)
    log_probs = hf_logits(hf, batch)
    mask = batch["response_mask"].bool()
    expected = log_probs.gather(-1, batch["responses"][..., None])[..., 0]
    top = log_probs.topk(TOP_K, dim=-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    for tp, found in results.items():
        torch.testing.assert_close(found["teacher_log_probs"][mask], expected[mask], atol=1e-4, rtol=1e-4,
                                   msg=f"tp={tp}")
        torch.testing.assert_close(found["teacher_entropy"][mask], entropy[mask], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(found["teacher_topk_log_probs"][mask], top.values[mask], atol=1e-4, rtol=1e-4)
        assert torch.equal(found["teacher_topk_ids"][mask].long(), top.indices[mask])
        assert torch.equal(found["teacher_top1_match"][mask].bool(), (top.indices[..., 0] == batch["responses"])[mask])
    torch.testing.assert_close(results[1]["teacher_log_probs"], results[2]["teacher_log_probs"], atol=1e-5, rtol=1e-5)


def test_split_vocabulary_top_k_and_gathered_log_probs_equal_the_full_ones(layouts):
    _, results = layouts
    generator = torch.Generator().manual_seed(3)
    full = (torch.randn(2, 3, VOCAB, generator=generator) * 3).requires_grad_(True)
    ids = torch.randint(0, VOCAB, (2, 3, 4), generator=generator)
    weights = torch.randn(2, 3, 4, generator=generator)
    log_probs = torch.log_softmax(full, dim=-1)
    gathered = log_probs.gather(-1, ids)
    (gathered * weights).sum().backward()
    top = log_probs.detach().topk(TOP_K, dim=-1)
    for tp, found in results.items():
        torch.testing.assert_close(found["random_top_log_probs"], top.values, msg=f"tp={tp}")
        assert torch.equal(found["random_top_ids"], top.indices)
        torch.testing.assert_close(found["random_gathered"], gathered.detach())
        torch.testing.assert_close(found["random_grad"], full.grad)
