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

// x' of 4 columns of one token, around stream 0 as postmix_fwd forms it (Newton's rows sum to one, so
// Σ_j H[i, j] x_j = x_0 + Σ_j H[i, j] (x_j − x_0)): xs the streams' 8-byte groups, yv y's, hr H_res[i, 1..3],
// hp H_post[i]; each stream's result rounded to bf16 and packed into xp[i] (xp may be xs: it is read first).
__device__ __forceinline__ void postmix4(const uint2 (&xs)[kStreams], uint2 yv,
                                         const float (&hr)[kStreams][kStreams - 1], const float (&hp)[kStreams],
                                         uint2 (&xp)[kStreams]) {
  float x0[4], d[kStreams - 1][4], yf[4];
  unpack4(xs[0], x0);
  unpack4(yv, yf);
#pragma unroll
  for (int j = 1; j < kStreams; ++j) {
    float xj[4];
    unpack4(xs[j], xj);
#pragma unroll
    for (int e = 0; e < 4; ++e) d[j - 1][e] = xj[e] - x0[e];
  }
#pragma unroll
  for (int i = 0; i < kStreams; ++i) {
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      float mix = hr[i][0] * d[0][e];
      mix = fmaf(hr[i][1], d[1][e], mix);
      mix = fmaf(hr[i][2], d[2][e], mix);
      o[e] = fmaf(hp[i], yf[e], x0[e] + mix);
    }
    xp[i] = pack4(o);
  }
}

// φ's slice of one split, both parts, into shared memory by the whole CTA (no barrier):
// phi_s[(p·Z + z)·row_len + i·cols_per_split + c − c_begin] for the split's `width` columns c of every stream i,
// row_len = 4·cols_per_split + kRowPad; 8 bytes at a time.
__device__ __forceinline__ void load_phi_slice(const __nv_bfloat16* __restrict__ phi2, __nv_bfloat16* phi_s, int C,
                                               int c_begin, int width, int cols_per_split) {
  const int K = kStreams * C, row_len = kStreams * cols_per_split + kRowPad;
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

  load_phi_slice(phi2, phi_s, C, c_begin, width, cols_per_split);
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
        uint2 xs[kStreams], xp[kStreams];
#pragma unroll
        for (int i = 0; i < kStreams; ++i) xs[i] = cur[r][i];
        postmix4(xs, cur[r][kStreams], hr[r], hp[r], xp);
#pragma unroll
        for (int i = 0; i < kStreams; ++i) {
          const uint2 v = xp[i];
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

// ---------------------------------------------------------------------------------------------------------------
// The backward boundary: site k+1's stream_grad (without the branch norm, as the compiled path runs it) and site
// k's post-mix backward on the dx tile just stored, which is site k's dx' (never read back):
//   dx_j = Σ_z (r·dz)_z φ[z, j·C + c] − c2·x_j + h_pre[j]·du + Σ_i H_res[i, j]·dx'_i          (site k+1)
//   dy = Σ_j H_post_k[j]·dx_j,  sums[j·4 + m] += dx_j·x_k[m],  sums[16 + j] += dx_j·y_k        (site k)
// The (r·dz)φ product on mma.sync m16n8k8 in tf32 (stream_grad's precision for bf16 streams), K = 24 in three
// steps; φ's slice in shared memory, stored already in each lane's B-fragment order (one 16-byte load a lane
// for both n-tiles of a chunk). The D fragment's columns are permuted so that a lane holds columns 4t .. 4t+3
// of its two rows, as in the forward: 8-byte loads and stores.

constexpr int kSums = kStreams * kStreams + kStreams;  // 20 sums a token: ⟨dx_j, x_k[m]⟩, then ⟨dx_j, y_k⟩

// Floats of one CTA's shared memory: for each 16-column chunk, stream, k-step and lane, four tf32 values
// (n-tile 0: b0, b1; n-tile 1: b0, b1).
constexpr int kCoefs = 1 + kStreams + kStreams * kStreams + kStreams;  // c2, h_pre, H_res, H_post_k

inline int grad_shared_bytes(int cols_per_split, int warps, bool coef_smem) {
  const int phi_floats = (cols_per_split / 16) * kStreams * 3 * 32 * 4;
  const int coef_floats = coef_smem ? warps * kTokensPerWarp * kCoefs : 0;
  return (phi_floats + coef_floats) * static_cast<int>(sizeof(float));
}

__device__ __forceinline__ uint32_t to_tf32(float v) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(v));
  return r;
}

