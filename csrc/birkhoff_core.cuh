// Per-matrix Birkhoff solver and implicit-gradient pieces (design.md §2),
// host+device so that the same code can be exercised on a CPU
// (tests and scripts) as well as run inside the CUDA kernels of birkhoff.cu.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MHC_HD __host__ __device__ __forceinline__
#else
#define MHC_HD inline
#endif

namespace mhc_birkhoff {

using std::fabs;
using std::isfinite;

constexpr int kMaxHalvings = 30;      // as _MAX_HALVINGS in projection.py
constexpr float kArmijoC1 = 1e-4f;    // as _ARMIJO_C1
constexpr float kEps = 1.1920928955078125e-07f;  // fp32 machine epsilon
constexpr float kTinySum = 1e-20f;    // below this a sum is renormalised in logs
constexpr float kTinyEntry = 1e-30f;  // multiplicative steps only while every T_ij >= this
constexpr float kMaxCheapStep = 40.f; // ... and every |t d_j| <= this
constexpr float kMaxStep = 24.f;      // largest dual move of one Newton step
#ifndef MHC_EXPAND_ERR
#define MHC_EXPAND_ERR 1e-2f
#endif
constexpr float kExpandErr = MHC_EXPAND_ERR;  // extrapolate full steps while the error is above this
constexpr int kMaxExpand = 4;         // up to 16x the Newton step

// Correctly rounded reciprocal, without the IEEE division's slow path.
MHC_HD float mhc_rcp(float x) {
#ifdef __CUDA_ARCH__
  return __frcp_rn(x);
#else
  return 1.f / x;
#endif
}

MHC_HD float mhc_rsqrt(float x) {
#ifdef __CUDA_ARCH__
  return rsqrtf(x);
#else
  return 1.f / std::sqrt(x);
#endif
}

// ----------------------------------------------------------------------------
// Dense pieces, M = N - 1 dual variables.
// ----------------------------------------------------------------------------

// H = diag(Σ_i T_ij Σ_{k≠j} T_ik) - TᵀT on the first N-1 columns; lower triangle.
template <int N>
MHC_HD void dual_hessian(const float (&T)[N][N], float (&H)[N - 1][N - 1]) {
  constexpr int M = N - 1;
#pragma unroll
  for (int j = 0; j < M; ++j)
#pragma unroll
    for (int k = 0; k <= j; ++k) H[j][k] = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float pre[N], suf[N];
    pre[0] = 0.f;
#pragma unroll
    for (int j = 1; j < N; ++j) pre[j] = pre[j - 1] + T[i][j - 1];
    suf[N - 1] = 0.f;
#pragma unroll
    for (int j = N - 2; j >= 0; --j) suf[j] = suf[j + 1] + T[i][j + 1];
#pragma unroll
    for (int j = 0; j < M; ++j) {
      H[j][j] = fmaf(T[i][j], pre[j] + suf[j], H[j][j]);
#pragma unroll
      for (int k = 0; k < j; ++k) H[j][k] = fmaf(-T[i][j], T[i][k], H[j][k]);
    }
  }
}

// Solve (H + E) x = rhs with a modified Cholesky: a ridge of 2·M·eps·max(diag)
// and every pivot clamped to at least that ridge, so the factor always exists
// and is positive definite (x is then a descent direction for rhs = -g).
// H is overwritten by the factor. Returns false if anything is non-finite.
template <int M>
MHC_HD bool spd_solve(float (&H)[M][M], const float (&rhs)[M], float (&x)[M], float shift = 0.f) {
  float scale = 0.f;
#pragma unroll
  for (int j = 0; j < M; ++j) scale = fmaxf(scale, H[j][j]);
  scale = fmaxf(scale, 1e-30f);
  const float ridge = 2.f * M * kEps * scale + shift;
  float inv_diag[M];
#pragma unroll
  for (int j = 0; j < M; ++j) {
    float s = H[j][j] + ridge;
#pragma unroll
    for (int k = 0; k < j; ++k) s = fmaf(-H[j][k], H[j][k], s);
    s = fmaxf(s, ridge);  // also catches NaN -> ridge? fmaxf(NaN, r) = r
    const float inv = mhc_rsqrt(s);
    inv_diag[j] = inv;
#pragma unroll
    for (int i = j + 1; i < M; ++i) {
      float t = H[i][j];
#pragma unroll
      for (int k = 0; k < j; ++k) t = fmaf(-H[i][k], H[j][k], t);
      H[i][j] = t * inv;
    }
  }
  // forward: Ly = rhs
  float y[M];
#pragma unroll
  for (int i = 0; i < M; ++i) {
    float t = rhs[i];
#pragma unroll
    for (int k = 0; k < i; ++k) t = fmaf(-H[i][k], y[k], t);
    y[i] = t * inv_diag[i];
  }
  // back: Lᵀx = y
  bool ok = true;
#pragma unroll
  for (int i = M - 1; i >= 0; --i) {
    float t = y[i];
#pragma unroll
    for (int k = i + 1; k < M; ++k) t = fmaf(-H[k][i], x[k], t);
    x[i] = t * inv_diag[i];
    ok = ok && isfinite(x[i]);
  }
  return ok;
}

