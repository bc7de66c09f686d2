// The CPU kernels' arithmetic (neuron/kernels/csrc/*.h) checked without Python or torch, for
// one instruction-set level (the build's -DNEURON_ISA_<LEVEL>): every product and fused op
// against a plain double-precision reference on random data, odd shapes included, with one and
// two threads. Built and run by tests/test_cpu_isa.py natively for the levels the machine runs,
// and for Arm under qemu-user. Prints "ok <level> <checks>" and exits 0, or names the first
// failure and exits 1.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "attention.h"
#include "ops.h"
#include "qlinear.h"
#include "sync.h"

namespace {

std::mt19937 rng(20261127);
int checks = 0;

float uniform(float lo, float hi) { return std::uniform_real_distribution<float>(lo, hi)(rng); }

void expect(bool ok, const std::string& what, double err, double tol) {
  ++checks;
  if (!ok) {
    std::printf("FAIL %s: error %.3g > %.3g\n", what.c_str(), err, tol);
    std::exit(1);
  }
}

uint16_t to_half(float f) {  // round to nearest float16 (normal range only: these scales are)
  uint32_t b;
  std::memcpy(&b, &f, 4);
  const uint32_t sign = (b >> 16) & 0x8000u;
  const int32_t exp = static_cast<int32_t>((b >> 23) & 0xff) - 127 + 15;
  uint32_t man = b & 0x7fffffu;
  uint32_t h = sign | (static_cast<uint32_t>(exp) << 10) | (man >> 13);
  if ((man & 0x1fffu) > 0x1000u || ((man & 0x1fffu) == 0x1000u && (h & 1u))) ++h;
  return static_cast<uint16_t>(h);
}

// x as the levels with int8 products take it (qdot.h): d * round(x / d) per group of 32, d =
// max|x| / 127, ties away from zero.
std::vector<float> quantized_rows(const std::vector<float>& x) {
  std::vector<float> out(x.size());
  for (size_t g = 0; g < x.size(); g += 32) {
    float amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[g + j]));
    const float inv = amax > 0 ? 127.0f / amax : 0.0f;
    for (int j = 0; j < 32; ++j) {
      const float v = x[g + j] * inv;
      out[g + j] = (v >= 0 ? std::floor(v + 0.5f) : -std::floor(0.5f - v)) * (amax / 127.0f);
    }
  }
  return out;
}

// y against the double product of x and the weights s * q + m.
void check_product(const std::vector<float>& x, const std::vector<uint8_t>& q, const std::vector<float>& s,
                   const std::vector<float>& m, const std::vector<float>& y, int64_t M, int64_t N, int64_t K,
                   int64_t gs, int64_t ns, const std::string& what) {
  double err = 0, big = 0;
  for (int64_t t = 0; t < M; ++t)
    for (int64_t n = 0; n < N; ++n) {
      double want = 0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t i = n * ns + k / gs;
        want += (static_cast<double>(s[i]) * q[n * K + k] + m[i]) * x[t * K + k];
      }
      err = std::max(err, std::fabs(want - y[t * N + n]));
      big = std::max(big, std::fabs(want));
    }
  expect(err <= 1e-5 * std::max(big, 1.0), what, err, 1e-5 * std::max(big, 1.0));
}

