// The Python binding's dots_pipe (boundary_dots.cu registers it): boundary_pipe.cuh's kernels, in a translation
// unit of their own so that their 24 instantiations compile in parallel with the other kernels.
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <algorithm>

#include "boundary_pipe.cuh"
#include "boundary_torch.h"

// part [splits, T, 32] = the dots and square sums of dots(), with or without the post-mix, the streams (and y)
// staged through shared memory by cp.async (boundary_pipe.cuh): chunk_cols columns of every stream a pipeline
// step, `stages` steps in the ring.
void dots_pipe(torch::Tensor x, torch::Tensor y, torch::Tensor h, torch::Tensor hres, torch::Tensor out,
               torch::Tensor phi2, torch::Tensor part, int64_t cols_per_split, int64_t grid_y, bool postmix,
               int64_t warps, int64_t chunk_cols, int64_t stages) {
  using namespace boundary_proto;
  TORCH_CHECK(x.dim() == 3, "x must be [T, 4, C]");
  const int64_t T = x.size(0), C = x.size(2);
  TORCH_CHECK(chunk_cols == 16 || chunk_cols == 32, "chunk_cols must be 16 or 32");
  TORCH_CHECK(cols_per_split > 0 && C % chunk_cols == 0 && cols_per_split % chunk_cols == 0,
              "C and cols_per_split must be multiples of chunk_cols");
  const int64_t splits = (C + cols_per_split - 1) / cols_per_split;
  check_dots_args(x, y, h, hres, out, phi2, part, splits, postmix);
  TORCH_CHECK(warps == 4 || warps == 8, "warps must be 4 or 8");
  TORCH_CHECK(stages >= 2 && stages <= 4, "stages must be 2, 3 or 4");
  if (T == 0) return;
  const c10::cuda::CUDAGuard guard(x.device());
  const int smem = pipe_shared_bytes(static_cast<int>(cols_per_split), static_cast<int>(warps),
                                     static_cast<int>(chunk_cols), static_cast<int>(stages), postmix);
  const dim3 grid(static_cast<unsigned>(splits), static_cast<unsigned>(std::max<int64_t>(1, grid_y)));
  auto launch = [&](auto kernel, int kernel_warps) {
    launch_dots(kernel, grid, kernel_warps, smem, x, y, h, hres, out, phi2, part, postmix,
                static_cast<int>(cols_per_split));
  };
  // (postmix, warps, chunk_cols, stages): one instantiation each
  const int key = (postmix ? 1000 : 0) + (warps == 8 ? 100 : 0) + (chunk_cols == 32 ? 10 : 0) + static_cast<int>(stages);
  switch (key) {
#define MHC_PIPE_CASE(P, W, CW, S) \
  case (P ? 1000 : 0) + (W == 8 ? 100 : 0) + (CW == 32 ? 10 : 0) + S: launch(dots_pipe_kernel<P, W, CW, S>, W); break;
#define MHC_PIPE_CASES(P, W, CW) MHC_PIPE_CASE(P, W, CW, 2) MHC_PIPE_CASE(P, W, CW, 3) MHC_PIPE_CASE(P, W, CW, 4)
    MHC_PIPE_CASES(false, 4, 16)
    MHC_PIPE_CASES(false, 4, 32)
    MHC_PIPE_CASES(false, 8, 16)
    MHC_PIPE_CASES(false, 8, 32)
    MHC_PIPE_CASES(true, 4, 16)
    MHC_PIPE_CASES(true, 4, 32)
    MHC_PIPE_CASES(true, 8, 16)
    MHC_PIPE_CASES(true, 8, 32)
#undef MHC_PIPE_CASES
#undef MHC_PIPE_CASE
    default: TORCH_CHECK(false, "no dots_pipe instantiation for key ", key);
  }
}
