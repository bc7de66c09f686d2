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
//   paged_decode      one query token per sequence over its keys in the paged cache: the
//                     scores, a softmax over them, the weighted values
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

// out[j] = scale * (q . k[j]) for C keys; four keys reduced together.
inline void scores(const float* q, const float* const* k, int64_t C, int64_t hd, float scale, float* out) {
  int64_t j = 0;
  if (hd % W == 0) {
    for (; j + 4 <= C; j += 4) {
      V a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < hd; d += W) {
        const V qd = load(q + d);
        a0 = fma(qd, load(k[j] + d), a0);
        a1 = fma(qd, load(k[j + 1] + d), a1);
        a2 = fma(qd, load(k[j + 2] + d), a2);
        a3 = fma(qd, load(k[j + 3] + d), a3);
      }
      out[j] = sum(a0) * scale;
      out[j + 1] = sum(a1) * scale;
      out[j + 2] = sum(a2) * scale;
      out[j + 3] = sum(a3) * scale;
    }
  }
  for (; j < C; ++j) out[j] = dot(q, k[j], hd) * scale;
}

// out = scale * sum_j p[j] v[j] (acc: hd floats of scratch), 4 W dimensions at a time in registers.
inline void weighted_sum(const float* p, const float* const* v, int64_t C, int64_t hd, float scale, float* acc,
                         float* out) {
  int64_t d0 = 0;
  for (; d0 + 4 * W <= hd; d0 += 4 * W) {
    V a0 = zero(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < C; ++j) {
      const V w = set1(p[j]);
      const float* vj = v[j] + d0;
      a0 = fma(w, load(vj), a0);
      a1 = fma(w, load(vj + W), a1);
      a2 = fma(w, load(vj + 2 * W), a2);
      a3 = fma(w, load(vj + 3 * W), a3);
    }
    const V sc = set1(scale);
    store(out + d0, mul(a0, sc));
    store(out + d0 + W, mul(a1, sc));
    store(out + d0 + 2 * W, mul(a2, sc));
    store(out + d0 + 3 * W, mul(a3, sc));
  }
  if (d0 == hd) return;
  std::fill(acc + d0, acc + hd, 0.0f);
  for (int64_t j = 0; j < C; ++j) scale_add(acc + d0, 1.0f, v[j] + d0, p[j], hd - d0);
  for (int64_t d = d0; d < hd; ++d) out[d] = acc[d] * scale;
}

// p = exp(p - max p) in place; returns its sum.
inline float softmax_in_place(float* p, int64_t C) {
  float m = -INFINITY;
  for (int64_t j = 0; j < C; ++j) m = std::max(m, p[j]);
  int64_t j = 0;
  V total = zero();
  const V vm = set1(m);
  for (; j + W <= C; j += W) {
    const V e = exp_nonpositive(sub(load(p + j), vm));
    store(p + j, e);
    total = add(total, e);
  }
  float s = sum(total);
  for (; j < C; ++j) {
    p[j] = std::exp(p[j] - m);
    s += p[j];
  }
  return s;
}

struct PagedDecode {
  const float* q;  // [B, n_q, hd], rows sb apart, heads sh apart
  int64_t B, n_q, hd, sb, sh;
  const float *k_cache, *v_cache;  // [blocks, bs, n_kv, hd]
  int64_t blocks, bs, n_kv;
  const int32_t* tables;  // [table_rows, max_blocks]
  int64_t table_rows, max_blocks;
  const int64_t *slots, *ctx;  // [B]
  const int32_t* kv_of_q;      // [n_q]
  double scale;
  float* out;  // [B, n_q, hd]
};

inline const char* paged_decode(const PagedDecode& a, int threads) {
  for (int64_t b = 0; b < a.B; ++b)
    if (a.slots[b] < 0 || a.slots[b] >= a.table_rows || a.ctx[b] <= 0 || a.ctx[b] > a.max_blocks * a.bs)
      return "slot or context out of range";
  for (int64_t h = 0; h < a.n_q; ++h)
    if (a.kv_of_q[h] < 0 || a.kv_of_q[h] >= a.n_kv) return "kv_of_q out of range";
  int64_t keys = 0;
  for (int64_t b = 0; b < a.B; ++b) {
    const int32_t* table = a.tables + a.slots[b] * a.max_blocks;
    for (int64_t i = 0; i < (a.ctx[b] + a.bs - 1) / a.bs; ++i)
      if (table[i] < 0 || table[i] >= a.blocks) return "block table entry out of range";
    keys += a.ctx[b];
  }
  const int64_t hd = a.hd, n_q = a.n_q, n_kv = a.n_kv, bs = a.bs;
  // The query heads of each KV head: they share its key and value rows.
  std::vector<std::vector<int64_t>> heads_of(n_kv);
  for (int64_t h = 0; h < n_q; ++h) heads_of[a.kv_of_q[h]].push_back(h);
  // One task per (sequence, KV head); a thread takes enough of them to be worth waking.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(keys / a.B * hd * n_q / n_kv, 1));
  parallel_for(a.B * n_kv, grain, threads, [&](int64_t w0, int64_t w1) {
    std::vector<float> acc(hd), p;
    std::vector<const float*> krow, vrow;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / n_kv, g = w % n_kv, C = a.ctx[b];
      if (heads_of[g].empty()) continue;
      const int32_t* table = a.tables + a.slots[b] * a.max_blocks;
      krow.resize(C);
      vrow.resize(C);
      for (int64_t j0 = 0, i = 0; j0 < C; j0 += bs, ++i) {  // block by block: no division a key
        const float* kb = a.k_cache + (table[i] * bs * n_kv + g) * hd;
        const float* vb = a.v_cache + (table[i] * bs * n_kv + g) * hd;
        for (int64_t j = j0; j < std::min(C, j0 + bs); ++j) {
          krow[j] = kb + (j - j0) * n_kv * hd;
          vrow[j] = vb + (j - j0) * n_kv * hd;
        }
      }
      p.resize(C);
      for (const int64_t h : heads_of[g]) {
        // The scores of every key, the softmax weights in their place, then the weighted values.
        scores(a.q + b * a.sb + h * a.sh, krow.data(), C, hd, static_cast<float>(a.scale), p.data());
        const float total = softmax_in_place(p.data(), C);
        weighted_sum(p.data(), vrow.data(), C, hd, 1.0f / total, acc.data(), a.out + (b * n_q + h) * hd);
      }
    }
  });
  return nullptr;
}

}  // namespace kernels
