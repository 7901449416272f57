// Fused Birkhoff projection T = Pi_B(exp(R)) for n = 4 and n = 8 (design.md §2):
// input checks, launches on PyTorch's current stream, the unconverged-matrix
// counter, the forward's autograd node and the torch.library registration. The
// kernels themselves are in birkhoff_kernels.cuh, the per-matrix solver in
// birkhoff_core.cuh.

#include <ATen/core/Tensor.h>
#include <ATen/cuda/EmptyTensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/autograd.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <cfloat>

#include "birkhoff_kernels.cuh"
#include "site_tokens.cuh"

#include <algorithm>
#include <array>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>
#include <mutex>
#include <string>

namespace mhc_birkhoff {

// ----------------------------------------------------------------------------
// Host side.
// ----------------------------------------------------------------------------

// Integers in error messages go through std::to_string: formatting them with the
// ostream inside TORCH_CHECK crashed the extension on the H200 machine (torch
// 2.11, host gcc /opt/gcc), while strings and torch's own types did not.
static void check_input(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.is_cuda(), "mhc::birkhoff: ", name, " must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 3 && x.size(1) == x.size(2), "mhc::birkhoff: ", name,
              " must have shape [B, n, n], got ", x.sizes());
  TORCH_CHECK(x.size(1) == 4 || x.size(1) == 8, "mhc::birkhoff: CUDA kernels support n = 4 and 8, got n = ",
              std::to_string(x.size(1)));
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "mhc::birkhoff: ", name, " must be float32, float16 or bfloat16, got ", x.scalar_type());
}

template <typename F>
static void dispatch_dtype(at::ScalarType t, F&& f) {
  switch (t) {
    case at::kFloat: f(float{}); break;
    case at::kHalf: f(__half{}); break;
    case at::kBFloat16: f(__nv_bfloat16{}); break;
    default: TORCH_CHECK(false, "mhc::birkhoff: unsupported dtype ", t);
  }
}

// A fresh CUDA tensor straight from the caching allocator. at::empty / at::empty_like go
// through the dispatcher first, about 1 us of host time per call on the H200's host, and a
// small projection or a decode-step site is nothing but host time.
static at::Tensor new_cuda(at::IntArrayRef size, at::ScalarType dtype, const at::Device& device) {
  return at::Tensor(at::detail::empty_cuda(size, dtype, device, std::nullopt));
}

// tol raised to 4 n eps(float32), the rounding floor of projection_common.effective_tol for the
// float32-computed dtypes these kernels take.
static double float32_tol(double tol, int64_t n) { return std::max(tol, 4.0 * (double)n * (double)FLT_EPSILON); }

static bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

