// The CPU step's small ops, fused (float32): what the CUDA path does with Triton kernels
// (neuron/kernels/fused.py), for the same reason. Unfused, a decode step of a small model spends
// most of its time in ~40 torch ops a layer (a few microseconds of dispatch each, and the paged
// keys gathered into fresh tensors for SDPA) rather than in its matrix products.
//
//   rms_norm          x [T, H] -> its RMS norm times w
//   add_rms_norm      residual + x (written into residual) and its RMS norm
//   silu_mul          [T, 2I] (gate | up) -> silu(gate) * up [T, I]
//   rope_store        qkv [T, n_q + 2 n_kv, hd]: optional per-head RMS norm of q and k (qwen3),
//                     neox RoPE; q rotated in place, k rotated and v written to the paged cache
//   paged_decode      one query token per sequence over its keys in the paged cache: the
//                     scores, a softmax over them, the weighted values

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#define NEURON_AVX512 1

// The sums of four vectors' lanes: [sum a0, sum a1, sum a2, sum a3].
inline __m128 reduce4(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(a0, a1), _mm512_unpackhi_ps(a0, a1));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(a2, a3), _mm512_unpackhi_ps(a2, a3));
  const __m512d d01 = _mm512_castps_pd(s01), d23 = _mm512_castps_pd(s23);
  const __m512 s = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(d01, d23)),
                                 _mm512_castpd_ps(_mm512_unpackhi_pd(d01, d23)));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s), _mm512_extractf32x8_ps(s, 1));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// e^x for x <= 0 (softmax weights), to a few float32 ulps: 2^(x log2 e) split into an integer
// power (applied by scalef) and 2^f, f in [-0.5, 0.5], by its Taylor polynomial.
inline __m512 exp_nonpositive(__m512 x) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // in [-ln2/2, ln2/2]
  __m512 p = _mm512_set1_ps(1.0f / 5040);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 720));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

#endif

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = y * c + x * w
inline void scale_add(float* y, float c, const float* x, float w, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 vc = _mm512_set1_ps(c), vw = _mm512_set1_ps(w);
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(_mm512_loadu_ps(x + i), vw, _mm512_mul_ps(_mm512_loadu_ps(y + i), vc)));
#endif
  for (; i < n; ++i) y[i] = y[i] * c + x[i] * w;
}

// out[j] = scale * (q . k[j]) for C keys; four keys reduced together where hd allows.
inline void scores(const float* q, const float* const* k, int64_t C, int64_t hd, float scale, float* out) {
  int64_t j = 0;
#if defined(NEURON_AVX512)
  if (hd % 16 == 0) {
    for (; j + 4 <= C; j += 4) {
      __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < hd; d += 16) {
        const __m512 qd = _mm512_loadu_ps(q + d);
        a0 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k[j] + d), a0);
        a1 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k[j + 1] + d), a1);
        a2 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k[j + 2] + d), a2);
        a3 = _mm512_fmadd_ps(qd, _mm512_loadu_ps(k[j + 3] + d), a3);
      }
      _mm_storeu_ps(out + j, _mm_mul_ps(reduce4(a0, a1, a2, a3), _mm_set1_ps(scale)));
    }
  }
#endif
  for (; j < C; ++j) out[j] = dot(q, k[j], hd) * scale;
}

// out = scale * sum_j p[j] v[j] (acc: hd floats of scratch), 64 dimensions at a time in registers.
inline void weighted_sum(const float* p, const float* const* v, int64_t C, int64_t hd, float scale, float* acc,
                         float* out) {
  int64_t d0 = 0;
#if defined(NEURON_AVX512)
  for (; d0 + 64 <= hd; d0 += 64) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t j = 0; j < C; ++j) {
      const __m512 w = _mm512_set1_ps(p[j]);
      const float* vj = v[j] + d0;
      a0 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj), a0);
      a1 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 16), a1);
      a2 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 32), a2);
      a3 = _mm512_fmadd_ps(w, _mm512_loadu_ps(vj + 48), a3);
    }
    const __m512 sc = _mm512_set1_ps(scale);
    _mm512_storeu_ps(out + d0, _mm512_mul_ps(a0, sc));
    _mm512_storeu_ps(out + d0 + 16, _mm512_mul_ps(a1, sc));
    _mm512_storeu_ps(out + d0 + 32, _mm512_mul_ps(a2, sc));
    _mm512_storeu_ps(out + d0 + 48, _mm512_mul_ps(a3, sc));
  }
#endif
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
  float total = 0;