// y = x W^T for W of N x K in `bits` and its scales (plain float16, or super: int8 x float16).
void check_qlinear(int bits, bool super, bool half, int64_t M, int64_t N, int64_t K, int threads) {
  const int64_t gs = half ? 16 : 32, ns = K / gs, per = super ? (half ? 16 : 8) : 1, nd = ns / per;
  const int64_t qmax = bits == 4 ? 15 : 255;
  std::vector<uint8_t> q(N * K);
  for (auto& v : q) v = static_cast<uint8_t>(std::uniform_int_distribution<int64_t>(0, qmax)(rng));
  std::vector<float> s(N * ns), m(N * ns), x(M * K), y(M * N);
  std::vector<uint16_t> s16(N * ns), m16(N * ns), d16(N * nd), dm16(N * nd);
  std::vector<int8_t> sc(N * ns), mn(N * ns);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < ns; ++j) {
      if (super) {
        if (j % per == 0) {
          d16[n * nd + j / per] = to_half(uniform(0.001f, 0.004f));
          dm16[n * nd + j / per] = to_half(uniform(0.001f, 0.004f));
        }
        sc[n * ns + j] = static_cast<int8_t>(std::uniform_int_distribution<int>(-63, 63)(rng));
        mn[n * ns + j] = static_cast<int8_t>(std::uniform_int_distribution<int>(-63, 63)(rng));
        s[n * ns + j] = simd::half_to_float(d16[n * nd + j / per]) * sc[n * ns + j];
        m[n * ns + j] = simd::half_to_float(dm16[n * nd + j / per]) * mn[n * ns + j];
      } else {
        s16[n * ns + j] = to_half(uniform(0.01f, 0.1f) / (bits == 4 ? 1 : 16));
        m16[n * ns + j] = to_half(uniform(-0.5f, 0.5f));
        s[n * ns + j] = simd::half_to_float(s16[n * ns + j]);
        m[n * ns + j] = simd::half_to_float(m16[n * ns + j]);
      }
    }
  for (auto& v : x) v = uniform(-1.0f, 1.0f);
  // The packed bytes: 4-bit groups of 32, byte j holding element j (low) and j + 16 (high).
  std::vector<uint8_t> u(bits == 4 ? N * K / 2 : N * K);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < K / 32; ++g)
      for (int j = 0; j < 32; ++j) {
        const uint8_t v = q[n * K + g * 32 + j];
        if (bits == 8) {
          u[n * K + g * 32 + j] = v;
        } else if (j < 16) {
          u[(n * K + g * 32) / 2 + j] = v;
        } else {
          u[(n * K + g * 32) / 2 + j - 16] |= static_cast<uint8_t>(v << 4);
        }
      }
  kernels::Scales scales;
  scales.ns = ns;
  if (super) {
    scales.sc = sc.data();
    scales.mn = mn.data();
    scales.d = d16.data();
    scales.dm = dm16.data();
    scales.nd = nd;
  } else {
    scales.s16 = s16.data();
    scales.m16 = m16.data();
  }
  for (bool int8 : {false, true}) {
    if (int8 && !kernels::int8::AVAILABLE) continue;
    if (bits == 4) {
      kernels::qlinear<4>(x.data(), u.data(), scales, y.data(), M, K, N, threads, int8);
    } else {
      kernels::qlinear<8>(x.data(), u.data(), scales, y.data(), M, K, N, threads, int8);
    }
    check_product(int8 ? quantized_rows(x) : x, q, s, m, y, M, N, K, gs, ns,
                  "qlinear bits " + std::to_string(bits) + (super ? " super" : " plain") + (half ? " half" : "") +
                      (int8 ? " int8" : "") + " M " + std::to_string(M) + " N " + std::to_string(N) + " K " +
                      std::to_string(K) + " threads " + std::to_string(threads));
  }
  // Rows n0..n1 of W dequantized (the GEMM path of many rows): each s * q + m, to float rounding.
  const int64_t n0 = N / 3, n1 = N - N / 4;
  std::vector<float> w((n1 - n0) * K);
  if (bits == 4) {
    kernels::dequant<4>(u.data(), scales, K, n0, n1, w.data(), threads);
  } else {
    kernels::dequant<8>(u.data(), scales, K, n0, n1, w.data(), threads);
  }
  double err = 0, big = 0;
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t i = n * ns + k / gs;
      const double want = static_cast<double>(s[i]) * q[n * K + k] + m[i];
      err = std::max(err, std::fabs(want - w[(n - n0) * K + k]));
      big = std::max(big, std::fabs(want));
    }
  expect(err <= 1e-6 * std::max(big, 1.0), "dequant bits " + std::to_string(bits) + " rows " +
         std::to_string(n0) + ".." + std::to_string(n1) + " K " + std::to_string(K), err, 1e-6 * std::max(big, 1.0));
}

