// What the native CPU kernels share: bfloat16 conversions, a 16-float vector type, and a
// parallel loop over XLA's intra-op thread pool. Included by each NAME.cc (a library of its own);
// pallas_kernels/native/__init__.py hashes this header into every build's key.

#pragma once

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

namespace pagedjax_native {

namespace ffi = xla::ffi;

inline float bf16_to_f32(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t f32_to_bf16(float f) {  // round to nearest even, as XLA's convert
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if (std::isnan(f)) return uint16_t((bits >> 16) | 0x40);
  bits += 0x7fff + ((bits >> 16) & 1);
  return uint16_t(bits >> 16);
}

// GCC/Clang vector types: kept in registers, lowered to whatever the -march has (one zmm on
// AVX-512, two ymm on AVX2).
typedef float f32x16 __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof v); }

// work(0 .. n-1) over the pool's threads (at most `max_threads`; 0: all). The caller claims
// items too, and waits only for items a worker has claimed (which are running), so it never
// waits on a worker the pool has not started: a worker that starts late finds nothing left and
// returns without touching the (by then gone) problem.
struct Shared {
  std::atomic<int64_t> next{0}, done{0};
  int64_t n = 0;
  std::function<void(int64_t)> work;

  void drain() {
    for (int64_t i; (i = next.fetch_add(1)) < n;) {
      work(i);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t max_threads,
                         std::function<void(int64_t)> work) {
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::min(threads, n);
  if (threads <= 1) {
    for (int64_t i = 0; i < n; ++i) work(i);
    return;
  }
  auto shared = std::make_shared<Shared>();
  shared->n = n;
  shared->work = std::move(work);
  for (int64_t w = 1; w < threads; ++w) pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  while (shared->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

}  // namespace pagedjax_native
