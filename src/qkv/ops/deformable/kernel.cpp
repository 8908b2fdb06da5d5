// Multi-scale deformable attention on CPU: forward and a deterministic backward.
//
// Built by qkv/ops/deformable/native.py through torch.utils.cpp_extension at first use, and
// called through ctypes on raw pointers (so the build needs no pybind11 and no torch/extension.h,
// and takes seconds). Layouts are mmcv's, contiguous:
//   value (B, S, M, D); shapes (L, 2) int64 as (H, W); starts (L,) int64;
//   loc (B, Lq, M, L, P, 2) as (x, y) in [0, 1]; attn (B, Lq, M, L, P); out (B, Lq, M, D).
// Sampling is F.grid_sample's (bilinear, align_corners=False, zeros outside the map): pixel
// coordinates are loc * (W, H) - 0.5, and a corner outside the map is never read.
//
// Rounding: built with -ffp-contract=off, so that no product is fused into an add unless
// written so (std::fma in the inner loops): the coordinates round as grid_sample's do, on every
// compiler.
//
// Precision: half types (c10::Half, c10::BFloat16) are read as they are and accumulated in
// float; float and double accumulate in their own type. Every output element is summed by one
// thread in a fixed order, so results do not depend on the thread count.
//
// Determinism of the backward: the value gradient of head m and level l of batch b is written
// only by the task (b, m, l), which walks the queries in order; there are no atomics and no
// per-thread copies to reduce. Its gradients for the locations and weights of (b, m, l) are
// written by the same task.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

namespace {

template <typename acc_t>
struct Corners {
  int64_t row[4];   // pixel index within the level, or -1 outside the map
  acc_t w[4];       // bilinear weights
  acc_t dwx[4];     // d w / d x (pixels)
  acc_t dwy[4];     // d w / d y (pixels)
};

// Pixel coordinate of a location in [0, 1] over a map of `size` pixels, rounded as grid_sample
// rounds it (grid = 2 * loc - 1, then ((grid + 1) * size - 1) / 2): a point on a pixel centre
// or edge then falls on the same side of it, and takes the same one-sided derivative.
template <typename acc_t>
inline acc_t pixel(acc_t loc, int64_t size) {
  const acc_t grid = acc_t(2) * loc - acc_t(1);
  return ((grid + acc_t(1)) * acc_t(size) - acc_t(1)) / acc_t(2);
}

// Corners of a sample at pixel coordinates (x, y); false if none can touch the map (NaN too).
template <typename acc_t>
inline bool corners(acc_t x, acc_t y, int64_t H, int64_t W, Corners<acc_t>& c) {
  if (!(x >= acc_t(-1) && x < acc_t(W) && y >= acc_t(-1) && y < acc_t(H))) return false;
  const acc_t xf = std::floor(x), yf = std::floor(y);
  const int64_t x0 = static_cast<int64_t>(xf), y0 = static_cast<int64_t>(yf);
  const acc_t fx = x - xf, fy = y - yf, gx = acc_t(1) - fx, gy = acc_t(1) - fy;
  const int64_t xs[4] = {x0, x0 + 1, x0, x0 + 1};
  const int64_t ys[4] = {y0, y0, y0 + 1, y0 + 1};
  const acc_t w[4] = {gy * gx, gy * fx, fy * gx, fy * fx};
  const acc_t dwx[4] = {-gy, gy, -fy, fy};
  const acc_t dwy[4] = {-gx, -fx, gx, fx};
  for (int k = 0; k < 4; ++k) {
    const bool in = xs[k] >= 0 && xs[k] < W && ys[k] >= 0 && ys[k] < H;
    c.row[k] = in ? ys[k] * W + xs[k] : -1;
    c.w[k] = w[k];
    c.dwx[k] = dwx[k];
    c.dwy[k] = dwy[k];
  }
  return true;
}

// Asks for the cache lines of a row of D elements. The samples of a query land anywhere on
// the maps, so nearly every corner row is a cache miss; naming the rows of the next query (or
// head) before summing this one's keeps many misses in flight instead of one at a time.
template <typename T>
inline void prefetch_row(const T* row, int64_t D) {
#if defined(__GNUC__)
  const char* bytes = reinterpret_cast<const char*>(row);
  for (int64_t o = 0; o < D * static_cast<int64_t>(sizeof(T)); o += 64) __builtin_prefetch(bytes + o);
#endif
}

// The corner rows and weights of all L * P samples of one (query, head), in (l, p, corner)
// order, corners outside the maps left out.
template <typename scalar_t, typename acc_t>
struct Gathered {
  std::vector<const scalar_t*> rows;
  std::vector<acc_t> weights;
  int64_t count = 0;

  explicit Gathered(int64_t samples) : rows(4 * samples), weights(4 * samples) {}

