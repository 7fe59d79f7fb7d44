// y = x @ w[layer]: a matmul that reads one layer's kernel straight out of the stacked weights.
//
// Under the layer scan XLA's CPU backend copies each layer's slice of a stacked kernel into a
// fresh buffer before its dot; at a few rows, where the dot is bound by reading the kernel, that
// copy (a write and a second read of every weight) makes the step 2-3x slower than one read of the
// parameters. This kernel takes the whole stack and the layer index and reads the layer's rows in
// place, once.
//
//   x: [M, K] f32 or bf16        w: [L, K, N] f32 or bf16        layer: s32[] (clamped to [0, L))
//   live: s32[], the rows of x worth computing (the step's real tokens; the rest are padding)
//   y: [M, N], x's dtype, accumulated in f32; rows from `live` on are zeros.
//
// Work: column tiles of NT floats, rows in blocks of MR (MR x NT accumulators held in registers),
// the tiles shared out over XLA's intra-op thread pool.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace pagedjax_native;

// A register block: R rows x V vectors of accumulators (R * V <= 16 of the 32 AVX-512
// registers). Few rows take wide tiles (long contiguous runs of each weight row), more rows
// narrower ones, so every weight a tile covers is read once for all its rows.
constexpr int64_t ACCUMULATORS = 16;

inline float load1(const float* p, int64_t i) { return p[i]; }
inline float load1(const uint16_t* p, int64_t i) { return bf16_to_f32(p[i]); }

// Rows [m0, m0 + R) of a tile 16 V columns wide: w points at the tile's first weight, its rows
// ldw apart (N row-major, the tile's width packed); y at the tile's first output, its rows ldy
// apart. The tile's weights are read once for the R rows.
template <int64_t R, int64_t V, typename W>
inline void block(const float* x, int64_t K, const W* w, int64_t ldw, int64_t m0, float* y,
                  int64_t ldy) {
  f32x16 acc[R][V];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t j = 0; j < V; ++j) acc[r][j] = f32x16{};
  const float* xr = x + m0 * K;
  for (int64_t k = 0; k < K; ++k) {
    const W* row = w + k * ldw;
    f32x16 wk[V];
    for (int64_t j = 0; j < V; ++j) wk[j] = load16(row + 16 * j);
    for (int64_t r = 0; r < R; ++r) {
      const float xv = xr[r * K + k];
      for (int64_t j = 0; j < V; ++j) acc[r][j] += xv * wk[j];
    }
  }
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(y + (m0 + r) * ldy, acc[r], 16 * V * sizeof(float));
}

// All M rows of a tile 16 V columns wide (w, ldw, y, ldy as in `block`), in row blocks of up to
// ACCUMULATORS / V.
template <int64_t V, typename W>
void rows_of_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t ldw, float* y,
                  int64_t ldy) {
  constexpr int64_t MR = ACCUMULATORS / V;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) block<MR, V, W>(x, K, w, ldw, m, y, ldy);
  const int64_t rest = M - m;
  if (rest == 0) return;
  // The remaining rows, one template per count (MR is at most 16).
  [&]<int64_t... I>(std::integer_sequence<int64_t, I...>) {
    ((rest == I + 1 ? (block<I + 1, V, W>(x, K, w, ldw, m, y, ldy), 0) : 0), ...);
  }(std::make_integer_sequence<int64_t, MR - 1>{});
}

// Fewer than 16 columns at the right edge.
template <typename W>
void columns_scalar(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0,
                    int64_t cols, float* y) {
  for (int64_t r = 0; r < M; ++r) {
    float acc[16] = {};
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[r * K + k];
      const W* row = w + k * N + n0;
      for (int64_t j = 0; j < cols; ++j) acc[j] += xv * load1(row, j);
    }
    std::memcpy(y + r * N + n0, acc, cols * sizeof(float));
  }
}

