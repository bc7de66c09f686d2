// y = x W^T for weights kept packed in groups of 32 along the input dimension, float32
// activations and accumulation, w = s * u + m per group of 32, or per half-group of 16 (the
// K-quants with 16-element sub-blocks), s and m float16 as GGUF files hold them.
//
//   q4: u in 0..15, 16 bytes a group: byte j holds u[j] (low nibble) and u[j + 16] (high nibble),
//       the order of GGUF's Q4_0/Q4_1 blocks.
//   q8: u in 0..255, one byte each.
//
// Each weight group is dequantized once into two 16-lane float registers and multiplied into up
// to four activation rows, so a batch of M rows reads the weights ceil(M / 4) times. Rows of W
// are split over torch's intra-op threads.

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cstdint>

namespace {

constexpr int G = 32;

inline float h2f(uint16_t h) { return _cvtsh_ss(h); }

#if defined(__AVX512F__) && defined(__AVX512BW__)

template <int BITS>
inline void dequant_group(const uint8_t* p, float s0, float m0, float s1, float m1, __m512& lo, __m512& hi) {
  __m128i a, b;
  if constexpr (BITS == 4) {
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    a = _mm_and_si128(raw, _mm_set1_epi8(15));
    b = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
  } else {
    a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
  }
  lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a)), _mm512_set1_ps(s0), _mm512_set1_ps(m0));
  hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)), _mm512_set1_ps(s1), _mm512_set1_ps(m1));
}

template <int BITS, bool HALF, int MT>
void rows_kernel(const float* x, int64_t K, const uint8_t* u, const uint16_t* s, const uint16_t* m,
                 float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int BYTES = BITS * G / 8;
  constexpr int SPG = HALF ? 2 : 1;  // scales per group
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* un = u + n * groups * BYTES;
    const uint16_t* sn = s + n * groups * SPG;
    const uint16_t* mn = m + n * groups * SPG;
    __m512 acc[MT];
    for (int t = 0; t < MT; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 lo, hi;
      const int64_t a = g * SPG, b = a + SPG - 1;
      dequant_group<BITS>(un + g * BYTES, h2f(sn[a]), h2f(mn[a]), h2f(sn[b]), h2f(mn[b]), lo, hi);
      for (int t = 0; t < MT; ++t) {
        const float* xg = x + t * K + g * G;
        acc[t] = _mm512_fmadd_ps(lo, _mm512_loadu_ps(xg), acc[t]);
        acc[t] = _mm512_fmadd_ps(hi, _mm512_loadu_ps(xg + 16), acc[t]);
      }
    }
    for (int t = 0; t < MT; ++t) y[t * N + n] = _mm512_reduce_add_ps(acc[t]);
  }
}

#else

template <int BITS, bool HALF, int MT>
void rows_kernel(const float* x, int64_t K, const uint8_t* u, const uint16_t* s, const uint16_t* m,
                 float* y, int64_t N, int64_t n0, int64_t n1) {
  constexpr int BYTES = BITS * G / 8;
  constexpr int SPG = HALF ? 2 : 1;
  const int64_t groups = K / G;
  for (int64_t n = n0; n < n1; ++n) {
    float acc[MT] = {0};
    for (int64_t g = 0; g < groups; ++g) {
      const uint8_t* p = u + (n * groups + g) * BYTES;
      for (int j = 0; j < G; ++j) {
        const int64_t i = (n * groups + g) * SPG + (HALF && j >= 16 ? 1 : 0);
        float sv = h2f(s[i]), mv = h2f(m[i]);
        int q = BITS == 4 ? (j < 16 ? p[j] & 15 : p[j - 16] >> 4) : p[j];
        float w = q * sv + mv;
        for (int t = 0; t < MT; ++t) acc[t] += w * x[t * K + g * G + j];
      }
    }
    for (int t = 0; t < MT; ++t) y[t * N + n] = acc[t];
  }
}

#endif

template <int BITS, bool HALF>
void run(const float* xp, const uint8_t* up, const uint16_t* sp, const uint16_t* mp, float* yp,
         int64_t M, int64_t K, int64_t N) {
  const int64_t grain = std::max<int64_t>(16, 4096 / std::max<int64_t>(K / 64, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t r = 0; r < M; r += 4) {
      const float* xr = xp + r * K;
      float* yr = yp + r * N;
      switch (std::min<int64_t>(4, M - r)) {
        case 1: rows_kernel<BITS, HALF, 1>(xr, K, up, sp, mp, yr, N, n0, n1); break;
        case 2: rows_kernel<BITS, HALF, 2>(xr, K, up, sp, mp, yr, N, n0, n1); break;
        case 3: rows_kernel<BITS, HALF, 3>(xr, K, up, sp, mp, yr, N, n0, n1); break;
        default: rows_kernel<BITS, HALF, 4>(xr, K, up, sp, mp, yr, N, n0, n1); break;
      }
    }
  });
}

template <int BITS>
torch::Tensor qlinear(torch::Tensor x, torch::Tensor u, torch::Tensor s, torch::Tensor m) {
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2, "x must be float32 [M, K]");
  TORCH_CHECK(u.scalar_type() == torch::kUInt8 && s.scalar_type() == torch::kFloat16 &&
              m.scalar_type() == torch::kFloat16, "u uint8, s and m float16");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = u.size(0);
  const bool half = s.size(1) == 2 * (K / G);  // a scale per 16 values instead of per 32
  TORCH_CHECK(K % G == 0 && u.size(1) * 8 == K * BITS && s.size(0) == N && (half || s.size(1) == K / G) &&
              m.sizes() == s.sizes() && u.is_contiguous() && s.is_contiguous() && m.is_contiguous(),
              "packed weight does not match x");
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* up = u.data_ptr<uint8_t>();
  const uint16_t* sp = reinterpret_cast<const uint16_t*>(s.data_ptr<at::Half>());
  const uint16_t* mp = reinterpret_cast<const uint16_t*>(m.data_ptr<at::Half>());
  float* yp = y.data_ptr<float>();
  if (half) {
    run<BITS, true>(xp, up, sp, mp, yp, M, K, N);
  } else {
    run<BITS, false>(xp, up, sp, mp, yp, M, K, N);
  }
  return y;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("q4_linear", &qlinear<4>, "y = x W^T, W in 4-bit groups of 32 (float32 x)");
  mod.def("q8_linear", &qlinear<8>, "y = x W^T, W in 8-bit groups of 32 (float32 x)");
}
