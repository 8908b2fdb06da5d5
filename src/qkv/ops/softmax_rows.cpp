// The softmax of rows of float32/float64 scores in place, each row's largest score kept: the one
// pass over a block of scores that the one-pass weights (ops/reference.py,
// attention_with_weights) take on the CPU, where torch's ops take two (amax, then the softmax;
// at 8 heads x 4096 x 4096 float32 scores the amax was 72 ms of a 860 ms call).
//
// Built by qkv/ops/softmax_rows.py through torch.utils.cpp_extension at first use
// (ops/_native_build.py) and called through ctypes on raw pointers. A row of S scores, S >= 1:
//   max = the largest score (NaN if one is NaN);
//   max == -inf (no key): every weight 0;
//   else weights exp(s - max) / sum (a row whose max is +inf or NaN: NaN throughout, as in torch's
//   softmax).
// Each row is read from memory once: its max, exps and the division run over it in cache.
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512  // at::vec's 512-bit Vectorized (its own namespace, not libtorch's)
#elif defined(__AVX2__) && !defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <cmath>
#include <cstdint>
#include <limits>

namespace {

template <typename T>
void softmax_row(T* x, int64_t S, T* row_max) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t kV = Vec::size();
  const T inf = std::numeric_limits<T>::infinity();
  Vec vm(-inf);
  int64_t i = 0;
  for (; i + kV <= S; i += kV) vm = at::vec::maximum(vm, Vec::loadu(x + i));
  T lanes[kV];
  vm.store(lanes);
  T m = -inf;
  for (int64_t l = 0; l < kV; ++l) m = (std::isnan(lanes[l]) || lanes[l] > m) ? lanes[l] : m;
  for (; i < S; ++i) m = (std::isnan(x[i]) || x[i] > m) ? x[i] : m;
  *row_max = m;
  if (m == -inf) {  // no key in this row
    for (int64_t j = 0; j < S; ++j) x[j] = T(0);
    return;
  }
  if (!(m < inf)) {  // a NaN or +inf score: NaN throughout, said here rather than left to the
    // vector exp of NaN (at::vec's exp_u20 of AVX2 gave a finite value, so a row of 40 float32
    // scores holding one was not all NaN)
    for (int64_t j = 0; j < S; ++j) x[j] = std::numeric_limits<T>::quiet_NaN();
    return;
  }
  const Vec vmax(m);
  Vec vs(T(0));
  i = 0;
  for (; i + kV <= S; i += kV) {
    const Vec e = (Vec::loadu(x + i) - vmax).exp_u20();  // (torch's softmax takes it too)
    e.store(x + i);
    vs = vs + e;
  }
  vs.store(lanes);
  T sum = T(0);
  for (int64_t l = 0; l < kV; ++l) sum += lanes[l];
  for (; i < S; ++i) {
    x[i] = std::exp(x[i] - m);
    sum += x[i];
  }
  const Vec vinv(T(1) / sum);
  i = 0;
  for (; i + kV <= S; i += kV) (Vec::loadu(x + i) * vinv).store(x + i);
  const T inv = T(1) / sum;
  for (; i < S; ++i) x[i] *= inv;
}

template <typename T>
void softmax_rows(T* x, int64_t rows, int64_t S, T* row_max) {
  const int64_t grain = 1 + (1 << 16) / S;  // ~64k scores a task
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) softmax_row<T>(x + r * S, S, row_max + r);
  });
}

}  // namespace

extern "C" {

// dtype 0 float32, 1 float64; x (rows, S) contiguous, written in place; row_max (rows,) contiguous.
// Returns 0, or 1 for an unknown dtype or S < 1.
int qkv_softmax_rows(int64_t dtype, void* x, int64_t rows, int64_t S, void* row_max) {
  if (S < 1) return 1;
  if (dtype == 0) {
    softmax_rows<float>(static_cast<float*>(x), rows, S, static_cast<float*>(row_max));
  } else if (dtype == 1) {
    softmax_rows<double>(static_cast<double*>(x), rows, S, static_cast<double*>(row_max));
  } else {
    return 1;
  }
  return 0;
}

}  // extern "C"