// Columns [n0, n0 + cols): tiles of up to V vectors, narrower ones at the edge.
template <typename W>
void column_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0,
                 int64_t cols, int64_t V, float* y) {
  while (cols > 0) {
    const int64_t vecs = std::min(V, cols / 16);
    if (vecs >= 8) rows_of_tile<8, W>(x, M, K, w + n0, N, y + n0, N);
    else if (vecs >= 4) rows_of_tile<4, W>(x, M, K, w + n0, N, y + n0, N);
    else if (vecs >= 2) rows_of_tile<2, W>(x, M, K, w + n0, N, y + n0, N);
    else if (vecs >= 1) rows_of_tile<1, W>(x, M, K, w + n0, N, y + n0, N);
    else return columns_scalar<W>(x, M, K, w, N, n0, cols, y);
    const int64_t done = 16 * (vecs >= 8 ? 8 : vecs >= 4 ? 4 : vecs >= 2 ? 2 : 1);
    n0 += done;
    cols -= done;
  }
}

// ---- y = x @ w.T, w [N, K] (a tied embedding used as the LM head) ---------------------------
// Each output is a dot product of two contiguous rows: R rows of x against T rows of w at a
// time (R * T accumulators of 16 lanes, summed across lanes at the end), so w streams once.

template <int64_t R, int64_t T, typename W>
inline void dot_block(const float* x, int64_t K, const W* w, int64_t N, int64_t m0, int64_t n0,
                      float* y) {
  f32x16 acc[R][T];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = 0; t < T; ++t) acc[r][t] = f32x16{};
  const int64_t K16 = K - K % 16;
  for (int64_t k = 0; k < K16; k += 16) {
    f32x16 wv[T];
    for (int64_t t = 0; t < T; ++t) wv[t] = load16(w + (n0 + t) * K + k);
    for (int64_t r = 0; r < R; ++r) {
      const f32x16 xv = load16(x + (m0 + r) * K + k);
      for (int64_t t = 0; t < T; ++t) acc[r][t] += xv * wv[t];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t t = 0; t < T; ++t) {
      float sum = 0.f;
      for (int64_t j = 0; j < 16; ++j) sum += acc[r][t][j];
      for (int64_t k = K16; k < K; ++k) sum += x[(m0 + r) * K + k] * load1(w + (n0 + t) * K, k);
      y[(m0 + r) * N + n0 + t] = sum;
    }
  }
}

// All M rows against w's rows [n0, n0 + T).
template <int64_t T, typename W>
void rows_of_dot_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0,
                      float* y) {
  constexpr int64_t MR = ACCUMULATORS / T;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) dot_block<MR, T, W>(x, K, w, N, m, n0, y);
  const int64_t rest = M - m;
  if (rest == 0) return;
  [&]<int64_t... I>(std::integer_sequence<int64_t, I...>) {
    ((rest == I + 1 ? (dot_block<I + 1, T, W>(x, K, w, N, m, n0, y), 0) : 0), ...);
  }(std::make_integer_sequence<int64_t, MR - 1>{});
}

// w's rows [n0, n0 + rows): tiles of T rows, then single rows at the edge.
template <typename W>
void dot_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0,
              int64_t rows, int64_t T, float* y) {
  for (; rows > 0;) {
    if (rows >= 8 && T >= 8) {
      rows_of_dot_tile<8, W>(x, M, K, w, N, n0, y), n0 += 8, rows -= 8;
    } else if (rows >= 4 && T >= 4) {
      rows_of_dot_tile<4, W>(x, M, K, w, N, n0, y), n0 += 4, rows -= 4;
    } else {
      rows_of_dot_tile<1, W>(x, M, K, w, N, n0, y), n0 += 1, rows -= 1;
    }
  }
}

// ---- y = x @ w.T for more rows of x: w's rows packed into transposed panels ------------------
// A dot product per output costs a lane sum each: fine at a few rows of x, where reading w once
// bounds the time, not at many. There, PANEL rows of w at a time are transposed into a panel
// [K][PANEL] (common.h's transpose16), which every row block of x multiplies as layer_matmul's
// tiles multiply w (register blocks of 8 rows x 32 columns).

constexpr int64_t PANEL = 32;
// x's rows up to which the dot products serve (SmolLM2's tied head on a 2-core CPU: the two tie
// at 4 rows; the panels are 12-25% faster at 8 to 16).
constexpr int64_t DOT_MAX_ROWS = 4;

