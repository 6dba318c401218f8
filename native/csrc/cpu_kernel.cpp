// CPU kernel of the fused SiLU-and-Mul (fp32, bf16, fp16; silu computed in fp32).
//
// Why it looks the way it does. torch's CPU silu is not one function of x: its TensorIterator
// loop computes x / (1 + exp(-x)) with Sleef's vectorized expf (1-ulp) on the body of each
// contiguous inner run, in blocks of two vectors, and with libm's expf on the run's remainder.
// The runs are the rows of the gate (the whole tensor when it is contiguous), cut where
// at::parallel_for splits [0, numel) between threads. The two expf differ on ~4% of inputs by
// up to 2 ulp, so a kernel using either one everywhere is not bit-identical to F.silu. This
// kernel walks the same runs with the same split, the same vector width and the same expf for
// each element, so the result is bit-identical to `F.silu(gate) * up` (invariant tested in
// tests/test_native.py). It follows torch's CPU capability (at::get_cpu_capability(): AVX512,
// AVX2 or DEFAULT) and resolves Sleef from libtorch_cpu at run time; without them it computes
// libm expf everywhere and reports mirrors_torch=0.
//
// fp32 computes exp and the division per element (an inlined copy of Sleef's expf, verified
// against the symbol at load). bf16/fp16 gates have 2^16 values: their silu comes from tables
// built at first use by the same mirrored code (one for torch's vector path, one for its scalar
// remainder), so the hot loop is a gather, a multiply and a rounding.
//
// SIMD code lives in functions with target attributes (no -march flags): the library runs on
// any x86-64 and the SIMD paths run only where torch itself runs its AVX2/AVX512 kernels.
#include "silu_and_mul.h"

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>
#include <ATen/Version.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#define RLT_X86 1
#define RLT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,f16c")))
#define RLT_AVX2 __attribute__((target("avx2,fma,f16c")))
#define RLT_F16C __attribute__((target("f16c")))
#else
#define RLT_X86 0
#endif

namespace rltserve_native {
namespace {

// The grain of TensorIterator::for_each: the split of [0, numel) between threads must be
// torch's for the runs (and so the results) to match.
constexpr int64_t kTorchGrainSize = at::internal::GRAIN_SIZE;

enum class Mode { kScalar, kAvx2, kAvx512 };

#if RLT_X86
using ExpF8 = __m256 (*)(__m256);
using ExpF16 = __m512 (*)(__m512);
#endif

struct Config {
  Mode mode = Mode::kScalar;
  bool mirrors_torch = false;
  std::string torch_capability;
  std::string note;
#if RLT_X86
  ExpF8 expf8 = nullptr;    // torch's Sleef symbols
  ExpF16 expf16 = nullptr;
  bool inline_exp = false;  // the inlined copy matched the symbol on the self-check
#endif
};

#if RLT_X86
void* torch_symbol(const char* name) {
  // This library links libtorch_cpu, so it is loaded: look there first, then globally.
  static void* handle = dlopen("libtorch_cpu.so", RTLD_LAZY | RTLD_NOLOAD);
  void* sym = handle != nullptr ? dlsym(handle, name) : nullptr;
  return sym != nullptr ? sym : dlsym(RTLD_DEFAULT, name);
}
#endif

#if RLT_X86
// ---- Sleef's expf_u10 inlined. libtorch's Sleef_expf{8,16}_u10 is Sleef's xexpf (FMA build):
// the same operations on the same constants, in the same order, give the same bits. Inlined, the
// compiler can overlap consecutive vectors instead of spilling around an opaque call. It is used
// only after matching the symbol bit for bit on self_check_inputs() (see make_config), and was
// checked exhaustively over all 2^32 inputs against torch 2.13's symbols (native/README.md).
constexpr uint32_t kLog2e = 0x3fb8aa3b;     // R_LN2f
constexpr uint32_t kNegLn2Hi = 0xbf317200;  // -L2Uf
constexpr uint32_t kNegLn2Lo = 0xb5bfbe8e;  // -L2Lf
constexpr uint32_t kPoly[6] = {
    0x39502bda, 0x3ab696c9, 0x3c0888a6, 0x3d2aaa7a, 0x3e2aaaab, 0x3f000000};
constexpr uint32_t kOne = 0x3f800000;
constexpr uint32_t kLow = 0xc2d00000;   // -104: below, exp is 0
constexpr uint32_t kHigh = 0x42c80000;  // 100: above, exp is inf
constexpr uint32_t kInf = 0x7f800000;

RLT_AVX512 inline __m512 f512(uint32_t bits) {
  return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(bits)));
}

