// y = x W^T for weights kept packed in groups of 32 along the input dimension, float32
// activations and accumulation: w = s * u + m per group of 32, or per half-group of 16 (the
// K-quants with 16-element sub-blocks).
//
//   u, 4-bit: 16 bytes a group, byte j holds u[j] (low nibble) and u[j + 16] (high nibble), the
//             order of GGUF's Q4_0/Q4_1 blocks; 8-bit: one byte each.
//   s, m:     float16 per scale group, as GGUF files hold them; or, for the K-quants, int8 per
//             scale group times a float16 per super-block (s = d * sc, m = dm * mn), which is
//             exactly how those files build them (float16 x 6-bit fits a float32 exactly).
//
// Each weight group is unpacked once into two 16-lane float registers and multiplied into up to
// eight activation rows, so a batch of M rows reads the weights ceil(M / 8) times; with several
// rows, two rows of W go together so that each load of x feeds four FMAs. Rows of W are split
// over torch's intra-op threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>
#include <vector>

namespace {

constexpr int G = 32;

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

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
#if defined(__AVX512F__)
      for (; i + 16 <= ns; i += 16) {
        _mm512_storeu_ps(sbuf + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sn + i))));
        _mm512_storeu_ps(mbuf + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(mn_ + i))));
      }
#endif
      for (; i < ns; ++i) { sbuf[i] = h2f(sn[i]); mbuf[i] = h2f(mn_[i]); }
      return;
    }
    const int64_t per = ns / nd;
    const int8_t* scn = sc + n * ns;
    const int8_t* mnn = mn + n * ns;
    for (int64_t j = 0; j < nd; ++j) {
      const float dj = h2f(d[n * nd + j]), dmj = h2f(dm[n * nd + j]);
      for (int64_t i = j * per; i < (j + 1) * per; ++i) {
        sbuf[i] = dj * static_cast<float>(scn[i]);
        mbuf[i] = dmj * static_cast<float>(mnn[i]);
      }
    }
  }
};

#if defined(__AVX512F__) && defined(__AVX512BW__)

// The 32 integers of one group as floats (not yet scaled).
template <int BITS>
inline void load_group(const uint8_t* p, __m512& lo, __m512& hi) {
  __m128i a, b;
  if constexpr (BITS == 4) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    a = _mm_and_si128(raw, _mm_set1_epi8(15));
    b = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
  } else {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  }
  lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a));
  hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
}