  void collect(const scalar_t* value, const int64_t* shapes, const int64_t* starts,
               const scalar_t* loc, const scalar_t* attn, int64_t n, int64_t m, int64_t b,
               int64_t S, int64_t M, int64_t D, int64_t L, int64_t P) {
    Corners<acc_t> c;
    count = 0;
    for (int64_t l = 0; l < L; ++l) {
      const int64_t H = shapes[2 * l], W = shapes[2 * l + 1];
      const scalar_t* base = value + ((b * S + starts[l]) * M + m) * D;
      for (int64_t p = 0; p < P; ++p) {
        const int64_t i = ((n * M + m) * L + l) * P + p;
        const acc_t x = pixel(static_cast<acc_t>(loc[2 * i]), W);
        const acc_t y = pixel(static_cast<acc_t>(loc[2 * i + 1]), H);
        if (!corners(x, y, H, W, c)) continue;
        const acc_t a = static_cast<acc_t>(attn[i]);
        for (int k = 0; k < 4; ++k) {
          if (c.row[k] < 0) continue;
          rows[count] = base + c.row[k] * M * D;
          weights[count] = a * c.w[k];
          prefetch_row(rows[count], D);
          ++count;
        }
      }
    }
  }
};

template <typename scalar_t, typename acc_t>
void forward(const scalar_t* value, const int64_t* shapes, const int64_t* starts,
             const scalar_t* loc, const scalar_t* attn, scalar_t* out, int64_t B, int64_t S,
             int64_t M, int64_t D, int64_t Lq, int64_t L, int64_t P) {
  at::parallel_for(0, B * Lq * M, 64, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(D);
    Gathered<scalar_t, acc_t> now(L * P), next(L * P);
    // j = n * M + m runs over (query, head); the next one's rows are asked for first
    next.collect(value, shapes, starts, loc, attn, begin / M, begin % M, begin / M / Lq, S, M, D,
                 L, P);
    for (int64_t j = begin; j < end; ++j) {
      std::swap(now, next);
      if (j + 1 < end) {
        const int64_t n = (j + 1) / M;
        next.collect(value, shapes, starts, loc, attn, n, (j + 1) % M, n / Lq, S, M, D, L, P);
      }
      for (int64_t d = 0; d < D; ++d) acc[d] = acc_t(0);
      for (int64_t k = 0; k < now.count; ++k) {
        const scalar_t* v = now.rows[k];
        const acc_t w = now.weights[k];
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) acc[d] = std::fma(w, static_cast<acc_t>(v[d]), acc[d]);
      }
      scalar_t* o = out + j * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[d]);
    }
  });
}

// The P samples of one query at one (batch, head, level), for the backward.
template <typename acc_t>
struct Points {
  std::vector<Corners<acc_t>> at;
  std::vector<acc_t> a;
  std::vector<char> touches;  // does the sample touch the map at all

  explicit Points(int64_t P) : at(P), a(P), touches(P) {}

  // vbase and gbase: row 0 of the level's value and value-gradient, rows vstride and
  // gstride elements apart
  template <typename scalar_t>
  void collect(const scalar_t* vbase, int64_t vstride, const acc_t* gbase, int64_t gstride,
               const scalar_t* loc, const scalar_t* attn, int64_t i0, int64_t H, int64_t W,
               int64_t D, int64_t P) {
    for (int64_t p = 0; p < P; ++p) {
      const int64_t i = i0 + p;
      const acc_t x = pixel(static_cast<acc_t>(loc[2 * i]), W);
      const acc_t y = pixel(static_cast<acc_t>(loc[2 * i + 1]), H);
      Corners<acc_t>& c = at[p];
      touches[p] = corners(x, y, H, W, c);
      a[p] = static_cast<acc_t>(attn[i]);
      if (!touches[p]) continue;
      for (int k = 0; k < 4; ++k) {
        if (c.row[k] < 0) continue;
        prefetch_row(vbase + c.row[k] * vstride, D);
        prefetch_row(gbase + c.row[k] * gstride, D);
      }
    }
  }
};