RLT_AVX512 inline __m512 expf_u10_512(__m512 d) {
  const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(d, f512(kLog2e)));
  const __m512 qf = _mm512_cvtepi32_ps(q);
  __m512 s = _mm512_fmadd_ps(qf, f512(kNegLn2Hi), d);
  s = _mm512_fmadd_ps(qf, f512(kNegLn2Lo), s);
  __m512 u = f512(kPoly[0]);
  for (int k = 1; k < 6; ++k) {
    u = _mm512_fmadd_ps(u, s, f512(kPoly[k]));
  }
  u = _mm512_add_ps(f512(kOne), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
  const __m512i bias = _mm512_set1_epi32(0x7f);
  const __m512i q1 = _mm512_srai_epi32(q, 1);
  const __m512i q2 = _mm512_sub_epi32(q, q1);
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q1, bias), 23)));
  u = _mm512_mul_ps(u, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(q2, bias), 23)));
  u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, f512(kLow), _CMP_LT_OQ), _mm512_setzero_ps());
  return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(f512(kHigh), d, _CMP_LT_OQ), f512(kInf));
}

RLT_AVX2 inline __m256 f256(uint32_t bits) {
  return _mm256_castsi256_ps(_mm256_set1_epi32(static_cast<int>(bits)));
}

RLT_AVX2 inline __m256 expf_u10_256(__m256 d) {
  const __m256i q = _mm256_cvtps_epi32(_mm256_mul_ps(d, f256(kLog2e)));
  const __m256 qf = _mm256_cvtepi32_ps(q);
  __m256 s = _mm256_fmadd_ps(qf, f256(kNegLn2Hi), d);
  s = _mm256_fmadd_ps(qf, f256(kNegLn2Lo), s);
  __m256 u = f256(kPoly[0]);
  for (int k = 1; k < 6; ++k) {
    u = _mm256_fmadd_ps(u, s, f256(kPoly[k]));
  }
  u = _mm256_add_ps(f256(kOne), _mm256_fmadd_ps(_mm256_mul_ps(s, s), u, s));
  const __m256i bias = _mm256_set1_epi32(0x7f);
  const __m256i q1 = _mm256_srai_epi32(q, 1);
  const __m256i q2 = _mm256_sub_epi32(q, q1);
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q1, bias), 23)));
  u = _mm256_mul_ps(u, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(q2, bias), 23)));
  u = _mm256_andnot_ps(_mm256_cmp_ps(d, f256(kLow), _CMP_LT_OQ), u);
  return _mm256_blendv_ps(u, f256(kInf), _mm256_cmp_ps(f256(kHigh), d, _CMP_LT_OQ));
}

// 2^16 inputs: a dense sweep of [-110, 110] (where exp is neither 0 nor inf, plus both cut-offs)
// and pseudo-random bit patterns (every exponent, subnormals, infinities, NaNs).
void self_check_inputs(float* out, int64_t count) {
  uint32_t state = 0x12345678u;
  for (int64_t i = 0; i < count; ++i) {
    if (i % 4 == 3) {
      state = state * 1664525u + 1013904223u;
      std::memcpy(&out[i], &state, sizeof(float));
    } else {
      out[i] = -110.0f + 220.0f * static_cast<float>(i) / static_cast<float>(count);
    }
  }
}

constexpr int64_t kSelfCheck = 1 << 16;

RLT_AVX512 bool inline_matches_512(ExpF16 ref) {
  std::vector<float> in(kSelfCheck);
  self_check_inputs(in.data(), kSelfCheck);
  for (int64_t i = 0; i < kSelfCheck; i += 16) {
    const __m512 d = _mm512_loadu_ps(in.data() + i);
    const __m512i a = _mm512_castps_si512(expf_u10_512(d));
    const __m512i b = _mm512_castps_si512(ref(d));
    if (_mm512_cmpneq_epi32_mask(a, b) != 0) {
      return false;
    }
  }
  return true;
}

