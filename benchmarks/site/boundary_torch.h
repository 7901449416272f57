// The tensor checks of the prototype's two translation units (boundary_dots.cu, boundary_grad.cu).
#pragma once

#include <torch/extension.h>

namespace boundary_proto {

inline void check(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

}  // namespace boundary_proto
