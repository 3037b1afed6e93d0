// RMSNorm over the last dimension of [rows, hidden] on the CPU, forward and backward. torch fuses both on CUDA,
// but on the CPU its backward is autograd's decomposition, one pass over the rows per operation.
// Rows run one after another on the calling thread (docs/kernels.md says why). The weight gradient is a sum over
// rows, taken per block of rows and the blocks' sums added in block order: the order the kernel has always used.
#include <ATen/Dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <algorithm>

#include "cpu_helpers.h"
#include "cpu_kernels.h"

namespace verl_mega {
namespace {

// Elements per block of the weight gradient's sum (whole rows, at least one): fixes its summation order.
constexpr int64_t kElementsPerBlock = 1 << 16;

int64_t rows_per_block(int64_t hidden) {
  return std::max<int64_t>(1, kElementsPerBlock / std::max<int64_t>(hidden, 1));
}

// Each row is read in vectors of kLanes<acc_t> (whole vectors, then the tail one by one).
template <typename scalar_t, typename acc_t>
void forward_rows(const scalar_t* x, const scalar_t* weight, acc_t eps, int64_t hidden, int64_t begin, int64_t end,
                  scalar_t* y, acc_t* rstd) {
  using V = vec_t<acc_t>;
  constexpr int64_t lanes = kLanes<acc_t>;
  const int64_t whole = hidden - hidden % lanes;
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* xr = x + row * hidden;
    V squares = splat<V>(0);
    for (int64_t j = 0; j < whole; j += lanes) {
      const V v = load<acc_t>(xr + j);
      squares += v * v;
    }
    acc_t sum_squares = lane_sum<acc_t>(squares);
    for (int64_t j = whole; j < hidden; ++j) sum_squares += static_cast<acc_t>(xr[j]) * static_cast<acc_t>(xr[j]);
    const acc_t r = acc_t(1) / std::sqrt(sum_squares / static_cast<acc_t>(hidden) + eps);
    rstd[row] = r;
    scalar_t* yr = y + row * hidden;
    for (int64_t j = 0; j < whole; j += lanes) store<acc_t>(yr + j, load<acc_t>(xr + j) * r * load<acc_t>(weight + j));
    for (int64_t j = whole; j < hidden; ++j) {
      yr[j] = static_cast<scalar_t>(static_cast<acc_t>(xr[j]) * r * static_cast<acc_t>(weight[j]));
    }
  }
}

// d/dx_j = r (g_j w_j - x^_j mean_k(g_k w_k x^_k)),  x^ = r x;   d/dw_j = sum over rows of g_j x^_j
template <typename scalar_t, typename acc_t>
void backward_rows(const scalar_t* grad_y, const scalar_t* x, const scalar_t* weight, const acc_t* rstd,
                   int64_t hidden, int64_t begin, int64_t end, scalar_t* grad_x, acc_t* grad_weight_partial) {
  using V = vec_t<acc_t>;
  constexpr int64_t lanes = kLanes<acc_t>;
  const int64_t whole = hidden - hidden % lanes;
  for (int64_t row = begin; row < end; ++row) {
    const scalar_t* gr = grad_y + row * hidden;
    const scalar_t* xr = x + row * hidden;
    const acc_t r = rstd[row];
    V dots = splat<V>(0);
    for (int64_t j = 0; j < whole; j += lanes) {
      const V normed = load<acc_t>(xr + j) * r, g = load<acc_t>(gr + j);
      dots += g * load<acc_t>(weight + j) * normed;
      store<acc_t>(grad_weight_partial + j, load<acc_t>(grad_weight_partial + j) + g * normed);
    }
    acc_t dot = lane_sum<acc_t>(dots);
    for (int64_t j = whole; j < hidden; ++j) {
      const acc_t normed = static_cast<acc_t>(xr[j]) * r, g = static_cast<acc_t>(gr[j]);
      dot += g * static_cast<acc_t>(weight[j]) * normed;
      grad_weight_partial[j] += g * normed;
    }
    const acc_t mean_dot = dot / static_cast<acc_t>(hidden);
    scalar_t* dxr = grad_x + row * hidden;
    for (int64_t j = 0; j < whole; j += lanes) {
      const V normed = load<acc_t>(xr + j) * r;
      store<acc_t>(dxr + j, r * (load<acc_t>(gr + j) * load<acc_t>(weight + j) - normed * mean_dot));
    }
    for (int64_t j = whole; j < hidden; ++j) {
      const acc_t normed = static_cast<acc_t>(xr[j]) * r;
      dxr[j] = static_cast<scalar_t>(r * (static_cast<acc_t>(gr[j]) * static_cast<acc_t>(weight[j]) - normed * mean_dot));
    }
  }
}

at::ScalarType accumulation_type(at::ScalarType type) {
  return type == at::kDouble ? at::kDouble : at::kFloat;
}

void check_rows(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [rows, hidden] tensor");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous() &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a contiguous [hidden] tensor of x's dtype");
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_rows(x, weight);
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor y = at::empty_like(x);
  at::Tensor rstd = at::empty({rows}, x.options().dtype(accumulation_type(x.scalar_type())));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_forward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    forward_rows<scalar_t, acc_t>(x.const_data_ptr<scalar_t>(), weight.const_data_ptr<scalar_t>(),
                                  static_cast<acc_t>(eps), hidden, 0, rows, y.mutable_data_ptr<scalar_t>(),
                                  rstd.mutable_data_ptr<acc_t>());
  });
  return {y, rstd};
}

std::tuple<at::Tensor, at::Tensor> rms_norm_backward(const at::Tensor& grad_y, const at::Tensor& x,
                                                     const at::Tensor& weight, const at::Tensor& rstd) {
  check_rows(x, weight);
  TORCH_CHECK(grad_y.sizes() == x.sizes() && grad_y.is_contiguous() && grad_y.scalar_type() == x.scalar_type(),
              "grad_y must be contiguous and shaped and typed like x");
  TORCH_CHECK(rstd.dim() == 1 && rstd.size(0) == x.size(0) && rstd.scalar_type() == accumulation_type(x.scalar_type()),
              "rstd must be the forward's");
  const int64_t rows = x.size(0), hidden = x.size(1);
  const int64_t per_block = rows_per_block(hidden), blocks = (rows + per_block - 1) / per_block;
  at::Tensor grad_x = at::empty_like(x);
  at::Tensor partials = at::zeros({std::max<int64_t>(blocks, 1), hidden}, rstd.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm_backward", [&] {
    using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
    for (int64_t block = 0; block < blocks; ++block) {
      const int64_t begin = block * per_block, end = std::min(rows, begin + per_block);
      backward_rows<scalar_t, acc_t>(grad_y.const_data_ptr<scalar_t>(), x.const_data_ptr<scalar_t>(),
                                     weight.const_data_ptr<scalar_t>(), rstd.const_data_ptr<acc_t>(), hidden, begin,
                                     end, grad_x.mutable_data_ptr<scalar_t>(),
                                     partials.mutable_data_ptr<acc_t>() + block * hidden);
    }
  });
  return {grad_x, partials.sum(0).to(weight.scalar_type())};
}

}  // namespace verl_mega
