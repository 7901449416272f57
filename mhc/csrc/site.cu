// Host side of the fused mHC site (mhc/fused.py) in C++: its two autograd nodes,
// their allocations and their launches. Python makes two calls per site forward
// (site_pre before the sublayer, post_mix after it) and none in backward.
//
// Why: at the width of a ~125M model a site's forward is bound by host time, not
// by the GPU. On the H200's host each Triton launch from Python cost ~25 µs, the
// projection op ~30 µs, each torch.empty ~4.5 µs and each autograd.Function ~30 µs
// beyond its body (notes/block_benchmarks.md). The kernels stay Triton's: Python
// compiles each variant on its first launch (mhc/fused.py's own path) and hands
// its CUfunction here (TritonKernel), with the kind of each parameter, so later
// launches skip Triton's Python launcher. The Birkhoff projection is called as
// the C++ functions behind torch.ops.mhc.birkhoff_forward / _backward.

#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#ifndef TORCH_EXTENSION_NAME
#define TORCH_EXTENSION_NAME mhc_birkhoff_cuda  // set by torch.utils.cpp_extension.load
#endif

namespace mhc_birkhoff {
at::Tensor birkhoff_forward(const at::Tensor& R, double tol, int64_t max_iter);
at::Tensor birkhoff_backward(const at::Tensor& T, const at::Tensor& grad_T);
}  // namespace mhc_birkhoff

namespace mhc_site {

// The kind of one kernel parameter, in the order of the Triton kernel's Python
// signature; kSkip marks a parameter Triton compiled in (constexpr, or an int
// specialised on its value), which is not passed.
enum ParamKind : int64_t { kSkip = 0, kPointer = 1, kInt32 = 2, kInt64 = 3, kFloat32 = 4, kFloat64 = 5 };

using LaunchKernelFn = CUresult (*)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                                    CUstream, void**, void**);

// cuLaunchKernel through the runtime's driver entry point, so that the extension
// needs no link against libcuda.
static LaunchKernelFn launch_kernel_fn() {
  static const LaunchKernelFn fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status{};
#if CUDART_VERSION >= 12050
    C10_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuLaunchKernel", &p, 12000, cudaEnableDefault, &status));
#else
    C10_CUDA_CHECK(cudaGetDriverEntryPoint("cuLaunchKernel", &p, cudaEnableDefault, &status));
#endif
    TORCH_CHECK(status == cudaDriverEntryPointSuccess && p != nullptr,
                "mhc: cuLaunchKernel not found in the CUDA driver");
    return reinterpret_cast<LaunchKernelFn>(p);
  }();
  return fn;
}

// Integers in error messages go through std::to_string: formatting them with the
// ostream inside TORCH_CHECK crashed this extension on the H200 machine
// (torch 2.11, host gcc /opt/gcc), while strings and torch's own types did not.

// One compiled variant of a Triton kernel and the grid of one launch plan.
struct TritonKernel {
  CUfunction function;
  unsigned grid[3];
  unsigned threads;
  unsigned shared_bytes;
  std::vector<int64_t> kinds;
};

// Python's constructor of TritonKernel: the checks come before the object is made.
static TritonKernel make_triton_kernel(int64_t function, const std::vector<int64_t>& grid, int64_t num_warps,
                                       int64_t shared, const std::vector<int64_t>& kinds) {
  TORCH_CHECK(function != 0, "mhc: TritonKernel needs a loaded CUfunction");
  TORCH_CHECK(grid.size() == 3, "mhc: TritonKernel needs a 3-d grid");
  TritonKernel k;
  for (int d = 0; d < 3; ++d) {
    TORCH_CHECK(grid[d] >= 1 && grid[d] < (int64_t(1) << 31), "mhc: bad grid size ", std::to_string(grid[d]),
                " in dimension ", std::to_string(d));
    k.grid[d] = static_cast<unsigned>(grid[d]);
  }
  TORCH_CHECK(num_warps >= 1 && num_warps <= 32 && shared >= 0, "mhc: bad num_warps / shared memory");
  for (int64_t kind : kinds) {
    TORCH_CHECK(kind >= kSkip && kind <= kFloat64, "mhc: unknown parameter kind ", std::to_string(kind));
  }
  k.function = reinterpret_cast<CUfunction>(static_cast<uintptr_t>(function));
  k.threads = static_cast<unsigned>(32 * num_warps);
  k.shared_bytes = static_cast<unsigned>(shared);
  k.kinds = kinds;
  return k;
}

