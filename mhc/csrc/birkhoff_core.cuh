// Per-matrix Birkhoff solver and implicit-gradient pieces (design.md §2),
// host+device so that the same code can be exercised on a CPU
// (tests and scripts) as well as run inside the CUDA kernels of birkhoff.cu.
#pragma once

#include <cmath>
#include <cstdint>

#ifdef __CUDACC__
#define MHC_HD __host__ __device__ __forceinline__
#define MHC_HD_NOINLINE __host__ __device__ __noinline__
#else
#define MHC_HD inline
#define MHC_HD_NOINLINE __attribute__((noinline))
#endif

namespace mhc_birkhoff {

using std::fabs;
using std::isfinite;

constexpr int kMaxHalvings = 30;      // as _MAX_HALVINGS in projection.py
constexpr float kArmijoC1 = 1e-4f;    // as _ARMIJO_C1
constexpr float kEps = 1.1920928955078125e-07f;  // fp32 machine epsilon
constexpr float kTinySum = 1e-20f;    // below this a sum is renormalised in logs
constexpr float kTinyEntry = 1e-30f;  // multiplicative steps only while every T_ij >= this
constexpr float kRobustRange = 69.f;  // a row of R spanning more than this (e^-69 ≈ kTinyEntry):
                                      // the robust solver from the start (see wants_robust)
constexpr float kMaxCheapStep = 40.f; // ... and every |t d_j| <= this
constexpr float kMaxStep = 24.f;      // largest dual move of one Newton step (robust solver)
constexpr float kFastMaxStep = 8.f;   // ... of the fast solver (fewer iterations on N(0,10²);
                                      // the robust solver stalls more with it at N(0,30²))
constexpr float kExpandErr = 1e-2f;   // robust solver: extrapolate full steps while the error is above this
constexpr float kTailErr = 16.f;      // fast solver: also while above kTailErr·tol and the last step cut the
constexpr float kTailRatio = 0.2f;    //     error by less than 1/kTailRatio (the e-fold tail)
constexpr int kMaxExpand = 2;         // up to 4x the Newton step (3 doublings cost more trials
                                      // than they saved iterations)
// Per-n settings of the fast solver, each measured on the H200 (kernel-only,
// notes/benchmarks.md): Sinkhorn sweeps before the first Newton iteration (a
// Newton step costs relatively more at n = 8), and the error above which it
// extrapolates (1e-3 saves iterations on N(0,10²) at both n but costs more
// than it saves on N(0,1) at n = 8).
template <int N> constexpr int init_sweeps() { return N <= 4 ? 3 : 5; }
template <int N> constexpr float expand_err() { return N <= 4 ? 1e-3f : 1e-2f; }
// n = 4: the fast solver sets entries below kTinyEntry to exactly 0 and goes
// on (see flush_tiny and fill_flushed) instead of handing the matrix back:
// at mid batch sizes the one warp that restarts a matrix in the robust solver
// (or runs it for all 32 lanes) sets the whole kernel's time. n = 8 hands
// the matrix back as before.
template <int N> constexpr bool flushes_tiny() { return N <= 4; }
constexpr int kFlushedMaxIter = 40;      // a plan with flushed entries that has not converged by then goes robust
constexpr float kFlushedLog = -27.631f; // ln 1e-12: largest value a flushed entry may have in the solution
                                         // (then every marginal moves by < N·1e-12 << tol; rechecked anyway)

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

// Special-function-unit 2^x, log2(x) and 1/x (about 2 ulp), with denormals
// flushed, so none of the range fix-ups of expf/__expf/__frcp_rn. Used only
// where the value moves the dual iterate (step factors e^{t d_j}, row
// renormalisation) or the line search's merit (compared with a slack of
// 8·N·eps), always on arguments and results kept within e^{±80}: the plan T,
// whose marginals are checked, is formed by exact-to-rounding
// multiplications, so these errors cannot leak into the contract.
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

MHC_HD float fast_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::exp2(x);
#endif
}

MHC_HD float fast_log2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return std::log2(x);
#endif
}

