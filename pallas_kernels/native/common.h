// What the native CPU kernels share: bfloat16 conversions, a 16-float vector type, lane shuffles
// and a 16 x 16 transpose, and a parallel loop over XLA's intra-op thread pool. Included by each NAME.cc (a library of its own);
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

// 16 bfloat16 values widened to floats.
typedef uint16_t v16h __attribute__((vector_size(32)));
typedef uint32_t v16u __attribute__((vector_size(64)));

inline f32x16 load16(const uint16_t* p) {
  v16h h;
  std::memcpy(&h, p, sizeof h);
  v16u u = __builtin_convertvector(h, v16u) << 16;
  f32x16 v;
  std::memcpy(&v, &u, sizeof v);
  return v;
}

typedef int32_t i32x16 __attribute__((vector_size(64)));

// Lanes of a and b (0-15: a's, 16-31: b's) by constant indices.
#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, i32x16{__VA_ARGS__})
#endif
// Interleaves of two vectors in runs of 1, 2, 4, 8 lanes: the low halves' runs, then the high.
#define PAGEDJAX_LO1 0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23
#define PAGEDJAX_HI1 8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31
#define PAGEDJAX_LO2 0, 1, 16, 17, 2, 3, 18, 19, 4, 5, 20, 21, 6, 7, 22, 23
#define PAGEDJAX_HI2 8, 9, 24, 25, 10, 11, 26, 27, 12, 13, 28, 29, 14, 15, 30, 31
#define PAGEDJAX_LO4 0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23
#define PAGEDJAX_HI4 8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31
#define PAGEDJAX_LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define PAGEDJAX_HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31

// out[i * out_stride + j] = rows[j * stride + i] (as float) for a 16 x 16 block whose rows past
// n are taken as zeros (and never read): four rounds of pairwise interleaves, 64 two-source
// shuffles, leave column i in vector bitreverse(i).
template <typename T>
inline void transpose16(const T* rows, int64_t stride, int64_t n, float* out,
                        int64_t out_stride) {
  f32x16 v[16], w[16];
  for (int64_t j = 0; j < 16; ++j) v[j] = j < n ? load16(rows + j * stride) : f32x16{};
#define PAGEDJAX_ROUND(d, LO, HI)                              \
  for (int base = 0; base < 16; base += 2 * d) {               \
    for (int m = 0; m < d; ++m) {                              \
      const f32x16 a = v[base + m], b = v[base + m + d];       \
      w[base + m] = SHUFFLE(a, b, LO);                         \
      w[base + m + d] = SHUFFLE(a, b, HI);                     \
    }                                                          \
  }                                                            \
  for (int j = 0; j < 16; ++j) v[j] = w[j];
  PAGEDJAX_ROUND(1, PAGEDJAX_LO1, PAGEDJAX_HI1)
  PAGEDJAX_ROUND(2, PAGEDJAX_LO2, PAGEDJAX_HI2)
  PAGEDJAX_ROUND(4, PAGEDJAX_LO4, PAGEDJAX_HI4)
  PAGEDJAX_ROUND(8, PAGEDJAX_LO8, PAGEDJAX_HI8)
#undef PAGEDJAX_ROUND
  constexpr int kBitReverse[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int k = 0; k < 16; ++k) store16(out + kBitReverse[k] * out_stride, v[k]);
}

// Items claimed from a shared counter. A running item may claim the item its thread runs after
// it early (`next()`), to prefetch for it near its own end.
class Claims {
 public:
  explicit Claims(int64_t n) : n_(n) {}
  int64_t n() const { return n_; }
  int64_t claim() { return next_.fetch_add(1); }

 private:
  std::atomic<int64_t> next_{0};
  int64_t n_;
};

class NextItem {  // what a running item sees of its thread's next claim
 public:
  explicit NextItem(Claims& claims) : claims_(claims) {}
  // The item this thread runs after the current one, claimed now if not yet; -1: none.
  int64_t next() {
    if (next_ == kUnclaimed) next_ = claims_.claim();
    return next_ < claims_.n() ? next_ : -1;
  }
  int64_t take() {  // the next claim, made now if the item did not ask
    next();
    const int64_t i = next_;
    next_ = kUnclaimed;
    return i;
  }

 private:
  static constexpr int64_t kUnclaimed = -2;
  Claims& claims_;
  int64_t next_ = kUnclaimed;
};

// work(i, next) for i in 0 .. n-1 over the pool's threads (at most `max_threads`; 0: all). The
// caller claims items too, and waits only for items a worker has claimed (which are running, or
// held by a running worker), so it never waits on a worker the pool has not started: a worker
// that starts late finds nothing left and returns without touching the (by then gone) problem.
struct Shared {
  explicit Shared(int64_t n) : claims(n) {}
  Claims claims;
  std::atomic<int64_t> done{0};
  std::function<void(int64_t, NextItem&)> work;

  void drain() {
    NextItem next(claims);
    for (int64_t i = claims.claim(); i < claims.n(); i = next.take()) {
      work(i, next);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

inline void parallel_for_ahead(ffi::ThreadPool& pool, int64_t n, int64_t max_threads,
                               std::function<void(int64_t, NextItem&)> work) {
  int64_t threads = std::max<int64_t>(pool.num_threads(), 1);
  if (max_threads > 0) threads = std::min(threads, max_threads);
  threads = std::min(threads, n);
  auto shared = std::make_shared<Shared>(n);
  shared->work = std::move(work);
  if (threads <= 1) {
    shared->drain();
    return;
  }
  for (int64_t w = 1; w < threads; ++w) pool.Schedule([shared] { shared->drain(); });
  shared->drain();
  while (shared->done.load(std::memory_order_acquire) < n) std::this_thread::yield();
}

// work(i) for i in 0 .. n-1, as parallel_for_ahead.
inline void parallel_for(ffi::ThreadPool& pool, int64_t n, int64_t max_threads,
                         std::function<void(int64_t)> work) {
  parallel_for_ahead(pool, n, max_threads, [work](int64_t i, NextItem&) { work(i); });
}

}  // namespace pagedjax_native
