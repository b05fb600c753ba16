// A dense projection on the CPU, y [M, N] = x [M, K] @ w, with w packed as
// panels of 32 columns: wp [P, K, 32], panel p holding columns 32p..32p+31
// (`jaxinfer.native.pack_panels`; y has P * 32 columns). An XLA FFI custom
// call (`jaxinfer.native.panel_matmul`).
//
// Why panels: at decode (a few rows) a projection is memory-bound, and each
// panel is one contiguous stream of 128 KB (K = 1024), read once by one core
// while the rows' 8 x 32 results stay in 16 vector registers over the whole
// depth. XLA:CPU's dot at 8 rows streamed bench_dense's weights at ~30 GB/s
// on the 2-core Zen 5 EPYC, these panels at ~43; strided 32-column strips of
// an unpacked [K, N] weight at ~32. More rows run in blocks of 8 over a
// panel, the panel then coming from cache. Panels are claimed from a shared
// counter by the calling thread and helpers on XLA's intra-op thread pool.

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

constexpr int kPanel = 32;   // columns of one panel
constexpr int kBlock = 8;    // rows multiplied per pass over a panel
constexpr int kAhead = 512;  // floats prefetched ahead of the panel stream (2 KB)

#ifdef __AVX512F__
// y[R, 32] = x[R, K] @ panel[K, 32]: R x 2 vector accumulators over the
// whole depth (x rows of stride ldx, y rows of stride ldy).
template <int R>
void Tile(const float* x, int64_t ldx, int64_t K, const float* panel, float* y, int64_t ldy,
          bool prefetch) {
  __m512 lo[R], hi[R];
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; ++k) {
    const float* w = panel + k * kPanel;
    if (prefetch) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + 16), _MM_HINT_T0);
    }
    const __m512 w0 = _mm512_loadu_ps(w), w1 = _mm512_loadu_ps(w + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 xv = _mm512_set1_ps(x[r * ldx + k]);
      lo[r] = _mm512_fmadd_ps(xv, w0, lo[r]);
      hi[r] = _mm512_fmadd_ps(xv, w1, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(y + r * ldy, lo[r]);
    _mm512_storeu_ps(y + r * ldy + 16, hi[r]);
  }
}
#else
template <int R>
void Tile(const float* x, int64_t ldx, int64_t K, const float* panel, float* y, int64_t ldy,
          bool) {
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < K; ++k)
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < kPanel; ++c) acc[r][c] += x[r * ldx + k] * panel[k * kPanel + c];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < kPanel; ++c) y[r * ldy + c] = acc[r][c];
}
#endif

using TileFn = void (*)(const float*, int64_t, int64_t, const float*, float*, int64_t, bool);
constexpr TileFn kTiles[kBlock + 1] = {nullptr,  Tile<1>, Tile<2>, Tile<3>, Tile<4>,
                                       Tile<5>, Tile<6>, Tile<7>, Tile<8>};

struct Work {
  const float* x;
  const float* wp;
  float* y;
  int64_t M, K, P;
  std::atomic<int64_t> next{0}, done{0};

  // Claims panels until none is left; each panel's rows in blocks of kBlock,
  // the first block streaming the panel from memory (prefetched ahead).
  void Drain() {
    const int64_t N = P * kPanel;
    for (int64_t p; (p = next.fetch_add(1)) < P;) {
      const float* panel = wp + p * K * kPanel;
      for (int64_t r0 = 0; r0 < M; r0 += kBlock) {
        const int rows = static_cast<int>(std::min<int64_t>(kBlock, M - r0));
        kTiles[rows](x + r0 * K, K, K, panel, y + r0 * N + p * kPanel, N, r0 == 0);
      }
      done.fetch_add(1, std::memory_order_release);
    }
  }
};

ffi::Error PanelMatMulImpl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x,
                           ffi::Buffer<ffi::F32> wp, ffi::ResultBuffer<ffi::F32> y) {
  const auto xd = x.dimensions();
  const auto wd = wp.dimensions();
  if (xd.size() != 2) return ffi::Error::InvalidArgument("panel matmul: x must be [M, K]");
  if (wd.size() != 3 || wd[1] != xd[1] || wd[2] != kPanel)
    return ffi::Error::InvalidArgument("panel matmul: w must be panels [P, K, 32] of x's K");
  auto work = std::make_shared<Work>();
  work->x = x.typed_data();
  work->wp = wp.typed_data();
  work->y = y->typed_data();
  work->M = xd[0];
  work->K = xd[1];
  work->P = wd[0];
  if (work->M == 0 || work->P == 0) return ffi::Error::Success();
  const int64_t helpers = std::min<int64_t>(pool.num_threads(), work->P) - 1;
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([work] { work->Drain(); });
  work->Drain();
  while (work->done.load(std::memory_order_acquire) < work->P) std::this_thread::yield();
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxinferPanelMatMul, PanelMatMulImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());