MHC_HD float fast_rcp(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return 1.f / x;
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

// Normalise one row in logs: L -= logsumexp(L), T = exp(L) (max-shifted, so
// it is safe for any finite row).
// Returns the logsumexp subtracted.
template <int N>
MHC_HD float row_log_softmax(float (&L)[N], float (&T)[N]) {
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
  return lse;
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

// One log-domain Sinkhorn step on (L, T = exp(L)): normalise columns, then rows.
// Sums come from T where they are large enough to be exact, from logsumexp on
// L where a whole column (or row) underflowed; so it never stalls.
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
    // On finite data T is a permutation to rounding; ∂T/∂R is 0 there, so any
    // w gives the same result: take w = 0 like the reference. A non-finite
    // rhs (NaN/Inf in grad_T or T) keeps NaN in w (0·rhs), which spreads to
    // the whole matrix's gradient, as on the PyTorch path, instead of only
    // to the rows that held it.
#pragma unroll
    for (int j = 0; j < M; ++j) w[j] = isfinite(w[j]) ? w[j] : 0.f * rhs[j];
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
// Per-matrix solver pieces. T always holds a plan with rows normalised to 1,
// so the dual is the (N-1)-vector of column shifts (the last one fixed at 0)
// and its gradient is the column sums minus 1.
// ----------------------------------------------------------------------------

// Marginal error of T, the dual gradient g, the fp32 error errf and the
// smallest entry. The fp32 sums are within (N-1)·2^-24 each of the exact
// sums of T while they stay below 2 (errf < 1), so the fp32 error is within
// kSumSlack (plus errf's own rounding) of the float64 one (the contract's
// measure): outside that band of tol the fp32 error decides and is returned;
// inside it, or always when `exact` (the caller reports the error), the
// float64 sums give the error and g.
template <int N>
MHC_HD double marginals(const float (&T)[N][N], float tol, float (&g)[N - 1], float& errf, float& tmin,
                        bool exact) {
  constexpr int M = N - 1;
  constexpr float kSumSlack = 2.f * N * (N - 1) * 5.9604645e-08f;  // 2N sums of N terms, half-ulp 2^-24
  float cs[N];
#pragma unroll
  for (int j = 0; j < N; ++j) cs[j] = 0.f;
  errf = 0.f;
  tmin = 1.f;
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
  // errf itself carries a relative rounding of at most 2N·2^-24 (< 2^-19).
  const float slack = fmaf(errf, 1.f / 524288.f, kSumSlack);
  if (!(errf <= tol + slack)) return (double)errf;
  if (!exact && errf + slack < 0.999f * tol) return (double)errf;  // margin for float64 rounding
  double cd[N];
#pragma unroll
  for (int j = 0; j < N; ++j) cd[j] = 0.0;
  double err = 0.0;
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
  return err;
}

// Newton direction on the dual, padded with the gauge dp[N-1] = 0, with its
// slope gᵀd, Σ d and max |d|. False when there is no descent direction.
// Trust region in the log domain: near a permutation the Hessian is singular
// up to the ridge and the raw step can be ~1e6, which fp32 logs cannot carry
// and whose direction is all null space. Take the Levenberg-Marquardt step
// (H + λI) d = -g with λ = ‖g‖₂/Δ instead, so ‖d‖ <= Δ, and cap what
// rounding leaves over.
template <int N>
MHC_HD bool newton_direction(const float (&T)[N][N], const float (&g)[N - 1], float (&dp)[N], float& slope,
                             float& dsum, float& dmax, float max_step) {
  constexpr int M = N - 1;
  float H[M][M], neg_g[M], d[M];
  dual_hessian<N>(T, H);
#pragma unroll
  for (int j = 0; j < M; ++j) neg_g[j] = -g[j];
  bool ok = spd_solve<M>(H, neg_g, d);
  direction_stats<M>(g, d, slope, dsum, dmax);
  ok = ok && (slope < 0.f);
  if (ok && dmax > max_step) {
    float gn = 0.f;
#pragma unroll
    for (int j = 0; j < M; ++j) gn = fmaf(g[j], g[j], gn);
    dual_hessian<N>(T, H);
    ok = spd_solve<M>(H, neg_g, d, sqrtf(gn) * (1.f / max_step));
    direction_stats<M>(g, d, slope, dsum, dmax);
    ok = ok && (slope < 0.f);
  }
  if (ok && dmax > max_step) {
    const float sc = max_step / dmax;
#pragma unroll
    for (int j = 0; j < M; ++j) d[j] *= sc;
    slope *= sc;
    dsum *= sc;
    dmax = max_step;
  }
#pragma unroll
  for (int j = 0; j < N; ++j) dp[j] = (j < M) ? d[j < M ? j : 0] : 0.f;
  return ok;
}

// Row sums s_i = Σ_j T_ij E_j of a multiplicative trial with column factors
// E, and the change of the dual objective, Σ_i log s_i - t Σ_j d_j, with one
// log per pair of rows (t|d| <= kMaxCheapStep keeps each s_i within e^{±40},
// so a product of two cannot leave the normal range).
template <int N>
MHC_HD float trial_merit(const float (&T)[N][N], const float (&E)[N], float t, float dsum, float (&s)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) acc = fmaf(T[i][j], E[j], acc);
    s[i] = acc;
  }
  float log2_prod = 0.f;
#pragma unroll
  for (int i = 0; i < N; i += 2) log2_prod += fast_log2(i + 1 < N ? s[i] * s[i + 1 < N ? i + 1 : i] : s[i]);
  return fmaf(kLn2, log2_prod, -t * dsum);
}

