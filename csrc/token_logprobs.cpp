// Token log-prob partials and their fused backward on the CPU: row after row on the calling thread
// (docs/kernels.md says why), each row in two passes (max, then sum-exp) while it sits in cache, never
// materialising a [rows, vocab] intermediate.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <limits>

#include "cpu_helpers.h"
#include "cpu_kernels.h"
#include "tensor_checks.h"

namespace verl_mega {
namespace {

// The label's column in this slice, or -1 when another slice holds it.
inline int64_t local_column(int64_t label, int64_t vocab_start, int64_t vocab) {
  const int64_t column = label - vocab_start;
  return (column >= 0 && column < vocab) ? column : -1;
}

// A per-row input as a typed pointer, or nullptr when absent.
template <typename acc_t>
const acc_t* row_input(const std::optional<at::Tensor>& input, const at::Tensor& logits) {
  check_row_input(input, logits);
  return input.has_value() ? input->data_ptr<acc_t>() : nullptr;
}

// Calls step(column, values) over a row: vec_t<acc_t> registers for the body, single acc_t for the tail, so
// that one generic lambda serves both.
template <typename acc_t, typename scalar_t, typename Step>
void for_each_column(const scalar_t* x, int64_t vocab, Step&& step) {
  constexpr int64_t lanes = kLanes<acc_t>;
  const int64_t body = vocab / lanes * lanes;
  for (int64_t j = 0; j < body; j += lanes) step(j, load<acc_t>(x + j));
  for (int64_t j = body; j < vocab; ++j) step(j, static_cast<acc_t>(x[j]));
}

template <typename scalar_t>
void partials_kernel(const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, at::Tensor& row_max,
                     at::Tensor& sum_exp, at::Tensor& label_logit, at::Tensor* shifted_sum) {
  using acc_t = at::opmath_type<scalar_t>;
  using vec = vec_t<acc_t>;
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const scalar_t* x_all = logits.const_data_ptr<scalar_t>();
  const int64_t* label_all = labels.const_data_ptr<int64_t>();
  acc_t* max_out = row_max.data_ptr<acc_t>();
  acc_t* sum_out = sum_exp.data_ptr<acc_t>();
  acc_t* label_out = label_logit.data_ptr<acc_t>();
  acc_t* shifted_out = shifted_sum ? shifted_sum->data_ptr<acc_t>() : nullptr;

  for (int64_t row = 0; row < rows; ++row) {
    const scalar_t* x = x_all + row * vocab;
    vec max_v = splat<vec>(-std::numeric_limits<acc_t>::infinity());
    acc_t max_s = -std::numeric_limits<acc_t>::infinity();
    for_each_column<acc_t>(x, vocab, [&](int64_t, auto v) {
      if constexpr (std::is_same_v<decltype(v), vec>) max_v = max_of(max_v, v);
      else max_s = max_of(max_s, v);
    });
    const acc_t m = max_of(lane_max<acc_t>(max_v), max_s);

    // Two accumulator pairs (vector body, scalar tail); the entropy sum costs one multiply-add more.
    vec sum_v = splat<vec>(0), shifted_v = splat<vec>(0);
    acc_t sum_s = 0, shifted_s = 0;
    for_each_column<acc_t>(x, vocab, [&](int64_t, auto v) {
      const auto d = floor_exponent(v - m);
      const auto e = exp_floored(d);
      if constexpr (std::is_same_v<decltype(v), vec>) {
        sum_v += e;
        if (shifted_out) shifted_v += e * d;
      } else {
        sum_s += e;
        if (shifted_out) shifted_s += e * d;
      }
    });
    max_out[row] = m;
    sum_out[row] = lane_sum<acc_t>(sum_v) + sum_s;
    if (shifted_out) shifted_out[row] = lane_sum<acc_t>(shifted_v) + shifted_s;
    const int64_t column = local_column(label_all[row], vocab_start, vocab);
    label_out[row] = column >= 0 ? static_cast<acc_t>(x[column]) : acc_t(0);
  }
}

template <typename scalar_t>
void backward_kernel(const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start,
                     const at::Tensor& log_normalizer, const std::optional<at::Tensor>& grad_logprob,
                     const std::optional<at::Tensor>& mean_logit, const std::optional<at::Tensor>& grad_entropy,
                     at::Tensor& grad_logits) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  const scalar_t* x_all = logits.const_data_ptr<scalar_t>();
  const int64_t* label_all = labels.const_data_ptr<int64_t>();
  const acc_t* log_z = row_input<acc_t>(log_normalizer, logits);
  const acc_t* grad_lp = row_input<acc_t>(grad_logprob, logits);
  const acc_t* mean = row_input<acc_t>(mean_logit, logits);
  const acc_t* grad_ent = row_input<acc_t>(grad_entropy, logits);
  TORCH_CHECK(grad_ent == nullptr || mean != nullptr, "an entropy gradient needs mean_logit");
  scalar_t* out_all = grad_logits.data_ptr<scalar_t>();

