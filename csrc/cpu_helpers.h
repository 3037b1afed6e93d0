// Helpers shared by the CPU kernels: explicit SIMD for float rows.
//
// GCC's auto-vectoriser gives up on the softmax loops (it turns the exponent floor into a branch), so the
// float path uses GCC/Clang vector extensions: explicit float vectors that lower to SSE, AVX or NEON,
// whatever the build targets. float64 (the gradcheck path) stays scalar and exact.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

namespace verl_mega {

// One register: vectors wider than the target's registers go through memory and run slower than scalars.
#if defined(__AVX__)
constexpr int kVectorBytes = 32;
#else
constexpr int kVectorBytes = 16;
#endif
using floatv = float __attribute__((vector_size(kVectorBytes)));
using int32v = int32_t __attribute__((vector_size(kVectorBytes)));

// The register type a row of acc_t is processed in, and how many acc_t it holds.
template <typename acc_t>
using vec_t = std::conditional_t<std::is_same_v<acc_t, float>, floatv, acc_t>;
template <typename acc_t>
constexpr int64_t kLanes = sizeof(vec_t<acc_t>) / sizeof(acc_t);

template <typename V>
inline V splat(double value) {
  return V{} + static_cast<std::conditional_t<std::is_same_v<V, floatv>, float, V>>(value);
}

template <typename acc_t, typename scalar_t>
inline vec_t<acc_t> load(const scalar_t* p) {
  vec_t<acc_t> v;
  if constexpr (kLanes<acc_t> == 1) {
    v = static_cast<acc_t>(*p);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(&v, p, sizeof(v));
  } else {
    for (int64_t i = 0; i < kLanes<acc_t>; ++i) v[i] = static_cast<float>(p[i]);
  }
  return v;
}

template <typename acc_t, typename scalar_t>
inline void store(scalar_t* p, vec_t<acc_t> v) {
  if constexpr (kLanes<acc_t> == 1) {
    *p = static_cast<scalar_t>(v);
  } else if constexpr (std::is_same_v<scalar_t, float>) {
    std::memcpy(p, &v, sizeof(v));
  } else {
    for (int64_t i = 0; i < kLanes<acc_t>; ++i) p[i] = static_cast<scalar_t>(v[i]);
  }
}

template <typename acc_t>
inline acc_t lane_sum(vec_t<acc_t> v) {
  if constexpr (kLanes<acc_t> == 1) {
    return v;
  } else {
    acc_t total = 0;
    for (int64_t i = 0; i < kLanes<acc_t>; ++i) total += v[i];
    return total;
  }
}

// A plain select rather than std::max so that it applies lane-wise to vectors too.
template <typename V>
inline V max_of(V a, V b) {
  return a > b ? a : b;
}

template <typename acc_t>
inline acc_t lane_max(vec_t<acc_t> v) {
  if constexpr (kLanes<acc_t> == 1) {
    return v;
  } else {
    acc_t best = v[0];
    for (int64_t i = 1; i < kLanes<acc_t>; ++i) best = max_of(best, v[i]);
    return best;
  }
}

// exp() of anything below this is < 2e-38: nothing next to the largest term of a row (exp(0) = 1).
// Flooring exponent arguments here keeps -inf logits (masked vocabulary entries) from producing 0 * -inf.
constexpr double kMinExponent = -87.0;

template <typename V>
inline V floor_exponent(V x) {
  return max_of(x, splat<V>(kMinExponent));
}

// 2^n for integral n in [-126, 127], built from the exponent bits.
inline float two_to_the(float n) {
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

inline floatv two_to_the(floatv n) {
  const int32v bits = (__builtin_convertvector(n, int32v) + 127) << 23;
  floatv result;
  std::memcpy(&result, &bits, sizeof(result));
  return result;
}

// exp for float arguments in [kMinExponent, ~0]: Cephes' expf, 2^n times a degree-6 polynomial on
// |r| <= ln2/2 (~1 ulp), the same code for one float and for a vector.
template <typename V>
inline V exp_floored(V x) {
  if constexpr (std::is_same_v<V, double>) {
    return std::exp(x);
  } else {
    // Adding then subtracting 1.5 * 2^23 rounds to the nearest integer.
    const V n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    const V r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    V p = splat<V>(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    return (p * r * r + r + 1.0f) * two_to_the(n);
  }
}

}  // namespace verl_mega