static void launch_forward(const at::Tensor& R, at::Tensor& out, double tol, int64_t max_iter, int* iters,
                           double* err) {
  const int64_t B = R.size(0);
  const int n = (int)R.size(1);
  if (B == 0) return;
  // Small batches are latency-bound: spread them over more multiprocessors.
  const int threads = B >= (int64_t)kThreads * 1024 ? kThreads : 32;
  const int64_t blocks = (B + threads - 1) / threads;
  TORCH_CHECK(blocks < (1LL << 31), "mhc::birkhoff: batch too large");
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(R.scalar_type(), [&](auto tag) {
    using ct = decltype(tag);
    const ct* src = reinterpret_cast<const ct*>(R.data_ptr());
    ct* dst = reinterpret_cast<ct*>(out.data_ptr());
    const bool vec = aligned16(src) && aligned16(dst);
    if (n == 4) {
      birkhoff_forward_kernel<4, ct><<<(unsigned)blocks, threads, 0, stream>>>(src, dst, B, (float)tol,
                                                                             (int)max_iter, iters, err, vec);
    } else {
      birkhoff_forward_kernel<8, ct><<<(unsigned)blocks, threads, 0, stream>>>(src, dst, B, (float)tol,
                                                                             (int)max_iter, iters, err, vec);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

at::Tensor birkhoff_forward(const at::Tensor& R_in, double tol, int64_t max_iter) {
  check_input(R_in, "R");
  TORCH_CHECK(max_iter >= 0 && max_iter < (1LL << 30), "mhc::birkhoff_forward: bad max_iter");
  c10::cuda::CUDAGuard guard(R_in.device());
  at::Tensor R = R_in.contiguous();
  at::Tensor out = new_cuda(R.sizes(), R.scalar_type(), R.device());
  launch_forward(R, out, tol, max_iter, nullptr, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> birkhoff_forward_info(const at::Tensor& R_in, double tol,
                                                                     int64_t max_iter) {
  check_input(R_in, "R");
  TORCH_CHECK(max_iter >= 0 && max_iter < (1LL << 30), "mhc::birkhoff_forward_info: bad max_iter");
  c10::cuda::CUDAGuard guard(R_in.device());
  at::Tensor R = R_in.contiguous();
  at::Tensor out = at::empty_like(R);
  at::Tensor iters = at::empty({R.size(0)}, R.options().dtype(at::kInt));
  at::Tensor err = at::empty({R.size(0)}, R.options().dtype(at::kDouble));
  launch_forward(R, out, tol, max_iter, iters.data_ptr<int>(), err.data_ptr<double>());
  return {out, iters, err};
}

at::Tensor birkhoff_backward(const at::Tensor& T_in, const at::Tensor& G_in) {
  check_input(T_in, "T");
  check_input(G_in, "grad_T");
  TORCH_CHECK(T_in.sizes() == G_in.sizes(), "mhc::birkhoff_backward: T and grad_T shapes differ");
  TORCH_CHECK(T_in.scalar_type() == G_in.scalar_type(), "mhc::birkhoff_backward: T and grad_T dtypes differ");
  c10::cuda::CUDAGuard guard(T_in.device());
  at::Tensor T = T_in.contiguous();
  at::Tensor G = G_in.contiguous();
  at::Tensor out = new_cuda(T.sizes(), T.scalar_type(), T.device());
  const int64_t B = T.size(0);
  const int n = (int)T.size(1);
  if (B == 0) return out;
  const int64_t blocks = (B + kThreads - 1) / kThreads;
  auto stream = c10::cuda::getCurrentCUDAStream();
  dispatch_dtype(T.scalar_type(), [&](auto tag) {
    using ct = decltype(tag);
    const ct* tp = reinterpret_cast<const ct*>(T.data_ptr());
    const ct* gp = reinterpret_cast<const ct*>(G.data_ptr());
    ct* op = reinterpret_cast<ct*>(out.data_ptr());
    const bool vec = aligned16(tp) && aligned16(gp) && aligned16(op);
    if (n == 4) {
      birkhoff_backward_kernel<4, ct><<<(unsigned)blocks, kThreads, 0, stream>>>(tp, gp, op, B, vec);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      birkhoff_backward_kernel<8, ct><<<(unsigned)blocks, kThreads, 0, stream>>>(tp, gp, op, B, vec);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    }
  });
  return out;
}

// Unconverged counter. mode 0: read (synchronises the device), 1: read and
// reset, 2: non-blocking poll: returns the value seen by the last completed
// asynchronous read (-1 if none yet) and enqueues a new read on the current
// stream if the previous one has completed.
constexpr int kMaxDevices = 64;
static std::mutex g_poll_mutex;
static unsigned long long* g_pinned[kMaxDevices] = {nullptr};
static cudaEvent_t g_event[kMaxDevices] = {nullptr};
static bool g_pending[kMaxDevices] = {false};
static int64_t g_last_seen[kMaxDevices];
static bool g_last_init = false;

int64_t birkhoff_unconverged(int64_t device, int64_t mode) {
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "mhc::birkhoff_unconverged: bad device ", std::to_string(device));
  c10::cuda::CUDAGuard guard((c10::DeviceIndex)device);
  if (mode == 0 || mode == 1) {
    unsigned long long v = 0;
    C10_CUDA_CHECK(cudaDeviceSynchronize());
    C10_CUDA_CHECK(cudaMemcpyFromSymbol(&v, g_unconverged, sizeof(v)));
    if (mode == 1) {
      const unsigned long long zero = 0;
      C10_CUDA_CHECK(cudaMemcpyToSymbol(g_unconverged, &zero, sizeof(zero)));
      C10_CUDA_CHECK(cudaDeviceSynchronize());
      // A copy made before the reset must not be reported after it.
      std::lock_guard<std::mutex> lock(g_poll_mutex);
      g_pending[device] = false;
      g_last_seen[device] = -1;
    }
    return (int64_t)v;
  }
  TORCH_CHECK(mode == 2, "mhc::birkhoff_unconverged: bad mode ", std::to_string(mode));
  std::lock_guard<std::mutex> lock(g_poll_mutex);
  if (!g_last_init) {
    for (int i = 0; i < kMaxDevices; ++i) g_last_seen[i] = -1;
    g_last_init = true;
  }
  const int d = (int)device;
  if (g_pinned[d] == nullptr) {
    C10_CUDA_CHECK(cudaHostAlloc((void**)&g_pinned[d], sizeof(unsigned long long), cudaHostAllocDefault));
    *g_pinned[d] = 0;
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&g_event[d], cudaEventDisableTiming));
  }
  if (g_pending[d]) {
    const cudaError_t q = cudaEventQuery(g_event[d]);
    if (q == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return g_last_seen[d];
    }
    C10_CUDA_CHECK(q);
    g_last_seen[d] = (int64_t)*g_pinned[d];
    g_pending[d] = false;
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  C10_CUDA_CHECK(cudaMemcpyFromSymbolAsync(g_pinned[d], g_unconverged, sizeof(unsigned long long), 0,
                                           cudaMemcpyDeviceToHost, stream));
  C10_CUDA_CHECK(cudaEventRecord(g_event[d], stream));
  g_pending[d] = true;
  return g_last_seen[d];
}

// Autograd of birkhoff_forward. It lives here, not in Python, because a Python
// autograd layer (torch.library.register_autograd) cost about 150 us of host
// time per forward+backward on the H200's host, ten times the kernels' own time
// at small batches. The backward needs only the saved output T (the implicit
// gradient, design.md §2). Under create_graph the kernel's result would have no
// derivative, so the backward then calls mhc::birkhoff_backward_graph instead:
// the PyTorch reference backward, registered from Python
// (mhc/projection_cuda.py), whose operations autograd records.
class BirkhoffProject : public torch::autograd::Function<BirkhoffProject> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& R, double tol,
                            int64_t max_iter) {
    // Through the dispatcher, not a direct call: under torch.compile R is a fake tensor.
    static auto forward_op = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("mhc::birkhoff_forward", "")
                                 .typed<at::Tensor(const at::Tensor&, double, int64_t)>();
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    at::Tensor T = forward_op.call(R, tol, max_iter);
    ctx->save_for_backward({T});
    return T;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const at::Tensor T = ctx->get_saved_variables()[0];
    const at::Tensor& G = grads[0];
    if (!G.defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    at::Tensor dR;
    if (at::GradMode::is_enabled()) {
      static auto graph_backward = c10::Dispatcher::singleton()
                                       .findSchemaOrThrow("mhc::birkhoff_backward_graph", "")
                                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
      dR = graph_backward.call(T, G);
    } else {
      static auto backward_op = c10::Dispatcher::singleton()
                                    .findSchemaOrThrow("mhc::birkhoff_backward", "")
                                    .typed<at::Tensor(const at::Tensor&, const at::Tensor&)>();
      dR = backward_op.call(T, G.to(T.scalar_type()));
    }
    return {dR, at::Tensor(), at::Tensor()};
  }
};

at::Tensor birkhoff_forward_autograd(const at::Tensor& R, double tol, int64_t max_iter) {
  return BirkhoffProject::apply(R, tol, max_iter);
}

// The hot path's look at the unconverged counter. Every g_poll_every calls of
// project_or_none it does what birkhoff_unconverged's mode 2 does (never while
// the stream is captured into a CUDA graph) and, when the count it saw is > 0,
// calls the Python callback set by set_poll with (device, count), which warns if
// the count grew. Counting in C++ rather than in a Python wrapper took a Python
// frame off every call. project_or_none is only called from Python, with the
// GIL held, which serialises the count.
static PyObject* g_poll_callback = nullptr;  // a new reference, kept for the process
static int64_t g_poll_every = 0;              // 0: no looks
static int64_t g_poll_calls = 0;

void set_poll(py::object callback, int64_t every) {
  TORCH_CHECK(every >= 0, "mhc::set_poll: every must be >= 0");
  TORCH_CHECK(callback.is_none() || PyCallable_Check(callback.ptr()), "mhc::set_poll: callback must be callable");
  PyObject* previous = g_poll_callback;
  g_poll_callback = callback.is_none() ? nullptr : callback.inc_ref().ptr();
  Py_XDECREF(previous);
  g_poll_every = every;
  g_poll_calls = 0;
}

static void poll_counter(const at::Tensor& out) {
  if (g_poll_every == 0 || ++g_poll_calls < g_poll_every) return;
  g_poll_calls = 0;
  const c10::DeviceIndex dev = out.device().index();
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(c10::cuda::getCurrentCUDAStream(dev).stream(), &capture));
  if (capture != cudaStreamCaptureStatusNone) return;
  const int64_t seen = birkhoff_unconverged(dev, 2);
  if (seen > 0 && g_poll_callback != nullptr) {
    py::reinterpret_borrow<py::object>(g_poll_callback)((int64_t)dev, seen);  // a Python exception propagates
  }
}

// birkhoff_project's hot path, called from Python (through project_or_none_py, below) without torch.ops' argument
// parsing (about 5 us of host time per call on the H200's host, half a small
// batch's whole cost). Returns an undefined tensor (None in Python) for inputs
// the kernels do not take, and under functorch transforms (vmap, torch.func:
// their wrapped tensors need the dispatcher), which then go the checked way
// (the same test as torch._C._are_functorch_transforms_active, without a
// Python call). Every option was checked by the caller; tol is raised here to
// 4 n eps(float32), the rounding floor of projection_common.effective_tol for
// these (float32-computed) dtypes. Polls the counter (poll_counter).
at::Tensor project_or_none(const at::Tensor& logits, double tol, int64_t max_iter) {
  const int64_t d = logits.dim();
  // A forward-mode tangent (torch.autograd.forward_ad, level 0) goes the checked way too, which refuses it.
  if (!logits.is_cuda() || d < 2 ||
      c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
      logits._fw_grad(/*level=*/0).defined()) {
    return at::Tensor();
  }
  const int64_t n = logits.size(d - 1);
  const auto t = logits.scalar_type();
  if (logits.size(d - 2) != n || (n != 4 && n != 8) ||
      (t != at::kFloat && t != at::kHalf && t != at::kBFloat16)) {
    return at::Tensor();
  }
  const double tol_eff = float32_tol(tol, n);
  const at::Tensor R = d == 3 ? logits : logits.reshape({-1, n, n});
  at::Tensor T = (at::GradMode::is_enabled() && R.requires_grad()) ? BirkhoffProject::apply(R, tol_eff, max_iter)
                                                                 : birkhoff_forward(R, tol_eff, max_iter);
  poll_counter(T);
  return d == 3 ? T : T.reshape(logits.sizes());
}

// The site's two steps for a few tokens (site_tokens.cuh), called from mhc/fused_tokens.py.
static void check_site_param(const at::Tensor& p, const at::Tensor& x, const char* name, int64_t numel) {
  TORCH_CHECK(p.device() == x.device(), "mhc::site_tokens: ", name, " is on ", p.device(), ", the streams on ",
              x.device());
  TORCH_CHECK(p.scalar_type() == at::kFloat && p.is_contiguous(), "mhc::site_tokens: ", name,
              " must be contiguous float32");
  TORCH_CHECK(p.numel() == numel, "mhc::site_tokens: ", name, " has ", std::to_string(p.numel()),
              " values, expected ", std::to_string(numel));
}

// Streams [..., n, C], contiguous; returns the token count T.
static int64_t check_streams(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 2 && x.is_contiguous(),
              "mhc::site_tokens: streams must be a contiguous CUDA tensor [..., n, C], got ", x.sizes());
  const int64_t n = x.size(-2), C = x.size(-1);
  TORCH_CHECK(n == 4 || n == 8, "mhc::site_tokens: n must be 4 or 8, got ", std::to_string(n));
  TORCH_CHECK(C >= 1 && n * C < (1LL << 31), "mhc::site_tokens: bad stream width");
  const int64_t T = x.numel() / (n * C);
  TORCH_CHECK(T <= 65535, "mhc::site_tokens: too many tokens");
  return T;
}

// Whether this build's token kernels were compiled for clusters (sm_90 and up) on `device`.
static bool token_clusters(int device) {
  static std::mutex mutex;
  static std::vector<int> known;  // per device: -1 not looked up yet, else 0 / 1
  std::lock_guard<std::mutex> lock(mutex);
  if ((int)known.size() <= device) known.resize(device + 1, -1);
  if (known[device] < 0) {
    cudaFuncAttributes attr;
    C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, site_pre_tokens_kernel<4, float>));
    known[device] = attr.binaryVersion >= 90 ? 1 : 0;
  }
  return known[device] == 1;
}