// E_j = e^{t d_j} (E_{N-1} = 1, the gauge).
template <int N>
MHC_HD void step_factors(const float (&dp)[N], float t, float (&E)[N]) {
  const float t2 = t * kLog2e;
#pragma unroll
  for (int j = 0; j < N; ++j) E[j] = (j < N - 1) ? fast_exp2(t2 * dp[j]) : 1.f;
}

// Armijo backtracking over multiplicative trials: N-1 exps and N/2 logs per
// trial instead of the N² exps of a log-domain trial. When `expand` (far
// from the solution, or in the e-fold tail) an accepted full step is doubled
// while the objective keeps falling (factors squared, no new exps). On
// success T <- diag(1/s) T diag(E) (rows stay normalised), s gets the row
// sums before normalising (log s_i is the row shift) and t the step. Exact
// while every T_ij >= kTinyEntry: then each product T_ij e^{t d_j}
// (t|d| <= kMaxCheapStep) is a normal float or negligible. Returns false, T
// untouched, when no trial is accepted. The search leaves its loop before
// renormalising, so a warp whose lanes accept at different steps
// renormalises once.
template <int N>
MHC_HD bool multiplicative_search(float (&T)[N][N], const float (&dp)[N], float slope, float dsum, float dmax,
                                  bool expand, float& t, float (&s)[N]) {
  const float slack = 8.f * N * kEps;
  float E[N], f1 = 0.f;
  bool found = false;
  t = 1.f;
  for (int h = 0; h < kMaxHalvings; ++h, t *= 0.5f) {
    step_factors<N>(dp, t, E);
    f1 = trial_merit<N>(T, E, t, dsum, s);
    if (f1 <= fmaf(kArmijoC1 * t, slope, slack)) {
      found = true;
      break;
    }
  }
  if (!found) return false;
  if (expand && t == 1.f) {
#pragma unroll
    for (int k = 0; k < kMaxExpand; ++k) {
      if (2.f * t * dmax > kMaxCheapStep) break;
      float E2[N], s2[N];
#pragma unroll
      for (int j = 0; j < N; ++j) E2[j] = E[j] * E[j];
      const float f2 = trial_merit<N>(T, E2, 2.f * t, dsum, s2);
      if (!(f2 < f1)) break;
      t *= 2.f;
      f1 = f2;
#pragma unroll
      for (int j = 0; j < N; ++j) {
        E[j] = E2[j];
        s[j] = s2[j];
      }
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const float inv = fast_rcp(s[i]);
#pragma unroll
    for (int j = 0; j < N; ++j) T[i][j] = T[i][j] * E[j] * inv;
  }
  return true;
}

// Entries below kTinyEntry set to exactly 0, where multiplicative steps keep
// them. False when a column is left without an entry (no doubly-stochastic
// plan on that support).
template <int N>
MHC_HD bool flush_tiny(float (&T)[N][N]) {
  bool cols_ok = true;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    float cmax = 0.f;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const float t = T[i][j] >= kTinyEntry ? T[i][j] : 0.f;
      T[i][j] = t;
      cmax = fmaxf(cmax, t);
    }
    cols_ok = cols_ok && cmax > 0.f;
  }
  return cols_ok;
}

