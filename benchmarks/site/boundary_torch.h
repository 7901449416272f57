// The tensor checks and the dots kernels' launch, shared by the prototype's translation units (boundary_dots.cu,
// boundary_pipe.cu, boundary_grad.cu).
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <torch/extension.h>

namespace boundary_proto {

inline void check(const torch::Tensor& t, const char* name, at::ScalarType dtype) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(t.scalar_type() == dtype, name, " has dtype ", t.scalar_type(), ", expected ", dtype);
}

// The arguments of dots() and dots_pipe(): x [T, 4, C] bf16, phi2 [2, 24, 4C] bf16, part [splits, T, 32] fp32,
// and with the post-mix y [T, C] bf16, h [T, 8] fp32, hres [T, 4, 4] fp32, out [T, 4, C] bf16.
inline void check_dots_args(const torch::Tensor& x, const torch::Tensor& y, const torch::Tensor& h,
                            const torch::Tensor& hres, const torch::Tensor& out, const torch::Tensor& phi2,
                            const torch::Tensor& part, int64_t splits, bool postmix) {
  check(x, "x", at::kBFloat16);
  check(phi2, "phi2", at::kBFloat16);
  check(part, "part", at::kFloat);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 4, "x must be [T, 4, C]");
  const int64_t T = x.size(0), C = x.size(2);
  TORCH_CHECK(phi2.dim() == 3 && phi2.size(0) == 2 && phi2.size(1) == 24 && phi2.size(2) == 4 * C,
              "phi2 must be [2, 24, 4C]");
  TORCH_CHECK(part.dim() == 3 && part.size(0) == splits && part.size(1) == T && part.size(2) == 32,
              "part must be [splits, T, 32]");
  if (postmix) {
    check(y, "y", at::kBFloat16);
    check(h, "h", at::kFloat);
    check(hres, "hres", at::kFloat);
    check(out, "out", at::kBFloat16);
    TORCH_CHECK(y.numel() == T * C && h.numel() == T * 8 && hres.numel() == T * 16 && out.sizes() == x.sizes(),
                "y [T, C], h [T, 8], hres [T, 4, 4] and out [T, 4, C] must match x");
  }
}

// One launch of a dots kernel (boundary_dots_kernel or dots_pipe_kernel, which take the same arguments) on the
// current stream, with `smem` bytes of dynamic shared memory.
template <typename Kernel>
void launch_dots(Kernel kernel, dim3 grid, int warps, int smem, const torch::Tensor& x, const torch::Tensor& y,
                 const torch::Tensor& h, const torch::Tensor& hres, const torch::Tensor& out,
                 const torch::Tensor& phi2, const torch::Tensor& part, bool postmix, int cols_per_split) {
  if (smem > 48 * 1024) {
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  }
  kernel<<<grid, dim3(warps * 32), smem, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
      postmix ? reinterpret_cast<const __nv_bfloat16*>(y.data_ptr()) : nullptr,
      postmix ? h.data_ptr<float>() : nullptr, postmix ? hres.data_ptr<float>() : nullptr,
      postmix ? reinterpret_cast<__nv_bfloat16*>(out.data_ptr()) : nullptr,
      reinterpret_cast<const __nv_bfloat16*>(phi2.data_ptr()), part.data_ptr<float>(), static_cast<int>(x.size(0)),
      static_cast<int>(x.size(2)), cols_per_split);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace boundary_proto
