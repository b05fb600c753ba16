// Routed experts of a MoE layer on the CPU, decode and prefill: an XLA FFI
// custom call (`jaxinfer.native.split_experts_ffn`).
//
// xs [M, D] float32 holds the token copies sorted by expert; sizes [E] int32
// the copies of each expert, in that order (rows past their sum are padding
// and come back zero). The remaining arguments are the E experts' fused
// gate-up weights [D, 2F] then their down weights [F, D], one array each, as
// the Engine's `SplitExperts` holds them. ys [M, D] = down(act(gate, up)).
//
// Each chosen expert is one task. Up to 8 rows: its weights are read once for
// all of them, row by row of W with the rows' accumulators in L1, 4 rows of W
// per pass over them (memory-bound: decode). More rows (prefill), with
// AVX-512: 64-column panels of W, each copied contiguous while the next one
// is prefetched, against blocks of 6 rows, the 6 x 64 results in 24 vector
// registers over the whole depth (compute-bound; each row computed once, no
// padding). Tasks are claimed from a shared counter (one ahead, to know what
// to prefetch) by the calling thread and by helpers on XLA's intra-op thread
// pool, so each core streams a different expert's weights.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kRows = 8;    // rows of one expert multiplied per pass over W
constexpr int kCols = 1024;  // output columns accumulated at once

// acc[r][0:n] += sum_d x[r][d] * w[d][c0 + 0:n] over d < depth; x rows of
// stride ldx, w rows of stride ldw.
void AccumulateBlock(const float* x, int64_t ldx, int rows, const float* w, int64_t ldw,
                     int64_t depth, int n, float (*acc)[kCols]) {
  int64_t d = 0;
  for (; d + 4 <= depth; d += 4) {
    const float* w0 = w + d * ldw;
    const float* w1 = w0 + ldw;
    const float* w2 = w1 + ldw;
    const float* w3 = w2 + ldw;
    for (int r = 0; r < rows; ++r) {
      const float* xr = x + r * ldx + d;
      const float a0 = xr[0], a1 = xr[1], a2 = xr[2], a3 = xr[3];
      float* out = acc[r];
#pragma GCC ivdep
      for (int c = 0; c < n; ++c) out[c] += a0 * w0[c] + a1 * w1[c] + a2 * w2[c] + a3 * w3[c];
    }
  }
  for (; d < depth; ++d) {
    const float* w0 = w + d * ldw;
    for (int r = 0; r < rows; ++r) {
      const float a0 = x[r * ldx + d];
      float* out = acc[r];
#pragma GCC ivdep
      for (int c = 0; c < n; ++c) out[c] += a0 * w0[c];
    }
  }
}

// y[rows, N] = x[rows, K] @ w[K, N] (row-major, y of stride ldy).
void MatMul(const float* x, int64_t ldx, int rows, const float* w, int64_t K, int64_t N,
            float* y, int64_t ldy) {
  alignas(64) float acc[kRows][kCols];
  for (int64_t c0 = 0; c0 < N; c0 += kCols) {
    const int n = static_cast<int>(std::min<int64_t>(kCols, N - c0));
    for (int r = 0; r < rows; ++r) std::memset(acc[r], 0, sizeof(float) * n);
    AccumulateBlock(x, ldx, rows, w + c0, N, K, n, acc);
    for (int r = 0; r < rows; ++r) std::memcpy(y + r * ldy + c0, acc[r], sizeof(float) * n);
  }
}

#ifdef __AVX512F__
// The cache lines of the next 64-column panel of W, touched a few at a time
// while the current panel's row blocks compute, so that reading W from
// memory overlaps the arithmetic (copying a panel waits on memory
// otherwise: ~10 of ~53 ms in a bench_moe layer of 1024 tokens).
struct PanelPrefetch {
  const char* base = nullptr;
  int64_t stride = 0, lines = 0, next = 0;
  int mask = 0;  // one line every mask + 1 steps of the depth loop

  void Set(const float* w, int64_t K, int64_t N, int64_t steps) {
    base = reinterpret_cast<const char*>(w);
    stride = N * sizeof(float);
    lines = 4 * K;  // 64 floats: 4 lines a row
    next = 0;
    mask = steps >= 4 * lines ? 3 : steps >= 2 * lines ? 1 : 0;
  }
  void Step(int64_t d) {
    if ((d & mask) == 0 && next < lines) {
      _mm_prefetch(base + (next >> 2) * stride + (next & 3) * 64, _MM_HINT_T1);
      ++next;
    }
  }
};

