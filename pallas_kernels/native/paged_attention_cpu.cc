// Paged attention on a CPU, called through XLA's FFI (pallas_kernels/native_attention.py).
//
// Each task is one KV head of one sequence and a run of that sequence's consecutive query rows
// (one row for a decode). It walks the sequence's block table from the earliest key any of its
// rows sees to the last, reads each live K/V page row once straight from the pool (no gathered
// copy), and folds it into every query vector of the run (the GQA group's heads x the rows) with
// flash attention's online softmax. Slots outside a vector's keys [window start, position] are
// never read or masked off by selection, never multiplied by zero: stale slots may hold NaN.
//
// Head dims 64 and 128 (fold_panel): each chunk of up to 16 keys is transposed once, so that a
// query's 16 scores are a run of broadcast multiply-adds into one register (no lane sums per key)
// and the softmax runs on 16 lanes; a row's arithmetic is the same in a decode, a prefill tile or
// a chunk of any size. Other head dims (fold_block): one query vector at a time, one key at a time.
//
// Pools: float32, bfloat16, int8 or float8_e4m3fn pages (8-bit ones with f32 per-slot scales,
// value = page * scale); the arithmetic is float32. Queries float32 or bfloat16; the output has
// the queries' dtype.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

using namespace pagedjax_native;

// ---------------------------------------------------------------------------------------------
// Element types

struct Fp8Table {  // float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no inf
  float value[256];
  Fp8Table() {
    for (int b = 0; b < 256; ++b) {
      int e = (b >> 3) & 15, m = b & 7;
      float mag = e == 0 ? std::ldexp(float(m), -9) : std::ldexp(1.0f + m / 8.0f, e - 7);
      if (e == 15 && m == 7) mag = NAN;
      value[b] = (b & 0x80) ? -mag : mag;
    }
  }
};
const Fp8Table kFp8;

enum class Page { kF32, kBF16, kS8, kF8 };

template <Page P>
struct PageType {
  using T = std::conditional_t<P == Page::kF32, float,
                               std::conditional_t<P == Page::kBF16, uint16_t, uint8_t>>;
};

// Elements [a, b) of a page, from `base` on, as f32 at the same offsets of the returned pointer:
// float32 pages are read in place, the others converted into `buf`.
template <Page P>
const float* page_f32(const void* page, int64_t base, int64_t a, int64_t b, float* buf) {
  if constexpr (P == Page::kF32) {
    return static_cast<const float*>(page) + base;
  } else if constexpr (P == Page::kBF16) {
    const uint16_t* src = static_cast<const uint16_t*>(page) + base;
    for (int64_t i = a; i < b; ++i) buf[i] = bf16_to_f32(src[i]);
  } else if constexpr (P == Page::kS8) {
    const int8_t* src = static_cast<const int8_t*>(page) + base;
    for (int64_t i = a; i < b; ++i) buf[i] = float(src[i]);
  } else {
    const uint8_t* src = static_cast<const uint8_t*>(page) + base;
    for (int64_t i = a; i < b; ++i) buf[i] = kFp8.value[src[i]];
  }
  return buf;
}

// ---------------------------------------------------------------------------------------------
// Vector pieces