void check_norms(int64_t T, int64_t H, int threads) {
  std::vector<float> x(T * H), r(T * H), w(H), out(T * H), r2(T * H);
  for (auto& v : x) v = uniform(-2, 2);
  for (auto& v : r) v = uniform(-2, 2);
  for (auto& v : w) v = uniform(-2, 2);
  r2 = r;
  kernels::rms_norm(x.data(), H, w.data(), out.data(), T, H, 1e-5, threads);
  double err = 0;
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) ss += static_cast<double>(x[t * H + i]) * x[t * H + i];
    const double inv = 1.0 / std::sqrt(ss / H + 1e-5);
    for (int64_t i = 0; i < H; ++i) err = std::max(err, std::fabs(w[i] * x[t * H + i] * inv - out[t * H + i]));
  }
  expect(err < 1e-5, "rms_norm", err, 1e-5);
  kernels::add_rms_norm(x.data(), r2.data(), w.data(), out.data(), T, H, 1e-5, threads);
  err = 0;
  for (int64_t t = 0; t < T; ++t) {
    double ss = 0;
    for (int64_t i = 0; i < H; ++i) {
      const double v = static_cast<double>(x[t * H + i]) + r[t * H + i];
      err = std::max(err, std::fabs(v - r2[t * H + i]));
      ss += v * v;
    }
    const double inv = 1.0 / std::sqrt(ss / H + 1e-5);
    for (int64_t i = 0; i < H; ++i)
      err = std::max(err, std::fabs(w[i] * (static_cast<double>(x[t * H + i]) + r[t * H + i]) * inv - out[t * H + i]));
  }
  expect(err < 2e-5, "add_rms_norm", err, 2e-5);
  std::vector<float> gu(T * 2 * H), o(T * H);
  for (auto& v : gu) v = uniform(-20, 20);
  kernels::silu_mul(gu.data(), 2 * H, o.data(), T, H, threads);
  err = 0;
  for (int64_t t = 0; t < T; ++t)
    for (int64_t i = 0; i < H; ++i) {
      const double g = gu[t * 2 * H + i], u = gu[t * 2 * H + H + i];
      const double want = g / (1 + std::exp(-g)) * u;
      err = std::max(err, std::fabs(want - o[t * H + i]) / std::max(1.0, std::fabs(want)));
    }
  expect(err < 1e-6, "silu_mul", err, 1e-6);
}

void check_rope_store(int64_t n_q, int64_t n_kv, int64_t hd, bool norm, int threads) {
  const int64_t T = 5, L = 64, rows = 40, width = (n_q + 2 * n_kv) * hd;
  std::vector<float> qkv(T * width), cos(L * hd), sin(L * hd), qn(hd), kn(hd), kc(rows * n_kv * hd, 0.0f),
      vc(rows * n_kv * hd, 0.0f);
  for (auto& v : qkv) v = uniform(-1, 1);
  for (int64_t p = 0; p < L; ++p)
    for (int64_t i = 0; i < hd; ++i) {
      const double a = p * std::pow(10000.0, -2.0 * (i % (hd / 2)) / hd);
      cos[p * hd + i] = static_cast<float>(std::cos(a));
      sin[p * hd + i] = static_cast<float>(std::sin(a));
    }
  for (auto& v : qn) v = uniform(0.5, 1.5);
  for (auto& v : kn) v = uniform(0.5, 1.5);
  std::vector<int64_t> pos = {0, 7, 63, 12, 30}, index = {3, 39, 0, 17, 22};
  const std::vector<float> before = qkv;
  kernels::RopeStore a{qkv.data(), T, width, n_q, n_kv, hd, pos.data(), cos.data(), sin.data(), L,
                       norm ? qn.data() : nullptr, norm ? kn.data() : nullptr, 1e-6, kc.data(), vc.data(), rows,
                       index.data()};
  expect(kernels::rope_store(a, threads) == nullptr, "rope_store ran", 0, 0);
  double err = 0;
  auto head = [&](const float* x, const float* nw, int64_t p, std::vector<double>& out) {
    std::vector<double> t(hd);
    double ss = 0;
    for (int64_t i = 0; i < hd; ++i) ss += static_cast<double>(x[i]) * x[i];
    const double inv = nw ? 1.0 / std::sqrt(ss / hd + 1e-6) : 1.0;
    for (int64_t i = 0; i < hd; ++i) t[i] = nw ? nw[i] * (x[i] * inv) : x[i];
    out.resize(hd);
    for (int64_t i = 0; i < hd / 2; ++i) {
      out[i] = t[i] * cos[p * hd + i] - t[i + hd / 2] * sin[p * hd + i];
      out[i + hd / 2] = t[i + hd / 2] * cos[p * hd + i + hd / 2] + t[i] * sin[p * hd + i + hd / 2];
    }
  };
  std::vector<double> want;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = before.data() + t * width;
    for (int64_t h = 0; h < n_q; ++h) {
      head(row + h * hd, norm ? qn.data() : nullptr, pos[t], want);
      for (int64_t i = 0; i < hd; ++i) err = std::max(err, std::fabs(want[i] - qkv[t * width + h * hd + i]));
    }
    for (int64_t h = 0; h < n_kv; ++h) {
      head(row + (n_q + h) * hd, norm ? kn.data() : nullptr, pos[t], want);
      for (int64_t i = 0; i < hd; ++i) {
        err = std::max(err, std::fabs(want[i] - kc[(index[t] * n_kv + h) * hd + i]));
        err = std::max(err, std::fabs(static_cast<double>(row[(n_q + n_kv + h) * hd + i]) -
                                      vc[(index[t] * n_kv + h) * hd + i]));
      }
    }
  }
  expect(err < 1e-5, "rope_store", err, 1e-5);
  pos[2] = L;  // out of range: refused, nothing written
  expect(kernels::rope_store(a, threads) != nullptr, "rope_store refuses a position past the table", 0, 0);
}

