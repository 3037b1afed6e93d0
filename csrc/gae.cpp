// Masked GAE on the CPU. The recursion is sequential in time, so the SIMD lanes run different sequences:
// a group of kLanes sequences is scanned backwards together, group after group, leftovers one at a time, all on
// the calling thread (docs/kernels.md says why).
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/ops/empty.h>

#include <algorithm>

#include "cpu_helpers.h"
#include "cpu_kernels.h"
#include "tensor_checks.h"

namespace verl_mega {
namespace {

// Steps per tile: one 64-byte cache line of float32 per sequence.
constexpr int64_t kTileSteps = 16;

// The per-lane condition type of a select between two V.
template <typename V>
using mask_of = std::conditional_t<std::is_arithmetic_v<V>, bool, int32v>;

template <typename V>
inline V load_lanes(const void* p) {
  V v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Scans sequences first, first + 1, ... (one per lane of V) from the last step to the first. Sequences are
// rows of [batch, steps], so each tile of kTileSteps steps is transposed into step-major buffers (row-wise,
// contiguous copies), scanned with one vector step per time step, and transposed back.
template <typename V, typename scalar_t, typename acc_t>
void scan_sequences(const scalar_t* rewards, const scalar_t* values, const bool* mask, int64_t first, int64_t steps,
                    acc_t discount, acc_t trace_decay, acc_t* advantages, acc_t* returns) {
  constexpr int64_t lanes = sizeof(V) / sizeof(acc_t);
  using keep_t = mask_of<V>;
  using keep_lane_t = std::conditional_t<lanes == 1, bool, int32_t>;
  acc_t reward_tile[kTileSteps][lanes], value_tile[kTileSteps][lanes];
  acc_t advantage_tile[kTileSteps][lanes], return_tile[kTileSteps][lanes];
  keep_lane_t keep_tile[kTileSteps][lanes];

  const V zero = splat<V>(0);
  V next_value = zero, last_gae = zero;
  for (int64_t tile_end = steps; tile_end > 0; tile_end -= kTileSteps) {
    const int64_t tile_begin = std::max<int64_t>(0, tile_end - kTileSteps), count = tile_end - tile_begin;
    const int64_t base = first * steps + tile_begin;
    // Loop orders as measured fastest: gather step by step, scatter sequence by sequence.
    for (int64_t s = 0; s < count; ++s) {
      for (int64_t lane = 0; lane < lanes; ++lane) {
        reward_tile[s][lane] = static_cast<acc_t>(rewards[base + lane * steps + s]);
        value_tile[s][lane] = static_cast<acc_t>(values[base + lane * steps + s]);
        keep_tile[s][lane] = mask[base + lane * steps + s] ? keep_lane_t(-1) : keep_lane_t(0);
      }
    }
    for (int64_t s = count - 1; s >= 0; --s) {
      const V reward = load_lanes<V>(reward_tile[s]), value = load_lanes<V>(value_tile[s]);
      const keep_t keep = load_lanes<keep_t>(keep_tile[s]);
      // Masked-out tokens (padding, tool output) carry next_value and last_gae through untouched.
      const V delta = reward + discount * next_value - value;
      last_gae = keep ? delta + trace_decay * last_gae : last_gae;
      next_value = keep ? value : next_value;
      const V advantage = keep ? last_gae : zero;
      const V ret = advantage + value;
      std::memcpy(advantage_tile[s], &advantage, sizeof(V));
      std::memcpy(return_tile[s], &ret, sizeof(V));
    }
    for (int64_t lane = 0; lane < lanes; ++lane) {
      for (int64_t s = 0; s < count; ++s) {
        advantages[base + lane * steps + s] = advantage_tile[s][lane];
        returns[base + lane * steps + s] = return_tile[s][lane];
      }
    }
  }
}

template <typename scalar_t>
void gae_kernel(const at::Tensor& rewards, const at::Tensor& values, const at::Tensor& mask, double gamma,
                double lam, at::Tensor& advantages, at::Tensor& returns) {
  using acc_t = at::opmath_type<scalar_t>;
  constexpr int64_t lanes = kLanes<acc_t>;
  const int64_t batch = rewards.size(0), steps = rewards.size(1);
  const auto scan = [&](auto lane_type, int64_t first) {
    scan_sequences<decltype(lane_type)>(rewards.const_data_ptr<scalar_t>(), values.const_data_ptr<scalar_t>(),
                                        mask.const_data_ptr<bool>(), first, steps, static_cast<acc_t>(gamma),
                                        static_cast<acc_t>(gamma * lam), advantages.data_ptr<acc_t>(),
                                        returns.data_ptr<acc_t>());
  };
  const int64_t groups = (batch + lanes - 1) / lanes;
  for (int64_t group = 0; group < groups; ++group) {
    const int64_t first = group * lanes;
    if (first + lanes <= batch) {
      scan(vec_t<acc_t>{}, first);
    } else {
      for (int64_t sequence = first; sequence < batch; ++sequence) scan(acc_t{}, sequence);
    }
  }
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