// Columns [n0, n0 + PANEL) of y (fewer at the right edge), all M rows.
template <typename W>
void panel_tile(const float* x, int64_t M, int64_t K, const W* w, int64_t N, int64_t n0,
                float* y) {
  const int64_t cols = std::min(PANEL, N - n0);
  thread_local std::vector<float> buf;
  buf.resize(K * PANEL + M * PANEL);
  float* panel = buf.data();  // [K][PANEL]: panel[k][j] = w[n0 + j][k], zeros past cols
  float* tile = panel + K * PANEL;  // [M][PANEL]
  const int64_t K16 = K - K % 16;
  for (int64_t h = 0; h < PANEL; h += 16) {
    const int64_t rows = std::clamp<int64_t>(cols - h, 0, 16);
    for (int64_t k = 0; k < K16; k += 16) {
      transpose16(w + (n0 + h) * K + k, K, rows, panel + k * PANEL + h, PANEL);
    }
    for (int64_t k = K16; k < K; ++k) {
      for (int64_t j = 0; j < 16; ++j) {
        panel[k * PANEL + h + j] = j < rows ? load1(w + (n0 + h + j) * K, k) : 0.0f;
      }
    }
  }
  rows_of_tile<PANEL / 16, float>(x, M, K, panel, PANEL, tile, PANEL);
  for (int64_t r = 0; r < M; ++r) std::memcpy(y + r * N + n0, tile + r * PANEL, cols * 4);
}

// x (f32 or bf16) in f32, y computed in f32 and written back in x's dtype; `compute(xp, yp, W*)`
// gets w's data as float* or uint16_t* (bf16). Only the first M of x's rows are computed; y's
// rows from M to `rows` (x's whole height) are zeros.
template <typename F>
ffi::Error with_f32(ffi::AnyBuffer& x, const void* w, bool w_bf16, ffi::AnyBuffer& y,
                    int64_t M, int64_t rows, int64_t K, int64_t N, F compute) {
  const bool x_bf16 = x.element_type() == ffi::BF16;
  const size_t out_item = x_bf16 ? 2 : 4;
  std::memset(static_cast<char*>(y.untyped_data()) + M * N * out_item, 0,
              (rows - M) * N * out_item);
  if (M == 0 || N == 0) return ffi::Error::Success();
  std::vector<float> xf;  // x in f32 (small: a few rows)
  const float* xp = reinterpret_cast<const float*>(x.untyped_data());
  if (x_bf16) {
    xf.resize(M * K);
    const auto* xs = reinterpret_cast<const uint16_t*>(x.untyped_data());
    for (int64_t i = 0; i < M * K; ++i) xf[i] = bf16_to_f32(xs[i]);
    xp = xf.data();
  }
  std::vector<float> yf;  // y in f32 when the output is bf16
  float* yp = reinterpret_cast<float*>(y.untyped_data());
  if (x_bf16) {
    yf.resize(M * N);
    yp = yf.data();
  }
  if (w_bf16) {
    compute(xp, yp, reinterpret_cast<const uint16_t*>(w));
  } else {
    compute(xp, yp, reinterpret_cast<const float*>(w));
  }
  if (x_bf16) {
    auto* ys = reinterpret_cast<uint16_t*>(y.untyped_data());
    for (int64_t i = 0; i < M * N; ++i) ys[i] = f32_to_bf16(yf[i]);
  }
  return ffi::Error::Success();
}

bool float_types(ffi::AnyBuffer& x, ffi::AnyBuffer& w) {
  auto ok = [](ffi::DataType t) { return t == ffi::F32 || t == ffi::BF16; };
  return ok(x.element_type()) && ok(w.element_type());
}

size_t itemsize(ffi::AnyBuffer& w) { return w.element_type() == ffi::BF16 ? 2 : 4; }

ffi::Error LayerMatmulImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                           ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live,
                           ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 3 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("layer_matmul: x must be [M, K] and w [L, K, N]");
  }
  if (!float_types(x, w)) {
    return ffi::Error::InvalidArgument("layer_matmul: x and w must be float32 or bfloat16");
  }
  const int64_t rows = xd[0], K = xd[1], L = wd[0], N = wd[2];
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, rows);  // rows worth computing
  const char* wl = static_cast<const char*>(w.untyped_data()) + l * K * N * itemsize(w);
  // Vectors per tile: wide for few rows, narrow for many (see ACCUMULATORS).
  const int64_t V = M <= 2 ? 8 : M <= 4 ? 4 : 2;
  const int64_t width = 16 * V;
  const int64_t tiles = (N + width - 1) / width;
  return with_f32(x, wl, w.element_type() == ffi::BF16, *y, M, rows, K, N,
                  [&](const float* xp, float* yp, const auto* wp) {
                    parallel_for(pool, tiles, 0, [=](int64_t t) {
                      const int64_t n0 = t * width;
                      column_tile(xp, M, K, wp, N, n0, std::min(width, N - n0), V, yp);
                    });
                  });
}

