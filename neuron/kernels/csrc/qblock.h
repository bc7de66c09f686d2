// y = x W^T with W in blocks of 16 rows and x in int16 per group of 32: the x86 levels' default
// packed product (neuron/kernels/cpu.py binds a weight to it once, reordering its bytes in place).
//
// Layout. A block holds rows 16b..16b+15 of W, group after group of 32 values; a group's bytes are
// 64-byte chunks, and in each chunk lane i (bytes 4i..4i+3, a little-endian 32-bit word) belongs
// to row 16b + i. 4-bit: 4 chunks, chunk c holding values 8c..8c+7 of each row, value 8c + 2e + h
// at bit 4e + 16h of its lane's word (e 0..3, h 0..1); 8-bit: 8 chunks, value 4c + 2e + h at bit
// 8e + 16h. So one shift and one mask give, in every 32-bit lane, a pair of values as two int16,
// and vpmaddwd (vpdpwssd where the level has VNNI) takes that pair of every row at once against
// the same two values of x, broadcast. The scales follow the rows: [N/16][ns][16] (and the
// K-quants' super-block scales [N/16][nd][16]), 16 of a group side by side.
//
// x. Each row is quantized once per product to int16 per group of 32: q = round(x / d), d =
// max|x| / 32767, ties away from zero, x / d taken as x * (32767 / max|x|) (NaN or infinity: q =
// 0, d = NaN, so the group's products are NaN, as float32's would be). The sums over a group are exact in int32 (15 or 255 times 32767
// times 32 values), then a scale group's s (u . q) + m sum(q) is rounded once (one FMA, its
// products exact inside it) and one more FMA adds d times it to the row's sum. That is the
// dequantized weights' product with x rounded to 16 bits per group, up to float32 rounding: the
// float32 path's answers (x loses 1 part in 65,534 of its group's largest value), at integer
// speed. Every lane ends with its own row's sum: no reduction across lanes, 16 outputs stored at
// once. A row of x's result is the same bits in any batch (its sums run in one order; the
// integer ones are exact).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "parallel.h"
#include "qlinear.h"
#include "simd.h"

namespace kernels {
namespace blocked {

constexpr int R = 16;  // rows of W a block holds

#if defined(NEURON_ISA_AVX512) || defined(NEURON_ISA_AVX2)
#define NEURON_BLOCKED 1
constexpr bool AVAILABLE = true;
#else
constexpr bool AVAILABLE = false;
#endif

template <int BITS>
constexpr int64_t group_bytes() {
  return R * G * BITS / 8;
}

// Where value k (0..31) of row i (0..15) of a block's group lies: its byte and its shift there.
template <int BITS>
inline int64_t place(int i, int k, int* shift) {
  const int per = BITS == 4 ? 8 : 4;  // values of a row in a chunk
  const int c = k / per, e = (k % per) / 2, h = k % 2, bit = BITS * e + 16 * h;
  *shift = bit % 8;
  return c * 64 + i * 4 + bit / 8;
}

// u in qlinear.h's rows ([N, K * BITS / 8]; 4-bit: byte j of a group holds value j low and
// j + 16 high) into blocks, out [N / 16][K / 32][group_bytes]. N a multiple of 16.
template <int BITS>
void to_blocks(const uint8_t* u, int64_t N, int64_t K, uint8_t* out, int threads) {
  const int64_t groups = K / G, row_bytes = K * BITS / 8;
  constexpr int CH = BITS == 4 ? 4 : 8;
  parallel_for(N / R, 4, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int64_t g = 0; g < groups; ++g) {
        uint8_t* o = out + (b * groups + g) * group_bytes<BITS>();
        for (int i = 0; i < R; ++i) {
          const uint8_t* src = u + (b * R + i) * row_bytes + g * G * BITS / 8;
          uint8_t v[G];
          for (int k = 0; k < G; ++k) v[k] = BITS == 4 ? (k < 16 ? src[k] & 15 : src[k - 16] >> 4) : src[k];
          for (int c = 0; c < CH; ++c) {
            uint32_t word = 0;
            for (int k = c * G / CH; k < (c + 1) * G / CH; ++k)  // value 2e + h of the chunk: bit BITS e + 16 h
              word |= static_cast<uint32_t>(v[k]) << (BITS * ((k % (G / CH)) / 2) + 16 * (k % 2));
            std::memcpy(o + c * 64 + i * 4, &word, 4);
          }
        }
      }
  });
}

