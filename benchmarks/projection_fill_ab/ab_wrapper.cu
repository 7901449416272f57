// A/B wrapper of the Birkhoff forward kernel (n = 4, fp32), no torch headers:
// called from ab.py through ctypes. Built once against the original headers
// and once against the working tree's (AB_NEW), as two separate libraries.
#include <cuda_runtime.h>
#include <cstdint>
#include "birkhoff_kernels.cuh"

using namespace mhc_birkhoff;

// variant 0: the kernel as birkhoff.cu launches it (the only one left; the
// argument stays for other variants of an A/B).
extern "C" int ab_forward(const void* R, void* out, long long B, float tol, int max_iter, int threads,
                          int variant, void* stream) {
  if (B <= 0) return 0;
  const long long blocks = (B + threads - 1) / threads;
  const bool vec = ((reinterpret_cast<uintptr_t>(R) | reinterpret_cast<uintptr_t>(out)) & 15) == 0;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const float* src = reinterpret_cast<const float*>(R);
  float* dst = reinterpret_cast<float*>(out);
  if (variant == 0) {
    birkhoff_forward_kernel<4, float><<<(unsigned)blocks, threads, 0, s>>>(src, dst, B, tol, max_iter, nullptr,
                                                                          nullptr, vec);
  } else {
    return -1;
  }
  return (int)cudaGetLastError();
}

extern "C" long long ab_unconverged(int reset) {
  unsigned long long v = 0;
  if (cudaDeviceSynchronize() != cudaSuccess) return -1;
  if (cudaMemcpyFromSymbol(&v, g_unconverged, sizeof(v)) != cudaSuccess) return -1;
  if (reset) {
    const unsigned long long zero = 0;
    if (cudaMemcpyToSymbol(g_unconverged, &zero, sizeof(zero)) != cudaSuccess) return -1;
  }
  return (long long)v;
}
