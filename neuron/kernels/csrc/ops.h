// The CPU step's small ops, fused (float32): what the CUDA path does with Triton kernels
// (neuron/kernels/fused.py), for the same reason. Unfused, a decode step of a small model spends
// most of its time in ~40 torch ops a layer (a few microseconds of dispatch each, and the paged
// keys gathered into fresh tensors for SDPA) rather than in its matrix products.
//
//   rms_norm          x [T, H] (rows `sx` apart) -> its RMS norm times w
//   add_rms_norm      residual + x (written into residual) and its RMS norm
//   silu_mul          [T, 2I] (gate | up, rows `s` apart) -> silu(gate) * up [T, I]
//   rope_store        qkv [T, n_q + 2 n_kv, hd]: optional per-head RMS norm of q and k (qwen3),
//                     neox RoPE; q rotated in place, k rotated and v written to the paged cache
//
// The attention over the paged cache is in attention.h.
//
// Indices that come from the step (positions, cache rows, block tables) are checked before any
// is used: a bad one is an error message, never a write out of bounds.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace kernels {

using namespace simd;

// Rows in parallel once there are enough of them to pay for waking the threads.
template <typename F>
void rows(int64_t T, int64_t width, int threads, F f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
  parallel_for(T, grain, threads, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(t);
  });
}

inline float inv_rms(const float* x, int64_t n, double eps) {
  return 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + static_cast<float>(eps));
}

// out = w * (x * r)
inline void scaled(float* out, const float* x, const float* w, float r, int64_t n) {
  int64_t i = 0;
  const V vr = set1(r);
  for (; i + W <= n; i += W) store(out + i, mul(load(w + i), mul(load(x + i), vr)));
  for (; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

inline void rms_norm(const float* x, int64_t sx, const float* w, float* out, int64_t T, int64_t H, double eps,
                     int threads) {
  rows(T, H, threads, [&](int64_t t) { scaled(out + t * H, x + t * sx, w, inv_rms(x + t * sx, H, eps), H); });
}

inline void add_rms_norm(const float* x, float* residual, const float* w, float* out, int64_t T, int64_t H,
                         double eps, int threads) {
  rows(T, H, threads, [&](int64_t t) {
    float* r = residual + t * H;
    const float* xr = x + t * H;
    int64_t i = 0;
    for (; i + W <= H; i += W) store(r + i, add(load(r + i), load(xr + i)));
    for (; i < H; ++i) r[i] += xr[i];
    scaled(out + t * H, r, w, inv_rms(r, H, eps), H);
  });
}

inline void silu_mul(const float* gate_up, int64_t s, float* out, int64_t T, int64_t I, int threads) {
  rows(T, I, threads, [&](int64_t t) {
    const float *g = gate_up + t * s, *u = g + I;
    float* o = out + t * I;
    int64_t i = 0;
    for (; i + W <= I; i += W) store(o + i, mul(silu(load(g + i)), load(u + i)));
    for (; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
}

// One head of hd values at x: optional RMS norm (weight nw), then neox RoPE, written to out
// (which may be x).
inline void norm_rope(const float* x, float* out, int64_t hd, const float* cos, const float* sin, const float* nw,
                      double eps, float* tmp) {
  const int64_t half = hd / 2;
  if (nw != nullptr) {
    scaled(tmp, x, nw, inv_rms(x, hd, eps), hd);
  } else {
    std::copy(x, x + hd, tmp);
  }
  int64_t i = 0;
  for (; i + W <= half; i += W) {
    const V a = load(tmp + i), b = load(tmp + i + half);
    store(out + i, sub(mul(a, load(cos + i)), mul(b, load(sin + i))));
    store(out + i + half, fma(a, load(sin + i + half), mul(b, load(cos + i + half))));
  }
  for (; i < half; ++i) {
    const float a = tmp[i], b = tmp[i + half];
    out[i] = a * cos[i] - b * sin[i];
    out[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

struct RopeStore {
  float* qkv;  // [T, n_q + 2 n_kv, hd], row t at qkv + t * sq
  int64_t T, sq, n_q, n_kv, hd;
  const int64_t* positions;  // [T], rows of cos/sin
  const float *cos, *sin;    // [L, hd]
  int64_t L;
  const float *q_norm, *k_norm;  // [hd] each, or null
  double eps;
  float *k_cache, *v_cache;  // [rows_in_cache, n_kv, hd]
  int64_t rows_in_cache;
  const int64_t* index;  // [T], each token's cache row
};

inline const char* rope_store(const RopeStore& a, int threads) {
  for (int64_t t = 0; t < a.T; ++t)
    if (a.positions[t] < 0 || a.positions[t] >= a.L || a.index[t] < 0 || a.index[t] >= a.rows_in_cache)
      return "position or cache row out of range";
  const int64_t n_q = a.n_q, n_kv = a.n_kv, hd = a.hd;
  rows(a.T, (n_q + 2 * n_kv) * hd, threads, [&](int64_t t) {
    std::vector<float> tmp(hd);
    float* row = a.qkv + t * a.sq;
    const float *c = a.cos + a.positions[t] * hd, *s = a.sin + a.positions[t] * hd;
    for (int64_t h = 0; h < n_q; ++h) norm_rope(row + h * hd, row + h * hd, hd, c, s, a.q_norm, a.eps, tmp.data());
    float* kdst = a.k_cache + a.index[t] * n_kv * hd;
    for (int64_t h = 0; h < n_kv; ++h)
      norm_rope(row + (n_q + h) * hd, kdst + h * hd, hd, c, s, a.k_norm, a.eps, tmp.data());
    std::copy(row + (n_q + n_kv) * hd, row + (n_q + 2 * n_kv) * hd, a.v_cache + a.index[t] * n_kv * hd);
  });
  return nullptr;
}

}  // namespace kernels
