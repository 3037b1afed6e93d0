"""Per-token log-probabilities (and entropy) from logits, with the vocabulary optionally split over a
tensor-parallel group, without materialising a [tokens, vocab] log-softmax.

Each rank reduces its vocabulary slice to per-token partials (csrc/cpu_kernels.h): the slice max m, the
sum-exp s relative to it, the label's logit where the slice holds it (0 elsewhere) and, for the entropy,
t = sum exp(x - m) (x - m). Rescaled to the global max M they add up over ranks, so
    log Z = M + log S,   log p(label) = x_label - log Z,   E[x] = M + T / S,   entropy = log S - T / S.
The backward needs only log Z and E[x] per token, so it runs slice-local with no communication.
"""
import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from ._backend import kernels_for
from ._checks import require_floating, require_integer, require_same_device


def token_logprobs(logits, labels, *, tp_group=None, return_entropy=False):
    """log p(labels) under softmax(logits), and optionally the entropy of that softmax.

    logits: [..., vocab] float32/bfloat16/float16/float64, the local slice of the vocabulary when `tp_group`
        is given (slices in rank order; they may differ in size).
    labels: [...] integer token ids in the full vocabulary.
    Returns float32 tensors shaped like `labels` (float64 for float64 logits): the log-probs, or
    (log-probs, entropy) with `return_entropy`. Differentiable with respect to `logits`.
    """
    require_floating("logits", logits)
    require_integer("labels", labels)
    if logits.dim() == 0 or logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"logits must be shaped [*labels.shape, vocab]: got logits {tuple(logits.shape)}, "
            f"labels {tuple(labels.shape)}"
        )
    vocab = logits.shape[-1]
    if vocab == 0:
        raise ValueError("logits has an empty vocabulary dimension")
    require_same_device(logits=logits, labels=labels)

    vocab_start, vocab_total = _vocabulary_slice(vocab, tp_group, logits.device)
    _require_labels_in_vocabulary(labels, vocab_total)
    outputs = _TokenLogprobs.apply(
        logits.reshape(-1, vocab).contiguous(),
        labels.reshape(-1).long().contiguous(),
        vocab_start,
        tp_group,
        return_entropy,
    )
    if return_entropy:
        return tuple(output.view(labels.shape) for output in outputs)
    return outputs.view(labels.shape)


def _vocabulary_slice(local_vocab: int, tp_group, device: torch.device) -> tuple[int, int]:
    """(first token id of this rank's slice, size of the full vocabulary)."""
    if tp_group is None:
        return 0, local_vocab
    rank, world = dist.get_rank(tp_group), dist.get_world_size(tp_group)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    sizes[rank] = local_vocab
    dist.all_reduce(sizes, group=tp_group)
    sizes = sizes.tolist()
    return sum(sizes[:rank]), sum(sizes)


def _require_labels_in_vocabulary(labels: torch.Tensor, vocab_total: int) -> None:
    if labels.numel() == 0:
        return
    low, high = torch.stack(torch.aminmax(labels)).tolist()
    if low < 0 or high >= vocab_total:
        raise ValueError(f"labels must lie in [0, {vocab_total}) (the vocabulary), got values in [{low}, {high}]")


def _combine_over_slices(row_max, sum_exp, label_logit, shifted_sum, tp_group):
    """Global partials from every rank's: two all-reduces, the max and then the rescaled sums."""
    global_max = row_max.clone()
    dist.all_reduce(global_max, op=dist.ReduceOp.MAX, group=tp_group)
    shift = row_max - global_max
    scale = shift.exp()
    parts = [sum_exp * scale, label_logit]
    if shifted_sum is not None:
        parts.append((shifted_sum + shift * sum_exp) * scale)
    summed = torch.stack(parts)
    dist.all_reduce(summed, group=tp_group)
    return global_max, summed[0], summed[1], (summed[2] if shifted_sum is not None else None)


def _per_row(grad, dtype):
    return None if grad is None else grad.to(dtype).contiguous()


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, vocab_start, tp_group, return_entropy):
        partials = kernels_for(logits.device).logprob_partials(logits, labels, vocab_start, return_entropy)
        if tp_group is not None:
            partials = _combine_over_slices(*partials, tp_group)
        row_max, sum_exp, label_logit, shifted_sum = partials
        log_sum_exp = sum_exp.log()
        log_normalizer = row_max + log_sum_exp
        logprob = label_logit - log_normalizer

        ctx.set_materialize_grads(False)
        ctx.vocab_start = vocab_start
        if not return_entropy:
            ctx.save_for_backward(logits, labels, log_normalizer, None)
            return logprob
        mean_shift = shifted_sum / sum_exp
        ctx.save_for_backward(logits, labels, log_normalizer, row_max + mean_shift)
        return logprob, log_sum_exp - mean_shift

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logprob, grad_entropy=None):
        if grad_logprob is None and grad_entropy is None:
            return None, None, None, None, None
        logits, labels, log_normalizer, mean_logit = ctx.saved_tensors
        grad_logits = kernels_for(logits.device).logprob_backward(
            logits,
            labels,
            ctx.vocab_start,
            log_normalizer,
            _per_row(grad_logprob, log_normalizer.dtype),
            mean_logit if grad_entropy is not None else None,
            _per_row(grad_entropy, log_normalizer.dtype),
        )
        return grad_logits, None, None, None, None
