// The mHC site's two steps for a few tokens (generation), a cluster of blocks per token
// (design.md §1; the same maths as mhc/fused_kernels.py's coeff_fwd and
// postmix_fwd, which stay the path for every other call):
//
//   site_pre_tokens_kernel:  z = RMSNorm(x_flat) φᵀ, the affine map α·z + b,
//     σ of H_pre's and H_post's columns, H_res = Π_B(exp(·)) (the projection's
//     own per-matrix solver, birkhoff_core.cuh, run by one thread), and the
//     pre-mix u = Σ_i h_pre[i] x_i, in one launch.
//   site_post_tokens_kernel: x'_i = x_0 + Σ_j H_res[i, j] (x_j − x_0) + H_post[i] y.
//   site_post_pre_tokens_kernel: both, the post-mix's x' feeding the next site's first step.
//
// Without grad (generation) the first step may also apply the branch's input RMSNorm to the u it
// has just written (InputNorm below), so a decode step's branch starts at its sublayer.
//
// Why a second form of the site for few tokens: coeff_fwd tiles 64 tokens per
// program, so a decode step (1-16 tokens) runs one program that walks all n·C
// columns alone (about 50 µs of GPU time per site on the H200), and each Triton
// launch costs ~17 µs of host time there, against ~5 µs for these.
//
// Why a cluster per token: the first step reads φ (Z·n·C float32, 295 KB at n = 4,
// C = 768) once per token. One block per token walked it alone in 12 dependent
// rounds of loads: 13.8 µs a site boundary on the H200, most of a CUDA-graph decode
// step's extra GPU time. A token's columns are split over the S blocks of one
// cluster (token_splits: up to 8, kTokenThreads columns a block), and the blocks add
// their partial sums of z through distributed shared memory. Each block adds the S
// partials in rank order, so every block of a token, and every kernel here, gets the
// same bits; each block then runs the pre-mix on its own columns, and block 0 alone
// writes the coefficients and runs the projection. Built for an arch below sm_90
// (no clusters), S is 1.
//
// Layouts are coeff_fwd's: zr [T, Z + 1] = z and 1/rms (not written when zr is null: no
// backward will read it), h [T, 2n] = σ of H_pre's and H_post's columns,
// H_res [T, n, n], all float32; x [T, n, C] and u [T, C],
// y [T, C], x' [T, n, C] in the streams' dtype. Products and sums in float32.
#pragma once

#include <cooperative_groups.h>

#include "birkhoff_kernels.cuh"

namespace mhc_birkhoff {

constexpr int kTokenThreads = 128;
constexpr int kMaxTokenSplits = 8;  // the portable cluster size

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

// This block's share of its token's columns: [begin, end) of C, the same in every kernel here.
struct TokenColumns {
  int begin, end;
};

__device__ __forceinline__ TokenColumns token_columns(int C) {
  const int per_block = (C + gridDim.x - 1) / gridDim.x;
  const int begin = min(C, (int)blockIdx.x * per_block);
  return {begin, min(C, begin + per_block)};
}

// A thread's running sums over its columns: z (unnormalised) and the sum of squares.
template <int N>
struct ColumnSums {
  static constexpr int Z = N * N + 2 * N;
  float z[Z];
  float sq;

  __device__ __forceinline__ ColumnSums() : sq(0.0f) {
#pragma unroll
    for (int k = 0; k < Z; ++k) z[k] = 0.0f;
  }

  // Adds column c's n values v[i] = x_i[c] (as stored in the streams' dtype).
  __device__ __forceinline__ void add(const float (&v)[N], const float* __restrict__ phi, int c, int C) {
    const int64_t K = (int64_t)N * C;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      sq = fmaf(v[i], v[i], sq);
#pragma unroll
      for (int k = 0; k < Z; ++k) z[k] = fmaf(v[i], __ldg(phi + k * K + (int64_t)i * C + c), z[k]);
    }
  }
};

// The branch's input RMSNorm (HF's LlamaRMSNorm: w ⊙ to_dtype(u_f · rsqrt(mean(u_f²) + eps)), the product
// in float32 rounded to the streams' dtype) applied to the u a first step writes; weight == nullptr: not
// applied. Why here: a decode step's norm is ~8 small launches of host time, once a site, and the first
// step has u in hand.
template <typename scalar_t>
struct InputNorm {
  const scalar_t* weight;  // [C], the streams' dtype
  scalar_t* out;           // [T, C]
  float eps;
};