// sum_k w[n,k] x[t,k] = sum_g s_g (u_g . x_g) + sum_g m_g xsum_g: the integers meet x unscaled,
// one FMA per group applies the scale, and the offsets meet the per-group sums of x at the end.
template <int BITS, bool HALF, int MT>
void rows_kernel(const float* x, const float* xsum, int64_t K, const uint8_t* u, const Scales& scales,
                 float* y, int64_t N, int64_t n0, int64_t n1, float* sbuf) {
  constexpr int BYTES = BITS * G / 8;
  const int64_t groups = K / G, ns = scales.ns;
  float* mbuf = sbuf + ns;
  int64_t n = n0;
  if constexpr (MT > 1) {  // two rows of W at a time: each load of x feeds both
    float* sbuf2 = sbuf + 2 * ns;
    float* mbuf2 = sbuf2 + ns;
    for (; n + 1 < n1; n += 2) {
      const uint8_t* u0 = u + n * groups * BYTES;
      const uint8_t* u1 = u0 + groups * BYTES;
      scales.row(n, sbuf, mbuf);
      scales.row(n + 1, sbuf2, mbuf2);
      __m512 acc0[MT], acc1[MT];
      for (int t = 0; t < MT; ++t) acc0[t] = acc1[t] = _mm512_setzero_ps();
      for (int64_t g = 0; g < groups; ++g) {
        __m512 lo0, hi0, lo1, hi1;
        load_group<BITS>(u0 + g * BYTES, lo0, hi0);
        load_group<BITS>(u1 + g * BYTES, lo1, hi1);
        const int64_t a = HALF ? 2 * g : g, b = HALF ? 2 * g + 1 : g;
        lo0 = _mm512_fmadd_ps(lo0, _mm512_set1_ps(sbuf[a]), _mm512_set1_ps(mbuf[a]));
        hi0 = _mm512_fmadd_ps(hi0, _mm512_set1_ps(sbuf[b]), _mm512_set1_ps(mbuf[b]));
        lo1 = _mm512_fmadd_ps(lo1, _mm512_set1_ps(sbuf2[a]), _mm512_set1_ps(mbuf2[a]));
        hi1 = _mm512_fmadd_ps(hi1, _mm512_set1_ps(sbuf2[b]), _mm512_set1_ps(mbuf2[b]));
        for (int t = 0; t < MT; ++t) {
          const float* xg = x + t * K + g * G;
          const __m512 xl = _mm512_loadu_ps(xg), xh = _mm512_loadu_ps(xg + 16);
          acc0[t] = _mm512_fmadd_ps(hi0, xh, _mm512_fmadd_ps(lo0, xl, acc0[t]));
          acc1[t] = _mm512_fmadd_ps(hi1, xh, _mm512_fmadd_ps(lo1, xl, acc1[t]));
        }
      }
      for (int t = 0; t < MT; ++t) {
        y[t * N + n] = _mm512_reduce_add_ps(acc0[t]);
        y[t * N + n + 1] = _mm512_reduce_add_ps(acc1[t]);
      }
    }
  }
  for (; n < n1; ++n) {
    const uint8_t* un = u + n * groups * BYTES;
    scales.row(n, sbuf, mbuf);
    __m512 acc[MT][2];
    for (int t = 0; t < MT; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
    if constexpr (MT > 1) {  // several rows: dequantize the group once, two FMAs a row
      for (int64_t g = 0; g < groups; ++g) {
        __m512 lo, hi;
        load_group<BITS>(un + g * BYTES, lo, hi);
        const int64_t a = HALF ? 2 * g : g, b = HALF ? 2 * g + 1 : g;
        lo = _mm512_fmadd_ps(lo, _mm512_set1_ps(sbuf[a]), _mm512_set1_ps(mbuf[a]));
        hi = _mm512_fmadd_ps(hi, _mm512_set1_ps(sbuf[b]), _mm512_set1_ps(mbuf[b]));
        for (int t = 0; t < MT; ++t) {
          const float* xg = x + t * K + g * G;
          acc[t][0] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), acc[t][0]);
          acc[t][1] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), acc[t][1]);
        }
      }
      for (int t = 0; t < MT; ++t) y[t * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]));
      continue;
    }
    for (int64_t g = 0; g < groups; ++g) {
      __m512 lo, hi;
      load_group<BITS>(un + g * BYTES, lo, hi);
      for (int t = 0; t < MT; ++t) {
        const float* xg = x + t * K + g * G;
        if constexpr (HALF) {
          acc[t][0] = _mm512_fmadd_ps(_mm512_mul_ps(lo, _mm512_loadu_ps(xg)), _mm512_set1_ps(sbuf[2 * g]), acc[t][0]);
          acc[t][1] = _mm512_fmadd_ps(_mm512_mul_ps(hi, _mm512_loadu_ps(xg + 16)), _mm512_set1_ps(sbuf[2 * g + 1]),
                                      acc[t][1]);
        } else {
          __m512 dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(xg)));
          acc[t][g & 1] = _mm512_fmadd_ps(dot, _mm512_set1_ps(sbuf[g]), acc[t][g & 1]);
        }
      }
    }
    for (int t = 0; t < MT; ++t) {
      const float* xs = xsum + t * ns;
      __m512 off = _mm512_setzero_ps();
      int64_t j = 0;
      for (; j + 16 <= ns; j += 16) off = _mm512_fmadd_ps(_mm512_loadu_ps(mbuf + j), _mm512_loadu_ps(xs + j), off);
      float tail = 0;
      for (; j < ns; ++j) tail += mbuf[j] * xs[j];
      y[t * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[t][0], acc[t][1]), off)) + tail;
    }
  }
}

#else

template <int BITS, bool HALF, int MT>
void rows_kernel(const float* x, const float* xsum, int64_t K, const uint8_t* u, const Scales& scales,
                 float* y, int64_t N, int64_t n0, int64_t n1, float* sbuf) {
  constexpr int BYTES = BITS * G / 8;
  const int64_t groups = K / G;
  float* mbuf = sbuf + scales.ns;
  for (int64_t n = n0; n < n1; ++n) {
    scales.row(n, sbuf, mbuf);
    float acc[MT] = {0};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = u + (n * groups + g) * BYTES;
      for (int j = 0; j < G; ++j) {
        const int64_t i = HALF ? 2 * g + (j >= 16 ? 1 : 0) : g;
        int q = BITS == 4 ? (j < 16 ? p[j] & 15 : p[j - 16] >> 4) : p[j];
        float w = q * sbuf[i] + mbuf[i];
        for (int t = 0; t < MT; ++t) acc[t] += w * x[t * K + g * G + j];
      }
    }
    for (int t = 0; t < MT; ++t) y[t * N + n] = acc[t];
  }
}