// A plan with flushed (zero) entries is diag(u) e^R diag(v) on its support,
// so log T_ij - R_ij = a_i + b_j there, and the value a flushed entry (i, j)
// has in that same scaling is R_ij + (a_i + b_k) + (a_l + b_j) - (a_l + b_k)
// for any l != i, k != j with (i, k), (l, j), (l, k) in the support (the
// largest over those cycles, against rounding). Where every such value is at
// most e^kFlushedLog the plan is the solution up to them: they are written
// into T and true is returned. False when one would be larger or has no such
// cycle (T is then partly written; the caller restarts from R). A -inf logit
// (prepare_logits) is a zero of the solution, not a flushed entry. R (the
// logits) is overwritten.
template <int N>
MHC_HD bool fill_flushed(float (&T)[N][N], float (&R)[N][N]) {
  uint64_t support = 0;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (T[i][j] > 0.f) support |= 1ULL << (i * N + j);
  auto in = [&](int i, int j) { return ((support >> (i * N + j)) & 1ULL) != 0; };
  // R_ij -> a_i + b_j on the support.
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j)
      if (in(i, j)) R[i][j] = logf(T[i][j]) - R[i][j];
  bool ok = true;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (in(i, j)) continue;
      if (R[i][j] == -INFINITY) {  // a zero of exp(R) (prepare_logits): 0 in the solution too
        T[i][j] = 0.f;
        continue;
      }
      float best = 0.f;
      bool found = false;
#pragma unroll
      for (int l = 0; l < N; ++l)
#pragma unroll
        for (int k = 0; k < N; ++k) {
          if (l == i || k == j || !(in(i, k) && in(l, j) && in(l, k))) continue;
          const float v = R[i][k] + R[l][j] - R[l][k];
          best = found ? fmaxf(best, v) : v;
          found = true;
        }
      const float log_t = R[i][j] + best;
      ok = ok && found && (log_t <= kFlushedLog);
      T[i][j] = expf(fminf(log_t, 0.f));
    }
  return ok;
}

// ----------------------------------------------------------------------------
// Fast solver: plan-only state, multiplicative steps throughout. On entry T
// holds the (finite) logits R; on exit the plan. Returns false when the
// matrix needs the robust solver (n = 8: an entry near fp32 underflow; n = 4:
// a flushed entry that the solution needs, or a flushed plan not converged by
// kFlushedMaxIter; either: no accepted step); the caller then restarts from R
// with Solver below. `reload(X)` writes R into X (only for flushed plans).
// `it` counts Newton iterations, err_out gets the marginal error (float64
// when `exact_err`, else possibly the fp32 estimate; see marginals).
// ----------------------------------------------------------------------------
template <int N, typename Reload>
MHC_HD bool fast_solve(float (&T)[N][N], Reload&& reload, float tol, int max_iter, int& it, double& err_out,
                       bool exact_err) {
  constexpr int M = N - 1;
  it = 0;
  // Row softmax of R (accurate exps: these fix the problem, not the iterate).
  float tmin = 1.f;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float m = T[i][0];
#pragma unroll
    for (int j = 1; j < N; ++j) m = fmaxf(m, T[i][j]);
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < N; ++j) {
      T[i][j] = expf(T[i][j] - m);
      s += T[i][j];
    }
    const float inv = mhc_rcp(s);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      T[i][j] *= inv;
      tmin = fminf(tmin, T[i][j]);
    }
  }
  if (!(tmin >= kTinyEntry) && (!flushes_tiny<N>() || !flush_tiny<N>(T))) return false;
  // A few Sinkhorn sweeps (columns, then rows), on row and column factors
  // u, v with T <- diag(u) T diag(v) once at the end: 2N² FMAs and 2N
  // reciprocals per sweep. Three save about one Newton iteration per warp
  // on N(0,1) and half of one on N(0,10²) at n = 4 (more cost more than they
  // save; measured: notes/benchmarks.md). Each half-sweep shrinks the
  // smallest entry by at most a factor N, so from kTinyEntry every sum stays
  // a normal float; an entry pushed below kTinyEntry is flushed (n = 4) or
  // sends the matrix to the robust solver at the first marginal check.
  // Flushed entries stay 0 (each column keeps an entry >= kTinyEntry).
  float u[N], v[N];