// The blocks of one token's cluster (site_tokens.cuh): kTokenThreads columns a block, at most
// kMaxTokenSplits; 1 without clusters.
static int token_splits(const at::Tensor& x) {
  const int64_t C = x.size(-1);
  if (!token_clusters(x.get_device())) return 1;
  return (int)std::min<int64_t>(kMaxTokenSplits, (C + kTokenThreads - 1) / kTokenThreads);
}

// A token kernel over grid (splits, T) in clusters of `splits` blocks, on the current stream.
template <typename... Params, typename... Args>
static void launch_token_clusters(void (*kernel)(Params...), int64_t T, int splits, Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((unsigned)splits, (unsigned)T, 1);
  config.blockDim = dim3(kTokenThreads, 1, 1);
  config.stream = c10::cuda::getCurrentCUDAStream();
  cudaLaunchAttribute cluster;
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = (unsigned)splits;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = splits > 1 ? 1 : 0;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args...));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// site_tokens.cuh's InputNorm from an optional weight and output (the same dtype as the streams).
template <typename scalar_t>
static InputNorm<scalar_t> input_norm(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& out,
                                      double eps) {
  if (!weight.has_value() || !out.has_value()) return {nullptr, nullptr, 0.0f};
  return {reinterpret_cast<const scalar_t*>(weight->data_ptr()), reinterpret_cast<scalar_t*>(out->data_ptr()),
          (float)eps};
}

