// y = x W^T for weights kept packed in groups of 32 along the input dimension: w = s * u + m per
// group of 32, or per half-group of 16 (the K-quants with 16-element sub-blocks). x in int8
// (qdot.h: run_int8) where the level has it and the caller asks, else float32 as below.
//
//   u, 4-bit: 16 bytes a group, byte j holds u[j] (low nibble) and u[j + 16] (high nibble), the
//             order of GGUF's Q4_0/Q4_1 blocks; 8-bit: one byte each.
//   s, m:     float16 per scale group, as GGUF files hold them; or, for the K-quants, int8 per
//             scale group times a float16 per super-block (s = d * sc, m = dm * mn), which is
//             exactly how those files build them (float16 x 6-bit fits a float32 exactly).
//
// One row of x (a decode): sum_k w[n,k] x[k] = sum_g s_g (u_g . x_g) + sum_g m_g xsum_g, so the
// integers meet x unscaled, one FMA a group applies its scale, and the offsets meet the per-group
// sums of x at the end; two rows of W go together, so each load of x feeds both. Several rows
// of x (up to 8): each group of W is dequantized once into registers and multiplied into every
// row, so a batch of M rows reads the weights ceil(M / 8) times. Rows of W are split over the
// threads. This float path is float32 throughout: the result is the dequantized product's, up to
// the order of the sums.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "qdot.h"
#include "simd.h"

namespace kernels {

using namespace simd;
constexpr int G = 32;

// One row's scales and offsets as float32.
struct Scales {
  const uint16_t* s16 = nullptr;  // plain: float16 [N, ns]
  const uint16_t* m16 = nullptr;
  const int8_t* sc = nullptr;  // super: int8 [N, ns] times float16 [N, nd]
  const int8_t* mn = nullptr;
  const uint16_t* d = nullptr;
  const uint16_t* dm = nullptr;
  int64_t ns = 0, nd = 0;

