// y = x W^T for a 4-bit packed W (packed_linear.PackedLinear's layout: row n of W holds K/32
// groups of 16 bytes, byte j of a group element j in its low nibble and j + 16 in its high one;
// each group's scale and offset one word of `words`: two float16 in 32 bits, or two float32 in 64)
// and 16-bit x of up to 8 * MT rows, on the tensor cores (mma.sync m16n8k16, float32 sums).
//
// The product is taken transposed, y^T = W x^T: a tile of 16 rows of W is the MMA's first
// operand, the rows of x its 8-wide second one, so 8 rows of x waste nothing. A thread of a warp
// (row r = lane / 4, quarter c = lane % 4) reads, for each of its rows of W, one group whole (16
// bytes: group 4 * chunk + c of the chunk of 128 columns), and the MMA's positions along K are
// mapped to that group's elements (the sum over K does not care in which order): positions 2c,
// 2c + 1, 2c + 8, 2c + 9 of a K step are elements j, j + 2, j + 1, j + 3 of the group (j = 4i for
// word i, steps 2i) or those plus 16 (steps 2i + 1), which a word of the group holds as its low or
// high nibbles. So W goes from memory to registers in 16-byte loads, in its own layout, with no
// shared memory; x is read in that order too (a byte permutation of two words).
//
// Each weight is the exact s q + m rounded once to x's type, as packed_gemm._asm computes it: a
// nibble OR-ed into the mantissa of `magic` is magic + q exactly, an FMA takes magic + c off
// (d = q - c, exact) and one more rounds d s + r once (r = m + c s; with SPLIT, a scale the type
// does not hold is s_hi + s_lo and d s_lo + r is exact first).
//
// K is split over gridDim.y parts; each part leaves its float32 sums in `part`, and the last part
// of a tile to finish (counted in `locks`, zero between launches) adds them in a fixed order.

template <bool B, class T, class F> struct Pick { typedef T type; };
template <class T, class F> struct Pick<false, T, F> { typedef F type; };

typedef unsigned int u32;
typedef unsigned long long u64;

struct Ops { u32 negc, s_hi, s_lo, r; };

__device__ __forceinline__ void ld16(const void* p, u32& a, u32& b, u32& c, u32& d) {
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

__device__ __forceinline__ u64 ld_word(const void* words, long i, bool wide) {
  if (wide) {
    u64 v;
    asm("ld.global.nc.u64 %0, [%1];" : "=l"(v) : "l"((const u64*)words + i));
    return v;
  }
  u32 v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"((const u32*)words + i));
  return v;
}

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}

