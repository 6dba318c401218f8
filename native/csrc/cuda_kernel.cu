// CUDA kernel of the fused SiLU-and-Mul (fp32, bf16, fp16; silu computed in fp32).
//
// Numerics mirror torch's CUDA ops element for element: silu is x / (1 + expf(-x)) in fp32
// (torch's ActivationSiluKernel.cu with opmath float; expf is the accurate libdevice one, no
// fast math), rounded to the storage dtype, then the product in fp32, rounded again (torch's
// mul). CUDA silu has no layout-dependent paths, so any layout can be copied or vectorized
// without changing results.
//
// Launch: grid.x walks rows, grid.y tiles a row; each thread handles one pack of 16 bytes
// (4 fp32 / 8 bf16 / 8 fp16) when every row start is 16-byte aligned and the row width is a
// multiple of the pack, else one element. Both loops are grid-stride, so any shape fits the
// grid limits.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "silu_and_mul.h"

namespace rltserve_native {
namespace {

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T v[N];
};

// 16-byte packs move as one uint4 (one 128-bit access); narrower ones as themselves.
template <typename P>
__device__ __forceinline__ P load_pack(const P* p) {
  if constexpr (sizeof(P) == 16) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    P out;
    memcpy(&out, &raw, sizeof(P));
    return out;
  } else {
    return *p;
  }
}

template <typename P>
__device__ __forceinline__ void store_pack(P* p, const P& v) {
  if constexpr (sizeof(P) == 16) {
    uint4 raw;
    memcpy(&raw, &v, sizeof(P));
    *reinterpret_cast<uint4*>(p) = raw;
  } else {
    *p = v;
  }
}

template <typename T>
__device__ __forceinline__ T silu_mul_elem(T g, T u) {
  const float x = static_cast<float>(g);
  const float s = x / (1.0f + ::expf(-x));
  if constexpr (std::is_same_v<T, float>) {
    return s * u;
  } else {
    return static_cast<T>(static_cast<float>(static_cast<T>(s)) * static_cast<float>(u));
  }
}

// out[row, :] = silu(gate[row, :]) * up[row, :] in packs of N elements; out rows are contiguous.
template <typename T, int N>
__global__ void silu_mul_kernel(
    T* __restrict__ out,
    const T* __restrict__ gate,
    const T* __restrict__ up,
    int64_t rows,
    int64_t packs_per_row,
    int64_t gate_row_stride,
    int64_t up_row_stride) {
  using P = Pack<T, N>;
  const int64_t out_row_stride = packs_per_row * N;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const P* g = reinterpret_cast<const P*>(gate + row * gate_row_stride);
    const P* u = reinterpret_cast<const P*>(up + row * up_row_stride);
    P* o = reinterpret_cast<P*>(out + row * out_row_stride);
    for (int64_t i = static_cast<int64_t>(blockIdx.y) * blockDim.x + threadIdx.x;
         i < packs_per_row;
         i += static_cast<int64_t>(gridDim.y) * blockDim.x) {
      const P gv = load_pack(g + i);
      const P uv = load_pack(u + i);
      P ov;
#pragma unroll
      for (int k = 0; k < N; ++k) {
        ov.v[k] = silu_mul_elem<T>(gv.v[k], uv.v[k]);
      }
      store_pack(o + i, ov);
    }
  }
}

bool aligned16(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % 16 == 0;
}

template <typename T>
void launch(const at::Tensor& gate, const RowView& g, const at::Tensor& up, const RowView& u,
            at::Tensor& out) {
  constexpr int kVec = 16 / sizeof(T);
  const T* gp = gate.const_data_ptr<T>();
  const T* upp = up.const_data_ptr<T>();
  T* op = out.mutable_data_ptr<T>();
  const bool vec = g.cols % kVec == 0 && g.row_stride % kVec == 0 && u.row_stride % kVec == 0 &&
      aligned16(gp) && aligned16(upp) && aligned16(op);
  const int64_t packs = vec ? g.cols / kVec : g.cols;
  const int64_t threads = std::min<int64_t>(256, std::max<int64_t>(32, (packs + 31) / 32 * 32));
  const int64_t tiles = std::min<int64_t>((packs + threads - 1) / threads, 65535);
  const int64_t blocks = std::min<int64_t>(g.rows, 2147483647);
  const dim3 grid(static_cast<unsigned>(blocks), static_cast<unsigned>(tiles));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  if (vec) {
    silu_mul_kernel<T, kVec><<<grid, static_cast<unsigned>(threads), 0, stream>>>(
        op, gp, upp, g.rows, packs, g.row_stride, u.row_stride);
  } else {
    silu_mul_kernel<T, 1><<<grid, static_cast<unsigned>(threads), 0, stream>>>(
        op, gp, upp, g.rows, packs, g.row_stride, u.row_stride);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor silu_mul_cuda_impl(const at::Tensor& gate, const at::Tensor& up) {
  const c10::cuda::CUDAGuard guard(gate.device());
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  if (out.numel() == 0) {
    return out;
  }
  // Layouts without a row view are copied: on CUDA that cannot change any result.
  at::Tensor gate_rows = gate;
  std::optional<RowView> g = row_view(gate);
  if (!g) {
    gate_rows = gate.contiguous();
    g = row_view(gate_rows);
  }
  at::Tensor up_rows = up;
  std::optional<RowView> u = row_view(up);
  if (!u) {
    up_rows = up.contiguous();
    u = row_view(up_rows);
  }
  switch (gate.scalar_type()) {
    case at::kFloat:
      launch<float>(gate_rows, *g, up_rows, *u, out);
      break;
    case at::kBFloat16:
      launch<c10::BFloat16>(gate_rows, *g, up_rows, *u, out);
      break;
    case at::kHalf:
      launch<c10::Half>(gate_rows, *g, up_rows, *u, out);
      break;
    default:
      TORCH_CHECK(false, "rltserve_native: unsupported dtype ", gate.scalar_type());
  }
  return out;
}

void check_cuda_dtype(const at::Tensor& t) {
  const auto st = t.scalar_type();
  TORCH_CHECK(
      st == at::kFloat || st == at::kBFloat16 || st == at::kHalf,
      "rltserve_native: dtype must be float32, bfloat16 or float16, got ", st);
}

at::Tensor silu_and_mul_cuda(const at::Tensor& x) {
  TORCH_CHECK(x.dim() >= 1, "rltserve_native.silu_and_mul: x must have at least one dim");
  TORCH_CHECK(
      x.size(-1) % 2 == 0, "rltserve_native.silu_and_mul: last dim must be even, got ",
      x.size(-1));
  check_cuda_dtype(x);
  const int64_t n = x.size(-1) / 2;
  return silu_mul_cuda_impl(x.narrow(-1, 0, n), x.narrow(-1, n, n));
}

at::Tensor silu_mul_cuda(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.sizes() == b.sizes(), "rltserve_native.silu_mul: shapes differ");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "rltserve_native.silu_mul: dtypes differ");
  TORCH_CHECK(a.device() == b.device(), "rltserve_native.silu_mul: devices differ");
  check_cuda_dtype(a);
  return silu_mul_cuda_impl(a, b);
}

}  // namespace
}  // namespace rltserve_native

TORCH_LIBRARY_IMPL(rltserve_native, CUDA, m) {
  m.impl("silu_and_mul", &rltserve_native::silu_and_mul_cuda);
  m.impl("silu_mul", &rltserve_native::silu_mul_cuda);
}