RLT_AVX2 bool inline_matches_256(ExpF8 ref) {
  std::vector<float> in(kSelfCheck);
  self_check_inputs(in.data(), kSelfCheck);
  for (int64_t i = 0; i < kSelfCheck; i += 8) {
    const __m256 d = _mm256_loadu_ps(in.data() + i);
    const __m256i a = _mm256_castps_si256(expf_u10_256(d));
    const __m256i b = _mm256_castps_si256(ref(d));
    const __m256i eq = _mm256_cmpeq_epi32(a, b);
    if (_mm256_movemask_epi8(eq) != -1) {
      return false;
    }
  }
  return true;
}
#endif

Config make_config() {
  Config c;
  c.torch_capability = at::get_cpu_capability();
#if RLT_X86
  __builtin_cpu_init();
  const std::string& cap = c.torch_capability;
  if (cap == "AVX512") {
    c.expf16 = reinterpret_cast<ExpF16>(torch_symbol("Sleef_expf16_u10"));
    const bool cpu_ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("fma");
    if (c.expf16 != nullptr && cpu_ok) {
      c.mode = Mode::kAvx512;
      c.mirrors_torch = true;
      c.inline_exp = inline_matches_512(c.expf16);
    } else {
      c.note = "Sleef_expf16_u10 not found in libtorch_cpu: libm expf everywhere";
    }
  } else if (cap == "AVX2") {
    c.expf8 = reinterpret_cast<ExpF8>(torch_symbol("Sleef_expf8_u10"));
    const bool cpu_ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (c.expf8 != nullptr && cpu_ok) {
      c.mode = Mode::kAvx2;
      c.mirrors_torch = true;
      c.inline_exp = inline_matches_256(c.expf8);
    } else {
      c.note = "Sleef_expf8_u10 not found in libtorch_cpu: libm expf everywhere";
    }
  } else if (cap == "DEFAULT") {
    c.mirrors_torch = true;  // torch's DEFAULT kernels use libm expf for every element too
  } else {
    c.note = "unknown torch CPU capability: libm expf everywhere";
  }
#else
  c.note = "not x86-64: torch vectorizes silu with its own expf here, results may differ by ulps";
#endif
  return c;
}

const Config& config() {
  static const Config c = make_config();
  return c;
}

// torch's scalar silu, op for op (the loop remainder, and every element on DEFAULT).
inline float silu_scalar(float x) {
  return x / (1.0f + std::exp(-x));
}

// Tables of silu for the 2^16 values of a 16-bit dtype, already rounded to that dtype (stored as
// fp32): `body` as torch's vectorized loop computes it, `tail` as its scalar remainder does. The
// product with `up` is exact in fp32 (8- or 11-bit significands) and rounds once, so
// out = T(table[bits(gate)] * float(up)) is bit-identical to torch's silu-then-mul by
// construction, and a gather replaces the exp and the division (the kernel's bottleneck).
struct SiluTable {
  std::vector<float> body;
  std::vector<float> tail;
};
constexpr int64_t kTableSize = 1 << 16;

#if RLT_X86
// ---- AVX512: 16 fp32 lanes. torch's body block is 2 x Vectorized<T>::size(): 32 fp32, 64 bf16.
template <typename T>
struct V512;

template <>
struct V512<float> {
  static constexpr int64_t kBlock = 32;
  RLT_AVX512 static __m512 load(const float* p) { return _mm512_loadu_ps(p); }
  RLT_AVX512 static __m512 round(__m512 v) { return v; }
  RLT_AVX512 static void store(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

// bf16 round-to-nearest-even in 32-bit lanes, NaN -> 0xffff: torch's vectorized cvtfp32_bf16
// (its scalar c10::BFloat16 gives 0x7fc0 instead; the scalar paths here use c10::BFloat16).
RLT_AVX512 inline __m512i bf16_bits512(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0xffff));
}

template <>
struct V512<c10::BFloat16> {
  static constexpr int64_t kBlock = 64;
  RLT_AVX512 static __m512 load(const c10::BFloat16* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  RLT_AVX512 static __m512 round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits512(v), 16));
  }
  RLT_AVX512 static void store(c10::BFloat16* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits512(v)));
  }
};