// A row's scales [N, cols] as [N / 16][cols][16].
template <typename T>
void scales_to_blocks(const T* in, int64_t N, int64_t cols, T* out, int threads) {
  parallel_for(N / R, 16, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int i = 0; i < R; ++i) {
        const T* row = in + (b * R + i) * cols;
        for (int64_t j = 0; j < cols; ++j) out[(b * cols + j) * R + i] = row[j];
      }
  });
}

// Scale group j of row n of a blocked W, as float32: s and m.
inline void scale_at(const Scales& sc, int64_t n, int64_t j, float* s, float* m) {
  const int64_t b = n / R, i = n % R;
  if (sc.s16 != nullptr) {
    *s = simd::half_to_float(sc.s16[(b * sc.ns + j) * R + i]);
    *m = simd::half_to_float(sc.m16[(b * sc.ns + j) * R + i]);
    return;
  }
  const int64_t jd = j / (sc.ns / sc.nd);
  *s = simd::half_to_float(sc.d[(b * sc.nd + jd) * R + i]) * static_cast<float>(sc.sc[(b * sc.ns + j) * R + i]);
  *m = simd::half_to_float(sc.dm[(b * sc.nd + jd) * R + i]) * static_cast<float>(sc.mn[(b * sc.ns + j) * R + i]);
}

// Rows of a blocked W as float32, out [T, K]: row t is ids[t], or n0 + t where ids is null. Each
// value s * u + m, as the float path's dequant computes it.
template <int BITS>
void dequant_rows(const uint8_t* u, const Scales& sc, int64_t K, int64_t n0, const int64_t* ids, int64_t T,
                  float* out, int threads) {
  const int64_t groups = K / G, gs = K / sc.ns;
  parallel_for(T, 8, threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n = ids != nullptr ? ids[t] : n0 + t, b = n / R;
      const int i = static_cast<int>(n % R);
      for (int64_t g = 0; g < groups; ++g) {
        const uint8_t* o = u + (b * groups + g) * group_bytes<BITS>();
        for (int k = 0; k < G; ++k) {
          float s, m;
          scale_at(sc, n, (g * G + k) / gs, &s, &m);
          int shift;
          const int v = (o[place<BITS>(i, k, &shift)] >> shift) & (BITS == 4 ? 15 : 255);
          out[t * K + g * G + k] = std::fma(static_cast<float>(v), s, m);
        }
      }
    }
  });
}

#ifdef NEURON_BLOCKED
#if defined(NEURON_ISA_AVX512)
using VI = __m512i;
inline VI load_i(const uint8_t* p) { return _mm512_loadu_si512(p); }
inline VI and_i(VI a, VI b) { return _mm512_and_si512(a, b); }
inline VI add_i(VI a, VI b) { return _mm512_add_epi32(a, b); }
inline VI set1_i(int32_t v) { return _mm512_set1_epi32(v); }
inline VI zero_i() { return _mm512_setzero_si512(); }
template <int S>
inline VI srli(VI a) {
  return _mm512_srli_epi32(a, S);
}
inline VI dot2(VI acc, VI w, VI x) {
#ifdef __AVX512VNNI__
  return _mm512_dpwssd_epi32(acc, w, x);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, x));
