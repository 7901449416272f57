// The mHC site's two steps for a few tokens (generation), one block per token
// (design.md §1; the same maths as mhc/fused_kernels.py's coeff_fwd and
// postmix_fwd, which stay the path for every other call):
//
//   site_pre_tokens_kernel:  z = RMSNorm(x_flat) φᵀ, the affine map α·z + b,
//     σ of H_pre's and H_post's columns, H_res = Π_B(exp(·)) (the projection's
//     own per-matrix solver, birkhoff_core.cuh, run by one thread), and the
//     pre-mix u = Σ_i h_pre[i] x_i, in one launch.
//   site_post_tokens_kernel: x'_i = x_0 + Σ_j H_res[i, j] (x_j − x_0) + H_post[i] y.
//
// Why a second form of the site for few tokens: coeff_fwd tiles 64 tokens per
// program, so a decode step (1-16 tokens) runs one program that walks all n·C
// columns alone (about 50 µs of GPU time per site on the H200), and each Triton
// launch costs ~17 µs of host time there, against ~5 µs for these. Layouts are
// coeff_fwd's: zr [T, Z + 1] = z and 1/rms (not written when zr is null: no
// backward will read it), h [T, 2n] = σ of H_pre's and H_post's columns,
// H_res [T, n, n], all float32; x [T, n, C] and u [T, C],
// y [T, C], x' [T, n, C] in the streams' dtype. Products and sums in float32.
#pragma once

#include "birkhoff_kernels.cuh"

namespace mhc_birkhoff {

constexpr int kTokenThreads = 256;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int N>
__device__ __forceinline__ float pairwise_sum(const float* v) {
  if constexpr (N == 1) {
    return v[0];
  } else {
    return pairwise_sum<N / 2>(v) + pairwise_sum<N / 2>(v + N / 2);
  }
}

// torch.sigmoid's bits on CUDA: 1 / (1 + exp(-v)) with expf and an IEEE division.
__device__ __forceinline__ float torch_sigmoid(float v) { return 1.0f / (1.0f + expf(-v)); }

// The first step for token t, by the whole block. xt is the token's streams [n, C]; zr, h_out, h_res
// and u the whole outputs (zr may be null). xt is read with ordinary loads: in the fused post-mix
// kernel below this block wrote it moments before.
template <int N, typename scalar_t>
__device__ __forceinline__ void pre_token(
    const scalar_t* xt, const float* __restrict__ phi, const float* __restrict__ alpha,
    const float* __restrict__ b_pre, const float* __restrict__ b_post, const float* __restrict__ b_res,
    float* zr, float* __restrict__ h_out, float* __restrict__ h_res, scalar_t* __restrict__ u,
    int64_t t, int C, float eps, float tol, int max_iter) {
  constexpr int Z = N * N + 2 * N;
  constexpr int kWarps = kTokenThreads / 32;
  __shared__ float partial[kWarps][Z + 1];
  __shared__ float coef[Z];  // h for [0, 2n), the logits of H_res for [2n, Z)
  const int K = N * C;

  // z and the sum of squares: each thread a strided share of the n·C columns.
  float acc[Z];
#pragma unroll
  for (int z = 0; z < Z; ++z) acc[z] = 0.0f;
  float sq = 0.0f;
  for (int k = threadIdx.x; k < K; k += kTokenThreads) {
    const float v = to_float<scalar_t>(xt[k]);
    sq = fmaf(v, v, sq);
#pragma unroll
    for (int z = 0; z < Z; ++z) acc[z] = fmaf(v, __ldg(phi + (int64_t)z * K + k), acc[z]);
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int z = 0; z < Z; ++z) {
    const float s = warp_sum(acc[z]);
    if (lane == 0) partial[warp][z] = s;
  }
  sq = warp_sum(sq);
  if (lane == 0) partial[warp][Z] = sq;
  __syncthreads();

  // One column per thread: z·r, the affine map of its group, σ for H_pre / H_post.
  if (threadIdx.x <= Z) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partial[w][threadIdx.x];
    partial[0][threadIdx.x] = total;  // every warp's partial of this column was read by this thread only
  }
  __syncthreads();
  const float r = rsqrtf(partial[0][Z] / (float)K + eps);
  if (threadIdx.x < Z) {
    const int col = threadIdx.x;
    const float zc = partial[0][col] * r;
    float v;
    if (col < N) {
      v = zc * alpha[0] + b_pre[col];
    } else if (col < 2 * N) {
      v = zc * alpha[1] + b_post[col - N];
    } else {
      v = zc * alpha[2] + b_res[col - 2 * N];
    }
    if (zr != nullptr) zr[t * (Z + 1) + col] = zc;
    if (col < 2 * N) {
      const float hv = torch_sigmoid(v);
      h_out[t * (2 * N) + col] = hv;
      coef[col] = hv;
    } else {
      coef[col] = v;
    }
  }
  if (threadIdx.x == 0 && zr != nullptr) zr[t * (Z + 1) + Z] = r;
  __syncthreads();