constexpr int kLanes = 16;
// A tree over v's lanes in four swaps (halves, quarters, pairs, neighbours), all in registers
// (halves taken through memory stall on store forwarding): every lane ends up holding
// op(all lanes).
template <typename Op>
inline f32x16 lane_tree(f32x16 v, Op op) {
  v = op(v, SHUFFLE(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = op(v, SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = op(v, SHUFFLE(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  return op(v, SHUFFLE(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
}

inline float sum16(f32x16 v) {
  return lane_tree(v, [](f32x16 a, f32x16 b) { return a + b; })[0];
}

// Any head dim (fold_block): plain loops over 16-lane vectors and a scalar tail.

float dot(const float* a, const float* b, int64_t n) {
  f32x16 x = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) x += load16(a + i) * load16(b + i);
  float tail = 0.0f;
  for (; i < n; ++i) tail += a[i] * b[i];
  return sum16(x) + tail;
}

// acc = alpha * acc + sum over keys j in [a, b) of w[j] * v[j]: v's rows are `n` apart.
void accumulate(float alpha, const float* w, const float* v, int64_t a, int64_t b, float* acc,
                int64_t n) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    f32x16 r = load16(acc + i) * alpha;
    for (int64_t j = a; j < b; ++j) r += w[j] * load16(v + j * n + i);
    store16(acc + i, r);
  }
  for (; i < n; ++i) {
    float r = acc[i] * alpha;
    for (int64_t j = a; j < b; ++j) r += w[j] * v[j * n + i];
    acc[i] = r;
  }
}

inline f32x16 splat(float x) { return f32x16{} + x; }

// The largest of v's lanes, NaN lanes passed over (as std::max(m, NaN) keeps m).
inline float max16(f32x16 v) {
  v = v != v ? splat(-INFINITY) : v;
  return lane_tree(v, [](f32x16 a, f32x16 b) { return a > b ? a : b; })[0];
}

// Lanes [0, n) of p, zeros past them (never reads p[n..]).
inline f32x16 load_first(const float* p, int64_t n) {
  f32x16 v = {};
  for (int64_t i = 0; i < n; ++i) v[i] = p[i];
  return v;
}

// exp(x) in float32 within ~2 ulp (Cephes' expf polynomial), branch-free, for a float or 16
// lanes (T = f32x16): exp(-inf) = 0, large x saturates to inf, NaN stays NaN.
template <typename T>
inline T fast_exp(T x) {
  using I = std::conditional_t<std::is_same_v<T, float>, int32_t, i32x16>;
  const T lo = T{} + -87.5f, hi = T{} + 88.7f, magic = T{} + 12582912.0f;  // 1.5 * 2^23
  const T xc = x < lo ? lo : (x > hi ? hi : x);
  const T n = (xc * 1.44269504088896341f + magic) - magic;  // rounded to an integer
  T r = xc - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  T y = T{} + 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r * r + r + 1.0f;
  I bits;
  std::memcpy(&bits, &y, sizeof bits);
  if constexpr (std::is_same_v<T, float>) {
    bits += int32_t(n) << 23;  // y * 2^n; n in [-126, 128]
  } else {
    bits += __builtin_convertvector(n, i32x16) << 23;
  }
  T out;
  std::memcpy(&out, &bits, sizeof out);
  out = x < lo ? T{} : (x > hi ? T{} + INFINITY : out);
  return x != x ? x : out;
}

// A later page's cache lines, prefetched a few at a time between pieces of the current page's
// work. Issued all at once, the prefetches fill the core's miss buffers and stall it until most
// have arrived, so the page's arithmetic waits on memory instead of overlapping it (measured:
// a decode layer's attention over 64 sequences' pages in DRAM, 1.43 -> 1.03 ms adjacent and
// 1.77 -> 1.30 ms scattered).
struct Ahead {
  const char* k = nullptr;  // the next K line to prefetch, up to k_end; then the V lines
  const char* k_end = nullptr;
  const char* v = nullptr;
  const char* v_end = nullptr;

  void step(int lines) {
    for (; lines > 0 && k < k_end; --lines, k += 64) __builtin_prefetch(k, 0, 3);
    for (; lines > 0 && v < v_end; --lines, v += 64) __builtin_prefetch(v, 0, 3);
  }
  void rest() { step(int((k_end - k + v_end - v) / 64) + 1); }
};

// ---------------------------------------------------------------------------------------------
// The problem and its tasks

struct Problem {
  const void* q;  // [num_rows, num_heads, head_dim], f32 or bf16
  bool q_bf16;
  const void* k_pages;  // [num_kv_heads, num_blocks, block_size, head_dim]
  const void* v_pages;
  const float* k_scales;  // [num_kv_heads, num_blocks, block_size]; null for a float pool
  const float* v_scales;
  const int32_t* tables;  // [num_seqs, max_blocks]
  void* out;              // like q
  int64_t num_heads, head_dim, num_kv_heads, num_blocks, block_size, max_blocks;
  int64_t window;  // <= 0: none
  float scale, soft_cap;
};

struct Task {
  int64_t seq;   // whose block table
  int64_t row0;  // first query row
  int64_t rows;  // consecutive rows, at consecutive positions
  int64_t pos0;  // position of the first row
  int64_t ctx;   // keys at or past it are not the sequence's
  int64_t kv_head;
};

// Keys [lo, hi) the query at `pos` sees.
void key_range(const Problem& p, const Task& t, int64_t pos, int64_t* lo, int64_t* hi) {
  *lo = p.window > 0 ? std::max<int64_t>(pos - p.window + 1, 0) : 0;
  *hi = std::min({pos + 1, t.ctx, p.max_blocks * p.block_size});
}

struct Scratch {  // one per thread, grown on demand
  std::vector<float> q, acc, m, l, s, k, v;
};

Scratch& scratch(const Problem& p, int64_t vectors) {
  thread_local Scratch sc;
  const int64_t d = p.head_dim, bs = p.block_size;
  sc.q.resize(vectors * d);
  sc.acc.assign(vectors * d, 0.0f);
  sc.m.assign(vectors, -INFINITY);
  sc.l.assign(vectors, 0.0f);
  sc.s.resize(bs);
  sc.k.resize(bs * d);
  sc.v.resize(bs * d);
  return sc;
}

void load_queries(const Problem& p, const Task& t, int64_t group, float* q) {
  const int64_t d = p.head_dim;
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t src = ((t.row0 + r) * p.num_heads + t.kv_head * group + g) * d;
      float* dst = q + (r * group + g) * d;
      if (p.q_bf16) {
        const uint16_t* x = static_cast<const uint16_t*>(p.q) + src;
        for (int64_t i = 0; i < d; ++i) dst[i] = bf16_to_f32(x[i]) * p.scale;
      } else {
        const float* x = static_cast<const float*>(p.q) + src;
        for (int64_t i = 0; i < d; ++i) dst[i] = x[i] * p.scale;
      }
    }
  }
}

void store_outputs(const Problem& p, const Task& t, int64_t group, const Scratch& sc) {
  const int64_t d = p.head_dim;
  for (int64_t r = 0; r < t.rows; ++r) {
    for (int64_t g = 0; g < group; ++g) {
      const int64_t vec = r * group + g;
      const float den = sc.l[vec];
      const float inv = den == 0.0f ? 0.0f : 1.0f / den;  // saw no key: zeros
      const float* acc = sc.acc.data() + vec * d;
      const int64_t dst = ((t.row0 + r) * p.num_heads + t.kv_head * group + g) * d;
      if (p.q_bf16) {
        uint16_t* o = static_cast<uint16_t*>(p.out) + dst;
        for (int64_t i = 0; i < d; ++i) o[i] = f32_to_bf16(acc[i] * inv);
      } else {
        float* o = static_cast<float*>(p.out) + dst;
        for (int64_t i = 0; i < d; ++i) o[i] = acc[i] * inv;
      }
    }
  }
}

// One query vector over keys [a, b) of a page whose rows k/v (f32) start at key 0, for a head
// dim only known at run time.
void fold_block(const Problem& p, const float* q, const float* k, const float* v,
                const float* ks, const float* vs, int64_t a, int64_t b, float* s, float* m,
                float* l, float* acc) {
  const int64_t d = p.head_dim;
  for (int64_t j = a; j < b; ++j) s[j] = dot(q, k + j * d, d);
  if (ks) {
    for (int64_t j = a; j < b; ++j) s[j] *= ks[j];
  }
  if (p.soft_cap > 0.0f) {
    for (int64_t j = a; j < b; ++j) s[j] = p.soft_cap * std::tanh(s[j] / p.soft_cap);
  }
  float block_max = -INFINITY;
  for (int64_t j = a; j < b; ++j) block_max = std::max(block_max, s[j]);
  const float m_new = std::max(*m, block_max);
  float sum = 0.0f;
  for (int64_t j = a; j < b; ++j) s[j] = fast_exp(s[j] - m_new);
  for (int64_t j = a; j < b; ++j) sum += s[j];
  const float alpha = fast_exp(*m - m_new);  // 0 when nothing was seen before
  *l = *l * alpha + sum;
  *m = m_new;
  if (vs) {
    for (int64_t j = a; j < b; ++j) s[j] *= vs[j];
  }
  accumulate(alpha, s, v, a, b, acc, d);
}

// The 16 scores of NV (<= 4) query vectors (kD floats apart) against a transposed chunk: two
// chains each, so that 2 to 8 independent multiply-add chains share each row of kt.
template <int kD, int NV>
inline void panel_scores_n(const float* q, const float* kt, f32x16* out) {
  f32x16 x[NV], y[NV];
  for (int v = 0; v < NV; ++v) x[v] = y[v] = f32x16{};
  for (int i = 0; i < kD; i += 2) {
    const f32x16 a = load16(kt + i * kLanes), b = load16(kt + (i + 1) * kLanes);
    for (int v = 0; v < NV; ++v) {
      x[v] += q[v * kD + i] * a;
      y[v] += q[v * kD + i + 1] * b;
    }
  }
  for (int v = 0; v < NV; ++v) out[v] = x[v] + y[v];
}

template <int kD>
inline void panel_scores(const float* q, int64_t count, const float* kt, f32x16* out) {
  switch (count) {
    case 4: return panel_scores_n<kD, 4>(q, kt, out);
    case 3: return panel_scores_n<kD, 3>(q, kt, out);
    case 2: return panel_scores_n<kD, 2>(q, kt, out);
    default: return panel_scores_n<kD, 1>(q, kt, out);
  }
}

// Every query vector of a task (its rows x the GQA group) over keys [a, b) of a page (rows k,
// v in f32 from the page's key 0, whose position is t0): each chunk of up to 16 keys is
// transposed once (kt: [kD][16]), so a vector's 16 scores are kD broadcast multiply-adds into
// one register; the online softmax runs on the 16 lanes. Row r's vectors see keys [lo_r, hi_r)
// (causal, window): the chunk's other lanes are masked off, and only its own keys' V rows are
// read.
template <int kD>
void fold_panel(const Problem& p, const Task& t, Scratch& sc, const float* k, const float* v,
                const float* ks, const float* vs, int64_t t0, int64_t a, int64_t b, Ahead& pf) {
  constexpr int kC = kD / kLanes;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const i32x16 lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  alignas(64) float kt[kD * kLanes];
  for (int64_t j0 = a; j0 < b; j0 += kLanes) {
    const int64_t n = std::min<int64_t>(kLanes, b - j0);
    for (int c = 0; c < kD; c += kLanes) {
      pf.step(8);  // 4 x 8 lines here, 2 per key and query vector below
      transpose16(k + j0 * kD + c, kD, n, kt + c * kLanes, kLanes);
    }
    const f32x16 k_scale = ks ? load_first(ks + j0, n) : f32x16{};
    const f32x16 v_scale = vs ? load_first(vs + j0, n) : f32x16{};
    f32x16 scores[4];
    for (int64_t r = 0; r < t.rows; ++r) {
      int64_t lo, hi;
      key_range(p, t, t.pos0 + r, &lo, &hi);
      const int64_t ra = std::max(lo - t0, j0), rb = std::min(hi - t0, j0 + n);
      if (ra >= rb) continue;
      const auto live = (lane >= int32_t(ra - j0)) & (lane < int32_t(rb - j0));
      for (int64_t g = 0; g < group; ++g) {
        const int64_t vec = r * group + g;
        if (g % 4 == 0) {  // the scores of this vector and up to 3 more, together
          panel_scores<kD>(sc.q.data() + vec * kD, std::min<int64_t>(4, group - g), kt, scores);
        }
        f32x16 s = scores[g % 4];
        if (ks) s *= k_scale;
        if (const float cap = p.soft_cap; cap > 0.0f) {
          for (int64_t j = ra - j0; j < rb - j0; ++j) s[j] = cap * std::tanh(s[j] / cap);
        }
        s = live ? s : splat(-INFINITY);
        float& m = sc.m[vec];
        const float m_new = std::max(m, max16(s));
        f32x16 e = fast_exp(s - m_new);
        e = live ? e : f32x16{};
        const float alpha = fast_exp(m - m_new);  // 0 when nothing was seen before
        sc.l[vec] = sc.l[vec] * alpha + sum16(e);
        m = m_new;
        if (vs) e *= v_scale;
        float* acc = sc.acc.data() + vec * kD;
        f32x16 o[kC];
        for (int c = 0; c < kC; ++c) o[c] = load16(acc + c * kLanes) * alpha;
        for (int64_t j = ra; j < rb; ++j) {
          pf.step(2);
          const float w = e[j - j0];
          for (int c = 0; c < kC; ++c) o[c] += w * load16(v + j * kD + c * kLanes);
        }
        for (int c = 0; c < kC; ++c) store16(acc + c * kLanes, o[c]);
      }
    }
  }
}

// Keys [first, last) that any of a task's rows sees.
void task_keys(const Problem& p, const Task& t, int64_t* first, int64_t* last) {
  int64_t unused;
  key_range(p, t, t.pos0, first, &unused);
  key_range(p, t, t.pos0 + t.rows - 1, &unused, last);  // lo and hi grow with the position
}

// Page `blk` of task t's block table: the pool slot of its key 0 (an index out of the pool is
// clamped, as XLA's gather does).
int64_t page_slot(const Problem& p, const Task& t, int64_t blk) {
  const int32_t page = p.tables[t.seq * p.max_blocks + blk];
  return (t.kv_head * p.num_blocks + std::clamp<int64_t>(page, 0, p.num_blocks - 1)) *
         p.block_size;
}

// The live rows of page `blk` of task t (keys below `last`), to prefetch.
Ahead page_lines(const Problem& p, const Task& t, int64_t blk, int64_t last, int64_t row_bytes) {
  const int64_t t0 = blk * p.block_size;
  const int64_t n = std::min(last - t0, p.block_size) * row_bytes;
  const int64_t at = page_slot(p, t, blk) * row_bytes;
  const char* k = static_cast<const char*>(p.k_pages) + at;
  const char* v = static_cast<const char*>(p.v_pages) + at;
  return Ahead{k, k + n, v, v + n};
}

// Task t: while a page is folded, the following one is prefetched (one page ahead: two were
// slower), and while its last page is, the first of the task its thread runs next (claimed
// then, out of `tasks`).
template <Page P, int kD>
void run_task(const Problem& p, const Task& t, NextItem& next_item, const Task* tasks) {
  const int64_t d = kD > 0 ? kD : p.head_dim, bs = p.block_size;
  const int64_t group = p.num_heads / p.num_kv_heads;
  const int64_t row_bytes = d * int64_t(sizeof(typename PageType<P>::T));
  int64_t first, last;
  task_keys(p, t, &first, &last);
  Scratch& sc = scratch(p, t.rows * group);
  load_queries(p, t, group, sc.q.data());
  for (int64_t blk = first / bs; blk * bs < last; ++blk) {
    const int64_t t0 = blk * bs;
    const int64_t a = std::max(first, t0) - t0, b = std::min(last, t0 + bs) - t0;
    const int64_t slot0 = page_slot(p, t, blk);
    Ahead pf;
    if ((blk + 1) * bs < last) {
      pf = page_lines(p, t, blk + 1, last, row_bytes);
    } else if (const int64_t i = next_item.next(); i >= 0) {
      int64_t next_first, next_last;
      task_keys(p, tasks[i], &next_first, &next_last);
      if (next_first < next_last) {
        pf = page_lines(p, tasks[i], next_first / bs, next_last, row_bytes);
      }
    }
    const float* k = page_f32<P>(p.k_pages, slot0 * d, a * d, b * d, sc.k.data());
    const float* v = page_f32<P>(p.v_pages, slot0 * d, a * d, b * d, sc.v.data());
    const float* ks = p.k_scales ? p.k_scales + slot0 : nullptr;
    const float* vs = p.v_scales ? p.v_scales + slot0 : nullptr;
    if constexpr (kD > 0) {
      fold_panel<kD>(p, t, sc, k, v, ks, vs, t0, a, b, pf);
      pf.rest();
    } else {
      pf.rest();
      for (int64_t r = 0; r < t.rows; ++r) {
        int64_t lo, hi;
        key_range(p, t, t.pos0 + r, &lo, &hi);
        const int64_t ra = std::max(lo, t0 + a) - t0, rb = std::min(hi, t0 + b) - t0;
        if (ra >= rb) continue;
        for (int64_t g = 0; g < group; ++g) {
          const int64_t vec = r * group + g;
          fold_block(p, sc.q.data() + vec * d, k, v, ks, vs, ra, rb, sc.s.data(), &sc.m[vec],
                     &sc.l[vec], sc.acc.data() + vec * d);
        }
      }
    }
  }
  store_outputs(p, t, group, sc);
}

// ---------------------------------------------------------------------------------------------
// Running the tasks over XLA's intra-op thread pool

template <Page P>
void run_all(ffi::ThreadPool& pool, const Problem& p, const std::vector<Task>& tasks,
             int64_t max_threads) {
  auto go = [&](auto task) {
    parallel_for_ahead(pool, int64_t(tasks.size()), max_threads,
                       [&](int64_t i, NextItem& next) { task(p, tasks[i], next, tasks.data()); });
  };
  if (p.head_dim == 64) {
    go(run_task<P, 64>);
  } else if (p.head_dim == 128) {
    go(run_task<P, 128>);
  } else {
    go(run_task<P, 0>);
  }
}

ffi::Error run(ffi::ThreadPool& pool, const Problem& p, ffi::DataType page_type,
               const std::vector<Task>& tasks, int64_t max_threads) {
  switch (page_type) {
    case ffi::DataType::F32:
      run_all<Page::kF32>(pool, p, tasks, max_threads);
      break;
    case ffi::DataType::BF16:
      run_all<Page::kBF16>(pool, p, tasks, max_threads);
      break;
    case ffi::DataType::S8:
      run_all<Page::kS8>(pool, p, tasks, max_threads);
      break;
    case ffi::DataType::F8E4M3FN:
      run_all<Page::kF8>(pool, p, tasks, max_threads);
      break;
    default:
      return ffi::Error::InvalidArgument("pages must be f32, bf16, s8 or f8e4m3fn");
  }
  return ffi::Error::Success();
}

// ---------------------------------------------------------------------------------------------
// Handlers

ffi::Error make_problem(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                        const ffi::Buffer<ffi::F32>& ks, const ffi::Buffer<ffi::F32>& vs,
                        const ffi::Buffer<ffi::S32>& tables, int32_t window,
                        ffi::AnyBuffer& out, float scale, float soft_cap, Problem* p) {
  const auto qd = q.dimensions(), kd = k.dimensions(), td = tables.dimensions();
  if (qd.size() != 3 || kd.size() != 4 || td.size() != 2 || !(kd == v.dimensions()) ||
      k.element_type() != v.element_type() || out.element_type() != q.element_type()) {
    return ffi::Error::InvalidArgument("paged attention: bad operand ranks or dtypes");
  }
  if (q.element_type() != ffi::DataType::F32 && q.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument("paged attention: q must be f32 or bf16");
  }
  if (qd[2] != kd[3] || kd[0] <= 0 || qd[1] % kd[0] != 0) {
    return ffi::Error::InvalidArgument("paged attention: q and pool shapes disagree");
  }
  const bool kv8 = k.element_type() == ffi::DataType::S8 ||
                   k.element_type() == ffi::DataType::F8E4M3FN;
  if (kv8 && (ks.element_count() != size_t(kd[0] * kd[1] * kd[2]) ||
              vs.element_count() != ks.element_count())) {
    return ffi::Error::InvalidArgument("paged attention: 8-bit pool without matching scales");
  }
  *p = Problem{q.untyped_data(),
               q.element_type() == ffi::DataType::BF16,
               k.untyped_data(),
               v.untyped_data(),
               kv8 ? ks.typed_data() : nullptr,
               kv8 ? vs.typed_data() : nullptr,
               tables.typed_data(),
               out.untyped_data(),
               qd[1],
               qd[2],
               kd[0],
               kd[1],
               kd[2],
               td[1],
               window,
               scale,
               soft_cap};
  std::memset(out.untyped_data(), 0, out.size_bytes());  // rows no task writes are zero
  return ffi::Error::Success();
}

ffi::Error DecodeImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> vs,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                      ffi::Buffer<ffi::S32> window, ffi::Result<ffi::AnyBuffer> out,
                      float scale, float soft_cap, int64_t max_threads) {
  Problem p;
  const int64_t num_seqs = q.dimensions()[0];
  if (lens.element_count() != size_t(num_seqs) || tables.dimensions()[0] != num_seqs) {
    return ffi::Error::InvalidArgument("paged attention: q, block_tables, context_lens disagree");
  }
  ffi::Error err = make_problem(q, k, v, ks, vs, tables, window.typed_data()[0], *out, scale,
                                soft_cap, &p);
  if (!err.success()) return err;
  std::vector<Task> tasks;
  const int32_t* len = lens.typed_data();
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (len[s] <= 0) continue;  // zeros
    for (int64_t h = 0; h < p.num_kv_heads; ++h) tasks.push_back({s, s, 1, len[s] - 1, len[s], h});
  }
  return run(pool, p, k.element_type(), tasks, max_threads);
}