// One log-domain Sinkhorn step on (L, T = exp(L)): normalise columns, then rows.
// Sums come from T where they are large enough to be exact, from logsumexp on
// L where a whole column (or row) underflowed; so it never stalls.
// Normalise one row in logs: L -= logsumexp(L), T = exp(L) (max-shifted, so
// it is safe for any finite row).
template <int N>
MHC_HD void row_log_softmax(float (&L)[N], float (&T)[N]) {
  float m = L[0];
#pragma unroll
  for (int j = 1; j < N; ++j) m = fmaxf(m, L[j]);
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    T[j] = expf(L[j] - m);
    s += T[j];
  }
  const float inv = mhc_rcp(s), lse = m + logf(s);
#pragma unroll
  for (int j = 0; j < N; ++j) {
    T[j] *= inv;
    L[j] -= lse;
  }
}

// Slope gᵀd, Σ d and max |d| of a Newton direction.
template <int M>
MHC_HD void direction_stats(const float (&g)[M], const float (&d)[M], float& slope, float& dsum, float& dmax) {
  slope = 0.f, dsum = 0.f, dmax = 0.f;
#pragma unroll
  for (int j = 0; j < M; ++j) {
    slope = fmaf(g[j], d[j], slope);
    dsum += d[j];
    dmax = fmaxf(dmax, fabsf(d[j]));
  }
}

template <int N>
MHC_HD void sinkhorn_sweep(float (&L)[N][N], float (&T)[N][N]) {
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float c = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) c += T[i][j];
    if (c > kTinySum) {
      const float inv = mhc_rcp(c), lc = logf(c);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        T[i][j] *= inv;
        L[i][j] -= lc;
      }
    } else {
      float m = L[0][j];
#pragma unroll
      for (int i = 1; i < N; ++i) m = fmaxf(m, L[i][j]);
      float s = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        T[i][j] = expf(L[i][j] - m);
        s += T[i][j];
      }
      const float inv = mhc_rcp(s), lse = m + logf(s);
#pragma unroll
      for (int i = 0; i < N; ++i) {
        T[i][j] *= inv;
        L[i][j] -= lse;
      }
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) s += T[i][j];
    if (s > kTinySum) {
      const float inv = mhc_rcp(s), ls = logf(s);
#pragma unroll
      for (int j = 0; j < N; ++j) {
        T[i][j] *= inv;
        L[i][j] -= ls;
      }
    } else {
      row_log_softmax<N>(L[i], T[i]);
    }
  }
}

// ----------------------------------------------------------------------------
// Implicit backward (design.md §2), in the cancellation-free form of
// mhc/projection.py: with rc(X)_ij = X_ij - Σ_k T_ik X_ik evaluated as
// Σ_{k≠j} T_ik (X_ij - X_ik) = X_ij·excl_ij - Σ_{k≠j} T_ik X_ik,
//   rhs = (T ∘ rc(G))ᵀ1 [:M],  H w = rhs (w_N = 0),  dR = T ∘ rc(G - 1wᵀ).
// Near a permutation w can be huge along a nearly singular direction while
// dR is tiny; the plain form would leave eps·|w| noise where T ≈ 1.
// ----------------------------------------------------------------------------