  for (int64_t row = 0; row < rows; ++row) {
    const scalar_t* x = x_all + row * vocab;
    scalar_t* out = out_all + row * vocab;
    const acc_t lz = log_z[row];
    const acc_t g = grad_lp ? grad_lp[row] : acc_t(0);
    const acc_t h = grad_ent ? grad_ent[row] : acc_t(0);
    const acc_t mean_x = grad_ent ? mean[row] : acc_t(0);
    // -p_j (g + h (x_j - E[x])), with x_j floored where p_j vanishes so that -inf logits give 0, not NaN.
    auto softmax_part = [&](auto v) {
      const auto d = floor_exponent(v - lz);
      return -exp_floored(d) * (g + h * (d + (lz - mean_x)));
    };
    for_each_column<acc_t>(x, vocab, [&](int64_t j, auto v) {
      if constexpr (std::is_same_v<decltype(v), acc_t>) out[j] = static_cast<scalar_t>(softmax_part(v));
      else store<acc_t>(out + j, softmax_part(v));
    });
    // Recomputed in acc_t rather than added to the rounded value, which matters for bfloat16.
    const int64_t column = local_column(label_all[row], vocab_start, vocab);
    if (column >= 0) out[column] = static_cast<scalar_t>(softmax_part(static_cast<acc_t>(x[column])) + g);
  }
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> logprob_partials(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, bool with_entropy) {
  check_logits_and_labels(logits, labels);
  const auto acc_dtype = at::toOpMathType(logits.scalar_type());
  const auto per_row = [&] { return at::empty({logits.size(0)}, logits.options().dtype(acc_dtype)); };
  at::Tensor row_max = per_row(), sum_exp = per_row(), label_logit = per_row();
  std::optional<at::Tensor> shifted_sum;
  if (with_entropy) shifted_sum = per_row();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprob_partials", [&] {
    partials_kernel<scalar_t>(logits, labels, vocab_start, row_max, sum_exp, label_logit,
                              shifted_sum ? &*shifted_sum : nullptr);
  });
  return {row_max, sum_exp, label_logit, shifted_sum};
}

at::Tensor logprob_backward(const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start,
                            const at::Tensor& log_normalizer, const std::optional<at::Tensor>& grad_logprob,
                            const std::optional<at::Tensor>& mean_logit,
                            const std::optional<at::Tensor>& grad_entropy) {
  check_logits_and_labels(logits, labels);
  at::Tensor grad_logits = at::empty_like(logits);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, logits.scalar_type(), "logprob_backward", [&] {
    backward_kernel<scalar_t>(logits, labels, vocab_start, log_normalizer, grad_logprob, mean_logit, grad_entropy,
                              grad_logits);
  });
  return grad_logits;
}

}  // namespace verl_mega
