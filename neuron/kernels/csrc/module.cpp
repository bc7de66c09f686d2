// The CPython binding of one instruction-set level of the CPU kernels (qlinear.h, qblock.h, ops.h,
// attention.h, sync.h): each function takes the addresses and sizes of its operands as integers
// (neuron/kernels/cpu.py checks the tensors and passes them) and runs without the GIL, as torch's
// own ops do, so a rank's socket loop answers pings and sends heartbeats while its device thread
// is inside a kernel.
// Built once per level by setup.py (its extension()) as neuron.kernels._cpu_<level>; no torch here.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "attention.h"
#include "ops.h"
#include "qblock.h"
#include "qlinear.h"
#include "sync.h"

#ifndef NEURON_MODULE
#error "NEURON_MODULE (the module's name) must be defined"
#endif
#define NEURON_CAT2(a, b) a##b
#define NEURON_CAT(a, b) NEURON_CAT2(a, b)
#define NEURON_STR2(a) #a
#define NEURON_STR(a) NEURON_STR2(a)

namespace {

// The arguments as integers and floats, in order; false (with a Python error set) if one is not.
struct Args {
  PyObject* const* a;
  Py_ssize_t n;
  bool ok = true;

  bool count(Py_ssize_t want, const char* name) {
    if (n != want) {
      PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, not %zd", name, want, n);
      ok = false;
    }
    return ok;
  }
  int64_t i(Py_ssize_t k) {
    const long long v = PyLong_AsLongLong(a[k]);
    if (v == -1 && PyErr_Occurred()) ok = false;
    return static_cast<int64_t>(v);
  }
  template <typename T>
  T* p(Py_ssize_t k) {
    return reinterpret_cast<T*>(static_cast<uintptr_t>(i(k)));
  }
  double f(Py_ssize_t k) {
    const double v = PyFloat_AsDouble(a[k]);
    if (v == -1.0 && PyErr_Occurred()) ok = false;
    return v;
  }
};

PyObject* done(const char* error) {
  if (error != nullptr) {
    PyErr_SetString(PyExc_RuntimeError, error);
    return nullptr;
  }
  Py_RETURN_NONE;
}

// A packed W's scales from arguments at (s, m, d, dm) and (ns, nd); d == 0 for float16 s, m.
kernels::Scales scales_at(Args& a, Py_ssize_t s, Py_ssize_t ns) {
  kernels::Scales scales;
  scales.ns = a.i(ns);
  scales.nd = a.i(ns + 1);
  if (scales.nd > 0) {
    scales.sc = a.p<const int8_t>(s);
    scales.mn = a.p<const int8_t>(s + 1);
    scales.d = a.p<const uint16_t>(s + 2);
    scales.dm = a.p<const uint16_t>(s + 3);
  } else {
    scales.s16 = a.p<const uint16_t>(s);
    scales.m16 = a.p<const uint16_t>(s + 1);
  }
  return scales;
}

bool fits(int64_t bits, int64_t K, const kernels::Scales& scales) {
  return (bits == 4 || bits == 8) && K % kernels::G == 0 && (scales.ns == K / 32 || scales.ns == K / 16) &&
         (scales.nd == 0 || scales.ns % scales.nd == 0);
}

// qlinear(bits, x, u, s, m, d, dm, y, M, K, N, ns, nd, threads, form): d == 0 for float16 s, m;
// form 0: x in float32, 1: in int8 (qdot.h), 2: in int16 on W in blocks (qblock.h's to_blocks),
// the integer forms where the level has them.
PyObject* qlinear(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(15, "qlinear")) return nullptr;
  const int64_t bits = a.i(0);
  const float* x = a.p<const float>(1);
  const uint8_t* u = a.p<const uint8_t>(2);
  const kernels::Scales scales = scales_at(a, 3, 11);
  float* y = a.p<float>(7);
  const int64_t M = a.i(8), K = a.i(9), N = a.i(10);
  const int threads = static_cast<int>(a.i(13));
  const int64_t form = a.i(14);
  const bool int8 = form == 1;
  if (!a.ok) return nullptr;
  if (!fits(bits, K, scales) || form < 0 || form > 2) return done("qlinear: bits, K, the scale counts and the form do not fit together");
  if (int8 && !kernels::int8::AVAILABLE) return done("qlinear: this level has no int8 products");
  if (form == 2 && (!kernels::blocked::AVAILABLE || N % kernels::blocked::R))
    return done("qlinear: no int16 products here, or N is not a multiple of 16");
  Py_BEGIN_ALLOW_THREADS
  if (form == 2) {
    if (bits == 4) {
      kernels::blocked::qlinear16<4>(x, u, scales, y, M, K, N, threads);
    } else {
      kernels::blocked::qlinear16<8>(x, u, scales, y, M, K, N, threads);
    }
  } else if (bits == 4) {
    kernels::qlinear<4>(x, u, scales, y, M, K, N, threads, int8);
  } else {
    kernels::qlinear<8>(x, u, scales, y, M, K, N, threads, int8);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// dequant(bits, u, s, m, d, dm, out, K, n0, n1, ns, nd, threads): rows n0..n1 of W as float32.
PyObject* dequant(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(13, "dequant")) return nullptr;
  const int64_t bits = a.i(0);
  const uint8_t* u = a.p<const uint8_t>(1);
  const kernels::Scales scales = scales_at(a, 2, 10);
  float* out = a.p<float>(6);
  const int64_t K = a.i(7), n0 = a.i(8), n1 = a.i(9);
  const int threads = static_cast<int>(a.i(12));
  if (!a.ok) return nullptr;
  if (!fits(bits, K, scales) || n0 < 0 || n1 < n0) return done("dequant: bits, K, rows and scales do not fit together");
  Py_BEGIN_ALLOW_THREADS
  if (bits == 4) {
    kernels::dequant<4>(u, scales, K, n0, n1, out, threads);
  } else {
    kernels::dequant<8>(u, scales, K, n0, n1, out, threads);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// to_blocks(bits, u, s, m, d, dm, N, K, ns, nd, u_out, s_out, m_out, d_out, dm_out, threads):
// W's bytes and scales in qblock.h's blocks of 16 rows, into the *_out buffers (same sizes).
PyObject* to_blocks(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(16, "to_blocks")) return nullptr;
  const int64_t bits = a.i(0);
  const uint8_t* u = a.p<const uint8_t>(1);
  const kernels::Scales scales = scales_at(a, 2, 8);
  const int64_t N = a.i(6), K = a.i(7);
  uint8_t* out[5] = {a.p<uint8_t>(10), a.p<uint8_t>(11), a.p<uint8_t>(12), a.p<uint8_t>(13), a.p<uint8_t>(14)};
  const int threads = static_cast<int>(a.i(15));
  if (!a.ok) return nullptr;
  if (!fits(bits, K, scales) || N % kernels::blocked::R) return done("to_blocks: bits, N, K and the scales do not fit together");
  const int64_t ns = scales.ns, nd = scales.nd;
  Py_BEGIN_ALLOW_THREADS
  if (bits == 4) {
    kernels::blocked::to_blocks<4>(u, N, K, out[0], threads);
  } else {
    kernels::blocked::to_blocks<8>(u, N, K, out[0], threads);
  }
  if (nd > 0) {
    kernels::blocked::scales_to_blocks(scales.sc, N, ns, reinterpret_cast<int8_t*>(out[1]), threads);
    kernels::blocked::scales_to_blocks(scales.mn, N, ns, reinterpret_cast<int8_t*>(out[2]), threads);
    kernels::blocked::scales_to_blocks(scales.d, N, nd, reinterpret_cast<uint16_t*>(out[3]), threads);
    kernels::blocked::scales_to_blocks(scales.dm, N, nd, reinterpret_cast<uint16_t*>(out[4]), threads);
  } else {
    kernels::blocked::scales_to_blocks(scales.s16, N, ns, reinterpret_cast<uint16_t*>(out[1]), threads);
    kernels::blocked::scales_to_blocks(scales.m16, N, ns, reinterpret_cast<uint16_t*>(out[2]), threads);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// dequant16(bits, u, s, m, d, dm, out, K, n0, ids, T, ns, nd, threads): rows of a blocked W as
// float32, out [T, K]: ids[t] (int64), or n0 + t where ids is 0.
PyObject* dequant16(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(14, "dequant16")) return nullptr;
  const int64_t bits = a.i(0);
  const uint8_t* u = a.p<const uint8_t>(1);
  const kernels::Scales scales = scales_at(a, 2, 11);
  float* out = a.p<float>(6);
  const int64_t K = a.i(7), n0 = a.i(8);
  const int64_t* ids = a.p<const int64_t>(9);
  const int64_t T = a.i(10);
  const int threads = static_cast<int>(a.i(13));
  if (!a.ok) return nullptr;
  if (!fits(bits, K, scales) || T < 0 || n0 < 0) return done("dequant16: bits, K, rows and scales do not fit together");
  Py_BEGIN_ALLOW_THREADS
  if (bits == 4) {
    kernels::blocked::dequant_rows<4>(u, scales, K, n0, ids, T, out, threads);
  } else {
    kernels::blocked::dequant_rows<8>(u, scales, K, n0, ids, T, out, threads);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// rms_norm(x, sx, w, out, T, H, eps, threads), x's rows sx apart; add_rms_norm(x, residual, w,
// out, T, H, eps, threads), residual += x first.
template <bool ADD>
PyObject* norm(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(8, ADD ? "add_rms_norm" : "rms_norm")) return nullptr;
  const float* x = a.p<const float>(0);
  const int64_t second = a.i(1);  // sx, or the residual's address
  const float* w = a.p<const float>(2);
  float* out = a.p<float>(3);
  const int64_t T = a.i(4), H = a.i(5);
  const double eps = a.f(6);
  const int threads = static_cast<int>(a.i(7));
  if (!a.ok) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  if constexpr (ADD) {
    kernels::add_rms_norm(x, reinterpret_cast<float*>(static_cast<uintptr_t>(second)), w, out, T, H, eps, threads);
  } else {
    kernels::rms_norm(x, second, w, out, T, H, eps, threads);
  }
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// silu_mul(gate_up, s, out, T, I, threads)
PyObject* silu_mul(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(6, "silu_mul")) return nullptr;
  const float* gu = a.p<const float>(0);
  const int64_t s = a.i(1);
  float* out = a.p<float>(2);
  const int64_t T = a.i(3), I = a.i(4);
  const int threads = static_cast<int>(a.i(5));
  if (!a.ok) return nullptr;
  Py_BEGIN_ALLOW_THREADS
  kernels::silu_mul(gu, s, out, T, I, threads);
  Py_END_ALLOW_THREADS
  Py_RETURN_NONE;
}

// rope_store(qkv, T, sq, n_q, n_kv, hd, positions, cos, sin, L, q_norm, k_norm, eps, k_cache,
//            v_cache, rows_in_cache, index, threads)
PyObject* rope_store(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(18, "rope_store")) return nullptr;
  kernels::RopeStore r{a.p<float>(0), a.i(1), a.i(2), a.i(3), a.i(4), a.i(5), a.p<const int64_t>(6),
                       a.p<const float>(7), a.p<const float>(8), a.i(9), a.p<const float>(10),
                       a.p<const float>(11), a.f(12), a.p<float>(13), a.p<float>(14), a.i(15),
                       a.p<const int64_t>(16)};
  const int threads = static_cast<int>(a.i(17));
  if (!a.ok) return nullptr;
  const char* error;
  Py_BEGIN_ALLOW_THREADS
  error = kernels::rope_store(r, threads);
  Py_END_ALLOW_THREADS
  return done(error);
}

// paged_decode(q, B, n_q, hd, sb, sh, k_cache, v_cache, blocks, bs, n_kv, tables, table_rows,
//              max_blocks, slots, ctx, kv_of_q, scale, out, threads)
PyObject* paged_decode(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(20, "paged_decode")) return nullptr;
  kernels::PagedDecode d{a.p<const float>(0), a.i(1), a.i(2), a.i(3), a.i(4), a.i(5), a.p<const float>(6),
                         a.p<const float>(7), a.i(8), a.i(9), a.i(10), a.p<const int32_t>(11), a.i(12), a.i(13),
                         a.p<const int64_t>(14), a.p<const int64_t>(15), a.p<const int32_t>(16), a.f(17),
                         a.p<float>(18)};
  const int threads = static_cast<int>(a.i(19));
  if (!a.ok) return nullptr;
  const char* error;
  Py_BEGIN_ALLOW_THREADS
  error = kernels::paged_decode(d, threads);
  Py_END_ALLOW_THREADS
  return done(error);
}

// arrive_and_wait(counters, rank, world, round, timeout_ms)
PyObject* arrive_and_wait(PyObject*, PyObject* const* args, Py_ssize_t n) {
  Args a{args, n};
  if (!a.count(5, "arrive_and_wait")) return nullptr;
  char* counters = a.p<char>(0);
  const int64_t rank = a.i(1), world = a.i(2), round = a.i(3), timeout_ms = a.i(4);
  if (!a.ok) return nullptr;
  const char* error;
  Py_BEGIN_ALLOW_THREADS
  error = kernels::arrive_and_wait(counters, rank, world, round, timeout_ms);
  Py_END_ALLOW_THREADS
  return done(error);
}

PyMethodDef methods[] = {
    {"qlinear", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(qlinear)), METH_FASTCALL,
     "y = x W^T, W packed in groups of 32"},
    {"dequant", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(dequant)), METH_FASTCALL,
     "rows of a packed W as float32"},
    {"to_blocks", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(to_blocks)), METH_FASTCALL,
     "a packed W's bytes and scales in blocks of 16 rows"},
    {"dequant16", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(dequant16)), METH_FASTCALL,
     "rows of a blocked W as float32"},
    {"rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(norm<false>)), METH_FASTCALL,
     "RMS norm of x [T, H] times w"},
    {"add_rms_norm", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(norm<true>)), METH_FASTCALL,
     "residual += x, then its RMS norm"},
    {"silu_mul", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(silu_mul)), METH_FASTCALL,
     "silu(gate) * up of [T, 2I]"},
    {"rope_store", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(rope_store)), METH_FASTCALL,
     "q/k norm and RoPE; q in place, k and v into the paged cache"},
    {"paged_decode", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(paged_decode)), METH_FASTCALL,
     "one query token per sequence over the paged KV cache"},
    {"arrive_and_wait", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(arrive_and_wait)), METH_FASTCALL,
     "publish this rank's round of a host collective, then wait for every rank's"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef module = {PyModuleDef_HEAD_INIT, NEURON_STR(NEURON_MODULE), "neuron's CPU kernels, one ISA level", -1,
                      methods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC NEURON_CAT(PyInit_, NEURON_MODULE)(void) {
  PyObject* m = PyModule_Create(&module);
  if (m == nullptr) return nullptr;
  if (PyModule_AddStringConstant(m, "ISA", simd::NAME) < 0 || PyModule_AddIntConstant(m, "LANES", simd::W) < 0 ||
      PyModule_AddIntConstant(m, "INT8_ROWS", kernels::int8::AVAILABLE) < 0 ||
      PyModule_AddIntConstant(m, "INT16_BLOCKS", kernels::blocked::AVAILABLE) < 0) {
    Py_DECREF(m);
    return nullptr;
  }
  return m;
}