template <int N>
MHC_HD void row_centred(const float (&t)[N], const float (&x)[N], float (&out)[N]) {
  float pre_t[N], pre_tx[N];
  pre_t[0] = 0.f;
  pre_tx[0] = 0.f;
#pragma unroll
  for (int j = 1; j < N; ++j) {
    pre_t[j] = pre_t[j - 1] + t[j - 1];
    pre_tx[j] = fmaf(t[j - 1], x[j - 1], pre_tx[j - 1]);
  }
  float suf_t = 0.f, suf_tx = 0.f;
#pragma unroll
  for (int j = N - 1; j >= 0; --j) {
    out[j] = fmaf(x[j], pre_t[j] + suf_t, -(pre_tx[j] + suf_tx));
    suf_t += t[j];
    suf_tx = fmaf(t[j], x[j], suf_tx);
  }
}

// G holds ∂L/∂T on entry and ∂L/∂R on exit.
template <int N>
MHC_HD void implicit_grad(const float (&T)[N][N], float (&G)[N][N]) {
  constexpr int M = N - 1;
  float rhs[M];
#pragma unroll
  for (int j = 0; j < M; ++j) rhs[j] = 0.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float rc[N];
    row_centred<N>(T[i], G[i], rc);
#pragma unroll
    for (int j = 0; j < M; ++j) rhs[j] = fmaf(T[i][j], rc[j], rhs[j]);
  }
  float H[M][M], w[M];
  dual_hessian<N>(T, H);
  if (!spd_solve<M>(H, rhs, w)) {
    // T is a permutation to rounding (or non-finite); ∂T/∂R is 0 there, so
    // any w gives the same result; take w = 0 like the reference.
#pragma unroll
    for (int j = 0; j < M; ++j) w[j] = isfinite(w[j]) ? w[j] : 0.f;
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float x[N], rc[N];
#pragma unroll
    for (int j = 0; j < N; ++j) x[j] = (j < M) ? G[i][j] - w[j < M ? j : 0] : G[i][j];
    row_centred<N>(T[i], x, rc);
#pragma unroll
    for (int j = 0; j < N; ++j) G[i][j] = T[i][j] * rc[j];
  }
}

// ----------------------------------------------------------------------------
// Per-matrix solver. On entry L holds R (finite). On exit T holds the result.
// Returns the number of Newton iterations; err gets the float64 marginal error.
// ----------------------------------------------------------------------------

// Solver state for one matrix: the log-plan L (kept lazily as
// L_ij + a_i + b_j, see step()), the plan T = exp(L) with rows normalised,
// and the iteration count. init() then step() until it returns true.
template <int N>
struct Solver {
  static constexpr int M = N - 1;
  float L[N][N], T[N][N], a[N], b[N];
  bool folded;
  int it;

  // On entry L holds the (finite) logits R.
  MHC_HD void init() {
    // Row softmax of R, then one sweep (the reference's starting point).
#pragma unroll
    for (int i = 0; i < N; ++i) row_log_softmax<N>(L[i], T[i]);
    sinkhorn_sweep<N>(L, T);
#pragma unroll
    for (int i = 0; i < N; ++i) a[i] = b[i] = 0.f;
    folded = true;
    it = 0;
  }

  // A multiplicative step T_ij <- T_ij e^{t d_j} / s_i costs N-1 exps
  // instead of N² and only updates a, b; L is folded (L += a_i + b_j) before
  // anything that needs it (an exp-path trial or a sweep).
  MHC_HD void fold() {
    if (!folded) {
#pragma unroll
      for (int i = 0; i < N; ++i)
#pragma unroll
        for (int j = 0; j < N; ++j) L[i][j] += a[i] + b[j];
#pragma unroll
      for (int i = 0; i < N; ++i) a[i] = b[i] = 0.f;
      folded = true;
    }
  }