#if defined(NEURON_AVX512)
  __m512 sum = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(m);
  for (; j + 16 <= C; j += 16) {
    const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(p + j), vm));
    _mm512_storeu_ps(p + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#endif
  for (; j < C; ++j) {
    p[j] = std::exp(p[j] - m);
    total += p[j];
  }
  return total;
}

inline float inv_rms(const float* x, int64_t n, double eps) {
  return 1.0f / std::sqrt(dot(x, x, n) / static_cast<float>(n) + static_cast<float>(eps));
}

inline void scaled(float* out, const float* x, const float* w, float r, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

// Rows in parallel once there are enough of them to pay for waking the threads.
template <typename F>
void rows(int64_t T, int64_t width, F f) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(width, 1));
  at::parallel_for(0, T, grain, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) f(t);
  });
}

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32 && t.device().is_cpu(), name, " must be a float32 CPU tensor");
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_f32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.numel() == x.size(1), "x [T, H], w [H]");
  const int64_t T = x.size(0), H = x.size(1), sx = x.stride(0);
  auto out = torch::empty({T, H}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  rows(T, H, [&](int64_t t) { scaled(op + t * H, xp + t * sx, wp, inv_rms(xp + t * sx, H, eps), H); });
  return out;
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  check_f32(x, "x");
  check_f32(residual, "residual");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
              w.is_contiguous() && w.numel() == x.size(1), "x and residual [T, H] contiguous, w [H]");
  const int64_t T = x.size(0), H = x.size(1);
  auto out = torch::empty({T, H}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *rp = residual.data_ptr<float>(), *op = out.data_ptr<float>();
  rows(T, H, [&](int64_t t) {
    float* r = rp + t * H;
    const float* xr = xp + t * H;
    for (int64_t i = 0; i < H; ++i) r[i] += xr[i];
    scaled(op + t * H, r, wp, inv_rms(r, H, eps), H);
  });
  return {out, residual};
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_f32(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0, "gate_up [T, 2I]");
  const int64_t T = gate_up.size(0), I = gate_up.size(1) / 2, s = gate_up.stride(0);
  auto out = torch::empty({T, I}, gate_up.options());
  const float* gp = gate_up.data_ptr<float>();
  float* op = out.data_ptr<float>();
  rows(T, I, [&](int64_t t) {
    const float *g = gp + t * s, *u = g + I;
    float* o = op + t * I;
    for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  });
  return out;
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
  for (int64_t i = 0; i < half; ++i) {
    const float a = tmp[i], b = tmp[i + half];
    out[i] = a * cos[i] - b * sin[i];
    out[i + half] = b * cos[i + half] + a * sin[i + half];
  }
}