  // H_res: the projection's solver on this token's logits (as birkhoff_forward_kernel does for one matrix).
  if (threadIdx.x == 0) {
    float T[N][N], R[N][N];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) R[i][j] = T[i][j] = coef[2 * N + i * N + j];
    auto reload = [&](float (&X)[N][N]) {
#pragma unroll
      for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) X[i][j] = R[i][j];
    };
    const bool finite = all_finite<N>(T);
    double err;
    project_matrix<N>(T, finite, finite && wants_robust<N>(T), reload, tol, max_iter, false, err);
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) h_res[t * N * N + i * N + j] = T[i][j];
  }

  // u = Σ_i h_pre[i] x_i around stream 0, as MHCBlock and coeff_fwd write it. Σ_i h_pre[i] is
  // summed pairwise, as coeff_fwd's tree reduction does: a converted model's H_pre sums to
  // exactly 1 (MHCBlock's init), so identical streams must give u = x_0 to the bit.
  const float h_sum = pairwise_sum<N>(coef);
  for (int c = threadIdx.x; c < C; c += kTokenThreads) {
    const float x0 = to_float<scalar_t>(xt[c]);
    float acc_u = h_sum * x0;
#pragma unroll
    for (int i = 1; i < N; ++i) acc_u = fmaf(coef[i], to_float<scalar_t>(xt[i * C + c]) - x0, acc_u);
    u[t * C + c] = from_float<scalar_t>(acc_u);
  }
}

template <int N, typename scalar_t>
__global__ void __launch_bounds__(kTokenThreads) site_pre_tokens_kernel(
    const scalar_t* __restrict__ x, const float* __restrict__ phi, const float* __restrict__ alpha,
    const float* __restrict__ b_pre, const float* __restrict__ b_post, const float* __restrict__ b_res,
    float* zr, float* __restrict__ h_out, float* __restrict__ h_res, scalar_t* __restrict__ u,
    int C, float eps, float tol, int max_iter) {
  const int64_t t = blockIdx.x;
  pre_token<N, scalar_t>(x + t * N * C, phi, alpha, b_pre, b_post, b_res, zr, h_out, h_res, u, t, C, eps, tol,
                         max_iter);
}

// x'_i[c] = x_0[c] + Σ_j H_res[i, j] (x_j[c] − x_0[c]) + H_post[i] y[c] for token t, column c.
template <int N, typename scalar_t>
__device__ __forceinline__ void post_column(const scalar_t* __restrict__ x, const scalar_t* __restrict__ y,
                                            const float* __restrict__ h, const float* __restrict__ h_res,
                                            scalar_t* out, int64_t t, int c, int C) {
  const scalar_t* xt = x + t * N * C;
  float dev[N];
  const float x0 = to_float<scalar_t>(xt[c]);
#pragma unroll
  for (int j = 0; j < N; ++j) dev[j] = to_float<scalar_t>(xt[j * C + c]) - x0;
  const float yc = to_float<scalar_t>(y[t * C + c]);
#pragma unroll
  for (int i = 0; i < N; ++i) {
    // Newton's rows sum to one by construction: Σ_j H[i, j] x_j = x_0 + Σ_j H[i, j] (x_j − x_0).
    float mix = 0.0f;
#pragma unroll
    for (int j = 0; j < N; ++j) mix = fmaf(__ldg(h_res + (t * N + i) * N + j), dev[j], mix);
    out[(t * N + i) * C + c] = from_float<scalar_t>(x0 + mix + 2.0f * __ldg(h + t * 2 * N + N + i) * yc);
  }
}

template <int N, typename scalar_t>
__global__ void __launch_bounds__(kTokenThreads) site_post_tokens_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ y, const float* __restrict__ h,
    const float* __restrict__ h_res, scalar_t* __restrict__ out, int C) {
  const int c = blockIdx.x * kTokenThreads + threadIdx.x;
  if (c < C) post_column<N, scalar_t>(x, y, h, h_res, out, blockIdx.y, c, C);
}

// One site's post-mix and the next site's first step, one block per token (generation): the
// block writes its token's x' and, once every thread's columns are written (__syncthreads makes
// them visible to the block), runs pre_token on them. Same arithmetic as the two kernels above,
// so the same bits as their two launches; zr is not written (no backward).
template <int N, typename scalar_t>
__global__ void __launch_bounds__(kTokenThreads) site_post_pre_tokens_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ y, const float* __restrict__ h,
    const float* __restrict__ h_res, scalar_t* out, const float* __restrict__ phi,
    const float* __restrict__ alpha, const float* __restrict__ b_pre, const float* __restrict__ b_post,
    const float* __restrict__ b_res, float* __restrict__ h_next, float* __restrict__ h_res_next,
    scalar_t* __restrict__ u_next, int C, float eps, float tol, int max_iter) {
  const int64_t t = blockIdx.x;
  for (int c = threadIdx.x; c < C; c += kTokenThreads) post_column<N, scalar_t>(x, y, h, h_res, out, t, c, C);
  __syncthreads();
  pre_token<N, scalar_t>(out + t * N * C, phi, alpha, b_pre, b_post, b_res, nullptr, h_next, h_res_next, u_next, t,
                         C, eps, tol, max_iter);
}

}  // namespace mhc_birkhoff
