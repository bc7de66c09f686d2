// One row of x against packed weights in integers, as llama.cpp's CPU backend and our GPU decode
// kernel (int8_rows.py) multiply it: x as int8 per group of 32 (q = round(x / d), d = max|x| /
// 127, ties away from zero), each group's dot product u . q exact in int32, then
//
//   y[n] = sum_j s_j d_j (u . q)_j + sum_j m_j d_j sum(q)_j
//
// over the row's scale groups j (32 values, or 16 for the K-quants' sub-blocks), d_j the scale
// of the group of x that j lies in. That is the float product of the weights with d * q, up to
// float32 rounding (int8_rows.reference_quantized_rows). The integers meet in vpmaddubsw (u
// unsigned, q signed; pairs in int16, which 15 * 127 * 2 cannot overflow) and vpmaddwd. 8-bit
// weights go in as u - 128, signed, their sign moved onto q, and each int32 lane gets its
// 128 sum(q) back from a table made with q (corr), so that the integers stay exact.
//
// x86 levels only (AVAILABLE); the others keep the float path of qlinear.h.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "simd.h"

namespace kernels {
namespace int8 {

#if defined(NEURON_ISA_AVX512) || defined(NEURON_ISA_AVX2)
#define NEURON_INT8_ROWS 1
constexpr bool AVAILABLE = true;
#else
constexpr bool AVAILABLE = false;
#endif

// How far ahead of its reads a row of W asks for its bytes (the next rows'): the hardware's own
// prefetching left a thread well short of what it can read (figures in the commit that added it).
constexpr int PREFETCH = 2048;

// Where element j of group g of x goes in q: AVX-512 takes 4-bit groups two at a time, as the
// nibbles unpack: [g 0..15, g+1 0..15, g 16..31, g+1 16..31]; otherwise in order.
template <int BITS>
inline int64_t slot(int64_t g, int j, int64_t groups) {
#if defined(NEURON_ISA_AVX512)
  if (BITS == 4 && (g | 1) < groups) return (g & ~int64_t{1}) * 32 + (j >= 16 ? 32 : 0) + (g & 1) * 16 + (j & 15);
#endif
  (void)groups;
  return g * 32 + j;
}

// x [K] as q [K] (in slot order), and per scale group j of GS values: dj [ns] = the d of its
// group, xs [ns] = d * sum(q); corr, where not null: corr [K / 4] = 128 * the sum of each 4 slots.
template <int BITS, int GS>
void quantize(const float* x, int64_t K, int8_t* q, float* dj, float* xs, int32_t* corr) {
  const int64_t groups = K / 32;
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * 32;
    float amax = 0;
    bool finite = true;
    for (int j = 0; j < 32; ++j) {
      amax = std::max(amax, std::fabs(xg[j]));
      finite = finite && std::isfinite(xg[j]);
    }
    // A NaN or infinity: q = 0 and d = NaN, so the group's products are NaN, as float32's would be.
    const float d = finite ? amax / 127.0f : NAN, inv = finite && amax > 0 ? 127.0f / amax : 0.0f;
    int sums[32 / GS] = {};
    for (int j = 0; j < 32; ++j) {
      const float v = xg[j] * inv;
      const int r = static_cast<int>(v >= 0 ? std::floor(v + 0.5f) : -std::floor(0.5f - v));
      q[slot<BITS>(g, j, groups)] = static_cast<int8_t>(r);
      sums[j / GS] += r;
    }
    for (int h = 0; h < 32 / GS; ++h) {
      dj[g * (32 / GS) + h] = d;
      xs[g * (32 / GS) + h] = d * static_cast<float>(sums[h]);
    }
  }
  if (corr != nullptr)
    for (int64_t i = 0; i < K / 4; ++i) corr[i] = 128 * (q[4 * i] + q[4 * i + 1] + q[4 * i + 2] + q[4 * i + 3]);
}

// sum_k u[k] q[k] of one group by the scalar road (a last group AVX-512 takes alone), per half.
template <int BITS>
inline void group_dot(const uint8_t* p, const int8_t* q, int out[2]) {
  out[0] = out[1] = 0;
  for (int j = 0; j < 32; ++j) {
    const int u = BITS == 4 ? (j < 16 ? p[j] & 15 : p[j - 16] >> 4) : p[j];
    out[j / 16] += u * q[j];
  }
}

#if defined(NEURON_ISA_AVX512)
// u . q of 64 bytes in 16 int32 lanes: unsigned u, signed q.
inline __m512i dot64(__m512i u, __m512i q) {
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, q), _mm512_set1_epi16(1));
}

// Two groups of W, unpacked once for every row of x: the unsigned bytes, and for 8-bit weights
// taken as u - 128, where that is negative (q's sign flips there).
struct Pair {
  __m512i u;
  __mmask64 neg = 0;
};

template <int BITS>
inline Pair unpack_pair(const uint8_t* p) {
  if constexpr (BITS == 4) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    return {_mm512_and_si512(both, _mm512_set1_epi8(15))};
  } else {
    const __m512i w = _mm512_xor_si512(_mm512_loadu_si512(p), _mm512_set1_epi8(static_cast<char>(0x80)));
    return {_mm512_abs_epi8(w), _mm512_movepi8_mask(w)};
  }
}