// out = InputNorm of token t's u, once this block's threads have written their columns of u (read back by the
// threads that wrote them). The sum of squares goes across the cluster in rank order, as finish_pre_token's
// sums do, so every block, and both kernels below, get the same bits.
template <typename scalar_t>
__device__ __forceinline__ void apply_input_norm(const InputNorm<scalar_t>& norm, const scalar_t* ut,
                                                 scalar_t* __restrict__ out, int C) {
  constexpr int kWarps = kTokenThreads / 32;
  __shared__ float warp_sq[kWarps];
  __shared__ float block_sq;  // read by the cluster's other blocks
  __shared__ float inv_rms;
  const TokenColumns cols = token_columns(C);
  float sq = 0.0f;
  for (int c = cols.begin + threadIdx.x; c < cols.end; c += kTokenThreads) {
    const float v = to_float<scalar_t>(ut[c]);
    sq = fmaf(v, v, sq);
  }
  sq = warp_sum(sq);
  if ((threadIdx.x & 31) == 0) warp_sq[threadIdx.x >> 5] = sq;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) s += warp_sq[w];
    block_sq = s;
  }
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's block_sq is written
  if (threadIdx.x == 0) {
    float total = 0.0f;
    for (unsigned r = 0; r < gridDim.x; ++r) total += *cluster.map_shared_rank(&block_sq, r);
    inv_rms = rsqrtf(total / (float)C + norm.eps);
  }
  cluster.sync();  // inv_rms is written, and no block leaves while another still reads its block_sq
#else
  __syncthreads();
  if (threadIdx.x == 0) inv_rms = rsqrtf(block_sq / (float)C + norm.eps);  // gridDim.x is 1
  __syncthreads();
#endif
  const float r = inv_rms;
  for (int c = cols.begin + threadIdx.x; c < cols.end; c += kTokenThreads) {
    const float normed = to_float<scalar_t>(from_float<scalar_t>(to_float<scalar_t>(ut[c]) * r));
    out[c] = from_float<scalar_t>(to_float<scalar_t>(__ldg(norm.weight + c)) * normed);
  }
}

// The rest of the first step for token t, once every thread of every block of the token's cluster has
// added its columns to `sums`: the sums across the cluster, the coefficients, H_res (block 0) and the
// pre-mix u on this block's columns. xt is the token's streams [n, C], read with ordinary loads: in the
// fused post-mix kernel below this thread wrote its columns of them moments before.
template <int N, typename scalar_t>
__device__ __forceinline__ void finish_pre_token(
    ColumnSums<N>& sums, const scalar_t* xt, const float* __restrict__ alpha,
    const float* __restrict__ b_pre, const float* __restrict__ b_post, const float* __restrict__ b_res,
    float* zr, float* __restrict__ h_out, float* __restrict__ h_res, scalar_t* u, const InputNorm<scalar_t>& norm,
    int64_t t, int C, float eps, float tol, int max_iter) {
  constexpr int Z = N * N + 2 * N;
  constexpr int kWarps = kTokenThreads / 32;
  __shared__ float partial[kWarps][Z + 1];
  __shared__ float block_total[Z + 1];  // read by the cluster's other blocks
  __shared__ float coef[Z];  // h for [0, 2n), the logits of H_res for [2n, Z)
  const int K = N * C;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int k = 0; k < Z; ++k) {
    const float s = warp_sum(sums.z[k]);
    if (lane == 0) partial[warp][k] = s;
  }
  const float sq = warp_sum(sums.sq);
  if (lane == 0) partial[warp][Z] = sq;
  __syncthreads();
  if (threadIdx.x <= Z) {
    float total = 0.0f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) total += partial[w][threadIdx.x];
    block_total[threadIdx.x] = total;
  }
  // The token's sums: every block adds the cluster's partials in rank order (the same bits in each).
  float total = 0.0f;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every block's block_total is written
  if (threadIdx.x <= Z) {
    for (unsigned r = 0; r < gridDim.x; ++r) total += cluster.map_shared_rank(block_total, r)[threadIdx.x];
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#else
  __syncthreads();
  if (threadIdx.x <= Z) total = block_total[threadIdx.x];  // gridDim.x is 1 (token_splits)
#endif
  if (threadIdx.x <= Z) partial[0][threadIdx.x] = total;
  __syncthreads();
  const bool lead = blockIdx.x == 0;  // writes the coefficients and runs the projection
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
    if (lead && zr != nullptr) zr[t * (Z + 1) + col] = zc;
    if (col < 2 * N) {
      const float hv = torch_sigmoid(v);
      if (lead) h_out[t * (2 * N) + col] = hv;
      coef[col] = hv;
    } else {
      coef[col] = v;
    }
  }
  if (lead && threadIdx.x == 0 && zr != nullptr) zr[t * (Z + 1) + Z] = r;
  __syncthreads();

  // H_res: the projection's solver on this token's logits (as birkhoff_forward_kernel does for one matrix).
  if (lead && threadIdx.x == 0) {
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
    const int kind = prepare_logits<N>(T);
    double err;
    project_matrix<N>(T, kind, kind <= kZeros && wants_robust<N>(T), reload, tol, max_iter, false, err);
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) h_res[t * N * N + i * N + j] = T[i][j];
  }

  // u = Σ_i h_pre[i] x_i around stream 0, as MHCBlock and coeff_fwd write it. Σ_i h_pre[i] is
  // summed pairwise, as coeff_fwd's tree reduction does: a converted model's H_pre sums to
  // exactly 1 (MHCBlock's init), so identical streams must give u = x_0 to the bit.
  const float h_sum = pairwise_sum<N>(coef);
  const TokenColumns cols = token_columns(C);
  for (int c = cols.begin + threadIdx.x; c < cols.end; c += kTokenThreads) {
    const float x0 = to_float<scalar_t>(xt[c]);
    float acc_u = h_sum * x0;
#pragma unroll
    for (int i = 1; i < N; ++i) acc_u = fmaf(coef[i], to_float<scalar_t>(xt[i * C + c]) - x0, acc_u);
    u[t * C + c] = from_float<scalar_t>(acc_u);
  }
  if (norm.weight != nullptr) apply_input_norm<scalar_t>(norm, u + t * C, norm.out + t * C, C);  // (uniform)
}