static void launch_site_pre(const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha,
                            const at::Tensor& b_pre, const at::Tensor& b_post, const at::Tensor& b_res,
                            float* zr, float* h, float* h_res, at::Tensor& u, double eps, double tol,
                            int64_t max_iter, const std::optional<at::Tensor>& norm_weight = std::nullopt,
                            const std::optional<at::Tensor>& normed = std::nullopt, double norm_eps = 0.0) {
  const int64_t T = x.numel() / (x.size(-2) * x.size(-1));
  const int64_t n = x.size(-2), C = x.size(-1);
  if (T == 0) return;
  const int splits = token_splits(x);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using ct = decltype(tag);
    const ct* xp = reinterpret_cast<const ct*>(x.data_ptr());
    ct* up = reinterpret_cast<ct*>(u.data_ptr());
    const float *pp = phi.data_ptr<float>(), *ap = alpha.data_ptr<float>(), *bp = b_pre.data_ptr<float>(),
                *bq = b_post.data_ptr<float>(), *br = b_res.data_ptr<float>();
    auto kernel = n == 4 ? site_pre_tokens_kernel<4, ct> : site_pre_tokens_kernel<8, ct>;
    launch_token_clusters(kernel, T, splits, xp, pp, ap, bp, bq, br, zr, h, h_res, up,
                          input_norm<ct>(norm_weight, normed, norm_eps), (int)C, (float)eps, (float)tol,
                          (int)max_iter);
  });
}

