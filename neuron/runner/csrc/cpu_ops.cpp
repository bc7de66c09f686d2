// The CPU step's small ops, fused (float32): what the CUDA path does with Triton kernels
// (neuron/runner/kernels.py), for the same reason. Unfused, a decode step of a small model spends
// most of its time in ~40 torch ops a layer (a few microseconds of dispatch each, and the paged
// keys gathered into fresh tensors for SDPA) rather than in its matrix products.
//
//   rms_norm          x [T, H] -> its RMS norm times w
//   add_rms_norm      residual + x (written into residual) and its RMS norm
//   silu_mul          [T, 2I] (gate | up) -> silu(gate) * up [T, I]
//   rope_store        qkv [T, n_q + 2 n_kv, hd]: optional per-head RMS norm of q and k (qwen3),
//                     neox RoPE; q rotated in place, k rotated and v written to the paged cache
//   paged_decode      one query token per sequence over its keys in the paged cache (online
//                     softmax), the query heads of one KV head together so its keys are read once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

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
  std::vector<std::vector<int64_t>> heads_of(n_kv);
  for (int64_t h = 0; h < n_q; ++h) heads_of[kvq[h]].push_back(h);
  auto out = torch::empty({B, n_q, hd}, q.options());
  const float *qp = q.data_ptr<float>(), *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t sb = q.stride(0), sh = q.stride(1);
  int64_t keys = 0;
  for (int64_t b = 0; b < B; ++b) keys += cx[b];
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(keys / B * hd * n_q / n_kv, 1));
  at::parallel_for(0, B * n_kv, grain, [&](int64_t w0, int64_t w1) {
    std::vector<float> acc;
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t b = w / n_kv, g = w % n_kv, C = cx[b];
      const std::vector<int64_t>& hs = heads_of[g];
      const int64_t G = static_cast<int64_t>(hs.size());
      if (G == 0) continue;
      acc.assign(G * hd, 0.0f);
      const int32_t* table = tp + sl[b] * max_blocks;
      std::vector<float> m(G, -INFINITY), l(G, 0.0f);
      for (int64_t j = 0; j < C; ++j) {
        const int64_t block = table[j / bs];
        TORCH_CHECK(0 <= block && block < blocks, "block table entry out of range");
        const int64_t row = ((block * bs + j % bs) * n_kv + g) * hd;
        const float *k = kc + row, *v = vc + row;
        for (int64_t i = 0; i < G; ++i) {
          const float s = dot(qp + b * sb + hs[i] * sh, k, hd) * static_cast<float>(scale);
          // online softmax: rescale what is summed so far when the maximum moves
          const float m_new = std::max(m[i], s);
          const float c = std::exp(m[i] - m_new), p = std::exp(s - m_new);
          l[i] = l[i] * c + p;
          scale_add(acc.data() + i * hd, c, v, p, hd);
          m[i] = m_new;
        }
      }
      for (int64_t i = 0; i < G; ++i) {
        float* o = op + (b * n_q + hs[i]) * hd;
        const float inv = 1.0f / l[i];
        for (int64_t d = 0; d < hd; ++d) o[d] = acc[i * hd + d] * inv;
      }
    }
  });
  return out;
}

}  // namespace

void register_cpu_ops(pybind11::module_& mod) {
  mod.def("rms_norm", &rms_norm, "RMS norm of x [T, H] times w");
  mod.def("add_rms_norm", &add_rms_norm, "residual += x, then its RMS norm: (norm, residual)");
  mod.def("silu_mul", &silu_mul, "silu(gate) * up of [T, 2I]");
  mod.def("rope_store", &rope_store, "q/k norm and RoPE; q in place, k and v into the paged cache");
  mod.def("paged_decode", &paged_decode, "one query token per sequence over the paged KV cache");
}