// Rows of each sequence, cut into runs of at most `tile` rows. Row n belongs to the last
// sequence starting at or before it (as the jnp reference's searchsorted); it is live below
// query_start_loc[-1] and among its sequence's first `max_query_len` rows.
std::vector<Task> ragged_tasks(const int32_t* qsl, const int32_t* lens, int64_t num_seqs,
                               int64_t num_tokens, int64_t max_q, int64_t num_kv_heads,
                               int64_t tile) {
  std::vector<Task> runs;
  const int64_t end = std::min<int64_t>(qsl[num_seqs], num_tokens);
  for (int64_t n = 0; n < end;) {
    int64_t seq = std::upper_bound(qsl, qsl + num_seqs + 1, int32_t(n)) - qsl - 1;
    seq = std::clamp<int64_t>(seq, 0, num_seqs - 1);
    const int64_t q_len = int64_t(qsl[seq + 1]) - qsl[seq];
    // Rows up to the next sequence's start are this one's; its first max_q of them are live.
    const int64_t seq_end = std::max<int64_t>(std::min<int64_t>(qsl[seq + 1], end), n + 1);
    const int64_t live_end = std::min<int64_t>(seq_end, int64_t(qsl[seq]) + max_q);
    for (int64_t r = n; r < live_end; r += tile) {
      const int64_t rows = std::min(tile, live_end - r);
      const int64_t pos0 = int64_t(lens[seq]) - q_len + (r - qsl[seq]);
      runs.push_back({seq, r, rows, pos0, lens[seq], 0});
    }
    n = seq_end;
  }
  std::vector<Task> tasks;
  tasks.reserve(runs.size() * num_kv_heads);
  for (const Task& t : runs) {
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      Task th = t;
      th.kv_head = h;
      tasks.push_back(th);
    }
  }
  return tasks;
}