static void launch_site_post(const at::Tensor& x, const at::Tensor& y, const float* h, const float* h_res,
                             at::Tensor& out) {
  const int64_t T = x.numel() / (x.size(-2) * x.size(-1));
  const int64_t n = x.size(-2), C = x.size(-1);
  if (T == 0) return;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const dim3 grid((unsigned)((C + kTokenThreads - 1) / kTokenThreads), (unsigned)T);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using ct = decltype(tag);
    const ct* xp = reinterpret_cast<const ct*>(x.data_ptr());
    const ct* yp = reinterpret_cast<const ct*>(y.data_ptr());
    ct* op = reinterpret_cast<ct*>(out.data_ptr());
    if (n == 4) {
      site_post_tokens_kernel<4, ct><<<grid, kTokenThreads, 0, stream>>>(xp, yp, h, h_res, op, (int)C);
    } else {
      site_post_tokens_kernel<8, ct><<<grid, kTokenThreads, 0, stream>>>(xp, yp, h, h_res, op, (int)C);
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

static std::vector<int64_t> token_shape(const at::Tensor& x) {  // [..., n, C] -> [..., C]
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end() - 1);
  shape.back() = x.size(-1);
  return shape;
}

static at::Tensor as_float32(const at::Tensor& p) {
  return p.scalar_type() == at::kFloat && p.is_contiguous() ? p : p.to(at::kFloat).contiguous();
}

// (phi, alpha, b_pre, b_post, b_res) as contiguous float32, checked against the streams x.
static std::array<at::Tensor, 5> float32_site_params(const at::Tensor& x, const at::Tensor& phi,
                                                     const at::Tensor& alpha, const at::Tensor& b_pre,
                                                     const at::Tensor& b_post, const at::Tensor& b_res) {
  const int64_t n = x.size(-2), C = x.size(-1), Z = n * n + 2 * n;
  std::array<at::Tensor, 5> p = {as_float32(phi), as_float32(alpha), as_float32(b_pre), as_float32(b_post),
                                 as_float32(b_res)};
  check_site_param(p[0], x, "phi", Z * n * C);
  check_site_param(p[1], x, "alpha", 3);
  check_site_param(p[2], x, "b_pre", n);
  check_site_param(p[3], x, "b_post", n);
  check_site_param(p[4], x, "b_res", n * n);
  return p;
}

std::vector<at::Tensor> site_pre_tokens(const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha,
                                        const at::Tensor& b_pre, const at::Tensor& b_post,
                                        const at::Tensor& b_res, double eps, double tol, int64_t max_iter) {
  const int64_t T = check_streams(x);
  const int64_t n = x.size(-2), Z = n * n + 2 * n;
  const auto p = float32_site_params(x, phi, alpha, b_pre, b_post, b_res);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor zr = new_cuda({T, Z + 1}, at::kFloat, x.device());
  at::Tensor h = new_cuda({T, 2 * n}, at::kFloat, x.device());
  at::Tensor h_res = new_cuda({T, n, n}, at::kFloat, x.device());
  at::Tensor u = new_cuda(token_shape(x), x.scalar_type(), x.device());
  launch_site_pre(x, p[0], p[1], p[2], p[3], p[4], zr.data_ptr<float>(), h.data_ptr<float>(),
                  h_res.data_ptr<float>(), u, eps, tol, max_iter);
  return {u, zr, h, h_res};
}

at::Tensor site_post_tokens(const at::Tensor& x, const at::Tensor& y, const at::Tensor& h,
                            const at::Tensor& h_res) {
  const int64_t T = check_streams(x);
  const int64_t n = x.size(-2), C = x.size(-1);
  TORCH_CHECK(y.device() == x.device() && y.scalar_type() == x.scalar_type() && y.is_contiguous() &&
                  y.numel() == T * C,
              "mhc::site_post_tokens: y must be a contiguous [T, C] tensor of the streams' dtype and device");
  check_site_param(h, x, "h", T * 2 * n);
  check_site_param(h_res, x, "H_res", T * n * n);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = new_cuda(x.sizes(), x.scalar_type(), x.device());
  launch_site_post(x, y, h.data_ptr<float>(), h_res.data_ptr<float>(), out);
  return out;
}

// The no-grad forms, for generation, where a site's cost is its host time: each call is one
// launch with no tensor the backward would need (no zr), h and H_res in one float32
// allocation `mix` = [h (T·2n) | H_res (T·n·n)], and the conversions the Python side would
// otherwise make (contiguous streams, float32 parameters, y in the streams' dtype) made here.

// The branch output y [T, C] in the streams' dtype, contiguous, checked against the streams x.
static at::Tensor branch_output(const at::Tensor& y, const at::Tensor& x, int64_t T) {
  TORCH_CHECK(y.device() == x.device() && y.is_floating_point() && y.numel() == T * x.size(-1),
              "mhc::site_tokens: y must be a floating-point [T, C] tensor on the streams' device");
  return y.scalar_type() == x.scalar_type() && y.is_contiguous() ? y : y.to(x.scalar_type()).contiguous();
}

// The output of the branch's input RMSNorm (site_tokens.cuh's InputNorm) if its weight fits the streams x: a
// dense [C] tensor of their dtype (the dtype HF's RMSNorm multiplies in) on their device. None otherwise: the
// branch then runs its norm itself.
static std::optional<at::Tensor> input_norm_output(const std::optional<at::Tensor>& weight, const at::Tensor& x) {
  if (!weight.has_value()) return std::nullopt;
  const at::Tensor& w = *weight;
  if (w.device() != x.device() || w.scalar_type() != x.scalar_type() || !w.is_contiguous() ||
      w.dim() != 1 || w.size(0) != x.size(-1)) {
    return std::nullopt;
  }
  return new_cuda(token_shape(x), x.scalar_type(), x.device());
}

// Returns None for streams these kernels do not take (not CUDA, n not in {4, 8}, a dtype other
// than float32 / bfloat16 / float16, no token or more than max_tokens), else (u, mix, streams, normed),
// the streams as the kernel read them (contiguous), for site_post_tokens_packed, and normed the
// branch's input RMSNorm of u (norm_weight, norm_eps; input_norm_output) or None. tol is raised to
// 4 n eps(float32), as project_or_none does.
using PackedFirstStep = std::tuple<at::Tensor, at::Tensor, at::Tensor, std::optional<at::Tensor>>;

std::optional<PackedFirstStep> site_pre_tokens_packed(
    const at::Tensor& x_in, const at::Tensor& phi_in, const at::Tensor& alpha_in, const at::Tensor& b_pre_in,
    const at::Tensor& b_post_in, const at::Tensor& b_res_in, double eps, double tol, int64_t max_iter,
    int64_t max_tokens, const std::optional<at::Tensor>& norm_weight, double norm_eps) {
  const int64_t d = x_in.dim();
  if (!x_in.is_cuda() || d < 2) return std::nullopt;
  const int64_t n = x_in.size(d - 2), C = x_in.size(d - 1);
  const auto dt = x_in.scalar_type();
  if ((n != 4 && n != 8) || C < 1 || (dt != at::kFloat && dt != at::kHalf && dt != at::kBFloat16)) {
    return std::nullopt;
  }
  const int64_t T = x_in.numel() / (n * C);
  if (T < 1 || T > max_tokens) return std::nullopt;
  const at::Tensor x = x_in.contiguous();
  check_streams(x);
  const auto p = float32_site_params(x, phi_in, alpha_in, b_pre_in, b_post_in, b_res_in);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor mix = new_cuda({T * (2 * n + n * n)}, at::kFloat, x.device());
  at::Tensor u = new_cuda(token_shape(x), x.scalar_type(), x.device());
  const std::optional<at::Tensor> normed = input_norm_output(norm_weight, x);
  float* h = mix.data_ptr<float>();
  const double tol_eff = float32_tol(tol, n);
  launch_site_pre(x, p[0], p[1], p[2], p[3], p[4], nullptr, h, h + T * 2 * n, u, eps, tol_eff, max_iter,
                  norm_weight, normed, norm_eps);
  return PackedFirstStep(u, mix, x, normed);
}

at::Tensor site_post_tokens_packed(const at::Tensor& x, const at::Tensor& y_in, const at::Tensor& mix) {
  const int64_t T = check_streams(x);
  const int64_t n = x.size(-2);
  const at::Tensor y = branch_output(y_in, x, T);
  check_site_param(mix, x, "mix", T * (2 * n + n * n));
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = new_cuda(x.sizes(), x.scalar_type(), x.device());
  const float* h = mix.data_ptr<float>();
  launch_site_post(x, y, h, h + T * 2 * n, out);
  return out;
}

// A site's post-mix after site_pre_tokens_packed and the next site's first step, in one launch
// (generation: every site boundary of a decode step). Returns (x', u_next, mix_next, normed_next), the
// last three as site_pre_tokens_packed would return them for x'. The next site's parameters must fit the
// streams.
PackedFirstStep site_post_pre_tokens_packed(
    const at::Tensor& x, const at::Tensor& y_in, const at::Tensor& mix, const at::Tensor& phi_in,
    const at::Tensor& alpha_in, const at::Tensor& b_pre_in, const at::Tensor& b_post_in, const at::Tensor& b_res_in,
    double eps, double tol, int64_t max_iter, const std::optional<at::Tensor>& norm_weight, double norm_eps) {
  const int64_t T = check_streams(x);
  TORCH_CHECK(T >= 1, "mhc::site_tokens: no token");
  const int64_t n = x.size(-2), C = x.size(-1);
  const at::Tensor y = branch_output(y_in, x, T);
  check_site_param(mix, x, "mix", T * (2 * n + n * n));
  const auto p = float32_site_params(x, phi_in, alpha_in, b_pre_in, b_post_in, b_res_in);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = new_cuda(x.sizes(), x.scalar_type(), x.device());
  at::Tensor mix_next = new_cuda({T * (2 * n + n * n)}, at::kFloat, x.device());
  at::Tensor u_next = new_cuda(token_shape(x), x.scalar_type(), x.device());
  const std::optional<at::Tensor> normed = input_norm_output(norm_weight, x);
  const double tol_eff = float32_tol(tol, n);
  const int splits = token_splits(x);
  dispatch_dtype(x.scalar_type(), [&](auto tag) {
    using ct = decltype(tag);
    const ct* xp = reinterpret_cast<const ct*>(x.data_ptr());
    const ct* yp = reinterpret_cast<const ct*>(y.data_ptr());
    ct* op = reinterpret_cast<ct*>(out.data_ptr());
    ct* up = reinterpret_cast<ct*>(u_next.data_ptr());
    const float* h = mix.data_ptr<float>();
    float* hn = mix_next.data_ptr<float>();
    const float *pp = p[0].data_ptr<float>(), *ap = p[1].data_ptr<float>(), *bp = p[2].data_ptr<float>(),
                *bq = p[3].data_ptr<float>(), *br = p[4].data_ptr<float>();
    auto kernel = n == 4 ? site_post_pre_tokens_kernel<4, ct> : site_post_pre_tokens_kernel<8, ct>;
    launch_token_clusters(kernel, T, splits, xp, yp, h, h + T * 2 * n, op, pp, ap, bp, bq, br, hn,
                          hn + T * 2 * n, up, input_norm<ct>(norm_weight, normed, norm_eps), (int)C, (float)eps,
                          (float)tol_eff, (int)max_iter);
  });
  return PackedFirstStep(out, u_next, mix_next, normed);
}

// project_or_none as a plain CPython function (METH_FASTCALL). pybind11's call
// machinery (overload loop, argument vectors, type casters) cost 0.54-0.70 us
// more a call on the H200's host (8.36 against 7.66 us at N = 512, 8.65 against
// 8.11 at 32K, commit 215327d), and at small batches the call's host time is the
// projection's cost. Arguments: (logits: Tensor, tol: float, max_iter: int),
// positional; returns a Tensor or None.
static PyObject* project_or_none_py(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  try {
    if (nargs != 3 || !THPVariable_Check(args[0])) {
      PyErr_SetString(PyExc_TypeError, "project_or_none(logits: Tensor, tol: float, max_iter: int)");
      return nullptr;
    }
    const double tol = PyFloat_AsDouble(args[1]);
    if (tol == -1.0 && PyErr_Occurred()) return nullptr;
    const long long max_iter = PyLong_AsLongLong(args[2]);
    if (max_iter == -1 && PyErr_Occurred()) return nullptr;
    at::Tensor T = project_or_none(THPVariable_Unpack(args[0]), tol, (int64_t)max_iter);
    if (!T.defined()) Py_RETURN_NONE;
    return THPVariable_Wrap(std::move(T));
  } catch (py::error_already_set& e) {  // raised by the poll callback
    e.restore();
    return nullptr;
  } catch (...) {  // c10::Error and the like, as torch's own bindings translate them
    torch::translate_exception_to_python(std::current_exception());
    return nullptr;
  }
}

static PyMethodDef project_or_none_def = {
    "project_or_none", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(project_or_none_py)),
    METH_FASTCALL, "birkhoff_project's unchecked CUDA path (logits, tol, max_iter) -> Tensor or None (birkhoff.cu)"};

}  // namespace mhc_birkhoff