#pragma unroll
  for (int i = 0; i < N; ++i) u[i] = 1.f;
  for (int k = 0; k < init_sweeps<N>(); ++k) {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      float c = 0.f;
#pragma unroll
      for (int i = 0; i < N; ++i) c = fmaf(T[i][j], u[i], c);
      v[j] = fast_rcp(c);
    }
#pragma unroll
    for (int i = 0; i < N; ++i) {
      float r = 0.f;
#pragma unroll
      for (int j = 0; j < N; ++j) r = fmaf(T[i][j], v[j], r);
      u[i] = fast_rcp(r);
    }
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) T[i][j] *= u[i] * v[j];
  float prev_errf = 3.4e38f;
  for (;;) {
    float g[M], errf;
    double err = marginals<N>(T, tol, g, errf, tmin, exact_err);
    if (!(err > (double)tol) || it >= max_iter) {
      if constexpr (flushes_tiny<N>()) {
        if (tmin == 0.f) {
          // Flushed entries (or one that underflowed in the last step): their
          // values in the solution, from R (re-read), and the marginals again
          // (float64) with them.
          float R[N][N];
          reload(R);
          if (!fill_flushed<N>(T, R)) return false;
          const bool met = !(err > (double)tol);
          err = marginals<N>(T, tol, g, errf, tmin, true);
          if (met && err > (double)tol) return false;
        }
      }
      err_out = err;
      return true;
    }
    // A flushed plan (tmin = 0 from then on) comes here at every iteration;
    // on a support with no doubly-stochastic plan it would make no progress.
    if (!(tmin >= kTinyEntry) && (!flushes_tiny<N>() || it >= kFlushedMaxIter || !flush_tiny<N>(T))) return false;
    ++it;
    float dp[N], slope, dsum, dmax, t, rows[N];
    if (!newton_direction<N>(T, g, dp, slope, dsum, dmax, kFastMaxStep)) return false;
    // Far from the solution, or in the linear tail where each full step only
    // shrinks the error by ~e (entries of T heading to 0 move one e-fold per
    // Newton step): try longer steps.
    const bool expand = errf > expand_err<N>() || (errf > kTailErr * tol && errf > kTailRatio * prev_errf);
    prev_errf = errf;
    if (!multiplicative_search<N>(T, dp, slope, dsum, dmax, expand, t, rows)) return false;
  }
}

