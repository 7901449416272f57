// Forward and backward kernels of the fused Birkhoff projection (design.md §2),
// free of torch headers so that they can also be built into a standalone
// benchmark (scripts/kernel_bench.cu). birkhoff.cu launches them.
// One templated kernel per direction, over N in {4, 8} and the I/O dtype.
//
// Forward: one matrix per thread, all of it in registers, loaded and stored
// with 16-byte vectors where the pointer allows (no block-level coupling, so
// a slow matrix holds up only its own warp). The per-matrix solver
// (birkhoff_core.cuh) is Newton on the (n-1)-dimensional dual with an Armijo
// line search: a fast solver that keeps only the plan and takes
// multiplicative steps (N-1 exps and N/2 logs per trial), and a robust one
// with log-domain trials and Sinkhorn sweeps, which a warp runs for all its
// matrices when enough of them (robust_votes) have logits wide enough to
// underflow, and a lane runs alone for the rare matrix the fast solver hands
// back. A matrix runs until it meets tol (measured in float64 like
// marginal_error) or max_iter; matrices that miss tol are counted in a
// device-global counter (no sync).
//
// Backward: the implicit-function gradient from T and G alone; a block
// stages its tile of matrices through shared memory (coalesced I/O).
//
// All coefficient math is fp32; inputs/outputs are fp32, bf16 or fp16.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math_constants.h>

#include <cstdint>

#include "birkhoff_core.cuh"

namespace mhc_birkhoff {

// Matrices that missed tol (or have no projection: -inf logits leaving no
// permutation), per device (one copy of a __device__ variable per device
// context); not those holding NaN or +inf. Read on demand from the host.
__device__ unsigned long long g_unconverged = 0ULL;

constexpr int kThreads = 128;         // threads per block

// ----------------------------------------------------------------------------
// dtype helpers
// ----------------------------------------------------------------------------

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}


// ----------------------------------------------------------------------------
// Shared-memory staging: a block's kThreads matrices, padded by one float per
// matrix so that thread t reading its own matrix hits distinct banks.
// ----------------------------------------------------------------------------

template <int N> struct Tile {
  static constexpr int NN = N * N;
  static constexpr int STRIDE = NN + 1;
  float v[kThreads * STRIDE];
  __device__ __forceinline__ float& at(int e) { return v[(e / NN) * STRIDE + (e % NN)]; }
  __device__ __forceinline__ float& at(int m, int k) { return v[m * STRIDE + k]; }
};

// Load `count` matrices starting at `src` (contiguous) into the tile.
template <int N, typename scalar_t>
__device__ __forceinline__ void tile_load(Tile<N>& tile, const scalar_t* __restrict__ src, int count,
                                          bool vec_ok) {
  constexpr int NN = N * N;
  constexpr int VEC = 16 / sizeof(scalar_t);
  const int total = count * NN;
  if (vec_ok && count == kThreads) {
    constexpr int NVEC = kThreads * NN / VEC;
    const uint4* src4 = reinterpret_cast<const uint4*>(src);
#pragma unroll 4
    for (int v = threadIdx.x; v < NVEC; v += kThreads) {
      uint4 raw = __ldg(src4 + v);
      const scalar_t* s = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
      for (int q = 0; q < VEC; ++q) tile.at(v * VEC + q) = to_float<scalar_t>(s[q]);
    }
  } else {
    for (int e = threadIdx.x; e < total; e += kThreads) tile.at(e) = to_float<scalar_t>(src[e]);
  }
}

template <int N, typename scalar_t>
__device__ __forceinline__ void tile_store(Tile<N>& tile, scalar_t* __restrict__ dst, int count, bool vec_ok) {
  constexpr int NN = N * N;
  constexpr int VEC = 16 / sizeof(scalar_t);
  const int total = count * NN;
  if (vec_ok && count == kThreads) {
    constexpr int NVEC = kThreads * NN / VEC;
    uint4* dst4 = reinterpret_cast<uint4*>(dst);
#pragma unroll 4
    for (int v = threadIdx.x; v < NVEC; v += kThreads) {
      uint4 raw;
      scalar_t* s = reinterpret_cast<scalar_t*>(&raw);
#pragma unroll
      for (int q = 0; q < VEC; ++q) s[q] = from_float<scalar_t>(tile.at(v * VEC + q));
      dst4[v] = raw;
    }
  } else {
    for (int e = threadIdx.x; e < total; e += kThreads) dst[e] = from_float<scalar_t>(tile.at(e));
  }
}

// Per-thread access to one matrix: 16-byte vectors when the pointer allows
// (each matrix is a whole number of 16-byte vectors for n = 4 and 8).
template <int N, typename scalar_t>
__device__ __forceinline__ void load_matrix(const scalar_t* __restrict__ p, float (&X)[N][N], bool vec) {
  constexpr int NN = N * N;
  constexpr int VEC = 16 / sizeof(scalar_t);
  if (vec) {
    const uint4* p4 = reinterpret_cast<const uint4*>(p);
#pragma unroll
    for (int v = 0; v < NN / VEC; ++v) {
      const uint4 raw = __ldg(p4 + v);
      const scalar_t* e = reinterpret_cast<const scalar_t*>(&raw);
#pragma unroll
      for (int q = 0; q < VEC; ++q) X[(v * VEC + q) / N][(v * VEC + q) % N] = to_float<scalar_t>(e[q]);
    }
  } else {
#pragma unroll
    for (int k = 0; k < NN; ++k) X[k / N][k % N] = to_float<scalar_t>(p[k]);
  }
}