TORCH_LIBRARY_FRAGMENT(mhc, m) {
  m.def("birkhoff_forward(Tensor R, float tol, int max_iter) -> Tensor");
  m.def("birkhoff_forward_info(Tensor R, float tol, int max_iter) -> (Tensor, Tensor, Tensor)");
  m.def("birkhoff_backward(Tensor T, Tensor grad_T) -> Tensor");
  m.def("birkhoff_unconverged(int device, int mode) -> int", &mhc_birkhoff::birkhoff_unconverged);
}

TORCH_LIBRARY_IMPL(mhc, CUDA, m) {
  m.impl("birkhoff_forward", &mhc_birkhoff::birkhoff_forward);
  m.impl("birkhoff_forward_info", &mhc_birkhoff::birkhoff_forward_info);
  m.impl("birkhoff_backward", &mhc_birkhoff::birkhoff_backward);
}

TORCH_LIBRARY_IMPL(mhc, Autograd, m) {
  m.impl("birkhoff_forward", &mhc_birkhoff::birkhoff_forward_autograd);
}

#ifndef TORCH_EXTENSION_NAME  // set by torch.utils.cpp_extension.load
#define TORCH_EXTENSION_NAME mhc_birkhoff_cuda
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  PyObject* project_or_none = PyCFunction_NewEx(&mhc_birkhoff::project_or_none_def, nullptr, nullptr);
  if (project_or_none == nullptr) throw py::error_already_set();
  m.add_object("project_or_none", py::reinterpret_steal<py::object>(project_or_none));
  m.def("set_poll", &mhc_birkhoff::set_poll, "project_or_none's counter look: callback(device, count), every N calls");
  m.def("site_pre_tokens", &mhc_birkhoff::site_pre_tokens, "the site's first step for a few tokens");
  m.def("site_post_tokens", &mhc_birkhoff::site_post_tokens, "the site's post-mix for a few tokens");
  m.def("site_pre_tokens_packed", &mhc_birkhoff::site_pre_tokens_packed,
        "the site's first step for a few tokens without grad, or None where the kernels do not take the streams");
  m.def("site_post_tokens_packed", &mhc_birkhoff::site_post_tokens_packed,
        "the post-mix after site_pre_tokens_packed");
  m.def("site_post_pre_tokens_packed", &mhc_birkhoff::site_post_pre_tokens_packed,
        "the post-mix after site_pre_tokens_packed and the next site's first step, in one launch");
}
