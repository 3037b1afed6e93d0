"""PyTorch versions of the kernels in csrc/: the fallback when they are not built, and the oracle in tests.

Same functions and signatures as the compiled modules (see csrc/cpu_kernels.h for the partials' definition).
Log-prob rows are processed in chunks so that the fallback, too, never holds a float32 copy of all the logits.
"""
import torch

# Exponent arguments are floored here, as in the kernels, so that -inf logits give 0 rather than 0 * -inf.
MIN_EXPONENT = -87.0
ROW_CHUNK_ELEMENTS = 1 << 24


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_chunks(rows: int, vocab: int):
    step = max(1, ROW_CHUNK_ELEMENTS // max(vocab, 1))
    for start in range(0, rows, step):
        yield slice(start, min(start + step, rows))


def _local_columns(labels: torch.Tensor, vocab_start: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each label's column in this slice (clamped into range) and whether the slice holds it."""
    columns = labels - vocab_start
    in_slice = (columns >= 0) & (columns < vocab)
    return columns.clamp(0, vocab - 1), in_slice


def logprob_partials(logits, labels, vocab_start, with_entropy):
    rows, vocab = logits.shape
    acc = accumulation_dtype(logits.dtype)
    row_max, sum_exp, label_logit = (logits.new_empty(rows, dtype=acc) for _ in range(3))
    shifted_sum = logits.new_empty(rows, dtype=acc) if with_entropy else None
    for chunk in _row_chunks(rows, vocab):
        x = logits[chunk].to(acc)
        m = x.amax(dim=-1)
        d = (x - m[:, None]).clamp_min(MIN_EXPONENT)
        e = d.exp()
        row_max[chunk], sum_exp[chunk] = m, e.sum(dim=-1)
        if with_entropy:
            shifted_sum[chunk] = (e * d).sum(dim=-1)
        columns, in_slice = _local_columns(labels[chunk], vocab_start, vocab)
        label_logit[chunk] = torch.where(in_slice, x.gather(-1, columns[:, None])[:, 0], 0.0)
    return row_max, sum_exp, label_logit, shifted_sum


def logprob_backward(logits, labels, vocab_start, log_normalizer, grad_logprob, mean_logit, grad_entropy):
    """d/dx_j of g log p(label) + h entropy = g (onehot_j - p_j) - h p_j (x_j - E[x])."""
    rows, vocab = logits.shape
    acc = accumulation_dtype(logits.dtype)
    grad_logits = torch.empty_like(logits)
    for chunk in _row_chunks(rows, vocab):
        lz = log_normalizer[chunk, None]
        d = (logits[chunk].to(acc) - lz).clamp_min(MIN_EXPONENT)
        p = d.exp()
        weight = grad_logprob[chunk, None] if grad_logprob is not None else 0.0
        if grad_entropy is not None:
            weight = weight + grad_entropy[chunk, None] * (d + lz - mean_logit[chunk, None])
        grad = -p * weight
        if grad_logprob is not None:
            columns, in_slice = _local_columns(labels[chunk], vocab_start, vocab)
            onehot = torch.where(in_slice, grad_logprob[chunk], 0.0)
            grad.scatter_add_(-1, columns[:, None], onehot[:, None])
        grad_logits[chunk] = grad
    return grad_logits


def gae(rewards, values, mask, gamma, lam):
    """verl's masked GAE: a reverse loop over time steps, vectorised over the batch. Masked-out tokens keep
    the running advantage and next value unchanged, so they are skipped without breaking the recursion."""
    acc = accumulation_dtype(rewards.dtype)
    rewards, values = rewards.to(acc), values.to(acc)
    batch, steps = rewards.shape
    next_value = rewards.new_zeros(batch)
    last_gae = rewards.new_zeros(batch)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(steps)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        candidate = delta + gamma * lam * last_gae
        keep = mask[:, t]
        next_value = torch.where(keep, values[:, t], next_value)
        last_gae = torch.where(keep, candidate, last_gae)
        advantages[:, t] = torch.where(keep, last_gae, 0.0)
    return advantages, advantages + values


def rms_norm_forward(x, weight, eps):
    """(y, rstd) over the rows of [rows, hidden], computed in the accumulation dtype and y rounded once."""
    acc = accumulation_dtype(x.dtype)
    x_acc = x.to(acc)
    rstd = torch.rsqrt(x_acc.square().mean(-1) + eps)
    return (x_acc * rstd[:, None] * weight.to(acc)).to(x.dtype), rstd


def rms_norm_backward(grad_y, x, weight, rstd):
    acc = rstd.dtype
    normed = x.to(acc) * rstd[:, None]
    grad = grad_y.to(acc)
    scaled = grad * weight.to(acc)
    grad_x = rstd[:, None] * (scaled - normed * (scaled * normed).mean(-1, keepdim=True))
    return grad_x.to(x.dtype), (grad * normed).sum(0).to(weight.dtype)
