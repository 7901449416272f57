// The backward boundary of boundary_dots.cuh (a measurement prototype), in a translation unit of its own so that
// the build compiles it beside boundary_dots.cu.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <algorithm>
#include <utility>

#include "boundary_dots.cuh"
#include "boundary_torch.h"

// The backward boundary (grad_boundary_kernel): dx and site k's dy written, sums [splits, T, 20] = each
// split's ⟨dx_j, x_k[m]⟩ (j·4 + m) and ⟨dx_j, y_k⟩ (16 + j).
void grad(torch::Tensor dout, torch::Tensor du, torch::Tensor x, torch::Tensor work, torch::Tensor phi,
          torch::Tensor h, torch::Tensor hres, torch::Tensor dx, torch::Tensor x_k, torch::Tensor y_k,
          torch::Tensor h_k, torch::Tensor dy, torch::Tensor sums, int64_t cols_per_split, int64_t grid_y,
          int64_t warps, bool coef_smem) {
  using namespace boundary_proto;
  for (auto [t, name] : {std::pair{&dout, "dout"}, {&x, "x"}, {&dx, "dx"}, {&x_k, "x_k"}, {&du, "du"},
                         {&y_k, "y_k"}, {&dy, "dy"}})
    check(*t, name, at::kBFloat16);
  for (auto [t, name] : {std::pair{&work, "work"}, {&phi, "phi"}, {&h, "h"}, {&hres, "hres"}, {&h_k, "h_k"},
                         {&sums, "sums"}})
    check(*t, name, at::kFloat);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == kStreams, "x must be [T, 4, C]");
  const int64_t T = x.size(0), C = x.size(2);
  TORCH_CHECK(C % 16 == 0 && cols_per_split % 16 == 0 && cols_per_split > 0,
              "C and cols_per_split must be multiples of 16");
  const int64_t splits = (C + cols_per_split - 1) / cols_per_split;
  TORCH_CHECK(dout.sizes() == x.sizes() && dx.sizes() == x.sizes() && x_k.sizes() == x.sizes(),
              "dout, dx and x_k must be [T, 4, C] as x");
  TORCH_CHECK(du.numel() == T * C && y_k.numel() == T * C && dy.numel() == T * C, "du, y_k and dy must be [T, C]");
  TORCH_CHECK(work.numel() == T * (2 * kZ + 4) && phi.numel() == kZ * kStreams * C && h.numel() == T * 8 &&
                  h_k.numel() == T * 8 && hres.numel() == T * 16,
              "work [T, 52], phi [24, 4C], h and h_k [T, 8], hres [T, 4, 4]");
  TORCH_CHECK(sums.dim() == 3 && sums.size(0) == splits && sums.size(1) == T && sums.size(2) == kSums,
              "sums must be [splits, T, 20]");
  TORCH_CHECK(warps == 4 || warps == 8, "warps must be 4 or 8");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int smem = grad_shared_bytes(static_cast<int>(cols_per_split), static_cast<int>(warps), coef_smem);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(std::max<int64_t>(1, grid_y)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel, int kernel_warps) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    auto bf = [](torch::Tensor& v) { return reinterpret_cast<__nv_bfloat16*>(v.data_ptr()); };
    kernel<<<grid, dim3(kernel_warps * 32), smem, stream>>>(
        bf(dout), bf(du), bf(x), work.data_ptr<float>(), phi.data_ptr<float>(), h.data_ptr<float>(),
        hres.data_ptr<float>(), bf(dx), bf(x_k), bf(y_k), h_k.data_ptr<float>(), bf(dy), sums.data_ptr<float>(),
        static_cast<int>(T), static_cast<int>(C), static_cast<int>(cols_per_split));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  const int key = (coef_smem ? 2 : 0) + (warps == 8 ? 1 : 0);
  switch (key) {
    case 0: launch(grad_boundary_kernel<4, false>, 4); break;
    case 1: launch(grad_boundary_kernel<8, false>, 8); break;
    case 2: launch(grad_boundary_kernel<4, true>, 4); break;
    default: launch(grad_boundary_kernel<8, true>, 8); break;
  }
}