#endif

template <int BITS, bool HALF>
void run(const float* xp, const uint8_t* up, const Scales& scales, float* yp, int64_t M, int64_t K, int64_t N) {
  constexpr int GS = HALF ? G / 2 : G;  // values per scale
  const int64_t ns = K / GS;
  std::vector<float> xsum(M * ns);  // per-group sums of x, for the offsets
  for (int64_t t = 0; t < M; ++t)
    for (int64_t j = 0; j < ns; ++j) {
      float a = 0;
      for (int k = 0; k < GS; ++k) a += xp[t * K + j * GS + k];
      xsum[t * ns + j] = a;
    }
  const int64_t grain = std::max<int64_t>(16, 4096 / std::max<int64_t>(K / 64, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    std::vector<float> sbuf(4 * ns + 16);  // scales and offsets of two rows
    for (int64_t r = 0; r < M; r += 8) {
      const float* xr = xp + r * K;
      const float* xs = xsum.data() + r * ns;
      float* yr = yp + r * N;
      switch (std::min<int64_t>(8, M - r)) {
        case 1: rows_kernel<BITS, HALF, 1>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 2: rows_kernel<BITS, HALF, 2>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 3: rows_kernel<BITS, HALF, 3>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 4: rows_kernel<BITS, HALF, 4>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 5: rows_kernel<BITS, HALF, 5>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 6: rows_kernel<BITS, HALF, 6>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        case 7: rows_kernel<BITS, HALF, 7>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
        default: rows_kernel<BITS, HALF, 8>(xr, xs, K, up, scales, yr, N, n0, n1, sbuf.data()); break;
      }
    }
  });
}

// s, m: float16 [N, ns] (d, dm empty), or int8 [N, ns] with d, dm float16 [N, nd]; ns = K/32 or
// K/16 (a scale per half-group).
template <int BITS>
torch::Tensor qlinear(torch::Tensor x, torch::Tensor u, torch::Tensor s, torch::Tensor m, torch::Tensor d,
                      torch::Tensor dm) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = u.size(0);
  const bool super = d.numel() > 0;
  TORCH_CHECK(u.scalar_type() == torch::kUInt8 && u.is_contiguous() && u.size(1) * 8 == K * BITS && K % G == 0,
              "u does not match x");
  TORCH_CHECK(s.scalar_type() == (super ? torch::kInt8 : torch::kFloat16) && m.scalar_type() == s.scalar_type() &&
              s.size(0) == N && m.sizes() == s.sizes() && s.is_contiguous() && m.is_contiguous(),
              "scales do not match u");
  const int64_t ns = s.size(1);
  const bool half = ns == 2 * (K / G);
  TORCH_CHECK(half || ns == K / G, "a scale per 32 or per 16 values");
  Scales scales;
  scales.ns = ns;
  if (super) {
    TORCH_CHECK(d.scalar_type() == torch::kFloat16 && dm.sizes() == d.sizes() && d.size(0) == N &&
                ns % d.size(1) == 0 && d.is_contiguous() && dm.is_contiguous(), "super-block scales do not match");
    scales.sc = s.data_ptr<int8_t>();
    scales.mn = m.data_ptr<int8_t>();
    scales.d = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
    scales.dm = reinterpret_cast<const uint16_t*>(dm.data_ptr<at::Half>());
    scales.nd = d.size(1);
  } else {
    scales.s16 = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
    scales.m16 = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  }
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* up = u.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (half) {
    run<BITS, true>(xp, up, scales, yp, M, K, N);
  } else {
    run<BITS, false>(xp, up, scales, yp, M, K, N);
  }
  return y;
}

}  // namespace

void register_cpu_ops(pybind11::module_& mod);  // neuron/kernels/csrc/cpu_ops.cpp, built with this file

// Every kernel runs without the GIL (as torch's own ops do): a rank's socket loop answers pings
// and sends heartbeats while its device thread is inside one, however long it takes.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  using NoGil = pybind11::call_guard<pybind11::gil_scoped_release>;
  register_cpu_ops(mod);
  mod.def("q4_linear", &qlinear<4>, "y = x W^T, W in 4-bit groups of 32 (float32 x)", NoGil());
  mod.def("q8_linear", &qlinear<8>, "y = x W^T, W in 8-bit groups of 32 (float32 x)", NoGil());
}
