// The instruction set the kernels are compiled for, as one small vocabulary: a vector V of W
// float32 lanes and what the kernels do with it. Each level is written for its own registers,
// W = 16 on AVX-512, 8 on AVX2 (256-bit), 4 on NEON (128-bit); the portable level is GCC's vector
// extension over 8 lanes, which the compiler lowers to whatever the target has (SSE2 on any
// x86-64, NEON on any aarch64). Torch-free: the kernels' arithmetic is tested by a plain C++
// program too (tests/csrc/kernel_check.cpp), under emulation for a level the machine lacks.
//
// Exactly one of NEURON_ISA_AVX512VNNI, NEURON_ISA_AVX512, NEURON_ISA_AVX2VNNI, NEURON_ISA_AVX2, NEURON_ISA_NEON,
// NEURON_ISA_PORTABLE is defined by the build (setup.py, one extension per level), with the compiler flags that level needs.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(NEURON_ISA_AVX512VNNI)  // AVX-512 with VNNI (vpdpwssd): the AVX-512 level's code, its integer sums fused
#define NEURON_ISA_AVX512 1
#define NEURON_ISA_NAME "avx512vnni"
#endif
#if defined(NEURON_ISA_AVX2VNNI)  // AVX2 with AVX-VNNI (vpdpwssd on ymm): the AVX2 level's code, its sums fused
#define NEURON_ISA_AVX2 1
#define NEURON_ISA_NAME "avx2vnni"
#endif

#if defined(NEURON_ISA_AVX512) || defined(NEURON_ISA_AVX2)
#include <immintrin.h>
#elif defined(NEURON_ISA_NEON)
#include <arm_neon.h>
#elif !defined(NEURON_ISA_PORTABLE)
#error "define one of NEURON_ISA_AVX512, NEURON_ISA_AVX2, NEURON_ISA_NEON, NEURON_ISA_PORTABLE"
#endif

namespace simd {

// float16 bits -> float32, exactly (subnormals, infinities and NaN too).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: value = man * 2^-24, exact in float32
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

#if defined(NEURON_ISA_AVX512)
#ifdef NEURON_ISA_NAME
constexpr const char* NAME = NEURON_ISA_NAME;
#else
constexpr const char* NAME = "avx512";
#endif
constexpr int W = 16;
constexpr int REGISTERS = 32;
using V = __m512;
inline V load(const float* p) { return _mm512_loadu_ps(p); }
inline void store(float* p, V v) { _mm512_storeu_ps(p, v); }
inline V set1(float x) { return _mm512_set1_ps(x); }
inline V zero() { return _mm512_setzero_ps(); }
inline V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm512_mul_ps(a, b); }
inline V add(V a, V b) { return _mm512_add_ps(a, b); }
inline V sub(V a, V b) { return _mm512_sub_ps(a, b); }
inline V max(V a, V b) { return _mm512_max_ps(a, b); }
inline V div(V a, V b) { return _mm512_div_ps(a, b); }
// The lanes' sum by halves: lane i + lane i + 8, then + 4, + 2, + 1 (sum4's order too).
inline float sum(V v) {
  const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
  const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));
  return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}
// out[k] = sum(ak) * scale for four vectors at once, each summed in sum()'s order.
inline void sum4(V a0, V a1, V a2, V a3, float scale, float* out) {
  const V x01 = _mm512_add_ps(_mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a0, a1, _MM_SHUFFLE(3, 2, 3, 2)));
  const V x23 = _mm512_add_ps(_mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(1, 0, 1, 0)),
                              _mm512_shuffle_f32x4(a2, a3, _MM_SHUFFLE(3, 2, 3, 2)));
  const V b = _mm512_add_ps(_mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(2, 0, 2, 0)),
                            _mm512_shuffle_f32x4(x01, x23, _MM_SHUFFLE(3, 1, 3, 1)));
  const V c = _mm512_add_ps(b, _mm512_permute_ps(b, _MM_SHUFFLE(1, 0, 3, 2)));
  const V d = _mm512_add_ps(c, _mm512_permute_ps(c, _MM_SHUFFLE(2, 3, 0, 1)));
  const __m128 lanes = _mm512_castps512_ps128(_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), d));
  _mm_storeu_ps(out, _mm_mul_ps(lanes, _mm_set1_ps(scale)));
}
inline V round(V v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V pow2(V n) { return _mm512_scalef_ps(set1(1.0f), n); }  // 2^n, n integral
inline V select_ge0(V x, V a, V b) { return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, zero(), _CMP_GE_OQ), b, a); }
inline V halves(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline float half(uint16_t h) { return _cvtsh_ss(h); }
// The 32 integers of a group as floats: 4-bit, 16 bytes (byte j: element j low, j + 16 high);
// 8-bit, 32 bytes.
inline void group4(const uint8_t* p, V* out) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi));
}
inline void group8(const uint8_t* p, V* out) {
  out[0] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  out[1] = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16))));
}