template <>
struct V512<c10::Half> {
  static constexpr int64_t kBlock = 64;
  static constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  RLT_AVX512 static __m512 load(const c10::Half* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  RLT_AVX512 static __m512 round(__m512 v) { return _mm512_cvtph_ps(_mm512_cvtps_ph(v, kRne)); }
  RLT_AVX512 static void store(c10::Half* p, __m512 v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, kRne));
  }
};

// torch's vectorized silu: x / (1 + exp(-x)) with Vectorized<float>::neg().exp(), rounded to T.
template <typename T, typename Exp>
RLT_AVX512 inline __m512 silu512(__m512 x, Exp exp) {
  const __m512 e = exp(_mm512_xor_ps(_mm512_set1_ps(-0.0f), x));
  return V512<T>::round(_mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0f), e)));
}

// fp32 elements [0, body) of a run, body = len rounded down to torch's block; returns body.
template <typename Exp>
RLT_AVX512 int64_t body_f32_avx512(const float* g, const float* u, float* o, int64_t len, Exp exp) {
  const int64_t body = len / V512<float>::kBlock * V512<float>::kBlock;
  for (int64_t i = 0; i < body; i += 16) {
    const __m512 s = silu512<float>(_mm512_loadu_ps(g + i), exp);
    _mm512_storeu_ps(o + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  return body;
}

// 16-bit elements [0, body) through the body table; returns body.
template <typename T>
RLT_AVX512 int64_t body_lut_avx512(const T* g, const T* u, T* o, int64_t len, const float* table) {
  using V = V512<T>;
  const int64_t body = len / V::kBlock * V::kBlock;
  for (int64_t i = 0; i < body; i += 16) {
    const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
    const __m512 s = _mm512_i32gather_ps(_mm512_cvtepu16_epi32(bits), table, 4);
    V::store(o + i, _mm512_mul_ps(s, V::load(u + i)));
  }
  return body;
}

template <typename T, typename Exp>
RLT_AVX512 void fill_body_avx512(const T* all, float* out, Exp exp) {
  for (int64_t b = 0; b < kTableSize; b += 16) {
    _mm512_storeu_ps(out + b, silu512<T>(V512<T>::load(all + b), exp));
  }
}

// ---- AVX2: 8 fp32 lanes; torch's block is 16 fp32, 32 bf16/fp16.
template <typename T>
struct V256;

template <>
struct V256<float> {
  static constexpr int64_t kBlock = 16;
  RLT_AVX2 static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  RLT_AVX2 static __m256 round(__m256 v) { return v; }
  RLT_AVX2 static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
};

// As bf16_bits512 (torch's vec256 cvtfp32_bf16).
RLT_AVX2 inline __m256i bf16_bits256(__m256 v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i bias = _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0xffff), nan);
}

template <>
struct V256<c10::BFloat16> {
  static constexpr int64_t kBlock = 32;
  RLT_AVX2 static __m256 load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  RLT_AVX2 static __m256 round(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits256(v), 16));
  }
  RLT_AVX2 static void store(c10::BFloat16* p, __m256 v) {
    const __m256i r = bf16_bits256(v);  // values <= 0xffff: unsigned saturation is exact
    const __m128i packed =
        _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
  }
};

template <>
struct V256<c10::Half> {
  static constexpr int64_t kBlock = 32;
  static constexpr int kRne = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  RLT_AVX2 static __m256 load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  RLT_AVX2 static __m256 round(__m256 v) { return _mm256_cvtph_ps(_mm256_cvtps_ph(v, kRne)); }
  RLT_AVX2 static void store(c10::Half* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, kRne));
  }
};

template <typename T, typename Exp>
RLT_AVX2 inline __m256 silu256(__m256 x, Exp exp) {
  const __m256 e = exp(_mm256_xor_ps(_mm256_set1_ps(-0.0f), x));
  return V256<T>::round(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)));
}

template <typename Exp>
RLT_AVX2 int64_t body_f32_avx2(const float* g, const float* u, float* o, int64_t len, Exp exp) {
  const int64_t body = len / V256<float>::kBlock * V256<float>::kBlock;
  for (int64_t i = 0; i < body; i += 8) {
    const __m256 s = silu256<float>(_mm256_loadu_ps(g + i), exp);
    _mm256_storeu_ps(o + i, _mm256_mul_ps(s, _mm256_loadu_ps(u + i)));
  }
  return body;
}

