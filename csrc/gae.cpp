// Masked GAE on the CPU: one reverse scan per sequence, sequences in parallel.
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "cpu_helpers.h"
#include "cpu_kernels.h"
#include "tensor_checks.h"

namespace verl_mega {
namespace {

template <typename scalar_t>
void gae_kernel(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask, double gamma,
                double lam, at::Tensor& advantages, at::Tensor& returns) {
  using acc_t = at::opmath_type<scalar_t>;
  const int64_t batch = rewards.size(0), steps = rewards.size(1);
  const scalar_t* reward_all = rewards.const_data_ptr<scalar_t>();
  const scalar_t* value_all = values.const_data_ptr<scalar_t>();
  const bool* mask_all = mask.const_data_ptr<bool>();
  acc_t* adv_all = advantages.data_ptr<acc_t>();
  acc_t* ret_all = returns.data_ptr<acc_t>();
  const acc_t discount = static_cast<acc_t>(gamma);
  const acc_t trace_decay = static_cast<acc_t>(gamma * lam);

  at::parallel_for(0, batch, rows_per_task(steps), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      acc_t next_value = 0, last_gae = 0;
      for (int64_t i = b * steps + steps - 1; i >= b * steps; --i) {
        const acc_t value = static_cast<acc_t>(value_all[i]);
        // Masked-out tokens (padding, tool output) carry the recursion through untouched.
        if (mask_all[i]) {
          const acc_t delta = static_cast<acc_t>(reward_all[i]) + discount * next_value - value;
          last_gae = delta + trace_decay * last_gae;
          next_value = value;
          adv_all[i] = last_gae;
        } else {
          adv_all[i] = 0;
        }
        ret_all[i] = adv_all[i] + value;
      }
    }
  });
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> gae(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask,
                                       double gamma, double lam) {
  check_gae_inputs(rewards, values, mask);
  const auto options = rewards.options().dtype(at::toOpMathType(rewards.scalar_type()));
  at::Tensor advantages = at::empty(rewards.sizes(), options);
  at::Tensor returns = at::empty(rewards.sizes(), options);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, rewards.scalar_type(), "gae", [&] {
    gae_kernel<scalar_t>(rewards, values, mask, gamma, lam, advantages, returns);
  });
  return {advantages, returns};
}

}  // namespace verl_mega