#endif
}
inline simd::V to_float(VI a) { return _mm512_cvtepi32_ps(a); }
inline simd::V bytes_to_float(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
#else
using VI = __m256i;
inline VI load_i(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VI and_i(VI a, VI b) { return _mm256_and_si256(a, b); }
inline VI add_i(VI a, VI b) { return _mm256_add_epi32(a, b); }
inline VI set1_i(int32_t v) { return _mm256_set1_epi32(v); }
inline VI zero_i() { return _mm256_setzero_si256(); }
template <int S>
inline VI srli(VI a) {
  return _mm256_srli_epi32(a, S);
}
inline VI dot2(VI acc, VI w, VI x) {
#ifdef __AVXVNNI__
  return _mm256_dpwssd_avx_epi32(acc, w, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, x));
#endif
}
inline simd::V to_float(VI a) { return _mm256_cvtepi32_ps(a); }
inline simd::V bytes_to_float(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
#endif

// One group of x (32 values) as int16 q, each rounded half away from zero: t = trunc(|v|),
// plus one where |v| - t (exact) is at least a half; its d, and the sums of q over its halves.
// A NaN or infinity: q = 0 and d = NaN, so the group's products are NaN, as float32's would be.
inline void not_finite(int16_t* q, float* d, int32_t half_sums[2]) {
  std::memset(q, 0, G * sizeof(int16_t));
  *d = NAN;
  half_sums[0] = half_sums[1] = 0;
}

#if defined(NEURON_ISA_AVX512)
inline void quantize_group(const float* xg, int16_t* q, float* d, int32_t half_sums[2]) {
  const __m512 x[2] = {_mm512_loadu_ps(xg), _mm512_loadu_ps(xg + 16)};
  const __m512 a[2] = {_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1])};
  const __m512 inf = _mm512_set1_ps(INFINITY);
  const bool finite = (_mm512_cmp_ps_mask(a[0], inf, _CMP_LT_OQ) & _mm512_cmp_ps_mask(a[1], inf, _CMP_LT_OQ)) == 0xFFFF;
  if (!finite) return not_finite(q, d, half_sums);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(a[0], a[1]));
  *d = amax / 32767.0f;
  const __m512 inv = _mm512_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
  for (int h = 0; h < 2; ++h) {
    const __m512 v = _mm512_mul_ps(x[h], inv), av = _mm512_abs_ps(v);
    const __m512 t = _mm512_roundscale_ps(av, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_mask_add_ps(t, _mm512_cmp_ps_mask(_mm512_sub_ps(av, t), _mm512_set1_ps(0.5f), _CMP_GE_OQ),
                                        t, _mm512_set1_ps(1.0f));
    const __m512i qi = _mm512_cvtps_epi32(_mm512_mask_sub_ps(r, _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ),
                                                             _mm512_setzero_ps(), r));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h), _mm512_cvtsepi32_epi16(qi));
    half_sums[h] = _mm512_reduce_add_epi32(qi);
  }
}
#else
inline void quantize_group(const float* xg, int16_t* q, float* d, int32_t half_sums[2]) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 x[4], a[4];
  int finite_bits = 0xFF;
  __m256 m = _mm256_setzero_ps();
  for (int i = 0; i < 4; ++i) {
    x[i] = _mm256_loadu_ps(xg + 8 * i);
    a[i] = _mm256_andnot_ps(sign, x[i]);
    finite_bits &= _mm256_movemask_ps(_mm256_cmp_ps(a[i], inf, _CMP_LT_OQ));
    m = _mm256_max_ps(m, a[i]);
  }
  if (finite_bits != 0xFF) return not_finite(q, d, half_sums);
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  const float amax = _mm_cvtss_f32(_mm_max_ss(m4, _mm_movehdup_ps(m4)));
  *d = amax / 32767.0f;
  const __m256 inv = _mm256_set1_ps(amax > 0 ? 32767.0f / amax : 0.0f);
  __m256i qi[4];
  for (int i = 0; i < 4; ++i) {
    const __m256 v = _mm256_mul_ps(x[i], inv), av = _mm256_andnot_ps(sign, v);
    const __m256 t = _mm256_round_ps(av, _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    const __m256 up = _mm256_and_ps(_mm256_cmp_ps(_mm256_sub_ps(av, t), _mm256_set1_ps(0.5f), _CMP_GE_OQ),
                                    _mm256_set1_ps(1.0f));
    qi[i] = _mm256_cvtps_epi32(_mm256_or_ps(_mm256_add_ps(t, up), _mm256_and_ps(sign, v)));
  }
  for (int h = 0; h < 2; ++h) {
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(qi[2 * h], qi[2 * h + 1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 16 * h), packed);
    const __m256i s = _mm256_add_epi32(qi[2 * h], qi[2 * h + 1]);
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    half_sums[h] = _mm_cvtsi128_si32(_mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1)));
  }
}
#endif