// y[MR, 64] = x[MR, K] @ w[K, 64]: MR x 4 vector accumulators in registers
// over the whole depth (x rows of stride ldx, w a packed [K, 64] panel, y
// rows of stride ldy).
template <int MR>
void MicroTile(const float* x, int64_t ldx, const float* w, int64_t K, float* y, int64_t ldy,
               PanelPrefetch& pf) {
  __m512 acc[MR][4];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t d = 0; d < K; ++d) {
    pf.Step(d);
    const float* wd = w + d * 64;
    const __m512 b0 = _mm512_load_ps(wd), b1 = _mm512_load_ps(wd + 16);
    const __m512 b2 = _mm512_load_ps(wd + 32), b3 = _mm512_load_ps(wd + 48);
    for (int r = 0; r < MR; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + d]);
      acc[r][0] = _mm512_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, b1, acc[r][1]);
      acc[r][2] = _mm512_fmadd_ps(a, b2, acc[r][2]);
      acc[r][3] = _mm512_fmadd_ps(a, b3, acc[r][3]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(y + r * ldy + 16 * j, acc[r][j]);
}

constexpr bool kTiled = true;

// MatMul for many rows: each 64-column panel of w copied contiguous (from
// cache: it was prefetched while the panel before computed), then its blocks
// of 6 rows on register tiles; the remaining columns as MatMul does. then:
// the matrix [K2, N2] multiplied next, whose first panel is prefetched
// during the last one (nullptr: none).
void MatMulTiled(const float* x, int64_t ldx, int rows, const float* w, int64_t K, int64_t N,
                 float* y, int64_t ldy, const float* then, int64_t K2, int64_t N2) {
  const int64_t n64 = N / 64 * 64;
  static thread_local std::vector<float> packed;
  packed.resize(K * 64 + 16);
  float* pw = packed.data() + ((16 - (reinterpret_cast<uintptr_t>(packed.data()) / 4) % 16) % 16);
  const int64_t steps = (rows + 5) / 6 * K;  // depth steps a panel computes
  PanelPrefetch pf;
  for (int64_t c0 = 0; c0 < n64; c0 += 64) {
    if (c0 + 64 < n64) {
      pf.Set(w + c0 + 64, K, N, steps);
    } else if (then != nullptr && N2 >= 64) {
      pf.Set(then, K2, N2, steps);
    } else {
      pf.lines = 0;
    }
    for (int64_t d = 0; d < K; ++d) std::memcpy(pw + d * 64, w + d * N + c0, 64 * sizeof(float));
    for (int r0 = 0; r0 < rows; r0 += 6) {
      const float* xr = x + r0 * ldx;
      float* yr = y + r0 * ldy + c0;
      switch (std::min(6, rows - r0)) {
        case 6: MicroTile<6>(xr, ldx, pw, K, yr, ldy, pf); break;
        case 5: MicroTile<5>(xr, ldx, pw, K, yr, ldy, pf); break;
        case 4: MicroTile<4>(xr, ldx, pw, K, yr, ldy, pf); break;
        case 3: MicroTile<3>(xr, ldx, pw, K, yr, ldy, pf); break;
        case 2: MicroTile<2>(xr, ldx, pw, K, yr, ldy, pf); break;
        default: MicroTile<1>(xr, ldx, pw, K, yr, ldy, pf); break;
      }
    }
  }
  if (n64 == N) return;
  alignas(64) float acc[kRows][kCols];
  const int n = static_cast<int>(N - n64);
  for (int r0 = 0; r0 < rows; r0 += kRows) {
    const int m = std::min(kRows, rows - r0);
    for (int r = 0; r < m; ++r) std::memset(acc[r], 0, sizeof(float) * n);
    AccumulateBlock(x + r0 * ldx, ldx, m, w + n64, N, K, n, acc);
    for (int r = 0; r < m; ++r) std::memcpy(y + (r0 + r) * ldy + n64, acc[r], sizeof(float) * n);
  }
}
#else
constexpr bool kTiled = false;
void MatMulTiled(const float*, int64_t, int, const float*, int64_t, int64_t, float*, int64_t,
                 const float*, int64_t, int64_t) {}
#endif

struct Activation {
  int64_t kind;  // 0: SwiGLU; 1: GPT-OSS's clamped variant
  float limit, alpha;

  float operator()(float gate, float up) const {
    if (kind == 0) return gate / (1.0f + std::exp(-gate)) * up;
    gate = std::min(gate, limit);
    up = std::min(std::max(up, -limit), limit);
    return (up + 1.0f) * (gate / (1.0f + std::exp(-gate * alpha)));
  }
};

struct Task {
  int64_t start, rows, expert;
};

struct Work {
  const float* xs;
  float* ys;
  int64_t D, F;
  Activation act;
  std::vector<const float*> gate_up, down;
  std::vector<Task> tasks;
  std::atomic<int64_t> next{0}, done{0};