// One argument as the caller has it: a tensor's address, an integer or a float.
struct Arg {
  enum Kind { kTensor, kInt, kFloat } kind;
  union {
    const void* ptr;
    int64_t i;
    double f;
  };
  Arg(const at::Tensor& t) : kind(kTensor), ptr(t.data_ptr()) {}
  Arg(int64_t v) : kind(kInt), i(v) {}
  Arg(double v) : kind(kFloat), f(v) {}
};

static void launch(const TritonKernel& k, std::initializer_list<Arg> args) {
  TORCH_CHECK(args.size() == k.kinds.size(), "mhc: kernel takes ", std::to_string(k.kinds.size()), " arguments, got ",
              std::to_string(args.size()));
  constexpr size_t kMaxParams = 32;
  TORCH_CHECK(args.size() + 2 <= kMaxParams, "mhc: too many kernel arguments");
  uint64_t slots[kMaxParams];
  void* params[kMaxParams];
  size_t np = 0;
  const Arg* a = args.begin();
  for (size_t i = 0; i < args.size(); ++i, ++a) {
    uint64_t& slot = slots[np];
    slot = 0;
    switch (k.kinds[i]) {
      case kSkip:
        continue;
      case kPointer:
        TORCH_CHECK(a->kind == Arg::kTensor, "mhc: kernel argument ", std::to_string(i), " must be a tensor");
        std::memcpy(&slot, &a->ptr, sizeof(void*));
        break;
      case kInt32: {
        TORCH_CHECK(a->kind == Arg::kInt && a->i >= INT32_MIN && a->i <= INT32_MAX, "mhc: kernel argument ",
                    std::to_string(i), " must be an int32");
        const int32_t v = static_cast<int32_t>(a->i);
        std::memcpy(&slot, &v, sizeof(v));
        break;
      }
      case kInt64:
        TORCH_CHECK(a->kind == Arg::kInt, "mhc: kernel argument ", std::to_string(i), " must be an integer");
        std::memcpy(&slot, &a->i, sizeof(int64_t));
        break;
      case kFloat32: {
        TORCH_CHECK(a->kind == Arg::kFloat, "mhc: kernel argument ", std::to_string(i), " must be a float");
        const float v = static_cast<float>(a->f);
        std::memcpy(&slot, &v, sizeof(v));
        break;
      }
      case kFloat64:
        TORCH_CHECK(a->kind == Arg::kFloat, "mhc: kernel argument ", std::to_string(i), " must be a float");
        std::memcpy(&slot, &a->f, sizeof(double));
        break;
    }
    params[np] = &slot;
    ++np;
  }
  // Triton kernels end with their global and profile scratch pointers. Python hands
  // over only variants that use neither, so both are null, as Triton passes them.
  // (A kernel with fewer parameters ignores the extra entries.)
  for (int s = 0; s < 2; ++s, ++np) {
    slots[np] = 0;
    params[np] = &slots[np];
  }
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const CUresult r = launch_kernel_fn()(k.function, k.grid[0], k.grid[1], k.grid[2], k.threads, 1, 1, k.shared_bytes,
                                        stream, params, nullptr);
  TORCH_CHECK(r == CUDA_SUCCESS, "mhc: a fused-site kernel failed to launch (CUresult ",
              std::to_string(static_cast<int>(r)), ")");
}

// t as a contiguous, 16-byte aligned tensor of dtype: what the Triton variants were
// specialised for (mhc.fused._dense does the same on the Python path).
static at::Tensor dense(const at::Tensor& t, std::optional<at::ScalarType> dtype = std::nullopt) {
  at::Tensor r = dtype && t.scalar_type() != *dtype ? t.to(*dtype) : t;
  if (!r.is_contiguous()) return r.contiguous();
  return reinterpret_cast<uintptr_t>(r.data_ptr()) % 16 == 0 ? r : r.clone();
}