  void row(int64_t n, float* sbuf, float* mbuf) const {
    if (s16 != nullptr) {
      const uint16_t* sn = s16 + n * ns;
      const uint16_t* mn_ = m16 + n * ns;
      int64_t i = 0;
      for (; i + W <= ns; i += W) {
        store(sbuf + i, halves(sn + i));
        store(mbuf + i, halves(mn_ + i));
      }
      for (; i < ns; ++i) {
        sbuf[i] = half(sn[i]);
        mbuf[i] = half(mn_[i]);
      }
      return;
    }
    const int64_t per = ns / nd;
    const int8_t* scn = sc + n * ns;
    const int8_t* mnn = mn + n * ns;
    for (int64_t j = 0; j < nd; ++j) {
      const float dj = half(d[n * nd + j]), dmj = half(dm[n * nd + j]);
      for (int64_t i = j * per; i < (j + 1) * per; ++i) {
        sbuf[i] = dj * static_cast<float>(scn[i]);
        mbuf[i] = dmj * static_cast<float>(mnn[i]);
      }
    }
  }
};

template <int BITS>
inline void unpack(const uint8_t* p, V* w) {
  if constexpr (BITS == 4) {
    group4(p, w);
  } else {
    group8(p, w);
  }
}

// The scale group of vector v of group g.
template <bool HALF>
constexpr int64_t scale_of(int64_t g, int v) {
  return HALF ? 2 * g + (v * W >= 16 ? 1 : 0) : g;
}

// sum_j m_j xsum_j over a row's ns scale groups.
inline float offsets(const float* m, const float* xs, int64_t ns) { return dot(m, xs, ns); }

// One row of x against rows n0..n1 of W, a row at a time (two rows of W together, each load of x
// feeding both, took 1.2-1.9x as long on a Zen 4).
template <int BITS, bool HALF>
void one_row(const float* x, const float* xsum, int64_t K, const uint8_t* u, const Scales& scales, float* y,
             int64_t n0, int64_t n1, float* sbuf) {
  constexpr int BYTES = BITS * G / 8;
  const int64_t groups = K / G, ns = scales.ns;
  float *s0 = sbuf, *m0 = sbuf + ns;
  int64_t n = n0;
  for (; n < n1; ++n) {
    const uint8_t* un = u + n * groups * BYTES;
    scales.row(n, s0, m0);
    V acc[2] = {zero(), zero()};
    for (int64_t g = 0; g < groups; ++g) {
      V w[NV];
      unpack<BITS>(un + g * BYTES, w);
      for (int v = 0; v < NV; ++v)
        acc[v & 1] = fma(mul(w[v], load(x + g * G + v * W)), set1(s0[scale_of<HALF>(g, v)]), acc[v & 1]);
    }
    y[n] = sum(add(acc[0], acc[1])) + offsets(m0, xsum, ns);
  }
}

// MT rows of x (2..8) against rows n0..n1 of W: each group dequantized once, into every row; R
// rows of W at a time. Two, where x outgrows an L1 cache of 32 KiB and the registers hold both
// rows' accumulators: each load of x then feeds two FMAs (8 rows of 1536 values took 1.26x as long a
// row of W at a time on a Zen 4; 8 rows of 576, 1.1x as long two at a time).
constexpr int64_t PAIR_ABOVE_BYTES = 32 << 10;
template <int BITS, bool HALF, int MT, int R>
void many_rows(const float* x, int64_t K, const uint8_t* u, const Scales& scales, float* y, int64_t N,
               int64_t n0, int64_t n1, float* sbuf) {
  constexpr int BYTES = BITS * G / 8;
  const int64_t groups = K / G, ns = scales.ns;
  int64_t n = n0;
  for (; n + R <= n1; n += R) {
    float *s[R], *m[R];
    V acc[R][MT];
    for (int r = 0; r < R; ++r) {
      s[r] = sbuf + 2 * r * ns;
      m[r] = s[r] + ns;
      scales.row(n + r, s[r], m[r]);
      for (int t = 0; t < MT; ++t) acc[r][t] = zero();
    }
    for (int64_t g = 0; g < groups; ++g) {
      V w[R][NV];
      for (int r = 0; r < R; ++r) unpack<BITS>(u + ((n + r) * groups + g) * BYTES, w[r]);
      for (int v = 0; v < NV; ++v) {
        const int64_t i = scale_of<HALF>(g, v);
        V wv[R];
        for (int r = 0; r < R; ++r) wv[r] = fma(w[r][v], set1(s[r][i]), set1(m[r][i]));
        for (int t = 0; t < MT; ++t) {
          const V xv = load(x + t * K + g * G + v * W);
          for (int r = 0; r < R; ++r) acc[r][t] = fma(wv[r], xv, acc[r][t]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int t = 0; t < MT; ++t) y[t * N + n + r] = sum(acc[r][t]);
  }
  if constexpr (R > 1) {
    if (n < n1) many_rows<BITS, HALF, MT, 1>(x, K, u, scales, y, N, n, n1, sbuf);
  }
}

template <int BITS, bool HALF, int MT>
void many_rows(const float* x, int64_t K, const uint8_t* u, const Scales& scales, float* y, int64_t N, int64_t n0,
               int64_t n1, float* sbuf) {
  if constexpr (2 * MT + 3 <= REGISTERS) {
    if (MT * K * 4 > PAIR_ABOVE_BYTES) return many_rows<BITS, HALF, MT, 2>(x, K, u, scales, y, N, n0, n1, sbuf);
  }
  many_rows<BITS, HALF, MT, 1>(x, K, u, scales, y, N, n0, n1, sbuf);
}

#ifdef NEURON_INT8_ROWS
// x in int8 (qdot.h): every row quantized once, then rows of W split over the threads, each
// row of W unpacked once for 8 rows of x at a time. A row's result is the same in any batch.
template <int BITS, bool HALF, int MT>
void int8_rows(const uint8_t* u, const int8_t* q, const int32_t* corr, int64_t K, const float* dj, const float* xs,
               int64_t ns, const float* s, const float* m, float* t, float* y, int64_t N) {
  float out[MT];
  for (int r = 0; r < MT; ++r) {
    const float* d = dj + r * ns;
    float* tr = t + r * ns;
    int64_t j = 0;
    for (; j + W <= ns; j += W) store(tr + j, mul(load(s + j), load(d + j)));
    for (; j < ns; ++j) tr[j] = s[j] * d[j];
  }
  int8::dot_rows<BITS, HALF, MT>(u, q, corr, K, t, ns, out);
  for (int r = 0; r < MT; ++r) y[r * N] = out[r] + dot(m, xs + r * ns, ns);
}

template <int BITS, bool HALF>
void run_int8(const float* x, const uint8_t* u, const Scales& scales, float* y, int64_t M, int64_t K, int64_t N,
              int threads) {
  constexpr int GS = HALF ? G / 2 : G, BYTES = BITS * G / 8;
  const int64_t ns = K / GS, groups = K / G;
  std::vector<int8_t> q(M * K);
  std::vector<float> dj(M * ns), xs(M * ns);
  std::vector<int32_t> corr(BITS == 8 ? M * K / 4 : 0);
  for (int64_t r = 0; r < M; ++r)
    int8::quantize<BITS, GS>(x + r * K, K, q.data() + r * K, dj.data() + r * ns, xs.data() + r * ns,
                             corr.empty() ? nullptr : corr.data() + r * K / 4);
  const int64_t grain = std::max<int64_t>(16, 4096 / std::max<int64_t>(K / 64, 1));
  parallel_for(N, grain, threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> buf(10 * ns);
    float *s = buf.data(), *m = s + ns, *t = m + ns;
    for (int64_t n = n0; n < n1; ++n) {
      scales.row(n, s, m);
      const uint8_t* un = u + n * groups * BYTES;
      for (int64_t r = 0; r < M; r += 8) {
        const int8_t* qr = q.data() + r * K;
        const int32_t* cr = corr.empty() ? nullptr : corr.data() + r * K / 4;
        const float *d = dj.data() + r * ns, *x_s = xs.data() + r * ns;
        float* yr = y + r * N + n;
        switch (std::min<int64_t>(8, M - r)) {
          case 1: int8_rows<BITS, HALF, 1>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
          case 2: int8_rows<BITS, HALF, 2>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
          case 3: int8_rows<BITS, HALF, 3>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
          case 4: int8_rows<BITS, HALF, 4>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
          case 5: int8_rows<BITS, HALF, 5>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
          case 6: int8_rows<BITS, HALF, 6>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
          case 7: int8_rows<BITS, HALF, 7>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
          default: int8_rows<BITS, HALF, 8>(un, qr, cr, K, d, x_s, ns, s, m, t, yr, N); break;
        }
      }
    }
  });
}
#endif

template <int BITS, bool HALF>
void run(const float* xp, const uint8_t* up, const Scales& scales, float* yp, int64_t M, int64_t K, int64_t N,
         int threads, bool int8) {
#ifdef NEURON_INT8_ROWS
  if (int8) return run_int8<BITS, HALF>(xp, up, scales, yp, M, K, N, threads);
#else
  (void)int8;
#endif
  constexpr int GS = HALF ? G / 2 : G;  // values per scale
  const int64_t ns = K / GS;
  std::vector<float> xsum(M == 1 ? ns : 0);  // per-group sums of x, for the offsets of one row
  if (M == 1)
    for (int64_t j = 0; j < ns; ++j) {
      float a = 0;
      for (int k = 0; k < GS; ++k) a += xp[j * GS + k];
      xsum[j] = a;
    }
  const int64_t grain = std::max<int64_t>(16, 4096 / std::max<int64_t>(K / 64, 1));
  parallel_for(N, grain, threads, [&](int64_t n0, int64_t n1) {
    std::vector<float> sbuf(4 * ns + 4 * W);  // scales and offsets of two rows
    if (M == 1) {
      one_row<BITS, HALF>(xp, xsum.data(), K, up, scales, yp, n0, n1, sbuf.data());
      return;
    }
    for (int64_t r = 0; r < M; r += 8) {
      const float* xr = xp + r * K;
      float* yr = yp + r * N;
      switch (std::min<int64_t>(8, M - r)) {
        case 1: many_rows<BITS, HALF, 1>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 2: many_rows<BITS, HALF, 2>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 3: many_rows<BITS, HALF, 3>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 4: many_rows<BITS, HALF, 4>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 5: many_rows<BITS, HALF, 5>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 6: many_rows<BITS, HALF, 6>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 7: many_rows<BITS, HALF, 7>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        default: many_rows<BITS, HALF, 8>(xr, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
      }
    }
  });
}

// Rows n0..n1 of W as float32, out [n1 - n0, K]: each value s * u + m, as many_rows computes it,
// so a float32 product with them is the packed products' result up to the order of the sums.
template <int BITS, bool HALF>
void dequant_rows(const uint8_t* u, const Scales& scales, int64_t K, int64_t n0, int64_t n1, float* out,
                  float* sbuf) {
  constexpr int BYTES = BITS * G / 8;
  const int64_t groups = K / G, ns = scales.ns;
  float *s = sbuf, *m = sbuf + ns;
  for (int64_t n = n0; n < n1; ++n) {
    scales.row(n, s, m);
    float* o = out + (n - n0) * K;
    for (int64_t g = 0; g < groups; ++g) {
      V w[NV];
      unpack<BITS>(u + (n * groups + g) * BYTES, w);
      for (int v = 0; v < NV; ++v) {
        const int64_t i = scale_of<HALF>(g, v);
        store(o + g * G + v * W, fma(w[v], set1(s[i]), set1(m[i])));
      }
    }
  }
}

template <int BITS>
void dequant(const uint8_t* u, const Scales& scales, int64_t K, int64_t n0, int64_t n1, float* out, int threads) {
  const bool half = scales.ns == 2 * (K / G);
  parallel_for(n1 - n0, 8, threads, [&](int64_t a, int64_t b) {
    std::vector<float> sbuf(2 * scales.ns + 2 * W);
    if (half) {
      dequant_rows<BITS, true>(u, scales, K, n0 + a, n0 + b, out + a * K, sbuf.data());
    } else {
      dequant_rows<BITS, false>(u, scales, K, n0 + a, n0 + b, out + a * K, sbuf.data());
    }
  });
}

// The whole product: y [M, N] = x [M, K] W^T. ns = K / 32, or K / 16 (a scale per half-group).
template <int BITS>
void qlinear(const float* x, const uint8_t* u, const Scales& scales, float* y, int64_t M, int64_t K, int64_t N,
             int threads, bool int8) {
  const bool half = scales.ns == 2 * (K / G);
  if (half) {
    run<BITS, true>(x, u, scales, y, M, K, N, threads, int8);
  } else {
    run<BITS, false>(x, u, scales, y, M, K, N, threads, int8);
  }
}

}  // namespace kernels