// Random caches, queries and block tables for the attention checks, and paged_decode's
// arguments over them.
struct AttentionCase {
  int64_t n_q, n_kv, hd, bs, blocks, max_blocks, table_rows, B;
  std::vector<float> kc, vc, q, out;
  std::vector<int32_t> tables, kv_of_q;
  double scale;

  AttentionCase(int64_t n_q_, int64_t n_kv_, int64_t hd_, int64_t bs_, int64_t max_blocks_, int64_t table_rows_,
                int64_t B_)
      : n_q(n_q_), n_kv(n_kv_), hd(hd_), bs(bs_), blocks(24), max_blocks(max_blocks_), table_rows(table_rows_), B(B_),
        kc(blocks * bs * n_kv * hd), vc(kc.size()), q(B * n_q * hd), out(B * n_q * hd),
        tables(table_rows * max_blocks), kv_of_q(n_q), scale(1.0 / std::sqrt(static_cast<double>(hd))) {
    for (auto& v : kc) v = uniform(-1, 1);
    for (auto& v : vc) v = uniform(-1, 1);
    for (auto& v : q) v = uniform(-1, 1);
    for (auto& v : tables) v = std::uniform_int_distribution<int32_t>(0, static_cast<int32_t>(blocks) - 1)(rng);
    for (int64_t h = 0; h < n_q; ++h) kv_of_q[h] = static_cast<int32_t>(h * n_kv / n_q);
  }

  kernels::PagedDecode args(const int64_t* slots, const int64_t* ctx) {
    return {q.data(), B, n_q, hd, n_q * hd, hd, kc.data(), vc.data(), blocks, bs, n_kv, tables.data(),
            table_rows, max_blocks, slots, ctx, kv_of_q.data(), scale, out.data()};
  }
};

void check_paged_decode(int64_t n_q, int64_t n_kv, int64_t hd, int64_t bs, int threads) {
  AttentionCase c(n_q, n_kv, hd, bs, 8, 4, 3);
  const std::vector<int64_t> slots = {2, 0, 3}, ctx = {1, 5, c.max_blocks * bs - 1};
  kernels::PagedDecode a = c.args(slots.data(), ctx.data());
  expect(kernels::paged_decode(a, threads) == nullptr, "paged_decode ran", 0, 0);
  double err = 0;
  for (int64_t b = 0; b < c.B; ++b)
    for (int64_t h = 0; h < n_q; ++h) {
      std::vector<double> p(ctx[b]);
      double mx = -1e300, total = 0;
      auto row = [&](int64_t j) {
        return ((c.tables[slots[b] * c.max_blocks + j / bs] * bs + j % bs) * n_kv + c.kv_of_q[h]) * hd;
      };
      for (int64_t j = 0; j < ctx[b]; ++j) {
        double s = 0;
        for (int64_t d = 0; d < hd; ++d) s += static_cast<double>(c.q[(b * n_q + h) * hd + d]) * c.kc[row(j) + d];
        p[j] = s * c.scale;
        mx = std::max(mx, p[j]);
      }
      for (auto& v : p) total += (v = std::exp(v - mx));
      for (int64_t d = 0; d < hd; ++d) {
        double want = 0;
        for (int64_t j = 0; j < ctx[b]; ++j) want += p[j] * c.vc[row(j) + d];
        err = std::max(err, std::fabs(want / total - c.out[(b * n_q + h) * hd + d]));
      }
    }
  expect(err < 1e-5, "paged_decode n_q " + std::to_string(n_q) + " n_kv " + std::to_string(n_kv) + " hd " +
                         std::to_string(hd), err, 1e-5);
  c.tables[0] = static_cast<int32_t>(c.blocks);  // slot 0's first block: past the cache
  expect(kernels::paged_decode(a, threads) != nullptr, "paged_decode refuses a block past the cache", 0, 0);
}

