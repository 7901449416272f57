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
  TORCH_CHECK(x.dim() == 3, "x must be [T, 4, C]");
  const int64_t T = x.size(0), C = x.size(2);
  TORCH_CHECK(C % 16 == 0 && cols_per_split % 16 == 0 && cols_per_split > 0,
              "C and cols_per_split must be multiples of 16");
  const int64_t splits = (C + cols_per_split - 1) / cols_per_split;
  check_dots_args(x, y, h, hres, out, phi2, part, splits, postmix);
  TORCH_CHECK(warps == 4 || warps == 8, "warps must be 4 or 8");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int smem = shared_bytes(static_cast<int>(cols_per_split));
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(std::max<int64_t>(1, grid_y)));
  auto launch = [&](auto kernel, int kernel_warps) {
    launch_dots(kernel, grid, kernel_warps, smem, x, y, h, hres, out, phi2, part, postmix,
                static_cast<int>(cols_per_split));
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