// The same product with the stack packed tile-major: w [L, N / 32, K, 32], tile t holding
// columns [32 t, 32 t + 32) of every row (layer_matmul.py's pack_stacked). A tile's weights are
// one contiguous run, which the hardware prefetcher streams from DRAM; row-major, its rows lie N
// apart, each on a page of its own (benchmarks/weight_layout_cpu.cc).
constexpr int64_t PACKED = 32;

ffi::Error LayerMatmulPackedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                 ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> live,
                                 ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 4 || wd[2] != xd[1] || wd[3] != PACKED) {
    return ffi::Error::InvalidArgument(
        "layer_matmul (packed): x must be [M, K] and w [L, N / 32, K, 32]");
  }
  if (!float_types(x, w)) {
    return ffi::Error::InvalidArgument("layer_matmul: x and w must be float32 or bfloat16");
  }
  const int64_t rows = xd[0], K = xd[1], L = wd[0], tiles = wd[1], N = tiles * PACKED;
  const int64_t l = std::clamp<int64_t>(layer.typed_data()[0], 0, L - 1);
  const int64_t M = std::clamp<int64_t>(live.typed_data()[0], 0, rows);  // rows worth computing
  const char* wl = static_cast<const char*>(w.untyped_data()) + l * K * N * itemsize(w);
  return with_f32(x, wl, w.element_type() == ffi::BF16, *y, M, rows, K, N,
                  [&](const float* xp, float* yp, const auto* wp) {
                    parallel_for(pool, tiles, 0, [=](int64_t t) {
                      rows_of_tile<PACKED / 16>(xp, M, K, wp + t * K * PACKED, PACKED,
                                                yp + t * PACKED, N);
                    });
                  });
}

ffi::Error MatmulTransposedImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w,
                                ffi::Result<ffi::AnyBuffer> y) {
  const auto xd = x.dimensions();
  const auto wd = w.dimensions();
  if (xd.size() != 2 || wd.size() != 2 || wd[1] != xd[1]) {
    return ffi::Error::InvalidArgument("matmul_transposed: x must be [M, K] and w [N, K]");
  }
  if (!float_types(x, w)) {
    return ffi::Error::InvalidArgument("matmul_transposed: x and w must be float32 or bfloat16");
  }
  const int64_t M = xd[0], K = xd[1], N = wd[0];
  const bool w_bf16 = w.element_type() == ffi::BF16;
  if (M > DOT_MAX_ROWS) {
    const int64_t tiles = (N + PANEL - 1) / PANEL;
    return with_f32(x, w.untyped_data(), w_bf16, *y, M, M, K, N,
                    [&](const float* xp, float* yp, const auto* wp) {
                      parallel_for(pool, tiles, 0, [=](int64_t t) {
                        panel_tile(xp, M, K, wp, N, t * PANEL, yp);
                      });
                    });
  }
  // w's rows per register tile: many for few rows of x, fewer for more (see ACCUMULATORS).
  const int64_t T = M <= 2 ? 8 : 4;
  constexpr int64_t ROWS = 256;  // w's rows per work item
  const int64_t tiles = (N + ROWS - 1) / ROWS;
  return with_f32(x, w.untyped_data(), w_bf16, *y, M, M, K, N,
                  [&](const float* xp, float* yp, const auto* wp) {
                    parallel_for(pool, tiles, 0, [=](int64_t t) {
                      const int64_t n0 = t * ROWS;
                      dot_tile(xp, M, K, wp, N, n0, std::min(ROWS, N - n0), T, yp);
                    });
                  });
}

// Both layer matmuls' operands: x, the stack, layer, live rows -> y.
auto layer_matmul_binding() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Arg<ffi::Buffer<ffi::S32>>()
      .Ret<ffi::AnyBuffer>();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerMatmul, LayerMatmulImpl, layer_matmul_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(LayerMatmulPacked, LayerMatmulPackedImpl, layer_matmul_binding());

XLA_FFI_DEFINE_HANDLER_SYMBOL(MatmulTransposed, MatmulTransposedImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
