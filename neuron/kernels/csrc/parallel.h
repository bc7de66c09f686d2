// Splitting work over threads, as torch's at::parallel_for does (OpenMP, contiguous chunks of at
// least `grain`, inline when one chunk would do), but with the thread count given: the kernels
// run on the rank's device thread, whose OpenMP settings are not torch's.

#pragma once

#include <algorithm>
#include <cstdint>

namespace kernels {

template <typename F>
void parallel_for(int64_t n, int64_t grain, int threads, F f) {
  const int64_t chunks = std::min<int64_t>(std::max(threads, 1), (n + grain - 1) / std::max<int64_t>(grain, 1));
  if (chunks <= 1) {
    if (n > 0) f(int64_t{0}, n);
    return;
  }
#ifdef _OPENMP
  const int64_t per = (n + chunks - 1) / chunks;
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
  for (int64_t c = 0; c < chunks; ++c) {  // every chunk, however many threads the team got
    const int64_t lo = c * per, hi = std::min(n, lo + per);
    if (lo < hi) f(lo, hi);
  }
#else
  f(int64_t{0}, n);
#endif
}

}  // namespace kernels
