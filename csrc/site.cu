// Host side of the fused mHC site (mhc/fused.py) in C++: each of the site's four
// autograd steps (pre forward, post-mix forward, post-mix backward, pre backward)
// allocates its outputs and launches its kernels in one call from Python.
//
// Why: at the width of a ~125M model a site's forward is bound by host time, not
// by the GPU, and on the H200's host each Triton launch from Python cost ~25 µs,
// the projection op ~30 µs and each torch.empty ~4.5 µs (notes/block_benchmarks.md).
// The kernels stay Triton's: Python compiles a variant on its first launch and
// hands its CUfunction here (TritonKernel), with the kind of each parameter, so
// later launches skip Triton's Python launcher. The Birkhoff projection is called
// as the C++ function behind torch.ops.mhc.birkhoff_forward / _backward.

#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <optional>
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

// One compiled variant of a Triton kernel and the grid of one launch plan.
struct TritonKernel {
  CUfunction function;
  unsigned grid[3];
  unsigned threads;
  unsigned shared_bytes;
  std::vector<int64_t> kinds;

  TritonKernel(int64_t function_handle, std::vector<int64_t> grid_xyz, int64_t num_warps, int64_t shared,
               std::vector<int64_t> param_kinds)
      : function(reinterpret_cast<CUfunction>(static_cast<uintptr_t>(function_handle))),
        threads(static_cast<unsigned>(32 * num_warps)),
        shared_bytes(static_cast<unsigned>(shared)),
        kinds(std::move(param_kinds)) {
    TORCH_CHECK(function_handle != 0, "mhc: TritonKernel needs a loaded CUfunction");
    TORCH_CHECK(grid_xyz.size() == 3, "mhc: TritonKernel needs a 3-d grid");
    for (int d = 0; d < 3; ++d) {
      TORCH_CHECK(grid_xyz[d] >= 1 && grid_xyz[d] < (int64_t(1) << 31), "mhc: bad grid size ", grid_xyz[d],
                  " in dimension ", d);
      grid[d] = static_cast<unsigned>(grid_xyz[d]);
    }
    TORCH_CHECK(num_warps >= 1 && num_warps <= 32 && shared >= 0, "mhc: bad num_warps / shared memory");
    for (int64_t k : kinds) TORCH_CHECK(k >= kSkip && k <= kFloat64, "mhc: unknown parameter kind ", k);
  }
};

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
  TORCH_CHECK(args.size() == k.kinds.size(), "mhc: kernel takes ", k.kinds.size(), " arguments, got ", args.size());
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
        TORCH_CHECK(a->kind == Arg::kTensor, "mhc: kernel argument ", i, " must be a tensor");
        std::memcpy(&slot, &a->ptr, sizeof(void*));
        break;
      case kInt32: {
        TORCH_CHECK(a->kind == Arg::kInt && a->i >= INT32_MIN && a->i <= INT32_MAX, "mhc: kernel argument ", i,
                    " must be an int32");
        const int32_t v = static_cast<int32_t>(a->i);
        std::memcpy(&slot, &v, sizeof(v));
        break;
      }
      case kInt64:
        TORCH_CHECK(a->kind == Arg::kInt, "mhc: kernel argument ", i, " must be an integer");
        std::memcpy(&slot, &a->i, sizeof(int64_t));
        break;
      case kFloat32: {
        TORCH_CHECK(a->kind == Arg::kFloat, "mhc: kernel argument ", i, " must be a float");
        const float v = static_cast<float>(a->f);
        std::memcpy(&slot, &v, sizeof(v));
        break;
      }
      case kFloat64:
        TORCH_CHECK(a->kind == Arg::kFloat, "mhc: kernel argument ", i, " must be a float");
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
  TORCH_CHECK(r == CUDA_SUCCESS, "mhc: a fused-site kernel failed to launch (CUresult ", static_cast<int>(r), ")");
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
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_pre_forward(
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
at::Tensor post_mix_forward(const TritonKernel& postmix_fwd, const at::Tensor& x, const at::Tensor& y,
                            const at::Tensor& h, const at::Tensor& H_res) {
  check_streams(x);
  at::Tensor out = at::empty_like(x);
  launch(postmix_fwd, {x, y, h, H_res, out, Shape(x).C});
  return out;
}

// (dx' as the kernels read it, dy, dh, dH_res) (mhc.fused._PostMix.backward).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> post_mix_backward(const TritonKernel& postmix_bwd,
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
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> site_pre_backward(
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

}  // namespace mhc_site

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "mhc: fused CUDA Birkhoff kernels (torch.ops.mhc.birkhoff_*) and the fused site's host side";
  pybind11::class_<mhc_site::TritonKernel>(m, "TritonKernel")
      .def(pybind11::init<int64_t, std::vector<int64_t>, int64_t, int64_t, std::vector<int64_t>>(),
           pybind11::arg("function"), pybind11::arg("grid"), pybind11::arg("num_warps"), pybind11::arg("shared"),
           pybind11::arg("kinds"));
  m.def("site_pre_forward", &mhc_site::site_pre_forward);
  m.def("post_mix_forward", &mhc_site::post_mix_forward);
  m.def("post_mix_backward", &mhc_site::post_mix_backward);
  m.def("site_pre_backward", &mhc_site::site_pre_backward);
}