// grad_value (B, S, M, D), grad_loc and grad_attn are fully written here (no zeroing needed).
//
// Task (b, m, l) accumulates the value gradient of its head and level in a compact buffer of
// its own, H * W rows of D in acc_t (3 MiB for BEVFormer's largest map in float32) instead of
// rows M * D apart in grad_value: the random read-modify-writes stay in cache, half types need
// no float32 copy of the whole gradient, and the slice is written out once, rounded once.
template <typename scalar_t, typename acc_t>
void backward(const scalar_t* grad_out, const scalar_t* value, const int64_t* shapes,
              const int64_t* starts, const scalar_t* loc, const scalar_t* attn,
              scalar_t* grad_value, scalar_t* grad_loc, scalar_t* grad_attn, int64_t B,
              int64_t S, int64_t M, int64_t D, int64_t Lq, int64_t L, int64_t P) {
  at::parallel_for(0, B * M * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> go(D), buf;
    Points<acc_t> now(P), next(P);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (M * L), m = (t / L) % M, l = t % L;
      const int64_t H = shapes[2 * l], W = shapes[2 * l + 1];
      const int64_t first = ((b * S + starts[l]) * M + m) * D;
      const scalar_t* vbase = value + first;
      buf.assign(H * W * D, acc_t(0));
      acc_t* gbase = buf.data();
      // the first sample of query q at (b, m, l): ((n * M + m) * L + l) * P with n = b * Lq + q
      auto first_sample = [&](int64_t q) { return (((b * Lq + q) * M + m) * L + l) * P; };
      if (Lq > 0) next.collect(vbase, M * D, gbase, D, loc, attn, first_sample(0), H, W, D, P);
      for (int64_t q = 0; q < Lq; ++q) {
        std::swap(now, next);
        if (q + 1 < Lq)
          next.collect(vbase, M * D, gbase, D, loc, attn, first_sample(q + 1), H, W, D, P);
        const int64_t n = b * Lq + q;
        const scalar_t* g = grad_out + (n * M + m) * D;
        for (int64_t d = 0; d < D; ++d) go[d] = static_cast<acc_t>(g[d]);
        for (int64_t p = 0; p < P; ++p) {
          const int64_t i = first_sample(q) + p;
          acc_t ga = 0, gx = 0, gy = 0;
          if (now.touches[p]) {
            const Corners<acc_t>& c = now.at[p];
            const acc_t a = now.a[p];
            for (int k = 0; k < 4; ++k) {
              if (c.row[k] < 0) continue;
              const scalar_t* v = vbase + c.row[k] * M * D;
              acc_t* gv = gbase + c.row[k] * D;
              const acc_t aw = a * c.w[k];
              acc_t dot = 0;
#pragma omp simd reduction(+ : dot)
              for (int64_t d = 0; d < D; ++d) {
                dot = std::fma(static_cast<acc_t>(v[d]), go[d], dot);
                gv[d] = std::fma(aw, go[d], gv[d]);
              }
              ga += c.w[k] * dot;
              gx += c.dwx[k] * dot;
              gy += c.dwy[k] * dot;
            }
            gx *= a * acc_t(W);
            gy *= a * acc_t(H);
          }
          grad_attn[i] = static_cast<scalar_t>(ga);
          grad_loc[2 * i] = static_cast<scalar_t>(gx);
          grad_loc[2 * i + 1] = static_cast<scalar_t>(gy);
        }
      }
      scalar_t* out = grad_value + first;
      for (int64_t r = 0; r < H * W; ++r)
        for (int64_t d = 0; d < D; ++d) out[r * M * D + d] = static_cast<scalar_t>(buf[r * D + d]);
    }
  });
}

}  // namespace

#define QKV_DEFORMABLE_ENTRIES(NAME, scalar_t, acc_t)                                         \
  extern "C" void qkv_deformable_forward_##NAME(                                             \
      const void* value, const int64_t* shapes, const int64_t* starts, const void* loc,      \
      const void* attn, void* out, int64_t B, int64_t S, int64_t M, int64_t D, int64_t Lq,   \
      int64_t L, int64_t P) {                                                                \
    forward<scalar_t, acc_t>(static_cast<const scalar_t*>(value), shapes, starts,            \
                             static_cast<const scalar_t*>(loc),                              \
                             static_cast<const scalar_t*>(attn), static_cast<scalar_t*>(out), \
                             B, S, M, D, Lq, L, P);                                          \
  }                                                                                          \
  extern "C" void qkv_deformable_backward_##NAME(                                            \
      const void* grad_out, const void* value, const int64_t* shapes, const int64_t* starts, \
      const void* loc, const void* attn, void* grad_value, void* grad_loc, void* grad_attn,  \
      int64_t B, int64_t S, int64_t M, int64_t D, int64_t Lq, int64_t L, int64_t P) {        \
    backward<scalar_t, acc_t>(                                                               \
        static_cast<const scalar_t*>(grad_out), static_cast<const scalar_t*>(value), shapes, \
        starts, static_cast<const scalar_t*>(loc), static_cast<const scalar_t*>(attn),       \
        static_cast<scalar_t*>(grad_value), static_cast<scalar_t*>(grad_loc),                  \
        static_cast<scalar_t*>(grad_attn), B, S, M, D, Lq, L, P);                            \
  }

QKV_DEFORMABLE_ENTRIES(float32, float, float)
QKV_DEFORMABLE_ENTRIES(float64, double, double)
QKV_DEFORMABLE_ENTRIES(bfloat16, c10::BFloat16, float)
QKV_DEFORMABLE_ENTRIES(float16, c10::Half, float)