#elif defined(NEURON_ISA_AVX2)
#ifdef NEURON_ISA_NAME
constexpr const char* NAME = NEURON_ISA_NAME;
#else
constexpr const char* NAME = "avx2";
#endif
constexpr int W = 8;
constexpr int REGISTERS = 16;
using V = __m256;
inline V load(const float* p) { return _mm256_loadu_ps(p); }
inline void store(float* p, V v) { _mm256_storeu_ps(p, v); }
inline V set1(float x) { return _mm256_set1_ps(x); }
inline V zero() { return _mm256_setzero_ps(); }
inline V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
inline V mul(V a, V b) { return _mm256_mul_ps(a, b); }
inline V add(V a, V b) { return _mm256_add_ps(a, b); }
inline V sub(V a, V b) { return _mm256_sub_ps(a, b); }
inline V max(V a, V b) { return _mm256_max_ps(a, b); }
inline V div(V a, V b) { return _mm256_div_ps(a, b); }
inline float sum(V v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline V round(V v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline V pow2(V n) {
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_castsi256_ps(e);
}
inline V select_ge0(V x, V a, V b) { return _mm256_blendv_ps(b, a, _mm256_cmp_ps(x, zero(), _CMP_GE_OQ)); }
inline V halves(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline float half(uint16_t h) { return _cvtsh_ss(h); }
inline void group4(const uint8_t* p, V* out) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
  const __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
  out[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo));
  out[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(lo, lo)));
  out[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi));
  out[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_unpackhi_epi64(hi, hi)));
}
inline void group8(const uint8_t* p, V* out) {
  for (int i = 0; i < 4; ++i)
    out[i] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8 * i))));
}

#elif defined(NEURON_ISA_NEON)
constexpr const char* NAME = "neon";
constexpr int W = 4;
constexpr int REGISTERS = 32;
using V = float32x4_t;
inline V load(const float* p) { return vld1q_f32(p); }
inline void store(float* p, V v) { vst1q_f32(p, v); }
inline V set1(float x) { return vdupq_n_f32(x); }
inline V zero() { return vdupq_n_f32(0.0f); }
inline V fma(V a, V b, V c) { return vfmaq_f32(c, a, b); }
inline V mul(V a, V b) { return vmulq_f32(a, b); }
inline V add(V a, V b) { return vaddq_f32(a, b); }
inline V sub(V a, V b) { return vsubq_f32(a, b); }
inline V max(V a, V b) { return vmaxq_f32(a, b); }
inline V div(V a, V b) { return vdivq_f32(a, b); }
inline float sum(V v) { return vaddvq_f32(v); }
inline V round(V v) { return vrndnq_f32(v); }
inline V pow2(V n) {
  return vreinterpretq_f32_s32(vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23));
}
inline V select_ge0(V x, V a, V b) { return vbslq_f32(vcgeq_f32(x, zero()), a, b); }
inline V halves(const uint16_t* p) { return vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p))); }
inline float half(uint16_t h) { return vgetq_lane_f32(vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h))), 0); }
inline void widen(uint8x16_t b, V* out) {  // 16 bytes -> 4 vectors
  const uint16x8_t lo = vmovl_u8(vget_low_u8(b)), hi = vmovl_u8(vget_high_u8(b));
  out[0] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo)));
  out[1] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(lo)));
  out[2] = vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi)));
  out[3] = vcvtq_f32_u32(vmovl_u16(vget_high_u16(hi)));
}
inline void group4(const uint8_t* p, V* out) {
  const uint8x16_t raw = vld1q_u8(p);
  widen(vandq_u8(raw, vdupq_n_u8(15)), out);
  widen(vshrq_n_u8(raw, 4), out + 4);
}
inline void group8(const uint8_t* p, V* out) {
  widen(vld1q_u8(p), out);
  widen(vld1q_u8(p + 16), out + 4);
}