// ----------------------------------------------------------------------------
// Robust solver, for the matrices fast_solve hands back. State: the log-plan
// L (kept lazily as L_ij + a_i + b_j, see fold()), the plan T = exp(L) with
// rows normalised, and the iteration count. init() then step() until it
// returns true. Trials are multiplicative where that is exact, log-domain
// (N² exps) otherwise, and a log-domain Sinkhorn sweep runs wherever the line
// search fails, so it never stalls on underflowed entries.
// ----------------------------------------------------------------------------
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
  MHC_HD bool step(float tol, int max_iter, double& err_out, bool exact_err) {
    const float slack = 8.f * N * kEps;
    float g[M], errf, tmin;
    const double err = marginals<N>(T, tol, g, errf, tmin, exact_err);
    if (!(err > (double)tol) || it >= max_iter) {
      err_out = err;
      return true;
    }
    ++it;
    float dp[N], slope, dsum, dmax;
    const bool ok = newton_direction<N>(T, g, dp, slope, dsum, dmax, kMaxStep);
    bool accepted = false, trashed = false;
    if (ok && tmin >= kTinyEntry) {
      float t, rows[N];
      accepted = multiplicative_search<N>(T, dp, slope, dsum, dmax, errf > kExpandErr, t, rows);
      if (accepted) {
#pragma unroll
        for (int i = 0; i < N; ++i) a[i] -= logf(rows[i]);
#pragma unroll
        for (int j = 0; j < M; ++j) b[j] = fmaf(t, dp[j], b[j]);
        folded = false;
      }
    } else if (ok) {
      // Log-domain trials: f(t) = Σ_i logsumexp_j(L_ij + t d_j) - t Σ_j d_j
      // (f(0) ≈ 0: rows of L are normalised).
      fold();
      trashed = true;
      float t = 1.f;
      for (int h = 0; h < kMaxHalvings && !accepted; ++h, t *= 0.5f) {
        float lse[N];
        float f1 = -t * dsum;
#pragma unroll
        for (int i = 0; i < N; ++i) {
          float tr[N];
#pragma unroll
          for (int j = 0; j < N; ++j) tr[j] = fmaf(t, dp[j], L[i][j]);
          lse[i] = row_log_softmax<N>(tr, T[i]);
          f1 += lse[i];
        }
        if (f1 <= fmaf(kArmijoC1 * t, slope, slack)) {
#pragma unroll
          for (int i = 0; i < N; ++i)
#pragma unroll
            for (int j = 0; j < N; ++j) L[i][j] = fmaf(t, dp[j], L[i][j]) - lse[i];
          accepted = true;
        }
      }
    }
    if (!accepted) {
      fold();
      if (trashed) {
        // log-domain trials overwrote T: rebuild it from L, then sweep.
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

// Whether the logits make fast_solve likely to hand the matrix back: a row
// spanning more than kRobustRange starts with an entry below kTinyEntry.
// Kernels vote on this per warp: lanes of a warp that mixes the two solvers
// run both one after the other, which costs more than the robust solver
// alone (measured: notes/benchmarks.md).
template <int N>
MHC_HD bool wants_robust(const float (&R)[N][N]) {
  bool wide = false;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    float lo = R[i][0], hi = R[i][0];
#pragma unroll
    for (int j = 1; j < N; ++j) {
      lo = fminf(lo, R[i][j]);
      hi = fmaxf(hi, R[i][j]);
    }
    wide = wide || (hi - lo > kRobustRange);
  }
  return wide;
}

// ----------------------------------------------------------------------------
// Zero entries (design.md §2, "Zero entries"): a -inf logit is an entry
// exp(R_ij) = 0. The projection then lives on the union U of the permutations
// inside the support S of the finite logits (every doubly stochastic matrix on
// S is a convex combination of those permutations), where it is an ordinary
// scaling with finite potentials; the entries of S off U are 0 whatever their
// logits, and would send the potentials to infinity if left in. So
// prepare_logits sets them to -inf too, and the solvers above run on U as on
// any matrix: every step maps a zero entry to zero. Where S holds no
// permutation there is no answer (NaN, error inf).
// ----------------------------------------------------------------------------

enum LogitsKind : int {
  kDense = 0,         // every logit finite
  kZeros = 1,         // -inf logits, and a permutation among the finite ones (solved on U)
  kNoProjection = 2,  // -inf logits that leave no permutation among the finite ones: NaN, error inf
  kBad = 3,           // NaN or +inf somewhere: NaN, error NaN
};

// The entries of `support` (bit i*N+j: logit (i, j) is finite) that lie on a
// permutation inside it; 0 when it holds none. A maximum matching by
// augmenting paths (breadth first from each row), then: an entry (i, j) off
// the matching, column j matched to row i', lies on a permutation iff i'
// reaches i in the graph with an edge a -> b wherever row a has a finite
// entry in the column matched to row b (an alternating cycle through (i, j)).
// Not inlined: only matrices holding a -inf call it, and its local arrays
// stay out of the solver's registers.
template <int N>
MHC_HD_NOINLINE uint64_t permutation_support(uint64_t support) {
  static_assert(N * N <= 64, "one bit per entry");
  constexpr unsigned kRowBits = (1u << N) - 1u;
  unsigned cols[N];
  int col_of[N], row_of[N];
  for (int i = 0; i < N; ++i) {
    cols[i] = (unsigned)(support >> (i * N)) & kRowBits;
    col_of[i] = row_of[i] = -1;
  }
  for (int root = 0; root < N; ++root) {
    int prev[N], queue[N];  // prev: the row that reached a column; each row enters the queue once
    int head = 0, tail = 0, free_col = -1;
    unsigned seen = 0;
    queue[tail++] = root;
    while (head < tail && free_col < 0) {
      const int i = queue[head++];
      for (int j = 0; j < N; ++j) {
        if (!((cols[i] >> j) & 1u) || ((seen >> j) & 1u)) continue;
        seen |= 1u << j;
        prev[j] = i;
        if (row_of[j] < 0) {
          free_col = j;
          break;
        }
        queue[tail++] = row_of[j];
      }
    }
    if (free_col < 0) return 0;  // Hall's condition fails: no permutation inside the support
    for (int j = free_col; j >= 0;) {  // flip the path back to the root
      const int i = prev[j], next = col_of[i];
      col_of[i] = j;
      row_of[j] = i;
      j = next;
    }
  }
  unsigned reach[N];
  for (int a = 0; a < N; ++a) {
    unsigned r = 0;
    for (int j = 0; j < N; ++j)
      if ((cols[a] >> j) & 1u) r |= 1u << row_of[j];
    reach[a] = r;
  }
  for (int k = 0; k < N; ++k)  // transitive closure (Warshall)
    for (int a = 0; a < N; ++a)
      if ((reach[a] >> k) & 1u) reach[a] |= reach[k];
  uint64_t keep = 0;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      if (((cols[i] >> j) & 1u) && (row_of[j] == i || ((reach[row_of[j]] >> i) & 1u))) keep |= 1ULL << (i * N + j);
  return keep;
}

// Sort the logits R (in place) into a LogitsKind; for kZeros also set the
// finite entries that lie on no permutation inside the finite ones to -inf.
// The common case, every logit finite, costs 2·N² compares.
template <int N>
MHC_HD int prepare_logits(float (&R)[N][N]) {
  bool bad = false, zero = false;
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) {
      bad = bad || !(R[i][j] < INFINITY);  // NaN or +inf
      zero = zero || R[i][j] == -INFINITY;
    }
  if (bad) return kBad;
  if (!zero) return kDense;
  uint64_t support = 0;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      if (R[i][j] > -INFINITY) support |= 1ULL << (i * N + j);
  const uint64_t keep = permutation_support<N>(support);
  if (keep == 0) return kNoProjection;
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < N; ++j)
      if (!((keep >> (i * N + j)) & 1ULL)) R[i][j] = -INFINITY;
  return kZeros;
}

