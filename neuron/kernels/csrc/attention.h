// Attention over the paged KV cache on the CPU (float32): every query row attends to the keys of
// its sequence up to its own position, computed the same way whatever else the step holds.
//
//   paged_decode      rows of queries, each with its sequence's slot and context length: the
//                     scores, a softmax over them, the weighted values. A decode is one row; a
//                     prompt's chunk (or a token and its drafts) is a run of rows of one slot
//                     whose contexts grow by one, taken in tiles of up to TILE rows that read
//                     each key and value once (a row alone takes the plain loop: scores,
//                     softmax_in_place, weighted_sum). A row's sums are the same bits in a tile as alone,
//                     so a prompt's answer does not depend on the other sequences of its step,
//                     on where its prompt was cut into chunks, or on which of its tokens came
//                     from the prefix cache.
//
// Indices that come from the step (cache rows, block tables) are checked before any is used: a
// bad one is an error message, never a read out of bounds.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "parallel.h"
#include "simd.h"

namespace kernels {

using namespace simd;

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
      sum4(a0, a1, a2, a3, scale, out + j);
    }
  }
  for (; j < C; ++j) out[j] = dot(q, k[j], hd) * scale;
}

// p = exp(p - max p) in place; returns its sum.
inline float softmax_in_place(float* p, int64_t C) {
  int64_t j = 0;
  V vmax = set1(-INFINITY);  // the max is exact in any order
  for (; j + W <= C; j += W) vmax = max(vmax, load(p + j));
  float lanes[W];
  store(lanes, vmax);
  float m = -INFINITY;
  for (int i = 0; i < W; ++i) m = std::max(m, lanes[i]);
  for (; j < C; ++j) m = std::max(m, p[j]);
  j = 0;
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

// scores() for RT rows whose contexts are c[0], c[0] + 1, ..., over keys j0 .. j1 (j0 a multiple
// of 4): each key's sum is the same chain of fma over hd as there (hd a multiple of W), and
// sum4 sums as sum() does, so row r's p[r] holds the bits scores() gives it.
template <int RT>
void tile_scores(const float* const* q, const float* const* k, const int64_t* c, int64_t j0, int64_t j1, int64_t hd,
                 float scale, float* const* p) {
  const int64_t C = std::min(j1, c[RT - 1]);
  int64_t j = j0;
  for (; j + 4 <= C; j += 4) {
    V a[RT][4];
    for (int r = 0; r < RT; ++r)
      for (int i = 0; i < 4; ++i) a[r][i] = zero();
    for (int64_t d = 0; d < hd; d += W) {
      const V k0 = load(k[j] + d), k1 = load(k[j + 1] + d), k2 = load(k[j + 2] + d), k3 = load(k[j + 3] + d);
      for (int r = 0; r < RT; ++r) {
        const V qd = load(q[r] + d);
        a[r][0] = fma(qd, k0, a[r][0]);
        a[r][1] = fma(qd, k1, a[r][1]);
        a[r][2] = fma(qd, k2, a[r][2]);
        a[r][3] = fma(qd, k3, a[r][3]);
      }
    }
    for (int r = 0; r < RT; ++r) {
      float s4[4];
      sum4(a[r][0], a[r][1], a[r][2], a[r][3], scale, s4);
      for (int i = 0; i < 4 && j + i < c[r]; ++i) p[r][j + i] = s4[i];
    }
  }
  for (; j < C; ++j)
    for (int r = 0; r < RT; ++r)
      if (j < c[r]) p[r][j] = dot(q[r], k[j], hd) * scale;
}

// weighted_sum()'s sums for the same RT rows over values j0 .. j1, NV vectors of dimensions from
// d0, added to acc[r]: each value row read once for all of them, each row's sums taken in
// weighted_sum's order (its four vectors at a time, then the rest, scale_add's fma by 1 exact).
template <int RT, int NV>
void tile_weighted_sum(const float* const* p, const float* const* v, const int64_t* c, int64_t j0, int64_t j1,
                       int64_t d0, float* const* acc) {
  const int64_t C = std::min(j1, c[RT - 1]);
  V a[RT][NV];
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = load(acc[r] + d0 + i * W);
  for (int64_t j = j0; j < C; ++j) {
    V vj[NV];
    for (int i = 0; i < NV; ++i) vj[i] = load(v[j] + d0 + i * W);
    for (int r = j < c[0] ? 0 : static_cast<int>(j - c[0]) + 1; r < RT; ++r) {
      const V w = set1(p[r][j]);
      for (int i = 0; i < NV; ++i) a[r][i] = fma(w, vj[i], a[r][i]);
    }
  }
  for (int r = 0; r < RT; ++r)
    for (int i = 0; i < NV; ++i) store(acc[r] + d0 + i * W, a[r][i]);
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

constexpr int64_t TILE = 32;  // rows of a run a task takes: they read each key and value once
constexpr int SUB = 4;        // of them, together in registers
constexpr int64_t KEYS = 64;  // keys (and values) a pass over a tile's rows keeps in the L1

// A tile (n rows from b0) of one KV head over its keys and values; p and acc: scratch.
struct Tile {
  const PagedDecode& a;
  int64_t b0, n;
  const float* const* krow;
  const float* const* vrow;

  template <int RT>
  void scores(int64_t h, int64_t r0, int64_t j0, int64_t j1, float* p, int64_t C) const {
    const float* q[RT];
    float* pr[RT];
    for (int r = 0; r < RT; ++r) {
      q[r] = a.q + (b0 + r0 + r) * a.sb + h * a.sh;
      pr[r] = p + (r0 + r) * C;
    }
    tile_scores<RT>(q, krow, a.ctx + b0 + r0, j0, j1, a.hd, static_cast<float>(a.scale), pr);
  }

  template <int RT, int NV>
  void values(int64_t r0, int64_t j0, int64_t j1, int64_t d0, const float* p, int64_t C, float* acc) const {
    const float* pr[RT];
    float* ar[RT];
    for (int r = 0; r < RT; ++r) {
      pr[r] = p + (r0 + r) * C;
      ar[r] = acc + (r0 + r) * a.hd;
    }
    tile_weighted_sum<RT, NV>(pr, vrow, a.ctx + b0 + r0, j0, j1, d0, ar);
  }

  template <int RT>
  void values(int64_t r0, int64_t j0, int64_t j1, const float* p, int64_t C, float* acc) const {
    int64_t d0 = 0;
    for (; d0 + 4 * W <= a.hd; d0 += 4 * W) values<RT, 4>(r0, j0, j1, d0, p, C, acc);
    switch ((a.hd - d0) / W) {
      case 1: values<RT, 1>(r0, j0, j1, d0, p, C, acc); break;
      case 2: values<RT, 2>(r0, j0, j1, d0, p, C, acc); break;
      case 3: values<RT, 3>(r0, j0, j1, d0, p, C, acc); break;
      default: break;
    }
  }

  // One query head: the scores of every row, KEYS keys at a time for all of them, the softmax of
  // each row, then the weighted values, KEYS at a time.
  void run(int64_t h, std::vector<float>& p, std::vector<float>& acc) const {
    const int64_t C = a.ctx[b0 + n - 1], hd = a.hd;
    p.resize(n * C);
    for (int64_t j0 = 0; j0 < C; j0 += KEYS)
      for (int64_t r0 = 0; r0 < n; r0 += SUB) {
        switch (std::min<int64_t>(SUB, n - r0)) {
          case 1: scores<1>(h, r0, j0, j0 + KEYS, p.data(), C); break;
          case 2: scores<2>(h, r0, j0, j0 + KEYS, p.data(), C); break;
          case 3: scores<3>(h, r0, j0, j0 + KEYS, p.data(), C); break;
          default: scores<4>(h, r0, j0, j0 + KEYS, p.data(), C); break;
        }
      }
    float scale[TILE];
    for (int64_t r = 0; r < n; ++r) scale[r] = 1.0f / softmax_in_place(p.data() + r * C, a.ctx[b0 + r]);
    acc.assign(n * hd, 0.0f);
    for (int64_t j0 = 0; j0 < C; j0 += KEYS)
      for (int64_t r0 = 0; r0 < n; r0 += SUB) {
        switch (std::min<int64_t>(SUB, n - r0)) {
          case 1: values<1>(r0, j0, j0 + KEYS, p.data(), C, acc.data()); break;
          case 2: values<2>(r0, j0, j0 + KEYS, p.data(), C, acc.data()); break;
          case 3: values<3>(r0, j0, j0 + KEYS, p.data(), C, acc.data()); break;
          default: values<4>(r0, j0, j0 + KEYS, p.data(), C, acc.data()); break;
        }
      }
    for (int64_t r = 0; r < n; ++r) {  // weighted_sum's last multiply
      const V sc = set1(scale[r]);
      float* out = a.out + ((b0 + r) * a.n_q + h) * hd;
      for (int64_t d = 0; d < hd; d += W) store(out + d, mul(load(acc.data() + r * hd + d), sc));
    }
  }
};

inline const char* paged_decode(const PagedDecode& a, int threads) {
  if (a.B == 0) return nullptr;
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
  // Tiles: rows that continue a run (its slot, a context one longer), at most TILE together.
  std::vector<int64_t> first;
  for (int64_t b = 0; b < a.B;) {
    first.push_back(b);
    int64_t e = b + 1;
    while (e < a.B && e - b < TILE && a.slots[e] == a.slots[b] && a.ctx[e] == a.ctx[e - 1] + 1) ++e;
    b = e;
  }
  const int64_t tiles = static_cast<int64_t>(first.size());
  first.push_back(a.B);
  // One task per (tile, KV head), the tiles taken from both ends in turn: a prompt's late rows
  // have the most keys, and each thread gets a contiguous range of tasks.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 17) / std::max<int64_t>(keys / tiles * hd * n_q / n_kv, 1));
  parallel_for(tiles * n_kv, grain, threads, [&](int64_t w0, int64_t w1) {
    std::vector<float> acc(hd), p;
    std::vector<const float*> krow, vrow;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t k = w / n_kv, g = w % n_kv, t = k % 2 == 0 ? k / 2 : tiles - 1 - k / 2;
      const int64_t b0 = first[t], n = first[t + 1] - b0, C = a.ctx[b0 + n - 1];
      if (heads_of[g].empty()) continue;
      const int32_t* table = a.tables + a.slots[b0] * a.max_blocks;
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
      if (hd % W == 0 && n > 1) {
        const Tile tile{a, b0, n, krow.data(), vrow.data()};
        for (const int64_t h : heads_of[g]) tile.run(h, p, acc);
        continue;
      }
      p.resize(C);
      acc.resize(hd);
      for (const int64_t h : heads_of[g])
        for (int64_t b = b0; b < b0 + n; ++b) {
          // The scores of every key, the softmax weights in their place, then the weighted values.
          scores(a.q + b * a.sb + h * a.sh, krow.data(), a.ctx[b], hd, static_cast<float>(a.scale), p.data());
          const float total = softmax_in_place(p.data(), a.ctx[b]);
          weighted_sum(p.data(), vrow.data(), a.ctx[b], hd, 1.0f / total, acc.data(), a.out + (b * n_q + h) * hd);
        }
    }
  });
  return nullptr;
}

}  // namespace kernels