#else  // portable: the compiler's own vectors
constexpr const char* NAME = "portable";
constexpr int W = 8;
constexpr int REGISTERS = 16;
typedef float V __attribute__((vector_size(32)));
typedef int32_t Vi __attribute__((vector_size(32)));
inline V load(const float* p) { V v; std::memcpy(&v, p, sizeof v); return v; }
inline void store(float* p, V v) { std::memcpy(p, &v, sizeof v); }
inline V set1(float x) { return V{} + x; }
inline V zero() { return V{}; }
inline V fma(V a, V b, V c) { return a * b + c; }
inline V mul(V a, V b) { return a * b; }
inline V add(V a, V b) { return a + b; }
inline V sub(V a, V b) { return a - b; }
inline V max(V a, V b) { return a > b ? a : b; }
inline V div(V a, V b) { return a / b; }
inline float sum(V v) {
  float s = 0;
  for (int i = 0; i < W; ++i) s += v[i];
  return s;
}
inline V round(V v) {  // to nearest, ties to even (|v| < 2^22)
  const V big = set1(12582912.0f);  // 1.5 * 2^23
  return (v + big) - big;
}
inline V pow2(V n) {
  Vi e = __builtin_convertvector(n, Vi);
  e = (e + 127) << 23;
  V out;
  std::memcpy(&out, &e, sizeof out);
  return out;
}
inline V select_ge0(V x, V a, V b) { return x >= 0 ? a : b; }
inline V halves(const uint16_t* p) {
  V v;
  for (int i = 0; i < W; ++i) v[i] = half_to_float(p[i]);
  return v;
}
inline float half(uint16_t h) { return half_to_float(h); }
inline void group4(const uint8_t* p, V* out) {
  for (int i = 0; i < 16; ++i) {
    out[i / W][i % W] = static_cast<float>(p[i] & 15);
    out[(i + 16) / W][i % W] = static_cast<float>(p[i] >> 4);
  }
}
inline void group8(const uint8_t* p, V* out) {
  for (int i = 0; i < 32; ++i) out[i / W][i % W] = static_cast<float>(p[i]);
}
#endif

constexpr int NV = 32 / W;  // vectors a group of 32 takes

// e^x for x <= 0 (softmax weights, sigmoid), to a few float32 ulps: 2^(x log2 e) split into an
// integer power and 2^f, f in [-0.5, 0.5], by its Taylor polynomial. Below e^-87 it gives ~1e-38.
inline V exp_nonpositive(V x) {
  const V t = max(mul(x, set1(1.4426950408889634f)), set1(-126.0f));
  const V n = round(t);
  const V f = mul(sub(t, n), set1(0.6931471805599453f));
  V p = set1(1.0f / 5040);
  p = fma(p, f, set1(1.0f / 720));
  p = fma(p, f, set1(1.0f / 120));
  p = fma(p, f, set1(1.0f / 24));
  p = fma(p, f, set1(1.0f / 6));
  p = fma(p, f, set1(0.5f));
  p = fma(p, f, set1(1.0f));
  p = fma(p, f, set1(1.0f));
  return mul(p, pow2(n));
}

// x * sigmoid(x), from e^-|x| so that nothing overflows.
inline V silu(V x) {
  const V e = exp_nonpositive(sub(zero(), max(x, sub(zero(), x))));
  const V one = set1(1.0f);
  return mul(x, div(select_ge0(x, one, e), add(one, e)));
}

#if !defined(NEURON_ISA_AVX512)
inline void sum4(V a0, V a1, V a2, V a3, float scale, float* out) {
  out[0] = sum(a0) * scale;
  out[1] = sum(a1) * scale;
  out[2] = sum(a2) * scale;
  out[3] = sum(a3) * scale;
}
#endif

inline float dot(const float* a, const float* b, int64_t n) {
  V acc = zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) acc = fma(load(a + i), load(b + i), acc);
  float s = sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = y * c + x * w
inline void scale_add(float* y, float c, const float* x, float w, int64_t n) {
  int64_t i = 0;
  const V vc = set1(c), vw = set1(w);
  for (; i + W <= n; i += W) store(y + i, fma(load(x + i), vw, mul(load(y + i), vc)));
  for (; i < n; ++i) y[i] = y[i] * c + x[i] * w;
}

}  // namespace simd
