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
// per-thread copies to reduce.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
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

template <typename scalar_t, typename acc_t>
void forward(const scalar_t* value, const int64_t* shapes, const int64_t* starts,
             const scalar_t* loc, const scalar_t* attn, scalar_t* out, int64_t B, int64_t S,
             int64_t M, int64_t D, int64_t Lq, int64_t L, int64_t P) {
  at::parallel_for(0, B * Lq, 8, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> acc(D);
    Corners<acc_t> c;
    for (int64_t n = begin; n < end; ++n) {
      const int64_t b = n / Lq;
      for (int64_t m = 0; m < M; ++m) {
        for (int64_t d = 0; d < D; ++d) acc[d] = acc_t(0);
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
              const acc_t aw = a * c.w[k];
              const scalar_t* v = base + c.row[k] * M * D;
#pragma omp simd
              for (int64_t d = 0; d < D; ++d)
                acc[d] = std::fma(aw, static_cast<acc_t>(v[d]), acc[d]);
            }
          }
        }
        scalar_t* o = out + (n * M + m) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[d]);
      }
    }
  });
}

// grad_value is (B, S, M, D) in acc_t, zeroed by the caller; grad_loc and grad_attn are fully
// written here.
template <typename scalar_t, typename acc_t>
void backward(const scalar_t* grad_out, const scalar_t* value, const int64_t* shapes,
              const int64_t* starts, const scalar_t* loc, const scalar_t* attn,
              acc_t* grad_value, scalar_t* grad_loc, scalar_t* grad_attn, int64_t B, int64_t S,
              int64_t M, int64_t D, int64_t Lq, int64_t L, int64_t P) {
  at::parallel_for(0, B * M * L, 1, [&](int64_t begin, int64_t end) {
    std::vector<acc_t> go(D);
    Corners<acc_t> c;
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t / (M * L), m = (t / L) % M, l = t % L;
      const int64_t H = shapes[2 * l], W = shapes[2 * l + 1];
      const int64_t first = ((b * S + starts[l]) * M + m) * D;
      const scalar_t* vbase = value + first;
      acc_t* gbase = grad_value + first;
      for (int64_t q = 0; q < Lq; ++q) {
        const int64_t n = b * Lq + q;
        const scalar_t* g = grad_out + (n * M + m) * D;
        for (int64_t d = 0; d < D; ++d) go[d] = static_cast<acc_t>(g[d]);
        for (int64_t p = 0; p < P; ++p) {
          const int64_t i = ((n * M + m) * L + l) * P + p;
          const acc_t x = pixel(static_cast<acc_t>(loc[2 * i]), W);
          const acc_t y = pixel(static_cast<acc_t>(loc[2 * i + 1]), H);
          acc_t ga = 0, gx = 0, gy = 0;
          if (corners(x, y, H, W, c)) {
            const acc_t a = static_cast<acc_t>(attn[i]);
            for (int k = 0; k < 4; ++k) {
              if (c.row[k] < 0) continue;
              const scalar_t* v = vbase + c.row[k] * M * D;
              acc_t* gv = gbase + c.row[k] * M * D;
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
        static_cast<acc_t*>(grad_value), static_cast<scalar_t*>(grad_loc),                  \
        static_cast<scalar_t*>(grad_attn), B, S, M, D, Lq, L, P);                            \
  }

QKV_DEFORMABLE_ENTRIES(float32, float, float)
QKV_DEFORMABLE_ENTRIES(float64, double, double)
QKV_DEFORMABLE_ENTRIES(bfloat16, c10::BFloat16, float)
QKV_DEFORMABLE_ENTRIES(float16, c10::Half, float)
