// A measurement prototype (benchmarks/site/boundary_sweep.py), not a path of the library: coeff_partial's dot
// products x φᵀ and square sums Σ x², as boundary_dots_kernel computes them (with the previous site's post-mix
// first, or without), but with the streams staged through shared memory by cp.async in a STAGES-deep ring
// instead of loaded straight into registers.
//
// Why: boundary_dots_kernel (8-byte loads into the fragments' layout, one chunk ahead at most) kept too few bytes
// in flight and reached 0.45-0.50x a device copy (notes/training_cost.md, eleventh session). Here each thread
// issues 16-byte cp.async copies of STAGES - 1 chunks ahead, so a CTA has (STAGES - 1) x 16·WARPS tokens x
// 4·CW columns in flight whatever its register count, and the arithmetic reads the tiles from shared memory.
//
// A CTA: WARPS warps, 16 tokens a warp; one split of the columns (cols_per_split of every stream) with φ's slice
// resident (both bf16 parts, laid out as boundary_dots_kernel lays them); it walks its token tiles (blockIdx.y,
// then every gridDim.y-th) in chunks of CW columns of every stream, the chunks of all its tiles forming one
// pipeline. The k order inside a 16-column step is boundary_dots_kernel's: lane (g, t) takes columns 4t .. 4t+3
// of rows g and g + 8, one 8-byte shared load each, as the A fragment's k = 2t, 2t+1, 2t+8, 2t+9.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

#include "boundary_dots.cuh"

namespace boundary_proto {

// A token's row of a stage: CW columns of each of the 4 streams (and, with the post-mix, of y), then padding so
// that consecutive rows start 8 banks apart mod 32 (row length ≡ 16 elements mod 64): the 8-byte loads of a half
// warp (rows g .. g+3, lanes t) then hit 32 distinct banks. The padding is a multiple of 8 elements, so every
// row stays 16-byte aligned for cp.async.
__host__ __device__ constexpr int pipe_row_elements(int chunk_cols, bool postmix) {
  const int cols = (kStreams + (postmix ? 1 : 0)) * chunk_cols;
  return cols + ((16 - cols) % 64 + 64) % 64;
}

inline int pipe_stage_elements(int warps, int chunk_cols, bool postmix) {
  return warps * kTokensPerWarp * pipe_row_elements(chunk_cols, postmix);
}

// Shared memory bytes of one CTA: φ's slice (as boundary_dots_kernel's), then the STAGES tiles.
inline int pipe_shared_bytes(int cols_per_split, int warps, int chunk_cols, int stages, bool postmix) {
  return shared_bytes(cols_per_split) +
         stages * pipe_stage_elements(warps, chunk_cols, postmix) * static_cast<int>(sizeof(__nv_bfloat16));
}

// 16 bytes global -> shared, bypassing L1; with ok false the 16 bytes are zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool ok) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = ok ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(PENDING));
}

