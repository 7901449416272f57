// A measurement prototype (benchmarks/site/boundary_sweep.py), not a path of the library: the next site's dot
// products x φᵀ and square sums Σ x², as mhc/fused/kernels.py's coeff_partial computes them, in CUDA with φ's
// slice resident in shared memory; with POSTMIX, the previous site's post-mix first (x' = H_res x + H_post ⊗ y,
// written around stream 0 as postmix_fwd does), its x' stored and multiplied in registers, never read back.
//
// n = 4 streams, bf16 streams, Z = 24 coefficient columns. One CTA: 4 or 8 warps, 16 tokens a warp, one split of
// the columns (cols_per_split of every stream, a multiple of 16), looping over token tiles with φ's slice in
// shared memory (φ in two bf16 parts, hi + lo, as coeff_partial's "bf16x2"). The dots run on mma.sync
// m16n8k16 (bf16 in, fp32 accumulate).
//
// The k order inside a 16-column chunk is permuted: lane (g, t) (g = lane / 4, t = lane % 4) holds columns
// 4t .. 4t + 3 of its rows, one 8-byte load, as the A fragment's k = 2t, 2t + 1, 2t + 8, 2t + 9; the B fragment
// takes φ's columns in the same order, so the products are the same sum in another order.
#pragma once

#include <cuda_bf16.h>
#include <stdint.h>

namespace boundary_proto {

constexpr int kStreams = 4;
constexpr int kZ = 24;       // n² + 2n
constexpr int kZP = 32;      // a row of part: the Z dots, then Σ x² in column Z, zeros after
constexpr int kTokensPerWarp = 16;
constexpr int kRowPad = 16;  // bf16 elements after each φ row in shared memory: 8-byte B loads without bank conflicts

// Shared memory bytes of one CTA: φ's two parts, Z rows of 4·cols_per_split (+ pad) bf16 each.
inline int shared_bytes(int cols_per_split) {
  return 2 * kZ * (kStreams * cols_per_split + kRowPad) * static_cast<int>(sizeof(__nv_bfloat16));
}

__device__ __forceinline__ void mma_bf16_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void unpack4(uint2 v, float (&f)[4]) {
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&v.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&v.y);
  const float2 a = __bfloat1622float2(lo), b = __bfloat1622float2(hi);
  f[0] = a.x;
  f[1] = a.y;
  f[2] = b.x;
  f[3] = b.y;
}

// Four floats rounded to bf16 (round to nearest even, as torch's .to(bfloat16)), packed as one 8-byte word.
__device__ __forceinline__ uint2 pack4(const float (&f)[4]) {
  __nv_bfloat162 lo = __floats2bfloat162_rn(f[0], f[1]);
  __nv_bfloat162 hi = __floats2bfloat162_rn(f[2], f[3]);
  uint2 v;
  v.x = *reinterpret_cast<uint32_t*>(&lo);
  v.y = *reinterpret_cast<uint32_t*>(&hi);
  return v;
}

__device__ __forceinline__ uint2 load8(const __nv_bfloat16* p, bool ok) {
  return ok ? __ldg(reinterpret_cast<const uint2*>(p)) : make_uint2(0u, 0u);
}

// One 16-column chunk of a lane's two rows: the streams (and, with the post-mix, y), 8 bytes each.
template <bool POSTMIX>
__device__ __forceinline__ void load_chunk(uint2 (&v)[2][kStreams + 1], const __nv_bfloat16* __restrict__ x,
                                           const __nv_bfloat16* __restrict__ y, const int (&rows)[2],
                                           const bool (&ok)[2], int K, int C, int col) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const __nv_bfloat16* xr = x + (size_t)rows[r] * K + col;
#pragma unroll
    for (int j = 0; j < kStreams; ++j) v[r][j] = load8(xr + j * C, ok[r]);
    if constexpr (POSTMIX) v[r][kStreams] = load8(y + (size_t)rows[r] * C + col, ok[r]);
  }
}

