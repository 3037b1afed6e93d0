// Device helpers shared by the .cu kernels: element types, conversions, dtype dispatch. Torch-free.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "cuda_kernels.h"

namespace verl_mega::cuda {

// The type values are computed in: double for double, float for everything else.
template <typename T>
struct Accumulate {
  using type = float;
};
template <>
struct Accumulate<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Accumulate<T>::type;

__device__ __forceinline__ float to_acc(float x) { return x; }
__device__ __forceinline__ double to_acc(double x) { return x; }
__device__ __forceinline__ float to_acc(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_acc(__half x) { return __half2float(x); }

template <typename T>
__device__ __forceinline__ T from_acc(acc_t<T> x) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16(x);
  } else if constexpr (std::is_same_v<T, __half>) {
    return __float2half(x);
  } else {
    return x;
  }
}

template <typename T>
struct TypeTag {
  using type = T;
};

// Calls launch(TypeTag<T>{}) with T the element type `dtype` names.
template <typename Launch>
cudaError_t dispatch(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kFloat32:
      return launch(TypeTag<float>{});
    case DType::kFloat64:
      return launch(TypeTag<double>{});
    case DType::kBFloat16:
      return launch(TypeTag<__nv_bfloat16>{});
    case DType::kFloat16:
      return launch(TypeTag<__half>{});
  }
  return cudaErrorInvalidValue;
}

}  // namespace verl_mega::cuda