// x [K] as q [K], dx [K / 32] (each group's d) and xs [K / GS] (each scale group's sum of q, exact).
template <int GS>
void quantize16(const float* x, int64_t K, int16_t* q, float* dx, float* xs) {
  for (int64_t g = 0; g < K / G; ++g) {
    int32_t halves[2];
    quantize_group(x + g * G, q + g * G, dx + g, halves);
    if constexpr (GS == G) {
      xs[g] = static_cast<float>(halves[0] + halves[1]);
    } else {
      xs[2 * g] = static_cast<float>(halves[0]);
      xs[2 * g + 1] = static_cast<float>(halves[1]);
    }
  }
}

// How far ahead of its reads a block asks for its bytes.
constexpr int PREFETCH = 2048;

// Scale group j of block b, lanes o..o + W: s and m.
inline void scales_of(const Scales& sc, int64_t b, int64_t j, int o, simd::V* s, simd::V* m) {
  if (sc.s16 != nullptr) {
    *s = simd::halves(sc.s16 + (b * sc.ns + j) * R + o);
    *m = simd::halves(sc.m16 + (b * sc.ns + j) * R + o);
    return;
  }
  const int64_t jd = j / (sc.ns / sc.nd);
  *s = simd::mul(simd::halves(sc.d + (b * sc.nd + jd) * R + o), bytes_to_float(sc.sc + (b * sc.ns + j) * R + o));
  *m = simd::mul(simd::halves(sc.dm + (b * sc.nd + jd) * R + o), bytes_to_float(sc.mn + (b * sc.ns + j) * R + o));
}

// Lanes o..o + W of block b (ub: its bytes) against MT rows of x: y [MT rows N apart][W].
template <int BITS, bool HALF, int MT>
void block_rows(const uint8_t* ub, int o, const Scales& sc, int64_t b, const int16_t* q, const float* dx,
                const float* xs, int64_t K, float* y, int64_t N) {
  constexpr int CH = BITS == 4 ? 4 : 8, PER = BITS == 4 ? 8 : 4, EX = BITS == 4 ? 4 : 2;
  constexpr int PARTS = HALF ? 2 : 1, P = MT == 1 ? 4 : (MT == 2 ? 2 : 1);
  const int64_t groups = K / G, ns = sc.ns;
  const int lane_bytes = o * 4;
  const VI mask = set1_i(BITS == 4 ? 0x000F000F : 0x00FF00FF);
  simd::V acc[MT];
  for (int r = 0; r < MT; ++r) acc[r] = simd::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* ug = ub + g * group_bytes<BITS>() + lane_bytes;
    for (int c = 0; c < CH; ++c) _mm_prefetch(reinterpret_cast<const char*>(ug + c * 64) + PREFETCH, _MM_HINT_T0);
    for (int part = 0; part < PARTS; ++part) {
      VI dot[MT][P];
      for (int r = 0; r < MT; ++r)
        for (int p = 0; p < P; ++p) dot[r][p] = zero_i();
      for (int c = part * CH / PARTS; c < (part + 1) * CH / PARTS; ++c) {
        const VI raw = load_i(ug + c * 64);
        VI w[EX];
        w[0] = and_i(raw, mask);
        if constexpr (BITS == 4) {
          w[1] = and_i(srli<4>(raw), mask);
          w[2] = and_i(srli<8>(raw), mask);
          w[3] = and_i(srli<12>(raw), mask);
        } else {
          w[1] = and_i(srli<8>(raw), mask);
        }
        for (int e = 0; e < EX; ++e)
          for (int r = 0; r < MT; ++r) {
            int32_t pair;
            std::memcpy(&pair, q + r * K + g * G + c * PER + 2 * e, 4);
            dot[r][e % P] = dot2(dot[r][e % P], w[e], set1_i(pair));
          }
      }
      const int64_t j = HALF ? 2 * g + part : g;
      simd::V s, m;
      scales_of(sc, b, j, o, &s, &m);
      for (int r = 0; r < MT; ++r) {
        VI t = dot[r][0];
        for (int p = 1; p < P; ++p) t = add_i(t, dot[r][p]);
        const simd::V group = simd::fma(to_float(t), s, simd::mul(m, simd::set1(xs[r * ns + j])));
        acc[r] = simd::fma(group, simd::set1(dx[r * groups + g]), acc[r]);
      }
    }
  }
  for (int r = 0; r < MT; ++r) simd::store(y + r * N, acc[r]);
}