// x [T, 4, C] bf16 (POSTMIX: site k's streams; else the streams whose dots are taken); y [T, C] bf16, h [T, 8]
// fp32 (H_post = 2 h[:, 4:]), hres [T, 4, 4] fp32, out [T, 4, C] bf16 (POSTMIX only); phi2 [2, Z, 4C] bf16
// (φ's hi and lo parts); part [splits, T, ZP] fp32. WARPS warps a CTA, 16 tokens each. PREFETCH: a chunk's
// loads are issued before the previous chunk's arithmetic (across token tiles too), in twice the registers.
template <bool POSTMIX, bool PREFETCH, int WARPS>
__global__ void __launch_bounds__(WARPS * 32) boundary_dots_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ y, const float* __restrict__ h,
    const float* __restrict__ hres, __nv_bfloat16* __restrict__ out, const __nv_bfloat16* __restrict__ phi2,
    float* __restrict__ part, int T, int C, int cols_per_split) {
  constexpr int kTokensPerCta = WARPS * kTokensPerWarp;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __nv_bfloat16* phi_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  const int K = kStreams * C;
  const int split = blockIdx.x;
  const int c_begin = split * cols_per_split;
  const int c_end = min(c_begin + cols_per_split, C);
  const int width = c_end - c_begin;  // a multiple of 16
  const int row_len = kStreams * cols_per_split + kRowPad;

  // φ's slice for this split, both parts: phi_s[p][z][i * cols_per_split + c - c_begin], 8 bytes at a time.
  {
    const int quads = width / 4;  // 8-byte groups per stream and row
    const int total = 2 * kZ * kStreams * quads;
    for (int e = threadIdx.x; e < total; e += blockDim.x) {
      const int q = e % quads;
      const int i = (e / quads) % kStreams;
      const int pz = e / (quads * kStreams);  // p * Z + z
      const uint2 v = __ldg(reinterpret_cast<const uint2*>(phi2 + (size_t)pz * K + i * C + c_begin + 4 * q));
      *reinterpret_cast<uint2*>(phi_s + pz * row_len + i * cols_per_split + 4 * q) = v;
    }
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int tiles = (T + kTokensPerCta - 1) / kTokensPerCta;
  const int chunks = width / 16;
  int tile = blockIdx.y, chunk = 0;
  if (tile >= tiles) return;  // (no barrier follows)
  auto rows_of = [&](int tl, int (&rows)[2], bool (&ok)[2]) {
    rows[0] = tl * kTokensPerCta + warp * kTokensPerWarp + g;  // this lane's rows r0 and r0 + 8
    rows[1] = rows[0] + 8;
    ok[0] = rows[0] < T;
    ok[1] = rows[1] < T;
  };
  int rows[2];
  bool ok[2];
  rows_of(tile, rows, ok);
  uint2 cur[2][kStreams + 1];
  load_chunk<POSTMIX>(cur, x, y, rows, ok, K, C, c_begin + 4 * t);

  float acc[3][4];
  float sq[2];
  float hr[2][kStreams][kStreams - 1];  // the post-mix's per-token coefficients: H_res[i, 1..3], H_post[i]
  float hp[2][kStreams];
  for (;;) {
    if (chunk == 0) {
#pragma unroll
      for (int nt = 0; nt < 3; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
      sq[0] = sq[1] = 0.f;
      if constexpr (POSTMIX) {
#pragma unroll
        for (int r = 0; r < 2; ++r)
#pragma unroll
          for (int i = 0; i < kStreams; ++i) {
            hp[r][i] = ok[r] ? 2.f * h[(size_t)rows[r] * (2 * kStreams) + kStreams + i] : 0.f;
#pragma unroll
            for (int j = 1; j < kStreams; ++j)
              hr[r][i][j - 1] = ok[r] ? hres[((size_t)rows[r] * kStreams + i) * kStreams + j] : 0.f;
          }
      }
    }
    // The next chunk, possibly of the next tile.
    int next_tile = tile, next_chunk = chunk + 1;
    if (next_chunk == chunks) {
      next_chunk = 0;
      next_tile += gridDim.y;
    }
    const bool has_next = next_tile < tiles;
    int next_rows[2];
    bool next_ok[2];
    rows_of(next_tile, next_rows, next_ok);
    uint2 nxt[2][kStreams + 1];
    if constexpr (PREFETCH) {
      if (has_next) load_chunk<POSTMIX>(nxt, x, y, next_rows, next_ok, K, C, c_begin + next_chunk * 16 + 4 * t);
    }

    const int c0 = c_begin + chunk * 16;
    const int col = c0 + 4 * t;
    const int kk = c0 - c_begin + 4 * t;  // this lane's column in φ's slice, within each stream's block
    // A fragments, one per stream: a[i][0] (row g, k 2t..2t+1), a[i][1] (row g+8), a[i][2] (row g, k 2t+8..),
    // a[i][3] (row g+8, k 2t+8..): here columns 4t, 4t+1 and 4t+2, 4t+3 of the chunk.
    uint32_t a[kStreams][4];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if constexpr (POSTMIX) {
        float x0[4], d[kStreams - 1][4], yf[4];
        unpack4(cur[r][0], x0);
        unpack4(cur[r][kStreams], yf);
#pragma unroll
        for (int j = 1; j < kStreams; ++j) {
          float xj[4];
          unpack4(cur[r][j], xj);
#pragma unroll
          for (int e = 0; e < 4; ++e) d[j - 1][e] = xj[e] - x0[e];
        }
#pragma unroll
        for (int i = 0; i < kStreams; ++i) {
          float o[4];
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // Newton's rows sum to one: Σ_j H[i, j] x_j = x_0 + Σ_j H[i, j] (x_j − x_0)
            float mix = hr[r][i][0] * d[0][e];
            mix = fmaf(hr[r][i][1], d[1][e], mix);
            mix = fmaf(hr[r][i][2], d[2][e], mix);
            o[e] = fmaf(hp[r][i], yf[e], x0[e] + mix);
          }
          const uint2 v = pack4(o);
          if (ok[r]) *reinterpret_cast<uint2*>(out + (size_t)rows[r] * K + i * C + col) = v;
          a[i][r] = v.x;      // columns 4t, 4t+1 (k 2t, 2t+1)
          a[i][r + 2] = v.y;  // columns 4t+2, 4t+3 (k 2t+8, 2t+9)
        }
      } else {
#pragma unroll
        for (int i = 0; i < kStreams; ++i) {
          a[i][r] = cur[r][i].x;
          a[i][r + 2] = cur[r][i].y;
        }
      }
    }
    // The square sums of the values as stored (rounded), and the dots on the tensor cores.
#pragma unroll
    for (int i = 0; i < kStreams; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float f[4];
        unpack4(make_uint2(a[i][r], a[i][r + 2]), f);
#pragma unroll
        for (int e = 0; e < 4; ++e) sq[r] = fmaf(f[e], f[e], sq[r]);
      }
#pragma unroll
      for (int p = 0; p < 2; ++p)
#pragma unroll
        for (int nt = 0; nt < 3; ++nt) {
          const int z = nt * 8 + g;  // B fragment: column n = g of this n-tile
          const uint2 b = *reinterpret_cast<const uint2*>(phi_s + (p * kZ + z) * row_len + i * cols_per_split + kk);
          mma_bf16_16816(acc[nt], a[i], b.x, b.y);
        }
    }

    if (chunk == chunks - 1) {  // the tile's last chunk: its rows of part
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        // Σ x² over the row's four lanes (every lane takes part, whether its row is in range or not)
        sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 1);
        sq[r] += __shfl_xor_sync(0xffffffffu, sq[r], 2);
      }
      // D fragment: acc[nt][0..1] row g, columns 8 nt + 2t, +1; acc[nt][2..3] row g + 8.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        if (!ok[r]) continue;
        float* dst = part + ((size_t)split * T + rows[r]) * kZP;
#pragma unroll
        for (int nt = 0; nt < 3; ++nt)
          *reinterpret_cast<float2*>(dst + nt * 8 + 2 * t) = make_float2(acc[nt][2 * r], acc[nt][2 * r + 1]);
        *reinterpret_cast<float2*>(dst + kZ + 2 * t) = make_float2(t == 0 ? sq[r] : 0.f, 0.f);
      }
    }
    if (!has_next) break;
    if constexpr (PREFETCH) {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int j = 0; j <= kStreams; ++j) cur[r][j] = nxt[r][j];
    } else {
      load_chunk<POSTMIX>(cur, x, y, next_rows, next_ok, K, C, c_begin + next_chunk * 16 + 4 * t);
    }
    tile = next_tile;
    chunk = next_chunk;
    rows[0] = next_rows[0];
    rows[1] = next_rows[1];
    ok[0] = next_ok[0];
    ok[1] = next_ok[1];
  }
}

}  // namespace boundary_proto