  // Check the marginals; if tol is met (or max_iter reached) set err_out and
  // return true, else take one globalised Newton step (or a sweep).
  MHC_HD bool step(float tol, int max_iter, double& err_out) {
    // Hysteresis: the float64 check is only needed once the fp32 one is close.
    const float near = 64.f * tol + 4.f * N * N * kEps;
    const float slack = 8.f * N * kEps;
    // Marginals. fp32 first; float64 when close to tol, where the contract
    // (marginal_error in float64) and the Newton finish need the exact sums.
    float g[M];
    float errf = 0.f, tmin = 1.f;
    {
      float cs[N];
#pragma unroll
      for (int j = 0; j < N; ++j) cs[j] = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float rs = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          rs += T[i][j];
          cs[j] += T[i][j];
          tmin = fminf(tmin, T[i][j]);
        }
        errf += fabsf(rs - 1.f);
      }
#pragma unroll
      for (int j = 0; j < N; ++j) errf += fabsf(cs[j] - 1.f);
#pragma unroll
      for (int j = 0; j < M; ++j) g[j] = cs[j] - 1.f;
    }
    double err = (double)errf;
    if (errf <= near) {
      double cd[N];
#pragma unroll
      for (int j = 0; j < N; ++j) cd[j] = 0.0;
      err = 0.0;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        double rs = 0.0;
#pragma unroll
        for (int j = 0; j < N; ++j) {
          const double t = (double)T[i][j];
          rs += t;
          cd[j] += t;
        }
        err += fabs(rs - 1.0);
      }
#pragma unroll
      for (int j = 0; j < N; ++j) err += fabs(cd[j] - 1.0);
#pragma unroll
      for (int j = 0; j < M; ++j) g[j] = (float)(cd[j] - 1.0);
    }
#ifdef MHC_TRACE
    MHC_TRACE("it %d err %.3e tmin %.2e\n", it, err, tmin);
#endif
    if (!(err > (double)tol) || it >= max_iter) {
      err_out = err;
      return true;
    }
    ++it;

    // Newton direction.
    float H[M][M];
    dual_hessian<N>(T, H);
    float neg_g[M], d[M];
#pragma unroll
    for (int j = 0; j < M; ++j) neg_g[j] = -g[j];
    bool ok = spd_solve<M>(H, neg_g, d);
    float slope, dsum, dmax;
    direction_stats<M>(g, d, slope, dsum, dmax);
    ok = ok && (slope < 0.f);
    // Trust region in the log domain: near a permutation the Hessian is
    // singular up to the ridge and the raw step can be ~1e6, which fp32 logs
    // cannot carry (L + t d would round entries near 0 by ~0.1), and whose
    // direction is all null space. Take the Levenberg-Marquardt step
    // (H + λI) d = -g with λ = ‖g‖₂/Δ instead, so ‖d‖ <= Δ, and cap what
    // rounding leaves over.
    if (ok && dmax > kMaxStep) {
      float gn = 0.f;
#pragma unroll
      for (int j = 0; j < M; ++j) gn = fmaf(g[j], g[j], gn);
      dual_hessian<N>(T, H);
      ok = spd_solve<M>(H, neg_g, d, sqrtf(gn) * (1.f / kMaxStep));
      direction_stats<M>(g, d, slope, dsum, dmax);
      ok = ok && (slope < 0.f);
    }
    if (ok && dmax > kMaxStep) {
      const float sc = kMaxStep / dmax;
#pragma unroll
      for (int j = 0; j < M; ++j) d[j] *= sc;
      slope *= sc;
      dsum *= sc;
      dmax = kMaxStep;
    }
    float dp[N];  // direction padded with the gauge d_N = 0