template <bool F16> __device__ __forceinline__ u32 twice(float v) {
  u32 d;
  if (F16) asm("cvt.rn.f16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(v));
  else asm("cvt.rn.bf16x2.f32 %0, %1, %1;" : "=r"(d) : "f"(v));
  return d;
}

template <bool F16> __device__ __forceinline__ float rounded(float v) {
  u32 d = twice<F16>(v);
  if (F16) {
    float f;
    asm("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, %1; cvt.f32.f16 %0, lo; }" : "=f"(f) : "r"(d));
    return f;
  }
  return __int_as_float(d << 16);
}

__device__ __forceinline__ float half_at(u32 w, int shift) {
  float f;
  unsigned short h = (unsigned short)(w >> shift);
  asm("{ .reg .b16 t; mov.b16 t, %1; cvt.f32.f16 %0, t; }" : "=f"(f) : "h"(h));
  return f;
}

// A group's operands from its word (packed_gemm.group_operands, the same arithmetic).
template <bool F16> __device__ __forceinline__ Ops operands(u64 word, bool wide) {
  float s, m, c;
  if (wide) {
    s = __int_as_float((int)(u32)word);
    m = __int_as_float((int)(u32)(word >> 32));
    float safe = s == 0.f ? 1.f : s, ratio;
    asm("div.full.f32 %0, %1, %2;" : "=f"(ratio) : "f"(-m), "f"(safe));
    c = s == 0.f ? 0.f : fminf(fmaxf(floorf(ratio + 0.5f), -112.f), 112.f);
  } else {
    s = half_at((u32)word, 0);
    m = half_at((u32)word, 16);
    c = 8.f;
  }
  const float magic = F16 ? 1024.f : 128.f;
  float r = __fmaf_rn(c, s, m);
  float s_hi = rounded<F16>(s);
  Ops o;
  o.negc = twice<F16>(-(magic + c));
  o.s_hi = twice<F16>(s_hi);
  o.s_lo = twice<F16>(s - s_hi);
  o.r = twice<F16>(r);
  return o;
}

template <bool F16> __device__ __forceinline__ u32 fma2(u32 a, u32 b, u32 c) {
  u32 d;
  if (F16) asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  else asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

// Two nibbles (bits 0-3 and 16-19 of `bits`) as two weights.
template <bool F16, bool SPLIT> __device__ __forceinline__ u32 weights(u32 bits, const Ops& o) {
  const u32 magic = F16 ? 0x64006400u : 0x43004300u, one = F16 ? 0x3C003C00u : 0x3F803F80u;
  u32 v;
  asm("lop3.b32 %0, %1, 0x000F000F, %2, 0xEA;" : "=r"(v) : "r"(bits), "r"(magic));
  u32 d = fma2<F16>(v, one, o.negc);
  if (SPLIT) return fma2<F16>(d, o.s_hi, fma2<F16>(d, o.s_lo, o.r));
  return fma2<F16>(d, o.s_hi, o.r);
}

template <bool F16> __device__ __forceinline__ void mma(float* acc, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
  if (F16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ void ld16_x(const void* p, u32& a, u32& b, u32& c, u32& d) {
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(p));
}

template <int AT, int MT, bool WIDE> struct Chunk {
  u32 w[AT][2][4];                                // rows r and r + 8 of each tile: the thread's group
  typename Pick<WIDE, u64, u32>::type s[AT][2];  // their words
  u32 x[MT][16];                                  // row 8 t + r of x at the group's 32 columns
};

template <int AT, int MT, bool WIDE>
__device__ __forceinline__ void fetch(Chunk<AT, MT, WIDE>& ck, const unsigned char* const (&wrow)[AT][2],
                                      const long (&wat)[AT][2], const void* words, int gshift,
                                      const unsigned short* const (&xrow)[MT], int ch, int c) {
  const int g = ch * 4 + c;
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      ld16(wrow[a][h] + (long)ch * 64, ck.w[a][h][0], ck.w[a][h][1], ck.w[a][h][2], ck.w[a][h][3]);
      ck.s[a][h] = ld_word(words, wat[a][h] + (g >> gshift), WIDE);
    }
#pragma unroll
  for (int t = 0; t < MT; ++t)
#pragma unroll
    for (int q = 0; q < 4; ++q)
      ld16_x(xrow[t] + (long)ch * 128 + 8 * q, ck.x[t][4 * q], ck.x[t][4 * q + 1], ck.x[t][4 * q + 2], ck.x[t][4 * q + 3]);
}

template <int AT, int MT, bool F16, bool SPLIT, bool WIDE>
__device__ __forceinline__ void multiply(float (&acc)[AT][MT][4], const Chunk<AT, MT, WIDE>& ck, const bool (&xok)[MT]) {
  Ops ops[AT][2];
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h) ops[a][h] = operands<F16>(ck.s[a][h], WIDE);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    u32 b[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t) {  // elements 4i .. 4i + 3 and 4i + 16 .. 4i + 19 (zero past x's last row)
      const u32 lo = xok[t] ? ck.x[t][2 * i] : 0u, hi = xok[t] ? ck.x[t][2 * i + 1] : 0u;
      const u32 lo2 = xok[t] ? ck.x[t][8 + 2 * i] : 0u, hi2 = xok[t] ? ck.x[t][9 + 2 * i] : 0u;
      b[t][0] = prmt(lo, hi, 0x5410);
      b[t][1] = prmt(lo, hi, 0x7632);
      b[t][2] = prmt(lo2, hi2, 0x5410);
      b[t][3] = prmt(lo2, hi2, 0x7632);
    }
#pragma unroll
    for (int a = 0; a < AT; ++a) {
      const u32 w0 = ck.w[a][0][i], w1 = ck.w[a][1][i];
      const u32 p0 = weights<F16, SPLIT>(w0, ops[a][0]), q0 = weights<F16, SPLIT>(w1, ops[a][1]);
      const u32 p1 = weights<F16, SPLIT>(w0 >> 8, ops[a][0]), q1 = weights<F16, SPLIT>(w1 >> 8, ops[a][1]);
      const u32 p2 = weights<F16, SPLIT>(w0 >> 4, ops[a][0]), q2 = weights<F16, SPLIT>(w1 >> 4, ops[a][1]);
      const u32 p3 = weights<F16, SPLIT>(w0 >> 12, ops[a][0]), q3 = weights<F16, SPLIT>(w1 >> 12, ops[a][1]);
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        mma<F16>(acc[a][t], p0, q0, p1, q1, b[t][0], b[t][1]);
        mma<F16>(acc[a][t], p2, q2, p3, q3, b[t][2], b[t][3]);
      }
    }
  }
}