// x [T, 4, C] bf16; phi2 [2, Z, 4C] bf16 (φ's hi and lo parts); part [splits, T, ZP] fp32. C and cols_per_split
// are multiples of CW (so every split's width is). POSTMIX: x is site k's streams, and the dots are taken of
// x' = H_res x + H_post ⊗ y (y [T, C] bf16, h [T, 8] fp32 with H_post = 2 h[:, 4:], hres [T, 4, 4] fp32), formed
// in registers around stream 0 as postmix_fwd does, stored to out [T, 4, C] and multiplied as stored (rounded).
template <bool POSTMIX, int WARPS, int CW, int STAGES>
__global__ void __launch_bounds__(WARPS * 32) dots_pipe_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ y, const float* __restrict__ h,
    const float* __restrict__ hres, __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ phi2,
    float* __restrict__ part, int T, int C, int cols_per_split) {
  static_assert(CW % 16 == 0 && STAGES >= 2, "CW: a multiple of 16 columns; at least two stages");
  constexpr int kThreads = WARPS * 32;
  constexpr int kTokens = WARPS * kTokensPerWarp;              // a tile
  constexpr int kSegments = kStreams + (POSTMIX ? 1 : 0);      // the streams' CW columns, then y's
  constexpr int kRow = pipe_row_elements(CW, POSTMIX);        // a token's row in a stage, elements
  constexpr int kStage = kTokens * kRow;                       // a stage, elements
  constexpr int kPiecesPerSegment = CW / 8;                    // 16-byte pieces of one segment
  constexpr int kPieces = kTokens * kSegments * kPiecesPerSegment;
  static_assert(kPieces % kThreads == 0, "whole pieces a thread");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* phi_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int K = kStreams * C;
  const int split = blockIdx.x;
  const int c_begin = split * cols_per_split;
  const int width = min(c_begin + cols_per_split, C) - c_begin;  // a multiple of CW
  const int row_len = kStreams * cols_per_split + kRowPad;
  __nv_bfloat16* stages_s = phi_s + 2 * kZ * row_len;  // 16-byte aligned: row_len is a multiple of 16

  const int tiles = (T + kTokens - 1) / kTokens;
  const int my_tiles = blockIdx.y < tiles ? (tiles - 1 - static_cast<int>(blockIdx.y)) / gridDim.y + 1 : 0;
  const int chunks = width / CW;
  const int total = my_tiles * chunks;  // this CTA's pipeline: chunk (it % chunks) of its tile (it / chunks)

  // The loads of pipeline step `it` into stage it % STAGES; a group is committed even when there is nothing
  // left to load, so that cp.async.wait_group's count always means "all but the newest STAGES - 2 steps".
  auto issue = [&](int it) {
    if (it < total) {
      const int tile = blockIdx.y + (it / chunks) * gridDim.y;
      const int c0 = c_begin + (it % chunks) * CW;
      __nv_bfloat16* dst = stages_s + (it % STAGES) * kStage;
#pragma unroll
      for (int k = 0; k < kPieces / kThreads; ++k) {
        const int p = threadIdx.x + k * kThreads;  // consecutive threads, consecutive 16 bytes of a stream
        const int q = p % kPiecesPerSegment;
        const int i = (p / kPiecesPerSegment) % kSegments;  // kStreams: y
        const int tok = p / (kPiecesPerSegment * kSegments);
        const int row = tile * kTokens + tok;
        const bool ok = row < T;
        const __nv_bfloat16* src = x;
        if (ok) src = i < kStreams ? x + (size_t)row * K + i * C + c0 + q * 8 : y + (size_t)row * C + c0 + q * 8;
        cp_async16(dst + tok * kRow + i * CW + q * 8, src, ok);
      }
    }
    cp_async_commit();
  };

  // The first STAGES - 1 steps in flight while φ's slice is loaded.
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  load_phi_slice(phi2, phi_s, C, c_begin, width, cols_per_split);

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  float acc[3][4];
  float sq[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 3; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
  float hr[2][kStreams][kStreams - 1];  // POSTMIX: this lane's two tokens' H_res[i, 1..3] and H_post[i]
  float hp[2][kStreams];

  for (int it = 0; it < total; ++it) {
    const int chunk = it % chunks;
    const int row0 = (blockIdx.y + (it / chunks) * gridDim.y) * kTokens + warp * kTokensPerWarp + g;
    if constexpr (POSTMIX) {
      if (chunk == 0) {  // a new tile: its tokens' coefficients, read while the tile's loads are in flight
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = row0 + 8 * r;
          const bool ok = row < T;
#pragma unroll
          for (int i = 0; i < kStreams; ++i) {
            hp[r][i] = ok ? 2.f * h[(size_t)row * (2 * kStreams) + kStreams + i] : 0.f;
#pragma unroll
            for (int j = 1; j < kStreams; ++j)
              hr[r][i][j - 1] = ok ? hres[((size_t)row * kStreams + i) * kStreams + j] : 0.f;
          }
        }
      }
    }
    cp_async_wait<STAGES - 2>();
    // Step it's tile is in every thread's view, and every warp is done with step it - 1's stage, which the
    // next issue overwrites (the first pass through here also publishes φ's slice).
    __syncthreads();
    issue(it + STAGES - 1);

    const __nv_bfloat16* rows_s = stages_s + (it % STAGES) * kStage + (warp * kTokensPerWarp + g) * kRow;
#pragma unroll
    for (int ks = 0; ks < CW / 16; ++ks) {
      // this lane's 4 columns of rows g and g + 8 (8 bytes each) of every stream: the streams' values, or with
      // the post-mix x' formed from the streams and y, stored, and kept as stored
      uint2 v[2][kStreams];
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int i = 0; i < kStreams; ++i)
          v[r][i] = *reinterpret_cast<const uint2*>(rows_s + r * 8 * kRow + i * CW + ks * 16 + 4 * t);
      if constexpr (POSTMIX) {
        const int col = c_begin + chunk * CW + ks * 16 + 4 * t;  // in the [T, 4, C] streams
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const uint2 yv = *reinterpret_cast<const uint2*>(rows_s + r * 8 * kRow + kStreams * CW + ks * 16 + 4 * t);
          postmix4(v[r], yv, hr[r], hp[r], v[r]);
          const int row = row0 + 8 * r;
          if (row < T) {
#pragma unroll
            for (int i = 0; i < kStreams; ++i) *reinterpret_cast<uint2*>(out + (size_t)row * K + i * C + col) = v[r][i];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kStreams; ++i) {
        const uint2 r0 = v[0][i], r1 = v[1][i];  // rows g and g + 8
        const uint32_t a[4] = {r0.x, r1.x, r0.y, r1.y};
        float f[4];
        unpack4(r0, f);
#pragma unroll
        for (int e = 0; e < 4; ++e) sq[0] = fmaf(f[e], f[e], sq[0]);
        unpack4(r1, f);
#pragma unroll
        for (int e = 0; e < 4; ++e) sq[1] = fmaf(f[e], f[e], sq[1]);
        const int kk = i * cols_per_split + chunk * CW + ks * 16 + 4 * t;  // the same columns of φ's slice
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int nt = 0; nt < 3; ++nt) {
            const uint2 b = *reinterpret_cast<const uint2*>(phi_s + (p * kZ + nt * 8 + g) * row_len + kk);
            mma_bf16_16816(acc[nt], a, b.x, b.y);
          }
      }
    }

    if (chunk == chunks - 1) {  // the tile's last chunk: its rows of part, then a fresh start for the next tile
#pragma unroll
      for (int r = 0; r < 2; ++r) {  // Σ x² over the row's four lanes (every lane takes part)
        sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 1);
        sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 2);
      }
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = row0 + 8 * r;
        if (row >= T) continue;
        float* dst = part + ((size_t)split * T + row) * kZP;
        // D fragment: acc[nt][0..1] row g, columns 8 nt + 2t, +1; acc[nt][2..3] row g + 8.
#pragma unroll
        for (int nt = 0; nt < 3; ++nt)
          *reinterpret_cast<float2*>(dst + nt * 8 + 2 * t) = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
        *reinterpret_cast<float2*>(dst + kZ + 2 * t) = make_float2(t == 0 ? sq[r] : 0.f, 0.f);
      }
      sq[0] = sq[1] = 0.f;
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
    }
  }
  cp_async_wait<0>();  // the empty groups of the last steps, before the CTA's shared memory is released
}

}  // namespace boundary_proto