// Solve one matrix: fast_solve (unless `robust`), and the robust Solver from
// the logits where fast_solve hands the matrix back. On entry T holds the
// (finite) logits R, on exit the plan. `reload(X)` writes R into X again; it
// is only called for the robust solver (so a kernel can re-read R from
// memory instead of keeping a copy in registers). Returns the number of
// Newton iterations (both solvers together, at most max_iter); err_out gets
// the marginal error: the float64 one when `exact_err`, otherwise possibly
// the fp32 estimate where that already decides err <= tol (see marginals).
template <int N, typename Reload>
MHC_HD int solve_matrix(float (&T)[N][N], Reload&& reload, float tol, int max_iter, double& err_out,
                        bool robust = false, bool exact_err = true) {
  int it = 0;
  if (!robust && fast_solve<N>(T, reload, tol, max_iter, it, err_out, exact_err)) return it;
  Solver<N> S;
  reload(S.L);
  S.init();
  const int budget = max_iter - it;
  while (!S.step(tol, budget, err_out, exact_err)) {
  }
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < N; ++j) T[i][j] = S.T[i][j];
  return it + S.it;
}

// One matrix of logits, whatever it holds (T: the logits, through
// prepare_logits, which returned `kind`; the plan on exit): solve_matrix for
// kDense and kZeros, NaN for the others, with err_out NaN (kBad) or inf
// (kNoProjection) and 0 iterations. `reload(X)` writes the raw logits into
// X; they are prepared again here (only the robust restart and n = 4's
// flushed entries reload).
template <int N, typename Reload>
MHC_HD int solve_logits(float (&T)[N][N], int kind, Reload&& reload, float tol, int max_iter, double& err_out,
                        bool robust = false, bool exact_err = true) {
  if (kind == kBad || kind == kNoProjection) {
#pragma unroll
    for (int i = 0; i < N; ++i)
#pragma unroll
      for (int j = 0; j < N; ++j) T[i][j] = NAN;
    err_out = kind == kBad ? (double)NAN : (double)INFINITY;
    return 0;
  }
  auto prepared = [&](float (&X)[N][N]) {
    reload(X);
    prepare_logits<N>(X);
  };
  return solve_matrix<N>(T, prepared, tol, max_iter, err_out, robust, exact_err);
}

}  // namespace mhc_birkhoff