template <int N, typename scalar_t>
__device__ __forceinline__ void store_matrix(scalar_t* __restrict__ p, const float (&X)[N][N], bool vec) {
  constexpr int NN = N * N;
  constexpr int VEC = 16 / sizeof(scalar_t);
  if (vec) {
    uint4* p4 = reinterpret_cast<uint4*>(p);
#pragma unroll
    for (int v = 0; v < NN / VEC; ++v) {
      uint4 raw;
      scalar_t* e = reinterpret_cast<scalar_t*>(&raw);
#pragma unroll
      for (int q = 0; q < VEC; ++q) e[q] = from_float<scalar_t>(X[(v * VEC + q) / N][(v * VEC + q) % N]);
      p4[v] = raw;
    }
  } else {
#pragma unroll
    for (int k = 0; k < NN; ++k) p[k] = from_float<scalar_t>(X[k / N][k % N]);
  }
}

// One matrix, in place (T: the logits after prepare_logits, which returned
// `kind`; the plan out): solve_logits, and counted in g_unconverged if it
// misses tol or has no projection (err inf). NaN where the logits hold NaN or
// +inf (err NaN, 0 iterations, not counted). Returns the Newton iterations.
template <int N, typename Reload>
__device__ __forceinline__ int project_matrix(float (&T)[N][N], int kind, bool robust, Reload&& reload, float tol,
                                              int max_iter, bool exact_err, double& err) {
  const int iters = solve_logits<N>(T, kind, reload, tol, max_iter, err, robust, exact_err);
  if (kind != kBad && !(err <= (double)tol)) atomicAdd(&g_unconverged, 1ULL);
  return iters;
}

// One matrix per thread, no block-level coupling: a thread loads its matrix,
// solves it and stores it, so a slow matrix holds up only its own warp.
// n = 4 is capped at 64 registers (8 blocks of kThreads per SM): the extra
// occupancy beats the few spills it costs (measured 1.20x at N(0,10²), 1.25x
// at N(0,1)); n = 8 would spill heavily there and gets the register file.
template <int N> constexpr int forward_min_blocks() { return N == 4 ? 8 : 1; }

// A warp runs the robust solver for all its lanes when at least this many of
// its matrices have a row spanning more than kRobustRange (wants_robust). At
// n = 4 the fast solver flushes such rows' tiny entries and goes on
// (flushes_tiny), so one or two wide matrices, the usual case up to
// N(0, 15²), no longer put their warp, the slowest of a mid-size batch, on
// the robust solver. Three votes, chosen on the H200 against 16 and against
// any wide lane (benchmarks/projection_fill_ab, 2026-12-01): at N(0, 10²)
// 32K matrices take 15.8 µs instead of 23.0 and 128K 28.5 instead of 34.2;
// at N(0, 20²) and N(0, 30²), where many lanes are wide, 3 votes cost 1-8 %
// (16 doubled the time at 20²). n = 8 votes on any wide lane, as before.
template <int N> constexpr int robust_votes() { return N == 4 ? 3 : 1; }

template <int N, typename scalar_t>
__global__ void __launch_bounds__(kThreads, forward_min_blocks<N>()) birkhoff_forward_kernel(
    const scalar_t* __restrict__ R, scalar_t* __restrict__ out, int64_t B, float tol, int max_iter,
    int* __restrict__ iters_out, double* __restrict__ err_out, bool vec_ok) {
  constexpr int NN = N * N;
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= B) return;
  const scalar_t* src = R + idx * NN;
  float T[N][N];
  load_matrix<N, scalar_t>(src, T, vec_ok);
  const int kind = prepare_logits<N>(T);  // -inf logits: zeros of exp(R) (birkhoff_core.cuh)
  // One solver per warp where possible (see wants_robust and robust_votes); a
  // matrix with zero entries votes like a wide one.
  const unsigned wide = __ballot_sync(__activemask(), kind <= kZeros && wants_robust<N>(T));
  const bool robust = __popc(wide) >= robust_votes<N>();
  // The robust solver re-reads R rather than keeping a copy in registers.
  auto reload = [&](float (&X)[N][N]) { load_matrix<N, scalar_t>(src, X, vec_ok); };
  double err;
  // The float64 error only where the caller asks for it (info).
  const int iters = project_matrix<N>(T, kind, robust, reload, tol, max_iter, iters_out != nullptr, err);
  store_matrix<N, scalar_t>(out + idx * NN, T, vec_ok);
  if (iters_out != nullptr) {
    iters_out[idx] = iters;
    err_out[idx] = err;
  }
}

// ∂L/∂R from T and G (implicit_grad in birkhoff_core.cuh).
template <int N, typename scalar_t>
__global__ void __launch_bounds__(kThreads) birkhoff_backward_kernel(
    const scalar_t* __restrict__ Tin, const scalar_t* __restrict__ Gin, scalar_t* __restrict__ out, int64_t B,
    bool vec_ok) {
  constexpr int NN = N * N;
  __shared__ Tile<N> tile;
  const int64_t first = (int64_t)blockIdx.x * kThreads;
  const int count = (int)min((int64_t)kThreads, B - first);
  const int tid = threadIdx.x;
  const bool mine = tid < count;

  float T[N][N];
  tile_load<N, scalar_t>(tile, Tin + first * NN, count, vec_ok);
  __syncthreads();
  if (mine) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) T[i][j] = tile.at(tid, i * N + j);
  }
  __syncthreads();
  tile_load<N, scalar_t>(tile, Gin + first * NN, count, vec_ok);
  __syncthreads();
  if (mine) {
    float G[N][N];
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) G[i][j] = tile.at(tid, i * N + j);
    implicit_grad<N>(T, G);
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) tile.at(tid, i * N + j) = G[i][j];
  }
  __syncthreads();
  tile_store<N, scalar_t>(tile, out + first * NN, count, vec_ok);
}

}  // namespace mhc_birkhoff
