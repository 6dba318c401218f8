// Shared declarations of the rltserve_native extension: fused SiLU-and-Mul.
//
//   silu_and_mul(x) = silu(x[..., :n]) * x[..., n:]      x: [..., 2n]
//   silu_mul(a, b)  = silu(a) * b                         a, b: same shape
//
// Numerics (the invariant every kernel keeps): the result equals torch's unfused
// `F.silu(gate) * up` on the same device. silu is computed in fp32 as x / (1 + exp(-x)),
// rounded to the storage dtype, and the product is computed in fp32 and rounded again:
// exactly the two roundings of the two torch ops. See native/README.md.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>

namespace rltserve_native {

// A tensor seen as `rows` rows of `cols` contiguous elements; row r starts at
// data_ptr + r * row_stride (in elements). For rows == 1 row_stride is `cols`.
struct RowView {
  int64_t rows;
  int64_t cols;
  int64_t row_stride;
};

// The row view of `t`, or nullopt when its last dim is not contiguous or its leading dims do not
// collapse into one row stride (size-1 dims are ignored, as torch's TensorIterator does).
inline std::optional<RowView> row_view(const at::Tensor& t) {
  const int64_t nd = t.dim();
  if (nd == 0) {
    return RowView{1, 1, 1};
  }
  const int64_t cols = t.size(-1);
  if (cols != 1 && t.stride(-1) != 1) {
    return std::nullopt;
  }
  int64_t rows = 1;
  int64_t row_stride = cols;
  int64_t expect = 0;  // the stride the next outer non-trivial dim must have
  bool seen = false;
  for (int64_t d = nd - 2; d >= 0; --d) {
    const int64_t size = t.size(d);
    if (size == 1) {
      continue;
    }
    if (!seen) {
      row_stride = t.stride(d);
      expect = row_stride * size;
      seen = true;
    } else {
      if (t.stride(d) != expect) {
        return std::nullopt;
      }
      expect *= size;
    }
    rows *= size;
  }
  return RowView{rows, cols, row_stride};
}

// CPU kernel: out[r, c] = silu(gate[r, c]) * up[r, c] over a contiguous `out` of g.rows x g.cols.
// When g's rows are back to back (g.rows == 1 or g.row_stride == g.cols) `up` must be too.
void silu_mul_cpu_kernel(
    const at::Tensor& gate,
    const RowView& g,
    const at::Tensor& up,
    const RowView& u,
    at::Tensor& out);

// "mode=avx512;mirrors_torch=1;torch_capability=AVX512;..." (parsed by rltserve/native.py).
std::string cpu_kernel_info();

}  // namespace rltserve_native