__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// dout (site k+1's dx'), x, dx, x_k [T, 4, C] bf16; du, y_k, dy [T, C] bf16; work [T, 2Z + 4] fp32 (r·dz in its
// first Z columns, c2 in its last); phi [Z, 4C] fp32; h, h_k [T, 8] fp32 (h_pre = h[:, :4], H_post_k =
// 2 h_k[:, 4:]); hres [T, 4, 4] fp32; sums [splits, T, 20] fp32.
// COEF_SMEM: each warp's per-token coefficients (c2, h_pre, H_res, H_post_k: 25 a token) in shared memory, read
// where used, instead of 50 registers a lane (the kernel otherwise holds about 250).
template <int WARPS, bool COEF_SMEM>
__global__ void __launch_bounds__(WARPS * 32) grad_boundary_kernel(
    const __nv_bfloat16* __restrict__ dout, const __nv_bfloat16* __restrict__ du,
    const __nv_bfloat16* __restrict__ x, const float* __restrict__ work, const float* __restrict__ phi,
    const float* __restrict__ h, const float* __restrict__ hres, __nv_bfloat16* __restrict__ dx,
    const __nv_bfloat16* __restrict__ x_k, const __nv_bfloat16* __restrict__ y_k, const float* __restrict__ h_k,
    __nv_bfloat16* __restrict__ dy, float* __restrict__ sums, int T, int C, int cols_per_split) {
  constexpr int kTokensPerCta = WARPS * kTokensPerWarp;
  constexpr int kWork = 2 * kZ + 4;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  uint32_t* phi_s = reinterpret_cast<uint32_t*>(smem_raw);
  const int K = kStreams * C;
  const int split = blockIdx.x;
  const int c_begin = split * cols_per_split;
  const int c_end = min(c_begin + cols_per_split, C);
  const int chunks = (c_end - c_begin) / 16;

  // φ's slice in fragment order: slot ((ch·4 + i)·3 + ks)·32 + lane holds n-tile 0's (b0, b1), n-tile 1's.
  // b0 is (k = t, n = g), b1 (k = t + 4, n = g); logical n = g of n-tile nt is the chunk's column
  // 4·(g / 2) + g % 2 + 2·nt, so that D's columns 2t, 2t+1 of n-tiles 0 and 1 are columns 4t .. 4t+3.
  for (int e = threadIdx.x; e < chunks * kStreams * 3 * 32 * 4; e += blockDim.x) {
    const int q = e % 4, ln = (e / 4) % 32, ks = (e / 128) % 3, i = (e / 384) % kStreams, ch = e / 1536;
    const int gg = ln / 4, tt = ln % 4, nt = q / 2, which = q % 2;
    const int z = ks * 8 + tt + 4 * which;
    const int col = c_begin + ch * 16 + 4 * (gg / 2) + gg % 2 + 2 * nt;
    phi_s[e] = to_tf32(phi[(size_t)z * K + i * C + col]);
  }
  __syncthreads();

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int tiles = (T + kTokensPerCta - 1) / kTokensPerCta;
  for (int tile = blockIdx.y; tile < tiles; tile += gridDim.y) {
    int rows[2];
    bool ok[2];
    rows[0] = tile * kTokensPerCta + warp * kTokensPerWarp + g;
    rows[1] = rows[0] + 8;
    ok[0] = rows[0] < T;
    ok[1] = rows[1] < T;
    // A fragments of r·dz for the three k-steps: a0 (row g, k t), a1 (row g+8, k t), a2 (row g, k t+4),
    // a3 (row g+8, k t+4).
    uint32_t a[3][4];
#pragma unroll
    for (int ks = 0; ks < 3; ++ks)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int r = q % 2, z = ks * 8 + t + 4 * (q / 2);
        a[ks][q] = to_tf32(ok[r] ? work[(size_t)rows[r] * kWork + z] : 0.f);
      }
    // c2, h_pre[4], H_res[4][4] (i·4 + j), H_post_k[4] of a row: a token's 25 coefficients
    auto coef_of_row = [&](int row, int v) -> float {
      if (row >= T) return 0.f;
      if (v == 0) return work[(size_t)row * kWork + kWork - 1];
      if (v <= kStreams) return h[(size_t)row * (2 * kStreams) + v - 1];
      if (v <= kStreams + kStreams * kStreams) return hres[(size_t)row * kStreams * kStreams + v - 1 - kStreams];
      return 2.f * h_k[(size_t)row * (2 * kStreams) + kStreams + (v - 1 - kStreams - kStreams * kStreams)];
    };
    float creg[2][kCoefs];
    float* coef_s = reinterpret_cast<float*>(phi_s + chunks * kStreams * 3 * 32 * 4) + warp * kTokensPerWarp * kCoefs;
    if constexpr (COEF_SMEM) {
      __syncwarp();  // the previous tile's reads are done
      for (int e = lane; e < kTokensPerWarp * kCoefs; e += 32)
        coef_s[e] = coef_of_row(tile * kTokensPerCta + warp * kTokensPerWarp + e / kCoefs, e % kCoefs);
      __syncwarp();
    } else {
#pragma unroll
      for (int r = 0; r < 2; ++r)
#pragma unroll
        for (int v = 0; v < kCoefs; ++v) creg[r][v] = coef_of_row(rows[r], v);
    }
    auto coef = [&](int r, int v) -> float {
      if constexpr (COEF_SMEM) {
        return coef_s[(g + 8 * r) * kCoefs + v];
      } else {
        return creg[r][v];
      }
    };
    float acc[2][kSums];
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int v = 0; v < kSums; ++v) acc[r][v] = 0.f;

    for (int ch = 0; ch < chunks; ++ch) {
      const int col = c_begin + ch * 16 + 4 * t;
      uint2 dov[2][kStreams], xv[2][kStreams], xkv[2][kStreams], duv[2], ykv[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const size_t base = (size_t)rows[r] * K + col;
#pragma unroll
        for (int i = 0; i < kStreams; ++i) {
          dov[r][i] = load8(dout + base + i * C, ok[r]);
          xv[r][i] = load8(x + base + i * C, ok[r]);
          xkv[r][i] = load8(x_k + base + i * C, ok[r]);
        }
        duv[r] = load8(du + (size_t)rows[r] * C + col, ok[r]);
        ykv[r] = load8(y_k + (size_t)rows[r] * C + col, ok[r]);
      }
      float dyv[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
#pragma unroll
      for (int j = 0; j < kStreams; ++j) {
        // (r·dz)φ for stream j: n-tile 0 gives columns 4t, 4t+1, n-tile 1 columns 4t+2, 4t+3
        float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int ks = 0; ks < 3; ++ks) {
          const uint4 b = *reinterpret_cast<const uint4*>(phi_s + ((((ch * kStreams + j) * 3 + ks) * 32 + lane) * 4));
          mma_tf32_1688(d0, a[ks], b.x, b.y);
          mma_tf32_1688(d1, a[ks], b.z, b.w);
        }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          float xj[4], duf[4], o[4];
          unpack4(xv[r][j], xj);
          unpack4(duv[r], duf);
          const float dotv[4] = {d0[2 * r], d0[2 * r + 1], d1[2 * r], d1[2 * r + 1]};
#pragma unroll
          for (int e = 0; e < 4; ++e) o[e] = fmaf(coef(r, 1 + j), duf[e], dotv[e] - coef(r, 0) * xj[e]);
#pragma unroll
          for (int i = 0; i < kStreams; ++i) {
            float di[4];
            unpack4(dov[r][i], di);
#pragma unroll
            for (int e = 0; e < 4; ++e) o[e] = fmaf(coef(r, 1 + kStreams + i * kStreams + j), di[e], o[e]);
          }
          const uint2 v = pack4(o);
          if (ok[r]) *reinterpret_cast<uint2*>(dx + (size_t)rows[r] * K + j * C + col) = v;
          // site k's post-mix backward on the stored (rounded) values
          float d[4], yk[4];
          unpack4(v, d);
          unpack4(ykv[r], yk);
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            dyv[r][e] = fmaf(coef(r, 1 + kStreams + kStreams * kStreams + j), d[e], dyv[r][e]);
            acc[r][kStreams * kStreams + j] = fmaf(d[e], yk[e], acc[r][kStreams * kStreams + j]);
          }
#pragma unroll
          for (int m = 0; m < kStreams; ++m) {
            float xm[4];
            unpack4(xkv[r][m], xm);
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[r][j * kStreams + m] = fmaf(d[e], xm[e], acc[r][j * kStreams + m]);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < 2; ++r)
        if (ok[r]) *reinterpret_cast<uint2*>(dy + (size_t)rows[r] * C + col) = pack4(dyv[r]);
    }
    // the sums over the row's four lanes, then lane t writes the values v ≡ t (mod 4)
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int v = 0; v < kSums; ++v) {
        acc[r][v] += __shfl_xor_sync(0xffffffffu, acc[r][v], 1);
        acc[r][v] += __shfl_xor_sync(0xffffffffu, acc[r][v], 2);
      }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (!ok[r]) continue;
      float* dst = sums + ((size_t)split * T + rows[r]) * kSums;
#pragma unroll
      for (int v = 0; v < kSums; ++v)
        if (v % 4 == t) dst[v] = acc[r][v];
    }
  }
}

}  // namespace boundary_proto