  // g[rows, F] = act(gate, up) of h[rows, 2F] (gate columns first).
  void Activate(const float* h, int64_t rows, float* g) const {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t f = 0; f < F; ++f) g[r * F + f] = act(h[r * 2 * F + f], h[r * 2 * F + F + f]);
  }

  // after: the task this thread runs after t (its first weights prefetched).
  void RunExpert(const Task& t, const Task* after, std::vector<float>& h, std::vector<float>& g) {
    const float* wgu = gate_up[t.expert];
    const float* wd = down[t.expert];
    if (kTiled && t.rows > kRows) {  // compute-bound: register tiles, all rows at once
      const int rows = static_cast<int>(t.rows);
      h.resize(rows * 2 * F);
      g.resize(rows * F);
      MatMulTiled(xs + t.start * D, D, rows, wgu, D, 2 * F, h.data(), 2 * F, wd, F, D);
      Activate(h.data(), rows, g.data());
      MatMulTiled(g.data(), F, rows, wd, F, D, ys + t.start * D, D,
                  after != nullptr && after->rows > kRows ? gate_up[after->expert] : nullptr, D,
                  2 * F);
      return;
    }
    for (int64_t r0 = 0; r0 < t.rows; r0 += kRows) {
      const int rows = static_cast<int>(std::min<int64_t>(kRows, t.rows - r0));
      const float* x = xs + (t.start + r0) * D;
      MatMul(x, D, rows, wgu, D, 2 * F, h.data(), 2 * F);
      Activate(h.data(), rows, g.data());
      MatMul(g.data(), F, rows, wd, F, D, ys + (t.start + r0) * D, D);
    }
  }

  // Claims tasks until none is left.
  void Drain() {
    std::vector<float> h(kRows * 2 * F), g(kRows * F);
    const int64_t n = static_cast<int64_t>(tasks.size());
    // a thread claims its next task before it runs the current one, so that
    // it can prefetch the next one's first weights
    for (int64_t i = next.fetch_add(1), j; i < n; i = j) {
      j = next.fetch_add(1);
      RunExpert(tasks[i], j < n ? &tasks[j] : nullptr, h, g);
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error SplitExpertsImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> xs,
                            ffi::Buffer<ffi::S32> sizes, ffi::RemainingArgs weights,
                            ffi::ResultBuffer<ffi::F32> ys, int64_t activation, float limit,
                            float alpha) {
  const auto xdims = xs.dimensions();
  if (xdims.size() != 2) return ffi::Error::InvalidArgument("xs must be [M, D]");
  const int64_t M = xdims[0], D = xdims[1];
  const int64_t E = static_cast<int64_t>(sizes.element_count());
  if (static_cast<int64_t>(weights.size()) != 2 * E)
    return ffi::Error::InvalidArgument("expected E gate-up and E down weight arrays");
  auto work = std::make_shared<Work>();
  work->xs = xs.typed_data();
  work->ys = ys->typed_data();
  work->D = D;
  work->act = Activation{activation, limit, alpha};
  for (int64_t e = 0; e < 2 * E; ++e) {
    auto w = weights.get<ffi::Buffer<ffi::F32>>(e);
    if (w.has_error()) return w.error();
    const auto dims = w->dimensions();
    if (dims.size() != 2) return ffi::Error::InvalidArgument("expert weights must be matrices");
    if (e == E) work->F = dims[0];
    (e < E ? work->gate_up : work->down).push_back(w->typed_data());
  }
  const int64_t F = work->F;
  for (int64_t e = 0; e < 2 * E; ++e) {
    const auto dims = weights.get<ffi::Buffer<ffi::F32>>(e)->dimensions();
    const bool ok = e < E ? (dims[0] == D && dims[1] == 2 * F) : (dims[0] == F && dims[1] == D);
    if (!ok) return ffi::Error::InvalidArgument("expert weights must be [D, 2F] and [F, D]");
  }
  const int32_t* n = sizes.typed_data();
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    if (n[e] < 0) return ffi::Error::InvalidArgument("negative expert size");
    if (n[e] > 0) work->tasks.push_back(Task{start, n[e], e});
    start += n[e];
  }
  if (start > M) return ffi::Error::InvalidArgument("expert sizes add up to more than xs's rows");
  std::memset(work->ys + start * D, 0, sizeof(float) * (M - start) * D);
  const int64_t tasks = static_cast<int64_t>(work->tasks.size());
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), tasks) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < tasks) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

// Whether experts of many rows run on register tiles (AVX-512), else row by row.
extern "C" int JaxinferSplitExpertsTiled() { return kTiled ? 1 : 0; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferSplitExperts, SplitExpertsImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("activation")
                                  .Attr<float>("limit")
                                  .Attr<float>("alpha"));