struct Shape {
  int64_t T, n, C, Z;
  explicit Shape(const at::Tensor& x)
      : T(x.numel() / (x.size(-2) * x.size(-1))), n(x.size(-2)), C(x.size(-1)), Z(n * n + 2 * n) {}
};

static void check_streams(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 2 && x.numel() > 0 && x.is_contiguous(),
              "mhc: the fused site needs contiguous, non-empty CUDA streams [..., n, C]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf,
              "mhc: the native fused site takes float32 / bfloat16 / float16 streams, got ", x.scalar_type());
}

// (u, zr, h, H_res): coeff_fwd, then the projection of its R (mhc.fused._SitePre.forward).
static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_pre_forward(
    const TritonKernel& coeff_fwd, const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha,
    const at::Tensor& b_pre, const at::Tensor& b_post, const at::Tensor& b_res, double eps, double tol_eff,
    int64_t max_iter) {
  check_streams(x);
  const Shape s(x);
  const auto f32 = x.options().dtype(at::kFloat);
  at::Tensor zr = at::empty({s.T, s.Z + 1}, f32);
  at::Tensor h = at::empty({s.T, 2 * s.n}, f32);
  at::Tensor R = at::empty({s.T, s.n, s.n}, f32);
  std::vector<int64_t> u_shape(x.sizes().begin(), x.sizes().end() - 1);
  u_shape.back() = s.C;
  at::Tensor u = at::empty(u_shape, x.options());
  launch(coeff_fwd, {x, phi, alpha, b_pre, b_post, b_res, zr, h, R, u, s.T, s.C, eps});
  at::Tensor H_res = mhc_birkhoff::birkhoff_forward(R, tol_eff, max_iter);
  return {u, zr, h, H_res};
}

// x' = H_res·x + H_post ⊗ y (mhc.fused._PostMix.forward).
static at::Tensor post_mix_forward(const TritonKernel& postmix_fwd, const at::Tensor& x, const at::Tensor& y,
                            const at::Tensor& h, const at::Tensor& H_res) {
  check_streams(x);
  at::Tensor out = at::empty_like(x);
  launch(postmix_fwd, {x, y, h, H_res, out, Shape(x).C});
  return out;
}

// (dx' as the kernels read it, dy, dh, dH_res) (mhc.fused._PostMix.backward).
static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> post_mix_backward(const TritonKernel& postmix_bwd,
                                                                             const at::Tensor& dout,
                                                                             const at::Tensor& x, const at::Tensor& y,
                                                                             const at::Tensor& h) {
  check_streams(x);
  const Shape s(x);
  at::Tensor d_out = dense(dout);
  at::Tensor dy = at::empty_like(y);
  at::Tensor g_h = at::empty_like(h);
  at::Tensor g_res = at::empty({s.T, s.n, s.n}, h.options());
  launch(postmix_bwd, {d_out, x, y, h, dy, g_h, g_res, s.C});
  return {d_out, dy, g_h, g_res};
}

// (dx, dφ, dα, db_pre, db_post, db_res) (mhc.fused._SitePre.backward). dx and dφ are
// undefined (None) when their kernel is not given; a missing dx' counts as zero.
static std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_pre_backward(
    const TritonKernel& coeff_bwd, const TritonKernel* stream_grad, const TritonKernel* phi_grad,
    const at::Tensor& du_in, const at::Tensor& d_h, const at::Tensor& d_res, const std::optional<at::Tensor>& d_out,
    const at::Tensor& x, const at::Tensor& phi, const at::Tensor& alpha, const at::Tensor& zr, const at::Tensor& h,
    const at::Tensor& H_res, int64_t stream_tokens, int64_t phi_splits, int64_t phi_tokens) {
  check_streams(x);
  const Shape s(x);
  // The projection's implicit backward needs only its output (design.md §2).
  at::Tensor dR = mhc_birkhoff::birkhoff_backward(H_res, dense(d_res, at::kFloat));
  at::Tensor du = dense(du_in);
  at::Tensor work = at::empty({s.T, 2 * s.Z + 4}, zr.options());  // per token [r·dz | dv | α's group sums | c2]
  launch(coeff_bwd, {du, x, h, dense(d_h, at::kFloat), dR, zr, alpha, work, s.C});
  at::Tensor sums = work.sum(0);
  at::Tensor db_pre = sums.narrow(0, s.Z, s.n);
  at::Tensor db_post = sums.narrow(0, s.Z + s.n, s.n);
  at::Tensor db_res = sums.narrow(0, s.Z + 2 * s.n, s.n * s.n).view({s.n, s.n});
  at::Tensor d_alpha = sums.narrow(0, 2 * s.Z, 3);

  at::Tensor dx, dphi;
  if (stream_grad != nullptr) {
    at::Tensor dx_prime = d_out.has_value() ? dense(*d_out) : at::zeros_like(x);
    dx = at::empty_like(x);
    launch(*stream_grad, {dx_prime, du, x, work, phi, h, H_res, dx, s.T, s.C, stream_tokens});
  }
  if (phi_grad != nullptr) {
    at::Tensor part = at::empty({phi_splits, s.Z, s.n * s.C}, zr.options());
    launch(*phi_grad, {work, x, part, s.T, s.n * s.C, s.Z, phi_tokens});
    dphi = part.sum(0);
  }
  return {dx, dphi, d_alpha, db_pre, db_post, db_res};
}

