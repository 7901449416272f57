// Kernel-only benchmark of the fused Birkhoff forward (no torch, no Python):
// the shipped kernel (mhc/csrc/birkhoff_kernels.cuh) against the robust solver
// alone and a device copy of the same bytes, on N(0, sigma^2) fp32 logits,
// CUDA-event medians of 20 launches after warm-up; marginal errors and
// per-warp iteration counts checked on the host in float64.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 --expt-relaxed-constexpr -Imhc/csrc benchmarks/projection/kernel_bench.cu -o /tmp/kernel_bench
//   /tmp/kernel_bench          # full table
//   /tmp/kernel_bench profile  # one launch each of n=4 N(0,10^2) and N(0,1) at 1M (for ncu)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "birkhoff_kernels.cuh"

using namespace mhc_birkhoff;

#define CHECK(x)                                                                        \
  do {                                                                                  \
    cudaError_t e_ = (x);                                                               \
    if (e_ != cudaSuccess) {                                                            \
      std::printf("CUDA error %s at line %d\n", cudaGetErrorString(e_), __LINE__);      \
      std::exit(1);                                                                     \
    }                                                                                   \
  } while (0)

// The robust solver alone, for comparison (same I/O as the shipped kernel).
template <int N>
__global__ void __launch_bounds__(kThreads, forward_min_blocks<N>())
    robust_only_kernel(const float* __restrict__ R, float* __restrict__ out, int64_t B, float tol) {
  const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= B) return;
  float T[N][N];
  load_matrix<N, float>(R + idx * N * N, T, true);
  auto reload = [&](float (&X)[N][N]) { load_matrix<N, float>(R + idx * N * N, X, true); };
  double err;
  solve_matrix<N>(T, reload, tol, 100, err, true);
  store_matrix<N, float>(out + idx * N * N, T, true);
}

__global__ void copy_kernel(const float4* __restrict__ a, float4* __restrict__ b, int64_t n) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    b[i] = a[i];
}

template <class F>
static float median_us(F launch, int reps = 20) {
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) launch();
  std::vector<float> t;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(a));
    launch();
    CHECK(cudaEventRecord(b));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(ms * 1000.f);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

template <int N>
static void run(float sigma, int64_t B, bool profile) {
  const float tol = std::max(1e-6f, 4 * N * kEps);  // effective_tol in fp32
  const int64_t nel = B * N * N;
  std::vector<float> h(nel);
  std::mt19937 rng(1234 + N + (int)sigma);
  std::normal_distribution<float> nd(0.f, sigma);
  for (auto& x : h) x = nd(rng);
  float *R, *T;
  int* iters;
  double* errs;
  CHECK(cudaMalloc(&R, nel * sizeof(float)));
  CHECK(cudaMalloc(&T, nel * sizeof(float)));
  CHECK(cudaMalloc(&iters, B * sizeof(int)));
  CHECK(cudaMalloc(&errs, B * sizeof(double)));
  CHECK(cudaMemcpy(R, h.data(), nel * sizeof(float), cudaMemcpyHostToDevice));
  // The launch configuration of launch_forward in mhc/csrc/birkhoff.cu.
  const int threads = B >= (int64_t)kThreads * 1024 ? kThreads : 32;
  const unsigned blocks = (unsigned)((B + threads - 1) / threads);
  auto ours = [&] {
    birkhoff_forward_kernel<N, float><<<blocks, threads>>>(R, T, B, tol, 100, nullptr, nullptr, true);
  };
  if (profile) {
    ours();
    CHECK(cudaDeviceSynchronize());
    return;
  }
  const float t_ours = median_us(ours);
  CHECK(cudaGetLastError());
  const float t_robust = median_us([&] { robust_only_kernel<N><<<blocks, threads>>>(R, T, B, tol); });
  const float t_copy = median_us([&] { copy_kernel<<<132 * 8, 512>>>((const float4*)R, (float4*)T, nel / 4); });
  birkhoff_forward_kernel<N, float><<<blocks, threads>>>(R, T, B, tol, 100, iters, errs, true);
  CHECK(cudaDeviceSynchronize());
  std::vector<float> out(nel);
  std::vector<int> it(B);
  CHECK(cudaMemcpy(out.data(), T, nel * sizeof(float), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(it.data(), iters, B * sizeof(int), cudaMemcpyDeviceToHost));
  double emax = 0, it_sum = 0, warp_max_sum = 0;
  int64_t missed = 0;
  for (int64_t m = 0; m < B; ++m) {
    const float* t = &out[m * N * N];
    double e = 0;
    for (int i = 0; i < N; ++i) {
      double r = 0, c = 0;
      for (int j = 0; j < N; ++j) {
        r += t[i * N + j];
        c += t[j * N + i];
      }
      e += std::fabs(r - 1) + std::fabs(c - 1);
    }
    missed += !(e <= tol);
    emax = std::max(emax, e);
    it_sum += it[m];
  }
  for (int64_t w = 0; w < B / 32; ++w) warp_max_sum += *std::max_element(&it[w * 32], &it[w * 32 + 32]);
  std::printf("n=%d N(0,%g^2) B=%8lld | ours %8.1f us (%5.2fx copy) | robust alone %8.1f us | copy %6.1f us | "
              "max err %.3e missed %lld | iterations mean %.2f, per-warp max %.2f\n",
              N, sigma, (long long)B, t_ours, t_ours / t_copy, t_robust, t_copy, emax, (long long)missed,
              it_sum / B, warp_max_sum / (B / 32));
  CHECK(cudaFree(R));
  CHECK(cudaFree(T));
  CHECK(cudaFree(iters));
  CHECK(cudaFree(errs));
}

int main(int argc, char** argv) {
  const bool profile = argc > 1 && std::strcmp(argv[1], "profile") == 0;
  if (profile) {
    run<4>(10.f, 1 << 20, true);
    run<4>(1.f, 1 << 20, true);
    return 0;
  }
  for (float s : {1.f, 10.f, 30.f}) run<4>(s, 1 << 20, false);
  run<4>(10.f, 4 << 20, false);
  run<4>(10.f, 8192, false);
  for (float s : {1.f, 10.f, 30.f}) run<8>(s, 1 << 20, false);
  run<8>(10.f, 8192, false);
  return 0;
}