ffi::Error RaggedImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k,
                      ffi::AnyBuffer v, ffi::Buffer<ffi::F32> ks, ffi::Buffer<ffi::F32> vs,
                      ffi::Buffer<ffi::S32> tables, ffi::Buffer<ffi::S32> lens,
                      ffi::Buffer<ffi::S32> qsl, ffi::Buffer<ffi::S32> window,
                      ffi::Result<ffi::AnyBuffer> out, float scale, float soft_cap,
                      int64_t max_query_len, int64_t tile_rows, int64_t max_threads) {
  Problem p;
  const int64_t num_seqs = tables.dimensions()[0];
  if (lens.element_count() != size_t(num_seqs) || qsl.element_count() != size_t(num_seqs + 1)) {
    return ffi::Error::InvalidArgument(
        "ragged paged attention: block_tables, context_lens, query_start_loc disagree");
  }
  if (tile_rows < 1 || max_query_len < 1) {
    return ffi::Error::InvalidArgument("ragged paged attention: tile_rows, max_query_len >= 1");
  }
  ffi::Error err = make_problem(q, k, v, ks, vs, tables, window.typed_data()[0], *out, scale,
                                soft_cap, &p);
  if (!err.success() || num_seqs == 0) return err;
  const std::vector<Task> tasks =
      ragged_tasks(qsl.typed_data(), lens.typed_data(), num_seqs, q.dimensions()[0],
                   max_query_len, p.num_kv_heads, tile_rows);
  return run(pool, p, k.element_type(), tasks, max_threads);
}