// The launch handles of one site's six kernels for one plan (streams of one shape,
// dtype and device), and the plan's integers.
struct SiteKernels : torch::CustomClassHolder {
  TritonKernel coeff_fwd, postmix_fwd, postmix_bwd, coeff_bwd, stream_grad, phi_grad;
  int64_t stream_tokens, phi_splits, phi_tokens;
  SiteKernels(TritonKernel a, TritonKernel b, TritonKernel c, TritonKernel d, TritonKernel e, TritonKernel f,
              int64_t stream_tokens_, int64_t phi_splits_, int64_t phi_tokens_)
      : coeff_fwd(std::move(a)), postmix_fwd(std::move(b)), postmix_bwd(std::move(c)), coeff_bwd(std::move(d)),
        stream_grad(std::move(e)), phi_grad(std::move(f)), stream_tokens(stream_tokens_), phi_splits(phi_splits_),
        phi_tokens(phi_tokens_) {}
};

// One call of a site. PostMix's backward leaves dx' here and SitePre's writes the
// whole dx in one pass (separate gradients would cost extra passes over the
// streams to add up).
struct SiteCall : torch::CustomClassHolder {
  c10::intrusive_ptr<SiteKernels> kernels;
  at::Tensor d_out;
  explicit SiteCall(c10::intrusive_ptr<SiteKernels> k) : kernels(std::move(k)) {}
};

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

static c10::intrusive_ptr<SiteCall> saved_call(AutogradContext* ctx) {
  // The backward's results carry no graph, so a second-order gradient through
  // them would silently be zero; refuse it instead.
  TORCH_CHECK(!at::GradMode::is_enabled(),
              "mhc: the fused mHC site does not support double backward (create_graph=True); "
              "use MHCBlock(fused=False)");
  return c10::static_intrusive_pointer_cast<SiteCall>(ctx->saved_data["call"].toCapsule());
}