template <int BITS>
inline __m512i dot_pair(const Pair& w, const int8_t* q) {
  const __m512i qv = _mm512_loadu_si512(q);
  if constexpr (BITS == 8) return dot64(w.u, _mm512_mask_sub_epi8(qv, w.neg, _mm512_setzero_si512(), qv));
  return dot64(w.u, qv);
}

// The scales of a pair's 16 lanes, from its scale groups' t (2 of them, or 4 when HALF): the
// lanes hold 16 values each, in q's slot order.
template <int BITS, bool HALF>
inline __m512 pair_scales(const float* t) {
  const __m512 v = HALF ? _mm512_castps128_ps512(_mm_loadu_ps(t))
                        : _mm512_castps128_ps512(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(t))));
  if constexpr (BITS == 4) {
    return _mm512_permutexvar_ps(HALF ? _mm512_set_epi32(3, 3, 3, 3, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0)
                                      : _mm512_set_epi32(1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0), v);
  } else {
    return _mm512_permutexvar_ps(HALF ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                      : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0), v);
  }
}

// out[r] = sum_j t[r]_j (u . q[r])_j over one row of W's groups, for MT rows of x (q [MT, K] in
// slot order, t [MT, ns], corr [MT, K / 4] for 8-bit weights). Each row's sums run in the same order
// whatever MT is.
template <int BITS, bool HALF, int MT>
void dot_rows(const uint8_t* u, const int8_t* q, const int32_t* corr, int64_t K, const float* t, int64_t ns,
              float* out) {
  constexpr int BYTES = BITS * 4, PER = HALF ? 2 : 1;
  const int64_t groups = K / 32;
  __m512 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm512_setzero_ps();
  int64_t g = 0;
  for (; g + 2 <= groups; g += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(u + g * BYTES) + PREFETCH, _MM_HINT_T0);
    const Pair w = unpack_pair<BITS>(u + g * BYTES);
    for (int r = 0; r < MT; ++r) {
      __m512i dot_i = dot_pair<BITS>(w, q + r * K + g * 32);
      if constexpr (BITS == 8) dot_i = _mm512_add_epi32(dot_i, _mm512_loadu_si512(corr + r * (K / 4) + g * 8));
      const __m512 dot = _mm512_cvtepi32_ps(dot_i);
      acc[r] = _mm512_fmadd_ps(dot, pair_scales<BITS, HALF>(t + r * ns + g * PER), acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) {
    out[r] = _mm512_reduce_add_ps(acc[r]);
    if (g < groups) {
      int d[2];
      const float* tr = t + r * ns;
      group_dot<BITS>(u + g * BYTES, q + r * K + g * 32, d);
      out[r] += HALF ? tr[2 * g] * static_cast<float>(d[0]) + tr[2 * g + 1] * static_cast<float>(d[1])
                     : tr[g] * static_cast<float>(d[0] + d[1]);
    }
  }
}

#elif defined(NEURON_ISA_AVX2)
// One group of W, unpacked once for every row of x (as Pair above, a group at a time).
struct Group {
  __m256i u, sign;
};

template <int BITS>
inline Group unpack_group(const uint8_t* p) {
  if constexpr (BITS == 4) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return {_mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(raw, 4), raw), _mm256_set1_epi8(15)), _mm256_setzero_si256()};
  } else {
    const __m256i w = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)),
                                       _mm256_set1_epi8(static_cast<char>(0x80)));
    return {_mm256_sign_epi8(w, w), w};
  }
}

// 8 int32 lanes, 4 to each half of the group.
template <int BITS>
inline __m256i dot_group(const Group& w, const int8_t* q) {
  __m256i qv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
  if constexpr (BITS == 8) qv = _mm256_sign_epi8(qv, w.sign);
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w.u, qv), _mm256_set1_epi16(1));
}

template <int BITS, bool HALF, int MT>
void dot_rows(const uint8_t* u, const int8_t* q, const int32_t* corr, int64_t K, const float* t, int64_t ns,
              float* out) {
  constexpr int BYTES = BITS * 4;
  const int64_t groups = K / 32;
  __m256 acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    _mm_prefetch(reinterpret_cast<const char*>(u + g * BYTES) + PREFETCH, _MM_HINT_T0);
    const Group w = unpack_group<BITS>(u + g * BYTES);
    for (int r = 0; r < MT; ++r) {
      const float* tr = t + r * ns;
      const __m256 sc = HALF ? _mm256_set_m128(_mm_set1_ps(tr[2 * g + 1]), _mm_set1_ps(tr[2 * g])) : _mm256_set1_ps(tr[g]);
      __m256i dot = dot_group<BITS>(w, q + r * K + g * 32);
      if constexpr (BITS == 8)
        dot = _mm256_add_epi32(dot, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(corr + r * (K / 4) + g * 8)));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), sc, acc[r]);
    }
  }
  for (int r = 0; r < MT; ++r) out[r] = simd::sum(acc[r]);
}
#endif

}  // namespace int8
}  // namespace kernels
