"""algorithms.distill against references written from the papers' formulas (plain Python loops over float64
numbers, not the module's tensor code), and their gradients checked by finite differences in fp64."""
import math

import pytest
import torch

from verl_mega.algorithms.distill import (
    distill_advantages, generalized_jsd, reverse_kl_advantage, topk_generalized_jsd,
)


def softmax_row(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    return [e / sum(exps) for e in exps]


def kl_reference(p: list[float], q: list[float]) -> float:
    """KL(p || q) = sum_v p_v log(p_v / q_v)."""
    return sum(pv * math.log(pv / qv) for pv, qv in zip(p, q) if pv > 0)


def jsd_reference(p: list[float], q: list[float], beta: float) -> float:
    """Agarwal et al. 2024, eq. 1: beta KL(P || M) + (1 - beta) KL(Q || M), M = beta P + (1 - beta) Q."""
    m = [beta * pv + (1 - beta) * qv for pv, qv in zip(p, q)]
    return beta * kl_reference(p, m) + (1 - beta) * kl_reference(q, m)


def random_distributions(rows: int, vocab: int, seed: int):
    generator = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 2
    teacher = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 2
    return student, teacher


def test_reverse_kl_advantage_is_teacher_minus_student_per_token():
    student = torch.tensor([[-1.0, -2.0, -0.5], [-3.0, -0.1, -9.0]])
    teacher = torch.tensor([[-0.5, -2.5, -0.5], [-1.0, -4.0, -0.2]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    expected = [-(s - t) * m for rows in zip(student.tolist(), teacher.tolist(), mask.tolist())
                for s, t, m in zip(*rows)]
    assert reverse_kl_advantage(student, teacher, mask).flatten().tolist() == pytest.approx(expected)


def test_reverse_kl_advantage_has_no_discounting():
    """Discount 0: a token's advantage does not depend on any other token's log-probs."""
    student, teacher = torch.randn(2, 6), torch.randn(2, 6)
    mask = torch.ones(2, 6)
    before = reverse_kl_advantage(student, teacher, mask)
    student[:, 3:] += 5.0
    after = reverse_kl_advantage(student, teacher, mask)
    assert torch.equal(before[:, :3], after[:, :3])


def test_reverse_kl_advantage_expectation_is_minus_reverse_kl():
    """Summed over the vocabulary with the student's weights, the advantage is -KL(student || teacher)."""
    student_logits, teacher_logits = random_distributions(3, 7, seed=1)
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    advantage = reverse_kl_advantage(student, teacher, torch.ones_like(student))
    expectation = (student.exp() * advantage).sum(-1)
    for row in range(3):
        reference = kl_reference(student[row].exp().tolist(), teacher[row].exp().tolist())
        assert expectation[row].item() == pytest.approx(-reference, rel=1e-12)


def test_distill_advantages_adds_the_scaled_term_to_the_outcome_advantages():
    student, teacher = torch.randn(2, 4), torch.randn(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    outcome = torch.tensor([[0.7, 0.7, 0.7, 0.7], [-0.3, -0.3, -0.3, -0.3]])
    combined = distill_advantages(outcome, student, teacher, mask, coef=0.25)
    for row in range(2):
        for col in range(4):
            expected = mask[row, col].item() * (outcome[row, col].item()
                                                + 0.25 * (teacher[row, col].item() - student[row, col].item()))
            assert combined[row, col].item() == pytest.approx(expected, abs=1e-6)
    alone = distill_advantages(None, student, teacher, mask, coef=2.0)
    assert torch.allclose(alone, 2.0 * (teacher - student) * mask)


@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_generalized_jsd_equals_the_papers_formula(beta):
    student_logits, teacher_logits = random_distributions(4, 9, seed=2)
    got = generalized_jsd(torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1), beta)
    for row in range(4):
        p, q = softmax_row(teacher_logits[row].tolist()), softmax_row(student_logits[row].tolist())
        assert got[row].item() == pytest.approx(jsd_reference(p, q, beta), rel=1e-10)


def test_generalized_jsd_ends_are_the_forward_and_reverse_kl():
    student_logits, teacher_logits = random_distributions(3, 6, seed=3)
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    for row in range(3):
        p, q = softmax_row(teacher_logits[row].tolist()), softmax_row(student_logits[row].tolist())
        assert generalized_jsd(student, teacher, 0.0)[row].item() == pytest.approx(kl_reference(p, q), rel=1e-10)
        assert generalized_jsd(student, teacher, 1.0)[row].item() == pytest.approx(kl_reference(q, p), rel=1e-10)


def test_generalized_jsd_tends_to_its_ends_as_beta_goes_to_them():
    """The paper's limits: JSD(beta) / beta -> KL(P || Q) as beta -> 0, JSD(beta) / (1 - beta) -> KL(Q || P)
    as beta -> 1; the ends the function returns are these limits."""
    student_logits, teacher_logits = random_distributions(2, 5, seed=4)
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    small = 1e-6
    assert torch.allclose(generalized_jsd(student, teacher, small) / small, generalized_jsd(student, teacher, 0.0),
                          rtol=1e-4)
    assert torch.allclose(generalized_jsd(student, teacher, 1 - small) / small,
                          generalized_jsd(student, teacher, 1.0), rtol=1e-4)


def test_generalized_jsd_is_zero_for_equal_distributions_and_positive_otherwise():
    student_logits, teacher_logits = random_distributions(3, 5, seed=5)
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    for beta in (0.0, 0.3, 1.0):
        assert torch.allclose(generalized_jsd(student, student, beta), torch.zeros(3, dtype=torch.float64),
                              atol=1e-12)
        assert (generalized_jsd(student, teacher, beta) > 0).all()


def test_generalized_jsd_refuses_beta_outside_the_unit_interval():
    student = torch.log_softmax(torch.randn(2, 3), -1)
    with pytest.raises(ValueError, match="beta must be in"):
        generalized_jsd(student, student, 1.5)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_topk_generalized_jsd_renormalises_over_the_teachers_top_k(beta):
    """The divergence of the two distributions restricted to the teacher's k most likely tokens and renormalised:
    with beta = 0, the forward KL on the teacher's top-k."""
    student_logits, teacher_logits = random_distributions(3, 10, seed=6)
    k = 4
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    top = teacher.topk(k, dim=-1).indices
    got = topk_generalized_jsd(student.gather(-1, top), teacher.gather(-1, top), beta)
    for row in range(3):
        ids = top[row].tolist()
        p = [teacher[row, v].exp().item() for v in ids]
        q = [student[row, v].exp().item() for v in ids]
        p, q = [x / sum(p) for x in p], [x / sum(q) for x in q]
        reference = kl_reference(p, q) if beta == 0 else kl_reference(q, p) if beta == 1 else jsd_reference(p, q,
                                                                                                          beta)
        assert got[row].item() == pytest.approx(reference, rel=1e-10)


def test_topk_over_the_whole_vocabulary_is_the_full_divergence():
    student_logits, teacher_logits = random_distributions(2, 6, seed=7)
    student, teacher = torch.log_softmax(student_logits, -1), torch.log_softmax(teacher_logits, -1)
    top = teacher.topk(6, dim=-1).indices
    assert torch.allclose(topk_generalized_jsd(student.gather(-1, top), teacher.gather(-1, top), 0.4),
                          generalized_jsd(student, teacher, 0.4), rtol=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_generalized_jsd_gradient_matches_finite_differences(beta):
    student_logits, teacher_logits = random_distributions(2, 5, seed=8)
    student_logits.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda logits: generalized_jsd(torch.log_softmax(logits, -1), torch.log_softmax(teacher_logits, -1), beta),
        (student_logits,), eps=1e-6, atol=1e-8)


@pytest.mark.parametrize("beta", [0.0, 0.6, 1.0])
def test_topk_generalized_jsd_gradient_matches_finite_differences(beta):
    student_logits, teacher_logits = random_distributions(2, 8, seed=9)
    top = torch.log_softmax(teacher_logits, -1).topk(3, dim=-1).indices
    teacher_top = torch.log_softmax(teacher_logits, -1).gather(-1, top)
    student_logits.requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda logits: topk_generalized_jsd(torch.log_softmax(logits, -1).gather(-1, top), teacher_top, beta),
        (student_logits,), eps=1e-6, atol=1e-8)


def test_reverse_kl_policy_gradient_matches_finite_differences_of_the_reverse_kl():
    """The policy gradient with the reverse-KL advantage, E_q[A grad log q], is minus the gradient of
    KL(q || p) (exact expectation over the vocabulary, fp64): the advantage minimises the reverse KL."""
    student_logits, teacher_logits = random_distributions(1, 6, seed=10)
    teacher = torch.log_softmax(teacher_logits, -1)
    logits = student_logits.clone().requires_grad_(True)
    student = torch.log_softmax(logits, -1)
    advantage = reverse_kl_advantage(student.detach(), teacher, torch.ones_like(teacher))
    surrogate = (student.detach().exp() * advantage * student).sum()
    (policy_gradient,) = torch.autograd.grad(surrogate, logits)

    def reverse_kl(x):
        return kl_reference(softmax_row(x), softmax_row(teacher_logits[0].tolist()))

    eps, base = 1e-6, student_logits[0].tolist()
    finite = [(reverse_kl([v + eps * (i == j) for j, v in enumerate(base)])
               - reverse_kl([v - eps * (i == j) for j, v in enumerate(base)])) / (2 * eps) for i in range(6)]
    assert policy_gradient[0].tolist() == pytest.approx([-g for g in finite], abs=1e-8)
