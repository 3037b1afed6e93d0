// verl_mega._kernels_cuda: the CUDA launchers (cuda_kernels.h) bound with the signatures of the CPU module,
// on the current stream of the tensors' device.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <tuple>

#include "cuda_kernels.h"
#include "tensor_checks.h"

namespace verl_mega {
namespace {

cuda::DType element_type(const at::Tensor& tensor) {
  switch (tensor.scalar_type()) {
    case at::kFloat:
      return cuda::DType::kFloat32;
    case at::kDouble:
      return cuda::DType::kFloat64;
    case at::kBFloat16:
      return cuda::DType::kBFloat16;
    case at::kHalf:
      return cuda::DType::kFloat16;
    default:
      TORCH_CHECK(false, "unsupported dtype for verl_mega CUDA kernels: ", tensor.scalar_type());
  }
}

void check_launch(cudaError_t status) {
  TORCH_CHECK(status == cudaSuccess, "verl_mega CUDA kernel launch failed: ", cudaGetErrorString(status));
}

void check_on_gpu(const at::Tensor& tensor) {
  TORCH_CHECK(tensor.is_cuda(), "verl_mega._kernels_cuda takes CUDA tensors, got one on ", tensor.device());
}

const void* data_or_null(const std::optional<at::Tensor>& tensor) {
  return tensor.has_value() ? tensor->data_ptr() : nullptr;
}

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream().stream(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>> logprob_partials(
    const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start, bool with_entropy) {
  check_on_gpu(logits);
  check_logits_and_labels(logits, labels);
  const c10::cuda::CUDAGuard device_guard(logits.device());
  const auto options = logits.options().dtype(at::toOpMathType(logits.scalar_type()));
  const auto per_row = [&] { return at::empty({logits.size(0)}, options); };
  at::Tensor row_max = per_row(), sum_exp = per_row(), label_logit = per_row();
  std::optional<at::Tensor> shifted_sum;
  if (with_entropy) shifted_sum = per_row();
  check_launch(cuda::launch_logprob_partials(
      element_type(logits), logits.data_ptr(), labels.data_ptr<int64_t>(), logits.size(0), logits.size(1),
      vocab_start,
      {row_max.data_ptr(), sum_exp.data_ptr(), label_logit.data_ptr(),
       shifted_sum.has_value() ? shifted_sum->data_ptr() : nullptr},
      current_stream()));
  return {row_max, sum_exp, label_logit, shifted_sum};
}

at::Tensor logprob_backward(const at::Tensor& logits, const at::Tensor& labels, int64_t vocab_start,
                            const at::Tensor& log_normalizer, const std::optional<at::Tensor>& grad_logprob,
                            const std::optional<at::Tensor>& mean_logit,
                            const std::optional<at::Tensor>& grad_entropy) {
  check_on_gpu(logits);
  check_logits_and_labels(logits, labels);
  for (const auto& input : {std::optional<at::Tensor>(log_normalizer), grad_logprob, mean_logit, grad_entropy}) {
    check_row_input(input, logits);
  }
  TORCH_CHECK(!grad_entropy.has_value() || mean_logit.has_value(), "an entropy gradient needs mean_logit");
  const c10::cuda::CUDAGuard device_guard(logits.device());
  at::Tensor grad_logits = at::empty_like(logits);
  check_launch(cuda::launch_logprob_backward(
      element_type(logits), logits.data_ptr(), labels.data_ptr<int64_t>(), logits.size(0), logits.size(1),
      vocab_start,
      {log_normalizer.data_ptr(), data_or_null(grad_logprob), data_or_null(mean_logit), data_or_null(grad_entropy)},
      grad_logits.data_ptr(), current_stream()));
  return grad_logits;
}

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                                       double gamma, double lam) {
  check_on_gpu(rewards);
  check_gae_inputs(rewards, values, mask);
  const c10::cuda::CUDAGuard device_guard(rewards.device());
  const auto options = rewards.options().dtype(at::toOpMathType(rewards.scalar_type()));
  at::Tensor advantages = at::empty(rewards.sizes(), options);
  at::Tensor returns = at::empty(rewards.sizes(), options);
  check_launch(cuda::launch_gae(element_type(rewards), rewards.data_ptr(), values.data_ptr(),
                                mask.data_ptr<bool>(), rewards.size(0), rewards.size(1), gamma, lam,
                                advantages.data_ptr(), returns.data_ptr(), current_stream()));
  return {advantages, returns};
}

}  // namespace
}  // namespace verl_mega

PYBIND11_MODULE(_kernels_cuda, m) {
  namespace py = pybind11;
  m.doc() = "CUDA kernels for verl_mega.ops: vocabulary-slice log-prob partials, their backward, masked GAE";
  m.def("logprob_partials", &verl_mega::logprob_partials, py::arg("logits"), py::arg("labels"),
        py::arg("vocab_start"), py::arg("with_entropy"));
  m.def("logprob_backward", &verl_mega::logprob_backward, py::arg("logits"), py::arg("labels"),
        py::arg("vocab_start"), py::arg("log_normalizer"), py::arg("grad_logprob"), py::arg("mean_logit"),
        py::arg("grad_entropy"));
  m.def("gae", &verl_mega::gae, py::arg("rewards"), py::arg("values"), py::arg("mask"), py::arg("gamma"),
        py::arg("lam"));
}
