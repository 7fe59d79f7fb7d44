// The layer matmul's weight layout on a CPU, from DRAM and from cache: a standalone C++ probe.
//
// The native layer matmul (pallas_kernels/native/matmul_cpu.cc) computes a decode step's
// y[64, 1536] = x[64, 576] @ w[576, 1536] in column tiles of 32 floats, 8 rows of x at a time.
// With w row-major ([K][N], the parameters' layout) a tile's 576 rows of 128 bytes lie 6 KB
// apart, each on a page of its own, where the hardware prefetcher does not follow. Packed
// tile-major ([N / 32][K][32]) a tile is 72 KB in one run. This probe runs the same register
// blocks over both layouts, for 30 layers' weights in turn (106 MB: from DRAM) or one layer's
// 30 times (3.5 MB: from cache), on 1 or 2 threads (a thread pool started per layer, as a
// kernel call's). Min of 7.
//
//   g++ -O3 -march=native -std=c++20 -pthread benchmarks/weight_layout_cpu.cc -o /tmp/weight_layout
//   /tmp/weight_layout 30 2    # layers in the stack (30: DRAM, 1: cache), threads

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>

typedef float f32x16 __attribute__((vector_size(64)));

namespace {

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, 64);
  return v;
}

constexpr int M = 64, K = 576, N = 1536, W = 32, TILES = N / W;

// Columns [32 t, 32 t + 32) of y, all M rows, in blocks of 8 rows x 2 vectors.
template <bool kPacked>
void tile(const float* x, const float* w, int t, float* y) {
  const float* base = kPacked ? w + size_t(t) * K * W : w + t * W;
  const int stride = kPacked ? W : N;
  for (int m0 = 0; m0 < M; m0 += 8) {
    f32x16 acc[8][2] = {};
    for (int k = 0; k < K; ++k) {
      const float* row = base + size_t(k) * stride;
      const f32x16 a = load16(row), b = load16(row + 16);
      for (int r = 0; r < 8; ++r) {
        const float xv = x[(m0 + r) * K + k];
        acc[r][0] += xv * a;
        acc[r][1] += xv * b;
      }
    }
    for (int r = 0; r < 8; ++r) std::memcpy(y + (m0 + r) * N + t * W, acc[r], 2 * 64);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s LAYERS THREADS\n", argv[0]);
    return 2;
  }
  const int layers = std::atoi(argv[1]), threads = std::atoi(argv[2]);
  std::vector<float> x(M * K, 1.0f), y(M * N);
  // 64-byte aligned, as XLA's buffers are (malloc's 16 would split rows across cache lines).
  const size_t count = size_t(layers) * K * N;
  float* w = static_cast<float*>(std::aligned_alloc(64, count * sizeof(float)));
  for (size_t i = 0; i < count; ++i) w[i] = 0.001f * float(i % 7);
  for (const bool packed : {false, true}) {
    double best = 1e9;
    for (int rep = 0; rep < 7; ++rep) {
      const auto start = std::chrono::steady_clock::now();
      for (int l = 0; l < 30; ++l) {
        const float* wl = w + size_t(l % layers) * K * N;
        std::atomic<int> next{0};
        auto work = [&] {
          for (int t; (t = next.fetch_add(1)) < TILES;) {
            packed ? tile<true>(x.data(), wl, t, y.data()) : tile<false>(x.data(), wl, t, y.data());
          }
        };
        std::vector<std::thread> pool;
        for (int i = 1; i < threads; ++i) pool.emplace_back(work);
        work();
        for (auto& th : pool) th.join();
      }
      const std::chrono::duration<double> took = std::chrono::steady_clock::now() - start;
      best = std::min(best, took.count());
    }
    std::printf("%2d layer(s), %d thread(s), %-10s %7.2f ms for 30 matmuls, %4.0f GFLOP/s\n",
                layers, threads, packed ? "packed" : "row-major", best * 1e3,
                30.0 * 2 * M * K * N / best / 1e9);
  }
  std::free(w);
  return 0;
}