// The operands both handlers take first: the thread pool, the queries, the paged KV (with an
// 8-bit pool's scales; an unread f32[1] each for a float pool), the block tables, the lengths.
auto BindPagedAttention() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()         // q
      .Arg<ffi::AnyBuffer>()         // k_pages
      .Arg<ffi::AnyBuffer>()         // v_pages
      .Arg<ffi::Buffer<ffi::F32>>()  // k_scales (8-bit pool)
      .Arg<ffi::Buffer<ffi::F32>>()  // v_scales
      .Arg<ffi::Buffer<ffi::S32>>()  // block_tables
      .Arg<ffi::Buffer<ffi::S32>>();   // context_lens
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionDecode, DecodeImpl,
                              BindPagedAttention()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding window, i32[1]
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("max_threads"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(PagedAttentionRagged, RaggedImpl,
                              BindPagedAttention()
                                  .Arg<ffi::Buffer<ffi::S32>>()   // query_start_loc
                                  .Arg<ffi::Buffer<ffi::S32>>()   // sliding window, i32[1]
                                  .Ret<ffi::AnyBuffer>()          // out
                                  .Attr<float>("scale")
                                  .Attr<float>("soft_cap")
                                  .Attr<int64_t>("max_query_len")
                                  .Attr<int64_t>("tile_rows")
                                  .Attr<int64_t>("max_threads"));