template <typename T>
RLT_AVX2 int64_t body_lut_avx2(const T* g, const T* u, T* o, int64_t len, const float* table) {
  using V = V256<T>;
  const int64_t body = len / V::kBlock * V::kBlock;
  for (int64_t i = 0; i < body; i += 8) {
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));
    const __m256 s = _mm256_i32gather_ps(table, _mm256_cvtepu16_epi32(bits), 4);
    V::store(o + i, _mm256_mul_ps(s, V::load(u + i)));
  }
  return body;
}

template <typename T, typename Exp>
RLT_AVX2 void fill_body_avx2(const T* all, float* out, Exp exp) {
  for (int64_t b = 0; b < kTableSize; b += 8) {
    _mm256_storeu_ps(out + b, silu256<T>(V256<T>::load(all + b), exp));
  }
}

// fp16 scalar conversions as torch's AVX2/AVX512 kernels do them: c10::Half uses F16C there
// (compiled with -mf16c) and a bit-twiddling fallback in DEFAULT; they differ on NaN payloads.
RLT_F16C inline float half_to_float_hw(uint16_t h) {
  return _cvtsh_ss(h);
}
RLT_F16C inline uint16_t float_to_half_hw(float f) {
  return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
}

RLT_F16C void fill_tail_half_hw(float* out) {
  for (int64_t b = 0; b < kTableSize; ++b) {
    const float x = half_to_float_hw(static_cast<uint16_t>(b));
    out[b] = half_to_float_hw(float_to_half_hw(silu_scalar(x)));
  }
}

RLT_F16C void tail_half_hw(
    const c10::Half* g, const c10::Half* u, c10::Half* o, int64_t i, int64_t len,
    const float* tail) {
  for (; i < len; ++i) {
    o[i].x = float_to_half_hw(tail[g[i].x] * half_to_float_hw(u[i].x));
  }
}

struct Inline512 {
  RLT_AVX512 __m512 operator()(__m512 d) const { return expf_u10_512(d); }
};
struct Inline256 {
  RLT_AVX2 __m256 operator()(__m256 d) const { return expf_u10_256(d); }
};
#endif  // RLT_X86

template <typename T>
SiluTable build_table(const Config& c) {
  std::vector<T> all(kTableSize);
  for (int64_t b = 0; b < kTableSize; ++b) {
    all[b] = T(static_cast<uint16_t>(b), T::from_bits());
  }
  SiluTable t;
  t.tail.resize(kTableSize);
  for (int64_t b = 0; b < kTableSize; ++b) {
    t.tail[b] = static_cast<float>(static_cast<T>(silu_scalar(static_cast<float>(all[b]))));
  }
#if RLT_X86
  if constexpr (std::is_same_v<T, c10::Half>) {
    if (c.mode != Mode::kScalar) {
      fill_tail_half_hw(t.tail.data());
    }
  }
#endif
  t.body = t.tail;  // DEFAULT: torch's body uses libm expf as well
#if RLT_X86
  if (c.mode == Mode::kAvx512) {
    c.inline_exp ? fill_body_avx512<T>(all.data(), t.body.data(), Inline512{})
                 : fill_body_avx512<T>(all.data(), t.body.data(), c.expf16);
  } else if (c.mode == Mode::kAvx2) {
    c.inline_exp ? fill_body_avx2<T>(all.data(), t.body.data(), Inline256{})
                 : fill_body_avx2<T>(all.data(), t.body.data(), c.expf8);
  }
#endif
  return t;
}

template <typename T>
const SiluTable& silu_table() {
  static const SiluTable t = build_table<T>(config());
  return t;
}

// One contiguous run of torch's silu loop: the SIMD body, then the scalar remainder.
void run_segment(const Config& c, const float* g, const float* u, float* o, int64_t len) {
  int64_t i = 0;
#if RLT_X86
  if (c.mode == Mode::kAvx512) {
    i = c.inline_exp ? body_f32_avx512(g, u, o, len, Inline512{})
                     : body_f32_avx512(g, u, o, len, c.expf16);
  } else if (c.mode == Mode::kAvx2) {
    i = c.inline_exp ? body_f32_avx2(g, u, o, len, Inline256{})
                     : body_f32_avx2(g, u, o, len, c.expf8);
  }
#endif
  for (; i < len; ++i) {
    o[i] = silu_scalar(g[i]) * u[i];
  }
}