template <bool F16> __device__ __forceinline__ void store(void* y, long i, float v, int out_f32) {
  if (out_f32) {
    ((float*)y)[i] = v;
  } else {
    ((unsigned short*)y)[i] = (unsigned short)twice<F16>(v);
  }
}

template <int AT, int MT, int D, int WARPS, int MINB, bool F16, bool SPLIT, bool WIDE>
__global__ void __launch_bounds__(32 * WARPS, MINB) w4mma(const unsigned char* __restrict__ u, long ldu, const void* __restrict__ words,
                                             int ns, int gshift, const unsigned short* __restrict__ x, long ldx,
                                             void* __restrict__ y, int out_f32, float* __restrict__ part, int* __restrict__ locks,
                                             int M, int N, int K, int per_part) {
  const int lane = threadIdx.x & 31, warps = WARPS;
  const int r = lane >> 2, c = lane & 3;
  const int n0 = (blockIdx.x * warps + (threadIdx.x >> 5)) * 16 * AT;
  const int chunks = K >> 7;
  const int ch0 = blockIdx.y * per_part, ch1 = min(ch0 + per_part, chunks);

  const unsigned char* wrow[AT][2];
  long wat[AT][2];
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const long n = min(n0 + 16 * a + 8 * h + r, N - 1);
      wrow[a][h] = u + n * ldu + c * 16;
      wat[a][h] = n * ns;
    }
  const unsigned short* xrow[MT];
  bool xok[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int m = 8 * t + r;
    xok[t] = m < M;
    xrow[t] = x + (long)min(m, M - 1) * ldx + c * 32;
  }

  float acc[AT][MT][4];
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int t = 0; t < MT; ++t) acc[a][t][0] = acc[a][t][1] = acc[a][t][2] = acc[a][t][3] = 0.f;

  if (n0 < N && ch0 < ch1) {
    Chunk<AT, MT, WIDE> buf[D];
#pragma unroll
    for (int d = 0; d + 1 < D; ++d)
      if (ch0 + d < ch1) fetch<AT, MT, WIDE>(buf[d], wrow, wat, words, gshift, xrow, ch0 + d, c);
    for (int ch = ch0; ch < ch1; ch += D) {
#pragma unroll
      for (int d = 0; d < D; ++d) {
        if (ch + d >= ch1) break;
        if (ch + d + D - 1 < ch1) fetch<AT, MT, WIDE>(buf[(d + D - 1) % D], wrow, wat, words, gshift, xrow, ch + d + D - 1, c);
        multiply<AT, MT, F16, SPLIT, WIDE>(acc, buf[d], xok);
      }
    }
  }

  // acc[a][t]: rows n0 + 16a + r (+8 for 2, 3) of W, rows 8t + 2c (+1 for 1, 3) of x
  if (gridDim.y == 1) {
#pragma unroll
    for (int a = 0; a < AT; ++a)
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int n = n0 + 16 * a + r + 8 * (e >> 1), m = 8 * t + 2 * c + (e & 1);
          if (n < N && m < M) store<F16>(y, (long)m * N + n, acc[a][t][e], out_f32);
        }
    return;
  }
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = n0 + 16 * a + r + 8 * (e >> 1), m = 8 * t + 2 * c + (e & 1);
        if (n < N && m < M) part[((long)blockIdx.y * M + m) * N + n] = acc[a][t][e];
      }
  __shared__ int last;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(locks + blockIdx.x, 1) == (int)gridDim.y - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
#pragma unroll
  for (int a = 0; a < AT; ++a)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = n0 + 16 * a + r + 8 * (e >> 1), m = 8 * t + 2 * c + (e & 1);
        if (n < N && m < M) {
          float sum = 0.f;
          for (int p = 0; p < (int)gridDim.y; ++p) sum += __ldcg(part + ((long)p * M + m) * N + n);
          store<F16>(y, (long)m * N + n, sum, out_f32);
        }
      }
  if (threadIdx.x == 0) locks[blockIdx.x] = 0;
}