void rope_store(torch::Tensor qkv, int64_t n_q, int64_t n_kv, torch::Tensor positions, torch::Tensor cos,
                torch::Tensor sin, c10::optional<torch::Tensor> q_norm, c10::optional<torch::Tensor> k_norm,
                double eps, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor index) {
  check_f32(qkv, "qkv");
  check_f32(k_cache, "k_cache");
  check_f32(v_cache, "v_cache");
  TORCH_CHECK(qkv.dim() == 3 && qkv.stride(2) == 1 && qkv.stride(1) == qkv.size(2) && qkv.size(1) == n_q + 2 * n_kv,
              "qkv [T, n_q + 2 n_kv, hd], heads contiguous");
  const int64_t T = qkv.size(0), hd = qkv.size(2), sq = qkv.stride(0);
  TORCH_CHECK(hd % 2 == 0 && cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == hd &&
              positions.scalar_type() == torch::kInt64 && index.scalar_type() == torch::kInt64 &&
              positions.numel() == T && index.numel() == T && positions.is_contiguous() && index.is_contiguous(),
              "positions and index int64 [T], cos/sin [L, hd]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(-1) == hd &&
              k_cache.size(-2) == n_kv && v_cache.sizes() == k_cache.sizes(), "caches [..., n_kv, hd] contiguous");
  const bool norm = q_norm.has_value() && q_norm->defined();
  const float* qn = norm ? q_norm->data_ptr<float>() : nullptr;
  const float* kn = norm ? k_norm->data_ptr<float>() : nullptr;
  float* qp = qkv.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const float *cp = cos.data_ptr<float>(), *sp = sin.data_ptr<float>();
  const int64_t *pos = positions.data_ptr<int64_t>(), *at = index.data_ptr<int64_t>();
  const int64_t L = cos.size(0), rows_in_cache = k_cache.numel() / (n_kv * hd);
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(0 <= pos[t] && pos[t] < L && 0 <= at[t] && at[t] < rows_in_cache, "position or cache row out of range");
  rows(T, (n_q + 2 * n_kv) * hd, [&](int64_t t) {
    std::vector<float> tmp(hd);
    float* row = qp + t * sq;
    const float *c = cp + pos[t] * hd, *s = sp + pos[t] * hd;
    for (int64_t h = 0; h < n_q; ++h) norm_rope(row + h * hd, row + h * hd, hd, c, s, qn, eps, tmp.data());
    float* kdst = kc + at[t] * n_kv * hd;
    for (int64_t h = 0; h < n_kv; ++h) norm_rope(row + (n_q + h) * hd, kdst + h * hd, hd, c, s, kn, eps, tmp.data());
    std::copy(row + (n_q + n_kv) * hd, row + (n_q + 2 * n_kv) * hd, vc + at[t] * n_kv * hd);
  });
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor slots, torch::Tensor ctx, torch::Tensor kv_of_q, double scale) {
  check_f32(q, "q");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q [B, n_q, hd]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
              v_cache.sizes() == k_cache.sizes() && k_cache.scalar_type() == torch::kFloat32,
              "caches [blocks, block_size, n_kv, hd] float32 contiguous");
  TORCH_CHECK(tables.scalar_type() == torch::kInt32 && tables.is_contiguous() && tables.dim() == 2,
              "tables int32 [rows, max_blocks]");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && ctx.scalar_type() == torch::kInt64 &&
              kv_of_q.scalar_type() == torch::kInt32 && slots.is_contiguous() && ctx.is_contiguous() &&
              kv_of_q.is_contiguous(), "slots, ctx int64 [B], kv_of_q int32 [n_q]");
  const int64_t B = q.size(0), n_q = q.size(1), hd = q.size(2);
  const int64_t bs = k_cache.size(1), n_kv = k_cache.size(2), blocks = k_cache.size(0);
  const int64_t max_blocks = tables.size(1), table_rows = tables.size(0);
  TORCH_CHECK(k_cache.size(3) == hd && kv_of_q.numel() == n_q && slots.numel() == B && ctx.numel() == B,
              "shapes do not match");
  const int32_t *tp = tables.data_ptr<int32_t>(), *kvq = kv_of_q.data_ptr<int32_t>();
  const int64_t *sl = slots.data_ptr<int64_t>(), *cx = ctx.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(0 <= sl[b] && sl[b] < table_rows && 0 < cx[b] && cx[b] <= max_blocks * bs, "slot or context out of range");
  for (int64_t h = 0; h < n_q; ++h) TORCH_CHECK(0 <= kvq[h] && kvq[h] < n_kv, "kv_of_q out of range");
  auto out = torch::empty({B, n_q, hd}, q.options());
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = q.stride(0), sh = q.stride(1);
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) keys += cx[b];
  // One task per (sequence, query head); a thread takes enough of them to be worth waking.
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 14) / std::max<int64_t>(keys / B * hd, 1));
  at::parallel_for(0, B * n_q, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> acc(hd), p;
    std::vector<const float*> krow, vrow;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / n_q, h = w % n_q, g = kvq[h], C = cx[b];
      const int32_t* table = tp + sl[b] * max_blocks;
      krow.resize(C);
      vrow.resize(C);
      for (int64_t j = 0; j < C; ++j) {
        const int64_t block = table[j / bs];
        TORCH_CHECK(0 <= block && block < blocks, "block table entry out of range");
        const int64_t row = ((block * bs + j % bs) * n_kv + g) * hd;
        krow[j] = kc + row;
        vrow[j] = vc + row;
      }
      // The scores of every key, the softmax weights in their place, then the weighted values.
      p.resize(C);
      scores(qp + b * sb + h * sh, krow.data(), C, hd, static_cast<float>(scale), p.data());
      const float total = softmax_in_place(p.data(), C);
      weighted_sum(p.data(), vrow.data(), C, hd, 1.0f / total, acc.data(), op + (b * n_q + h) * hd);
    }
  });
  return out;
}

}  // namespace

void register_cpu_ops(pybind11::module_& mod) {
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  mod.def("rms_norm", &rms_norm, "RMS norm of x [T, H] times w", NoGil());
  mod.def("add_rms_norm", &add_rms_norm, "residual += x, then its RMS norm: (norm, residual)", NoGil());
  mod.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I]", NoGil());
  mod.def("rope_store", &rope_store, "q/k norm and RoPE; q in place, k and v into the paged cache", NoGil());
  mod.def("paged_decode", &paged_decode, "one query token per sequence over the paged KV cache", NoGil());
}