// Grid (S, T), clusters of S blocks along x: the cluster of token t = blockIdx.y.
template <int N, typename scalar_t>
__global__ void __launch_bounds__(kTokenThreads) site_pre_tokens_kernel(
    const scalar_t* __restrict__ x, const float* __restrict__ phi, const float* __restrict__ alpha,
    const float* __restrict__ b_pre, const float* __restrict__ b_post, const float* __restrict__ b_res,
    float* zr, float* __restrict__ h_out, float* __restrict__ h_res, scalar_t* u, InputNorm<scalar_t> norm,
    int C, float eps, float tol, int max_iter) {
  const int64_t t = blockIdx.y;
  const scalar_t* xt = x + t * N * C;
  ColumnSums<N> sums;
  const TokenColumns cols = token_columns(C);
  for (int c = cols.begin + threadIdx.x; c < cols.end; c += kTokenThreads) {
    float v[N];
#pragma unroll
    for (int i = 0; i < N; ++i) v[i] = to_float<scalar_t>(xt[i * C + c]);
    sums.add(v, phi, c, C);
  }
  finish_pre_token<N, scalar_t>(sums, xt, alpha, b_pre, b_post, b_res, zr, h_out, h_res, u, norm, t, C, eps, tol,
                                max_iter);
}

// x'_i[c] = x_0[c] + Σ_j H_res[i, j] (x_j[c] − x_0[c]) + H_post[i] y[c] for token t, column c, stored and
// returned (as stored: rounded to the streams' dtype) in v.
template <int N, typename scalar_t>
__device__ __forceinline__ void post_column(const scalar_t* __restrict__ x, const scalar_t* __restrict__ y,
                                            const float* __restrict__ h, const float* __restrict__ h_res,
                                            scalar_t* out, int64_t t, int c, int C, float (&v)[N]) {
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
    const scalar_t stored = from_float<scalar_t>(x0 + mix + 2.0f * __ldg(h + t * 2 * N + N + i) * yc);
    out[(t * N + i) * C + c] = stored;
    v[i] = to_float<scalar_t>(stored);
  }
}

template <int N, typename scalar_t>
__global__ void __launch_bounds__(kTokenThreads) site_post_tokens_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ y, const float* __restrict__ h,
    const float* __restrict__ h_res, scalar_t* __restrict__ out, int C) {
  const int c = blockIdx.x * kTokenThreads + threadIdx.x;
  float v[N];
  if (c < C) post_column<N, scalar_t>(x, y, h, h_res, out, blockIdx.y, c, C, v);
}

// One site's post-mix and the next site's first step, a cluster per token as site_pre_tokens_kernel
// (generation): each thread writes its columns of x' and adds the values it wrote to the next step's
// sums. Same arithmetic, columns and order as the two kernels above, so the same bits as their two
// launches; zr is not written (no backward).
template <int N, typename scalar_t>
__global__ void __launch_bounds__(kTokenThreads) site_post_pre_tokens_kernel(
    const scalar_t* __restrict__ x, const scalar_t* __restrict__ y, const float* __restrict__ h,
    const float* __restrict__ h_res, scalar_t* out, const float* __restrict__ phi,
    const float* __restrict__ alpha, const float* __restrict__ b_pre, const float* __restrict__ b_post,
    const float* __restrict__ b_res, float* __restrict__ h_next, float* __restrict__ h_res_next,
    scalar_t* u_next, InputNorm<scalar_t> norm, int C, float eps, float tol, int max_iter) {
  const int64_t t = blockIdx.y;
  ColumnSums<N> sums;
  const TokenColumns cols = token_columns(C);
  for (int c = cols.begin + threadIdx.x; c < cols.end; c += kTokenThreads) {
    float v[N];
    post_column<N, scalar_t>(x, y, h, h_res, out, t, c, C, v);
    sums.add(v, phi, c, C);
  }
  finish_pre_token<N, scalar_t>(sums, out + t * N * C, alpha, b_pre, b_post, b_res, nullptr, h_next, h_res_next,
                                u_next, norm, t, C, eps, tol, max_iter);
}

}  // namespace mhc_birkhoff