template <int BITS, bool HALF>
void run(const float* x, const uint8_t* u, const Scales& sc, float* y, int64_t M, int64_t K, int64_t N,
         int threads) {
  constexpr int GS = HALF ? G / 2 : G;
  const int64_t ns = K / GS, groups = K / G;
  std::vector<int16_t> q(M * K);
  std::vector<float> dx(M * groups), xs(M * ns);
  parallel_for(M, 16, threads, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      quantize16<GS>(x + r * K, K, q.data() + r * K, dx.data() + r * groups, xs.data() + r * ns);
  });
  const int64_t block_bytes = groups * group_bytes<BITS>();
  constexpr int ROWS = simd::REGISTERS >= 32 ? 8 : 4;  // rows of x a pass: their sums stay in registers
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / block_bytes);
  parallel_for(N / R, grain, threads, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b)
      for (int o = 0; o < R; o += simd::W)
        for (int64_t r = 0; r < M; r += ROWS) {
          const uint8_t* ub = u + b * block_bytes;
          const int16_t* qr = q.data() + r * K;
          const float *d = dx.data() + r * groups, *s = xs.data() + r * ns;
          float* yr = y + r * N + b * R + o;
          switch (std::min<int64_t>(ROWS, M - r)) {
            case 1: block_rows<BITS, HALF, 1>(ub, o, sc, b, qr, d, s, K, yr, N); break;
            case 2: block_rows<BITS, HALF, 2>(ub, o, sc, b, qr, d, s, K, yr, N); break;
            case 3: block_rows<BITS, HALF, 3>(ub, o, sc, b, qr, d, s, K, yr, N); break;
            case 4: block_rows<BITS, HALF, 4>(ub, o, sc, b, qr, d, s, K, yr, N); break;
            case 5: block_rows<BITS, HALF, 5>(ub, o, sc, b, qr, d, s, K, yr, N); break;
            case 6: block_rows<BITS, HALF, 6>(ub, o, sc, b, qr, d, s, K, yr, N); break;
            case 7: block_rows<BITS, HALF, 7>(ub, o, sc, b, qr, d, s, K, yr, N); break;
            default: block_rows<BITS, HALF, 8>(ub, o, sc, b, qr, d, s, K, yr, N); break;
          }
        }
  });
}
#endif

// The whole product: y [M, N] = x [M, K] W^T, W blocked; N a multiple of 16.
template <int BITS>
void qlinear16(const float* x, const uint8_t* u, const Scales& sc, float* y, int64_t M, int64_t K, int64_t N,
               int threads) {
#ifdef NEURON_BLOCKED
  if (sc.ns == 2 * (K / G)) {
    run<BITS, true>(x, u, sc, y, M, K, N, threads);
  } else {
    run<BITS, false>(x, u, sc, y, M, K, N, threads);
  }
#else
  (void)x, (void)u, (void)sc, (void)y, (void)M, (void)K, (void)N, (void)threads;
#endif
}

}  // namespace blocked
}  // namespace kernels