// Rows of one slot whose contexts grow by one (a prompt's chunk) beside a decode: each row the
// same bits as that row alone.
void check_runs_alone(int64_t n_q, int64_t n_kv, int64_t hd, int threads) {
  AttentionCase c(n_q, n_kv, hd, 16, 12, 2, 47);
  std::vector<int64_t> slots(c.B), ctx(c.B);
  // Row 0 a decode of slot 1, then a run of slot 0 from context 99: four rows' tile then sums some
  // keys in a group of four that the row alone sums one by one.
  for (int64_t b = 0; b < c.B; ++b) {
    slots[b] = b == 0 ? 1 : 0;
    ctx[b] = b == 0 ? 30 : 98 + b;
  }
  const kernels::PagedDecode a = c.args(slots.data(), ctx.data());
  expect(kernels::paged_decode(a, threads) == nullptr, "paged_decode ran", 0, 0);
  std::vector<float> one(n_q * hd);
  int64_t differ = 0;
  for (int64_t b = 0; b < c.B; ++b) {
    kernels::PagedDecode alone = a;
    alone.q = c.q.data() + b * n_q * hd;
    alone.B = 1;
    alone.slots = slots.data() + b;
    alone.ctx = ctx.data() + b;
    alone.out = one.data();
    kernels::paged_decode(alone, threads);
    differ += std::memcmp(one.data(), c.out.data() + b * n_q * hd, one.size() * sizeof(float)) != 0;
  }
  expect(differ == 0, "paged_decode's rows of a run equal each row alone, hd " + std::to_string(hd),
         static_cast<double>(differ), 0);
}

// The host collectives' meeting point: publishes the round, returns once every counter has it,
// gives up by its deadline when one never does, refuses a bad rank.
void check_sync() {
  alignas(64) int64_t counters[3 * 8] = {};
  char* c = reinterpret_cast<char*>(counters);
  counters[8] = 5;
  counters[16] = 7;
  expect(kernels::arrive_and_wait(c, 0, 3, 5, 1000) == nullptr && counters[0] == 5, "arrive_and_wait meets", 0, 0);
  expect(kernels::arrive_and_wait(c, 0, 3, 6, 50) != nullptr && counters[0] == 6, "arrive_and_wait gives up", 0, 0);
  expect(kernels::arrive_and_wait(c, 3, 3, 1, 10) != nullptr, "arrive_and_wait refuses a bad rank", 0, 0);
}

}  // namespace

int main() {
  check_sync();
  for (int threads : {1, 2}) {
    for (int bits : {4, 8})
      for (bool super : {false, true})
        for (bool half : {false, true})
          for (int64_t M : {1, 2, 3, 7, 8, 9, 17, 64})  // a super-block is 256 values
            check_qlinear(bits, super, half, M, 37, super ? 256 : 96, threads);
    check_qlinear(4, false, false, 1, 1, 32, threads);
    check_qlinear(4, false, true, 9, 130, 544, threads);
    check_qlinear(8, true, true, 5, 130, 512, threads);
    check_qlinear(4, false, false, 9, 37, 1536, threads);  // rows of x past the L1: two rows of W at a time
    check_qlinear(8, true, true, 8, 37, 1536, threads);
    check_norms(3, 576, threads);
    check_norms(300, 40, threads);
    for (bool norm : {false, true}) {
      check_rope_store(9, 3, 64, norm, threads);
      check_rope_store(5, 2, 24, norm, threads);
    }
    check_paged_decode(9, 3, 64, 16, threads);
    check_paged_decode(5, 2, 24, 8, threads);
    check_paged_decode(4, 4, 16, 16, threads);
    check_runs_alone(9, 3, 64, threads);
    check_runs_alone(4, 2, 128, threads);
    check_runs_alone(4, 2, 24, threads);
  }
  std::printf("ok %s %d\n", simd::NAME, checks);
  return 0;
}
