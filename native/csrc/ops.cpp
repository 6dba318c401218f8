// Operator schemas and the CPU / Meta implementations of rltserve_native.
//
//   torch.ops.rltserve_native.silu_and_mul(x)   x: [..., 2n] -> [..., n]
//   torch.ops.rltserve_native.silu_mul(a, b)    a, b: same shape -> same shape
//   torch.ops.rltserve_native.cpu_kernel_info() -> str   (which CPU path; does it mirror torch)
//   torch.ops.rltserve_native.cuda_kernel_compiled() -> bool
//
// Outputs are always new contiguous tensors. Inputs whose gate rows have a contiguous last dim
// and a single row stride (every fused projection output and its slices) run the native kernel
// in place; other layouts fall back to ATen's silu and mul, so the op is bit-identical to the
// torch fallback for every layout (a contiguous copy would change which expf torch applies).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/silu.h>
#include <torch/library.h>

#include "silu_and_mul.h"

namespace rltserve_native {
namespace {

void check_dtype(const at::Tensor& t) {
  const auto st = t.scalar_type();
  TORCH_CHECK(
      st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
      "rltserve_native: dtype must be float32, bfloat16 or float16, got ", st);
}

// n, the width of each half of x: [..., 2n].
int64_t check_fused(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "rltserve_native.silu_and_mul: x must have at least one dim");
  TORCH_CHECK(
      x.size(-1) % 2 == 0, "rltserve_native.silu_and_mul: last dim must be even, got ",
      x.size(-1));
  check_dtype(x);
  return x.size(-1) / 2;
}

void check_pair(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(
      a.sizes() == b.sizes(), "rltserve_native.silu_mul: shapes differ: ", a.sizes(), " vs ",
      b.sizes());
  TORCH_CHECK(
      a.scalar_type() == b.scalar_type(), "rltserve_native.silu_mul: dtypes differ: ",
      a.scalar_type(), " vs ", b.scalar_type());
  TORCH_CHECK(a.device() == b.device(), "rltserve_native.silu_mul: devices differ");
  check_dtype(a);
}

std::vector<int64_t> fused_out_shape(const at::Tensor& x, int64_t n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return shape;
}

at::Tensor silu_mul_cpu_impl(const at::Tensor& gate, const at::Tensor& up) {
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (out.numel() == 0) {
    return out;
  }
  const std::optional<RowView> g = row_view(gate);
  if (!g) {
    // Torch would iterate this layout in its own order: let it (exact by construction).
    return at::mul_out(out, at::silu(gate), up);
  }
  at::Tensor up_rows = up;
  std::optional<RowView> u = row_view(up);
  const bool linear = g->rows == 1 || g->row_stride == g->cols;
  if (!u || (linear && u->rows > 1 && u->row_stride != u->cols)) {
    up_rows = up.contiguous();  // `up` only enters the (exact) product: copying it is free of
    u = row_view(up_rows);      // numerical effect
  }
  silu_mul_cpu_kernel(gate, *g, up_rows, *u, out);
  return out;
}

at::Tensor silu_and_mul_cpu(const at::Tensor& x) {
  const int64_t n = check_fused(x);
  return silu_mul_cpu_impl(x.narrow(-1, 0, n), x.narrow(-1, n, n));
}

at::Tensor silu_mul_cpu(const at::Tensor& a, const at::Tensor& b) {
  check_pair(a, b);
  return silu_mul_cpu_impl(a, b);
}

at::Tensor silu_and_mul_meta(const at::Tensor& x) {
  const int64_t n = check_fused(x);
  return at::empty(fused_out_shape(x, n), x.options());
}

at::Tensor silu_mul_meta(const at::Tensor& a, const at::Tensor& b) {
  check_pair(a, b);
  return at::empty(a.sizes(), a.options());
}

std::string cpu_kernel_info_op() {
  return cpu_kernel_info();
}

bool cuda_kernel_compiled_op() {
#ifdef RLTSERVE_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace rltserve_native

TORCH_LIBRARY(rltserve_native, m) {
  m.def("silu_and_mul(Tensor x) -> Tensor");
  m.def("silu_mul(Tensor a, Tensor b) -> Tensor");
  m.def("cpu_kernel_info() -> str", &rltserve_native::cpu_kernel_info_op);
  m.def("cuda_kernel_compiled() -> bool", &rltserve_native::cuda_kernel_compiled_op);
}

TORCH_LIBRARY_IMPL(rltserve_native, CPU, m) {
  m.impl("silu_and_mul", &rltserve_native::silu_and_mul_cpu);
  m.impl("silu_mul", &rltserve_native::silu_mul_cpu);
}

TORCH_LIBRARY_IMPL(rltserve_native, Meta, m) {
  m.impl("silu_and_mul", &rltserve_native::silu_and_mul_meta);
  m.impl("silu_mul", &rltserve_native::silu_mul_meta);
}
