// The Python binding of boundary_dots.cuh (a measurement prototype; benchmarks/site/boundary_sweep.py builds it
// with torch.utils.cpp_extension.load).
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include "boundary_dots.cuh"
#include "boundary_torch.h"

namespace {

// part [splits, T, 32] = the dots of x (or, with postmix, of x' = H_res x + H_post ⊗ y, written to out) with
// φ = phi2[0] + phi2[1], and the square sums; cols_per_split columns of every stream a split; grid_y CTAs a
// split, each looping over token tiles of 16·warps tokens; prefetch: each chunk's loads issued a chunk ahead.
void dots(torch::Tensor x, torch::Tensor y, torch::Tensor h, torch::Tensor hres, torch::Tensor out,
          torch::Tensor phi2, torch::Tensor part, int64_t cols_per_split, int64_t grid_y, bool postmix,
          bool prefetch, int64_t warps) {
  using namespace boundary_proto;
  check(x, "x", at::kBFloat16);
  check(phi2, "phi2", at::kBFloat16);
  check(part, "part", at::kFloat);
  TORCH_CHECK(x.dim() == 3 && x.size(1) == kStreams, "x must be [T, 4, C]");
  const int64_t T = x.size(0), C = x.size(2);
  TORCH_CHECK(C % 16 == 0 && cols_per_split % 16 == 0 && cols_per_split > 0,
              "C and cols_per_split must be multiples of 16");
  const int64_t splits = (C + cols_per_split - 1) / cols_per_split;
  TORCH_CHECK(phi2.dim() == 3 && phi2.size(0) == 2 && phi2.size(1) == kZ && phi2.size(2) == kStreams * C,
              "phi2 must be [2, 24, 4C]");
  TORCH_CHECK(part.dim() == 3 && part.size(0) == splits && part.size(1) == T && part.size(2) == kZP,
              "part must be [splits, T, 32]");
  if (postmix) {
    check(y, "y", at::kBFloat16);
    check(h, "h", at::kFloat);
    check(hres, "hres", at::kFloat);
    check(out, "out", at::kBFloat16);
    TORCH_CHECK(y.numel() == T * C && h.numel() == T * 2 * kStreams && hres.numel() == T * kStreams * kStreams &&
                    out.sizes() == x.sizes(),
                "y [T, C], h [T, 8], hres [T, 4, 4] and out [T, 4, C] must match x");
  }
  TORCH_CHECK(warps == 4 || warps == 8, "warps must be 4 or 8");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int smem = shared_bytes(static_cast<int>(cols_per_split));
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(std::max<int64_t>(1, grid_y)));
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel, int kernel_warps) {
    if (smem > 48 * 1024) {
      C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
    }
    kernel<<<grid, dim3(kernel_warps * 32), smem, stream>>>(
        reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()),
        postmix ? reinterpret_cast<const __nv_bfloat16*>(y.data_ptr()) : nullptr,
        postmix ? h.data_ptr<float>() : nullptr, postmix ? hres.data_ptr<float>() : nullptr,
        postmix ? reinterpret_cast<__nv_bfloat16*>(out.data_ptr()) : nullptr,
        reinterpret_cast<const __nv_bfloat16*>(phi2.data_ptr()), part.data_ptr<float>(), static_cast<int>(T),
        static_cast<int>(C), static_cast<int>(cols_per_split));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  // (postmix, prefetch, warps): one instantiation each
  const int key = (postmix ? 4 : 0) + (prefetch ? 2 : 0) + (warps == 8 ? 1 : 0);
  switch (key) {
    case 0: launch(boundary_dots_kernel<false, false, 4>, 4); break;
    case 1: launch(boundary_dots_kernel<false, false, 8>, 8); break;
    case 2: launch(boundary_dots_kernel<false, true, 4>, 4); break;
    case 3: launch(boundary_dots_kernel<false, true, 8>, 8); break;
    case 4: launch(boundary_dots_kernel<true, false, 4>, 4); break;
    case 5: launch(boundary_dots_kernel<true, false, 8>, 8); break;
    case 6: launch(boundary_dots_kernel<true, true, 4>, 4); break;
    default: launch(boundary_dots_kernel<true, true, 8>, 8); break;
  }
}

}  // namespace

// boundary_pipe.cu and boundary_grad.cu (their own translation units, compiled in parallel with this one)
void dots_pipe(torch::Tensor x, torch::Tensor y, torch::Tensor h, torch::Tensor hres, torch::Tensor out,
               torch::Tensor phi2, torch::Tensor part, int64_t cols_per_split, int64_t grid_y, bool postmix,
               int64_t warps, int64_t chunk_cols, int64_t stages);
void grad(torch::Tensor dout, torch::Tensor du, torch::Tensor x, torch::Tensor work, torch::Tensor phi,
          torch::Tensor h, torch::Tensor hres, torch::Tensor dx, torch::Tensor x_k, torch::Tensor y_k,
          torch::Tensor h_k, torch::Tensor dy, torch::Tensor sums, int64_t cols_per_split, int64_t grid_y,
          int64_t warps, bool coef_smem);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dots", &dots, "the next site's dot products (with the post-mix first if postmix); a prototype");
  m.def("dots_pipe", &dots_pipe, "dots() with the streams staged through shared memory by cp.async; a prototype");
  m.def("grad", &grad, "site k+1's stream gradient and site k's post-mix backward on it; a prototype");
}
