// The contract between verl_mega.ops and the compiled kernels (CPU and CUDA bindings alike). Python validates
// user input and prepares tensors; these checks only catch a caller that breaks the contract.
#pragma once

#include <ATen/OpMathType.h>
#include <ATen/core/Tensor.h>

#include <optional>

namespace verl_mega {

inline void check_logits_and_labels(const at::Tensor& logits, const at::Tensor& labels) {
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits must be a contiguous [rows, vocab] tensor");
  TORCH_CHECK(labels.dim() == 1 && labels.is_contiguous() && labels.scalar_type() == at::kLong &&
                  labels.size(0) == logits.size(0) && labels.device() == logits.device(),
              "labels must be a contiguous int64 [rows] tensor on the device of logits");
}

// A per-row input of the backward (log Z, a gradient, E[x]): absent, or [rows] in the accumulation dtype.
inline void check_row_input(const std::optional<at::Tensor>& input, const at::Tensor& logits) {
  if (!input.has_value()) return;
  TORCH_CHECK(input->is_contiguous() && input->numel() == logits.size(0) &&
                  input->scalar_type() == at::toOpMathType(logits.scalar_type()) &&
                  input->device() == logits.device(),
              "per-row inputs must be contiguous [rows] tensors in the accumulation dtype, on the device of logits");
}

inline void check_gae_inputs(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask) {
  TORCH_CHECK(rewards.dim() == 2 && rewards.is_contiguous() && values.is_contiguous() && mask.is_contiguous() &&
                  values.sizes() == rewards.sizes() && mask.sizes() == rewards.sizes() &&
                  values.scalar_type() == rewards.scalar_type() && mask.scalar_type() == at::kBool &&
                  values.device() == rewards.device() && mask.device() == rewards.device(),
              "gae expects contiguous [batch, time] rewards and values of one dtype and a bool mask, on one device");
}

}  // namespace verl_mega
