// The meeting point of the CPU ranks of one host (neuron/models/host_collectives.py): each rank
// of a group has a counter in a memory segment they all map, one per 64-byte line. A collective's
// round publishes this rank's data (written before the call) with a release store of the round,
// then waits, with acquire loads, until every rank has published it: what they wrote before is
// then visible here, on any CPU (x86's ordering or Arm's weaker one).

#pragma once

#include <sched.h>

#include <chrono>
#include <cstdint>

namespace kernels {

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Returns nullptr, or why the wait failed (a rank did not arrive within timeout_ms).
inline const char* arrive_and_wait(char* counters, int64_t rank, int64_t world, int64_t round, int64_t timeout_ms) {
  if (rank < 0 || rank >= world || round <= 0) return "bad rank or round";
  __atomic_store_n(reinterpret_cast<int64_t*>(counters + 64 * rank), round, __ATOMIC_RELEASE);
  const auto start = std::chrono::steady_clock::now();
  for (int64_t r = 0; r < world; ++r) {
    const int64_t* at = reinterpret_cast<const int64_t*>(counters + 64 * r);
    // Spin briefly (the other ranks are mostly a few microseconds behind), then give the core
    // away between looks, so that ranks outnumbering the cores still take turns quickly.
    for (uint64_t looks = 0; __atomic_load_n(at, __ATOMIC_ACQUIRE) < round; ++looks) {
      if (looks < 256) {
        relax();
        continue;
      }
      sched_yield();
      if ((looks & 1023) == 0 && std::chrono::steady_clock::now() - start > std::chrono::milliseconds(timeout_ms))
        return "a rank of the group did not reach the collective in time";
    }
  }
  return nullptr;
}

}  // namespace kernels