#pragma unroll
    for (int j = 0; j < N; ++j) dp[j] = (j < M) ? d[j < M ? j : 0] : 0.f;

    // Σ_i log Σ_j T_ij e^{t d_j}: f(t) + t Σ d for a multiplicative trial.
    auto cheap_lse = [&](float tt, float (&lse_out)[N]) -> float {
      float E[N];
#pragma unroll
      for (int j = 0; j < N; ++j) E[j] = (j < M) ? expf(tt * dp[j]) : 1.f;
      float acc = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        float s = 0.f;
#pragma unroll
        for (int j = 0; j < N; ++j) s = fmaf(T[i][j], E[j], s);
        lse_out[i] = logf(s);
        acc += lse_out[i];
      }
      return acc;
    };
    bool accepted = false, trashed = false;
    if (ok) {
      // Multiplicative trials are exact while no entry of T is near underflow
      // (then every product T_ij e^{t d_j} is a normal float or negligible).
      bool use_exp = !(tmin >= kTinyEntry);
      float t = 1.f;
      for (int h = 0; h < kMaxHalvings; ++h) {
        use_exp = use_exp || (t * dmax > kMaxCheapStep);
        float lse[N];
        float f1 = -t * dsum;
        if (!use_exp) {
          f1 += cheap_lse(t, lse);
          if (f1 <= fmaf(kArmijoC1 * t, slope, slack)) {
            // Far from the solution, near-saturated rows make full Newton
            // steps too short (each only an e-fold): extrapolate while f drops.
            if (h == 0 && errf > kExpandErr) {
              float lse2[N];
              for (int k = 0; k < kMaxExpand; ++k) {
                const float t2 = 2.f * t;
                if (t2 * dmax > kMaxCheapStep) break;
                const float f2 = cheap_lse(t2, lse2) - t2 * dsum;
                if (!(f2 < f1)) break;
                t = t2;
                f1 = f2;
#pragma unroll
                for (int i = 0; i < N; ++i) lse[i] = lse2[i];
              }
            }
            float E[N];
#pragma unroll
            for (int j = 0; j < N; ++j) E[j] = (j < M) ? expf(t * dp[j]) : 1.f;
#pragma unroll
            for (int i = 0; i < N; ++i) {
              float s = 0.f;
#pragma unroll
              for (int j = 0; j < N; ++j) {
                T[i][j] *= E[j];
                s += T[i][j];
              }
              const float inv = mhc_rcp(s);
#pragma unroll
              for (int j = 0; j < N; ++j) T[i][j] *= inv;
              a[i] -= lse[i];
            }
#pragma unroll
            for (int j = 0; j < M; ++j) b[j] = fmaf(t, dp[j], b[j]);
            folded = false;
            accepted = true;
            break;
          }
        } else {
          fold();
          trashed = true;
          // f(t) = Σ_i logsumexp_j(L_ij + t d_j) - t Σ_j d_j   (f(0) ≈ 0: rows of L are normalised)
#pragma unroll
          for (int i = 0; i < N; ++i) {
            float tr[N];
#pragma unroll
            for (int j = 0; j < N; ++j) tr[j] = fmaf(t, dp[j], L[i][j]);
            float m = tr[0];
#pragma unroll
            for (int j = 1; j < N; ++j) m = fmaxf(m, tr[j]);
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < N; ++j) {
              T[i][j] = expf(tr[j] - m);  // unnormalised trial plan, rows scaled by 1/s below
              s += T[i][j];
            }
            lse[i] = m + logf(s);
            f1 += lse[i];
            const float inv = mhc_rcp(s);
#pragma unroll
            for (int j = 0; j < N; ++j) T[i][j] *= inv;
          }
          if (f1 <= fmaf(kArmijoC1 * t, slope, slack)) {
#pragma unroll
            for (int i = 0; i < N; ++i)
#pragma unroll
              for (int j = 0; j < N; ++j) L[i][j] = fmaf(t, dp[j], L[i][j]) - lse[i];
            accepted = true;
            break;
          }
        }
        t *= 0.5f;
      }
    }
#ifdef MHC_TRACE
    MHC_TRACE("   ok %d accepted %d trashed %d slope %.3e dmax %.3e\n", (int)ok, (int)accepted, (int)trashed, slope, dmax);
#endif
    if (!accepted) {
      fold();
      if (trashed) {
        // exp-path trials overwrote T: rebuild it from L, then sweep.
#pragma unroll
        for (int i = 0; i < N; ++i)
#pragma unroll
          for (int j = 0; j < N; ++j) T[i][j] = expf(L[i][j]);
      }
      sinkhorn_sweep<N>(L, T);
    }
    return false;
  }
};

template <int N>
MHC_HD int solve_matrix(float (&L)[N][N], float (&T)[N][N], float tol, int max_iter, double& err_out) {
  Solver<N> S;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) S.L[i][j] = L[i][j];
  S.init();
  while (!S.step(tol, max_iter, err_out)) {
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) T[i][j] = S.T[i][j];
  return S.it;
}

}  // namespace mhc_birkhoff