template <typename T>
void run_segment(const Config& c, const T* g, const T* u, T* o, int64_t len) {
  const SiluTable& t = silu_table<T>();
  int64_t i = 0;
#if RLT_X86
  if (c.mode == Mode::kAvx512) {
    i = body_lut_avx512<T>(g, u, o, len, t.body.data());
  } else if (c.mode == Mode::kAvx2) {
    i = body_lut_avx2<T>(g, u, o, len, t.body.data());
  }
  if constexpr (std::is_same_v<T, c10::Half>) {
    if (c.mode != Mode::kScalar) {
      tail_half_hw(g, u, o, i, len, t.tail.data());
      return;
    }
  }
#endif
  for (; i < len; ++i) {
    o[i] = static_cast<T>(t.tail[g[i].x] * static_cast<float>(u[i]));
  }
}

// Runs of length `seg` (rows of gate and up at strides gs, us; out contiguous), split between
// threads exactly as TensorIterator::for_each splits them.
template <typename T>
void run_rows(
    const T* g, int64_t gs, const T* u, int64_t us, T* o, int64_t seg, int64_t total) {
  const Config& c = config();
  if constexpr (!std::is_same_v<T, float>) {
    silu_table<T>();  // build it once, before the threads start
  }
  at::parallel_for(0, total, kTorchGrainSize, [&](int64_t begin, int64_t end) {
    int64_t r = begin / seg;
    int64_t col = begin - r * seg;
    while (begin < end) {
      const int64_t len = std::min(seg - col, end - begin);
      run_segment(c, g + r * gs + col, u + r * us + col, o + r * seg + col, len);
      begin += len;
      ++r;
      col = 0;
    }
  });
}

template <typename T>
void run_typed(
    const at::Tensor& gate, const RowView& g, const at::Tensor& up, const RowView& u,
    at::Tensor& out) {
  // Contiguous gate rows coalesce into one run in torch's iterator; `up` must follow.
  const bool linear = g.rows == 1 || g.row_stride == g.cols;
  TORCH_CHECK(!linear || u.rows == 1 || u.row_stride == u.cols, "rltserve_native: up layout");
  const int64_t total = g.rows * g.cols;
  run_rows<T>(
      gate.const_data_ptr<T>(), linear ? 0 : g.row_stride, up.const_data_ptr<T>(),
      linear ? 0 : u.row_stride, out.mutable_data_ptr<T>(), linear ? total : g.cols, total);
}

}  // namespace

void silu_mul_cpu_kernel(
    const at::Tensor& gate, const RowView& g, const at::Tensor& up, const RowView& u,
    at::Tensor& out) {
  switch (gate.scalar_type()) {
    case at::kFloat:
      run_typed<float>(gate, g, up, u, out);
      break;
    case at::kBFloat16:
      run_typed<c10::BFloat16>(gate, g, up, u, out);
      break;
    case at::kHalf:
      run_typed<c10::Half>(gate, g, up, u, out);
      break;
    default:
      TORCH_CHECK(false, "rltserve_native: unsupported dtype ", gate.scalar_type());
  }
}

std::string cpu_kernel_info() {
  const Config& c = config();
  const char* mode = c.mode == Mode::kAvx512 ? "avx512" : c.mode == Mode::kAvx2 ? "avx2" : "scalar";
  std::string s = std::string("mode=") + mode;
  s += ";mirrors_torch=" + std::string(c.mirrors_torch ? "1" : "0");
#if RLT_X86
  s += ";exp=" + std::string(c.mode == Mode::kScalar ? "libm" : c.inline_exp ? "inline-sleef" : "sleef");
#else
  s += ";exp=libm";
#endif
  s += ";torch_capability=" + c.torch_capability;
  s += ";threads=" + std::to_string(at::get_num_threads());
  if (!c.note.empty()) {
    s += ";note=" + c.note;
  }
  return s;
}

}  // namespace rltserve_native