// (x, φ, α, b_pre, b_post, b_res) -> (u, h, H_res).
struct SitePre : torch::autograd::Function<SitePre> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& phi,
                               const at::Tensor& alpha, const at::Tensor& b_pre, const at::Tensor& b_post,
                               const at::Tensor& b_res, const c10::intrusive_ptr<SiteCall>& call, double eps,
                               double tol_eff, int64_t max_iter) {
    auto [u, zr, h, H_res] =
        site_pre_forward(call->kernels->coeff_fwd, x, phi, alpha, b_pre, b_post, b_res, eps, tol_eff, max_iter);
    ctx->save_for_backward({x, phi, alpha, zr, h, H_res});
    ctx->saved_data["call"] = at::IValue::make_capsule(call);
    return {u, h, H_res};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto call = saved_call(ctx);
    const SiteKernels& k = *call->kernels;
    const variable_list saved = ctx->get_saved_variables();
    // No dx' when the site's output took no part in the loss (only H_post / H_res did).
    std::optional<at::Tensor> d_out;
    if (call->d_out.defined()) d_out = std::move(call->d_out);
    call->d_out = at::Tensor();
    auto [dx, dphi, d_alpha, db_pre, db_post, db_res] = site_pre_backward(
        k.coeff_bwd, ctx->needs_input_grad(0) ? &k.stream_grad : nullptr,
        ctx->needs_input_grad(1) ? &k.phi_grad : nullptr, grads[0], grads[1], grads[2], d_out, saved[0], saved[1],
        saved[2], saved[3], saved[4], saved[5], k.stream_tokens, k.phi_splits, k.phi_tokens);
    return {dx, dphi, d_alpha, db_pre, db_post, db_res, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// (x, y, h, H_res) -> x' = H_res·x + H_post ⊗ y. Returns no gradient for x: it
// leaves dx' for SitePre (SiteCall).
struct PostMix : torch::autograd::Function<PostMix> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& y, const at::Tensor& h,
                               const at::Tensor& H_res, const c10::intrusive_ptr<SiteCall>& call) {
    at::Tensor out = post_mix_forward(call->kernels->postmix_fwd, x, y, h, H_res);
    ctx->save_for_backward({x, y, h});
    ctx->saved_data["call"] = at::IValue::make_capsule(call);
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto call = saved_call(ctx);
    const variable_list saved = ctx->get_saved_variables();
    auto [d_out, dy, g_h, g_res] =
        post_mix_backward(call->kernels->postmix_bwd, grads[0], saved[0], saved[1], saved[2]);
    call->d_out = std::move(d_out);
    return {at::Tensor(), dy, g_h, g_res, at::Tensor()};
  }
};

// Python's entry points: site_pre before the sublayer, post_mix after it.
static std::tuple<at::Tensor, at::Tensor, at::Tensor, c10::intrusive_ptr<SiteCall>> site_pre(
    const c10::intrusive_ptr<SiteKernels>& kernels, const at::Tensor& x, const at::Tensor& phi,
    const at::Tensor& alpha, const at::Tensor& b_pre, const at::Tensor& b_post, const at::Tensor& b_res, double eps,
    double tol_eff, int64_t max_iter) {
  auto call = c10::make_intrusive<SiteCall>(kernels);
  variable_list out = SitePre::apply(x, phi, alpha, b_pre, b_post, b_res, call, eps, tol_eff, max_iter);
  return {out[0], out[1], out[2], call};
}

static at::Tensor post_mix(const c10::intrusive_ptr<SiteCall>& call, const at::Tensor& x, const at::Tensor& y,
                           const at::Tensor& h, const at::Tensor& H_res) {
  return PostMix::apply(x, y, h, H_res, call)[0];
}

}  // namespace mhc_site

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mhc: fused CUDA Birkhoff kernels (torch.ops.mhc.birkhoff_*) and the fused site's host side";
  pybind11::class_<mhc_site::TritonKernel>(m, "TritonKernel")
      .def(pybind11::init(&mhc_site::make_triton_kernel), pybind11::arg("function"), pybind11::arg("grid"),
           pybind11::arg("num_warps"), pybind11::arg("shared"), pybind11::arg("kinds"));
  pybind11::class_<mhc_site::SiteKernels, c10::intrusive_ptr<mhc_site::SiteKernels>>(m, "SiteKernels")
      .def(pybind11::init([](mhc_site::TritonKernel coeff_fwd, mhc_site::TritonKernel postmix_fwd,
                             mhc_site::TritonKernel postmix_bwd, mhc_site::TritonKernel coeff_bwd,
                             mhc_site::TritonKernel stream_grad, mhc_site::TritonKernel phi_grad,
                             int64_t stream_tokens, int64_t phi_splits, int64_t phi_tokens) {
             return c10::make_intrusive<mhc_site::SiteKernels>(coeff_fwd, postmix_fwd, postmix_bwd, coeff_bwd,
                                                               stream_grad, phi_grad, stream_tokens, phi_splits,
                                                               phi_tokens);
           }));
  pybind11::class_<mhc_site::SiteCall, c10::intrusive_ptr<mhc_site::SiteCall>>(m, "SiteCall");
  m.def("site_pre", &mhc_site::site_pre,
        "(kernels, x, phi, alpha, b_pre, b_post, b_res, eps, tol_eff, max_iter) -> (u, h, H_res, call)");
  m.def("post_mix", &mhc_site::post_mix, "(call, x, y, h, H_res) -> x'");
}
