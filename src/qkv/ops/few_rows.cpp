// Attention of a few query rows (a decoding step) in float32, of float32, bfloat16 or float16 inputs, whole
// in one call: scores, softmax, the weighted values and qkv's NaN/inf contract, per head, in registers and
// the cache. Half entries are widened exactly as they are read, the arithmetic is float32's, and the output
// is rounded to the half dtype once: the nearest half value to the float32 result.
//
// Built by qkv/ops/few_rows.py through torch.utils.cpp_extension at first use (ops/_native_build.py) and
// called through ctypes with its arguments packed in one int64 array. At T=1, S=128, 8 heads of 64 torch's
// CPU flash kernel took 31-45 us on AMD Zen 4 (one thread) for some 0.1 M multiply-adds: its buffers, its
// blocking and its threads are made for long sequences. Here a head's rows read each key and value row
// once, as it lies in memory (any batch, head and row strides; the last dim contiguous).
//
// Each query row t attends the keys start_t <= j < end_t (given per row: a causal mask of either alignment,
// windows, key lengths; else [0, S), or [0, t + 1) for torch's top-left causal mask) that its batch element's
// bool key mask keeps (none: all). Per row, in float32:
//   s_j = scale * (q_t . k_j), m = max s_j, e_j = exp(s_j - m), out = (sum_j e_j v_j) / (sum_j e_j),
//   lse = m + log(sum_j e_j);
// a row with no key outputs 0 and lse -inf. The NaN/inf contract of ops/nonfinite.py, kept here by the
// plain math's rows (as its fused row passes keep it): hidden keys are never read, so their values have no
// effect; a row that attends a key whose value row holds a NaN/inf, or whose score is NaN or +inf, or whose
// query row holds one, outputs NaN (if it has a key), as does a row whose every score is -inf; a key whose
// score is -inf (a -inf entry of k) weighs 0 in its row. A head whose rows meet a NaN/inf (a score or a
// row's sums not finite) is computed again from copies with those entries zeroed, by the same arithmetic,
// the -inf keys excluded per row: the rows that meet none get the same bits as without the bad entries.
//
// Sums run in a fixed order (dimension chunks of one vector, keys in order): results do not depend on the
// thread count. Supports float32, bfloat16 or float16 q, k, v, out (one dtype) with unit last stride, H a multiple of G (grouped heads read
// key/value head h / (H / G)), 1 <= T (the caller keeps it small: every row of a head is held at once),
// S >= 1, D >= 1, Dv >= 1.
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512  // at::vec's 512-bit Vectorized<float> (its own namespace, not libtorch's)
#elif defined(__AVX2__) && !defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();
constexpr float kInf = std::numeric_limits<float>::infinity();

char last_error[512] = "";

// The packed arguments (few_rows.py, _ARGS): pointers as int64, the scale as a double's bits.
struct Args {
  const void *q, *k, *v;   // float32 or bfloat16 (dtype)
  void* out;               // the inputs' dtype
  float* lse;              // null: not wanted
  const uint8_t* keep;     // (B or 1, S) bool, unit stride; null: every key
  int64_t B, H, G, T, S, D, Dv;
  int64_t qs[3], ks[3], vs[3], os[3];  // (batch, head, row) strides
  int64_t keep_sb;         // the keep mask's batch stride (0: one row for all)
  int64_t causal;          // 1: row t attends keys j <= t (torch's top-left causal)
  double scale;
  int64_t dtype;           // 0: float32, 1: bfloat16, 2: float16
  const int64_t *lo, *hi;  // (B or 1, T): row t attends keys [lo, hi) (then causal is 0); null: none
  int64_t range_sb;        // their batch stride (0: one row of ranges for all)
};

using bf16 = c10::BFloat16;
using f16 = c10::Half;

// Loads of kV elements (or the first n, the rest 0) as float32: bfloat16 widened exactly (its bits are a
// float32's top half).
inline Vec load(const float* p) { return Vec::loadu(p); }
inline Vec load(const float* p, int64_t n) { return Vec::loadu(p, n); }
inline Vec load(const bf16* p) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
#else
  float x[kV];
  for (int64_t i = 0; i < kV; ++i) x[i] = static_cast<float>(p[i]);
  return Vec::loadu(x);
#endif
}
inline Vec load(const f16* p) {  // (float16 widened exactly by F16C's conversion)
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(CPU_CAPABILITY_AVX2)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  float x[kV];
  for (int64_t i = 0; i < kV; ++i) x[i] = static_cast<float>(p[i]);
  return Vec::loadu(x);
#endif
}
// The first n (< kV) half entries, widened, the rest 0 (a row's last, partial vector).
template <typename Half>
inline Vec load(const Half* p, int64_t n) {
  float x[kV] = {};
  for (int64_t i = 0; i < n; ++i) x[i] = static_cast<float>(p[i]);
  return Vec::loadu(x);
}

// The sum of a vector's lanes (a fixed tree of shuffles and adds).
inline float lanes_sum(const Vec& x) { return x.reduce_add(); }

// x[0, n) . y[0, n) in float32, one vector of partial sums over chunks in order, then its lanes summed.
template <typename E>
inline float dot(const float* x, const E* y, int64_t n) {
  Vec acc(0.0f);
  int64_t d = 0;
  for (; d + kV <= n; d += kV) acc = at::vec::fmadd(Vec::loadu(x + d), load(y + d), acc);
  if (d < n) acc = at::vec::fmadd(Vec::loadu(x + d, n - d), load(y + d, n - d), acc);
  return lanes_sum(acc);
}

// x . y_i for the four rows y_0..y_3 at y + i * y_row, each as dot() sums it (their sums side by side: four
// chains of multiply-adds in flight instead of one).
template <typename E>
inline void dot4(const float* x, const E* y, int64_t y_row, int64_t n, float* out) {
  Vec a0(0.0f), a1(0.0f), a2(0.0f), a3(0.0f);
  const E *y0 = y, *y1 = y + y_row, *y2 = y + 2 * y_row, *y3 = y + 3 * y_row;
  int64_t d = 0;
  for (; d + kV <= n; d += kV) {
    const Vec q = Vec::loadu(x + d);
    a0 = at::vec::fmadd(q, load(y0 + d), a0);
    a1 = at::vec::fmadd(q, load(y1 + d), a1);
    a2 = at::vec::fmadd(q, load(y2 + d), a2);
    a3 = at::vec::fmadd(q, load(y3 + d), a3);
  }
  if (d < n) {
    const int64_t c = n - d;
    const Vec q = Vec::loadu(x + d, c);
    a0 = at::vec::fmadd(q, load(y0 + d, c), a0);
    a1 = at::vec::fmadd(q, load(y1 + d, c), a1);
    a2 = at::vec::fmadd(q, load(y2 + d, c), a2);
    a3 = at::vec::fmadd(q, load(y3 + d, c), a3);
  }
  out[0] = lanes_sum(a0), out[1] = lanes_sum(a1), out[2] = lanes_sum(a2), out[3] = lanes_sum(a3);
}

inline bool finite_check(const Vec& check) {
  return std::isfinite(lanes_sum(check));
}

// x[0, n) with NaN/inf entries as 0 into dst; whether it held one.
template <typename E>
bool zeroed(const E* x, int64_t n, float* dst) {
  bool bad = false;
  for (int64_t d = 0; d < n; ++d) {
    const float f = static_cast<float>(x[d]);
    const bool ok = std::isfinite(f);
    bad |= !ok;
    dst[d] = ok ? f : 0.0f;
  }
  return bad;
}

// One head's rows, as they are or from zeroed copies: key row j at k + j * k_row, value row at v + j * v_row.
// sc (T x S), acc (T x Dv) scratch; writes m, sum per row; returns the running checks of the keys and values
// the rows read (NaN if one held a NaN/inf).
template <typename E>
struct Head {
  const float* q;  // T x D, contiguous (the zeroed copy of the rows)
  const E* k;
  int64_t k_row;
  const E* v;
  int64_t v_row;
  const uint8_t* keep;  // this batch element's row of S, or null
  const int64_t* start;  // each row's first key
  const int64_t* end;   // each row's key end
  const uint8_t* excluded;  // (T x last): keys a row does not weigh (their scores are -inf), or null
  int64_t begin;        // min of start (over rows with a key)
  int64_t last;         // max of end
};

// acc[c0, c0 + NV kV) (past Dv untouched) = sum over the kept keys a0 <= j < n of w[j] * v_j[c0, ...), multiply-adds
// in key order, in registers. A value entry that is NaN or inf makes its sum NaN or inf whatever its weight
// (0 * inf is NaN): the caller finds bad values from the sums.
template <int NV, typename E>
void weighted(const float* w, const Head<E>& h, int64_t a0, int64_t n, int64_t c0, int64_t Dv, float* acc) {
  Vec sum[NV];
  int64_t count[NV];
  for (int i = 0; i < NV; ++i) {
    sum[i] = Vec(0.0f);
    count[i] = std::min<int64_t>(kV, Dv - c0 - i * kV);
  }
  const bool whole = count[NV - 1] == kV;
  for (int64_t j = a0; j < n; ++j) {
    if (h.keep != nullptr && !h.keep[j]) continue;
    const E* vj = h.v + j * h.v_row + c0;
    const Vec wj(w[j]);
    // (unrolled, so that the sums stay in registers: left rolled for half inputs, GCC kept them on the
    // stack, a store and a load per multiply-add: the bfloat16 step took 13.7 us against float32's 9.8)
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) {
      const Vec x = whole || i < NV - 1 ? load(vj + i * kV) : load(vj + i * kV, count[i]);
      sum[i] = at::vec::fmadd(wj, x, sum[i]);
    }
  }
  for (int i = 0; i < NV; ++i) sum[i].store(acc + c0 + i * kV, count[i]);
}

template <typename E>
void run_head(const Args& a, const Head<E>& h, float scale, float* sc, float* acc, float* m, float* sum,
              bool* checks_ok) {
  const int64_t T = a.T, S = a.S, D = a.D, Dv = a.Dv;
  bool keys_ok = true;  // a score of a key row holding a NaN/inf is not finite: the row's zeroed q times
  // an inf is an inf, or a NaN where q's entry is 0 (a finite key's score is finite unless it overflows,
  // and then its head is computed again to the same result: no key is found bad there)
  // scores, keys in fours where every row sees all four (each key row read once for all rows), else one
  // by one
  for (int64_t j = h.begin; j < h.last;) {
    bool four = j + 4 <= h.last;
    for (int64_t t = 0; t < T && four; ++t) four = h.start[t] <= j && j + 4 <= h.end[t];
    for (int64_t i = 0; i < 4 && four && h.keep != nullptr; ++i) four = h.keep[j + i] != 0;
    const E* kj = h.k + j * h.k_row;
    if (four) {
      for (int64_t t = 0; t < T; ++t) {
        float d[4];
        dot4(h.q + t * D, kj, h.k_row, D, d);
        float* s = sc + t * S + j;
        for (int i = 0; i < 4; ++i) {
          keys_ok &= std::isfinite(d[i]);
          s[i] = scale * d[i];
        }
      }
      j += 4;
      continue;
    }
    if (h.keep != nullptr && !h.keep[j]) {
      for (int64_t t = 0; t < T; ++t) sc[t * S + j] = -kInf;
      ++j;
      continue;
    }
    for (int64_t t = 0; t < T; ++t) {
      float s = -kInf;
      if (h.start[t] <= j && j < h.end[t]) {
        const float d = dot(h.q + t * D, kj, D);
        keys_ok &= std::isfinite(d);
        s = scale * d;
      }
      sc[t * S + j] = s;
    }
    ++j;
  }
  if (h.excluded != nullptr)
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = h.start[t]; j < h.end[t]; ++j)
        if (h.excluded[t * h.last + j]) sc[t * S + j] = -kInf;
  for (int64_t t = 0; t < T; ++t) {  // each row's max and exps, over its keys [start, end)
    float* s = sc + t * S + h.start[t];
    const int64_t n = std::max<int64_t>(h.end[t] - h.start[t], 0);
    Vec vmax(-kInf);
    int64_t j = 0;
    for (; j + kV <= n; j += kV) vmax = at::vec::maximum(vmax, Vec::loadu(s + j));
    float top = vmax.reduce_max();  // (NaN scores: their key is found bad)
    for (; j < n; ++j) top = std::max(top, s[j]);
    m[t] = top;
    if (top == -kInf) {  // no key (or a NaN: the check below sees its key)
      sum[t] = 0.0f;
      continue;
    }
    const Vec vtop(top);
    Vec vs(0.0f);
    j = 0;
    for (; j + kV <= n; j += kV) {
      const Vec e = (Vec::loadu(s + j) - vtop).exp();
      e.store(s + j);
      vs = vs + e;
    }
    if (j < n) {
      const Vec e = (Vec::loadu(s + j, n - j) - vtop).exp();
      e.store(s + j, n - j);
      vs = vs + Vec::set(Vec(0.0f), e, n - j);
    }
    sum[t] = lanes_sum(vs);
  }
  // the weighted values, row by row (a row's sums in registers), keys in order; a row whose sums are not
  // finite read a value holding a NaN/inf (or its sums overflowed: computed again, to the same result)
  bool values_ok = true;
  for (int64_t t = 0; t < T; ++t) {
    if (sum[t] == 0.0f) continue;  // no key: nothing read (its output is 0)
    float* o = acc + t * Dv;
    for (int64_t c0 = 0; c0 < Dv; c0 += 4 * kV) {
      switch (std::min<int64_t>(4, (Dv - c0 + kV - 1) / kV)) {
        case 1: weighted<1>(sc + t * S, h, h.start[t], h.end[t], c0, Dv, o); break;
        case 2: weighted<2>(sc + t * S, h, h.start[t], h.end[t], c0, Dv, o); break;
        case 3: weighted<3>(sc + t * S, h, h.start[t], h.end[t], c0, Dv, o); break;
        default: weighted<4>(sc + t * S, h, h.start[t], h.end[t], c0, Dv, o);
      }
    }
    Vec chk(0.0f);
    int64_t c = 0;
    for (; c + kV <= Dv; c += kV) chk = at::vec::fmadd(Vec(0.0f), Vec::loadu(o + c), chk);
    if (c < Dv) chk = at::vec::fmadd(Vec(0.0f), Vec::loadu(o + c, Dv - c), chk);
    values_ok &= finite_check(chk);
  }
  *checks_ok = keys_ok && values_ok;
}

template <typename E>
void attend(const Args& a) {
  const E* q = static_cast<const E*>(a.q);
  const E* k = static_cast<const E*>(a.k);
  const E* v = static_cast<const E*>(a.v);
  E* out = static_cast<E*>(a.out);
  const int64_t BH = a.B * a.H, T = a.T, S = a.S, D = a.D, Dv = a.Dv;
  const int64_t group = a.H / a.G;
  const float scale = static_cast<float>(a.scale);
  // heads per task: about 64 K multiply-adds each (a short call runs on the calling thread)
  const int64_t work = std::max<int64_t>(1, T * S * (D + Dv));
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / work);
  at::parallel_for(0, BH, grain, [&](int64_t begin, int64_t end_bh) {
    std::vector<float> qz(T * D), sc(T * S), acc(T * Dv), m(T), sum(T);
    std::vector<int64_t> start(T), end(T);
    std::vector<uint8_t> row_bad(T), has_key(T);
    std::vector<float> kz, vz;  // zeroed copies of a head's keys and values (a head with a NaN/inf)
    std::vector<uint8_t> k_bad, v_bad, excluded;
    for (int64_t bh = begin; bh < end_bh; ++bh) {
      const int64_t b = bh / a.H, hq = bh % a.H, hk = hq / group;
      Head<E> h;
      h.keep = a.keep == nullptr ? nullptr : a.keep + b * a.keep_sb;
      h.excluded = nullptr;
      h.begin = S, h.last = 0;
      for (int64_t t = 0; t < T; ++t) {
        if (a.lo != nullptr) {  // the rows' ranges, clamped to [0, S] (an empty one: lo >= hi)
          start[t] = std::clamp<int64_t>(a.lo[b * a.range_sb + t], 0, S);
          end[t] = std::max(start[t], std::clamp<int64_t>(a.hi[b * a.range_sb + t], 0, S));
        } else {
          start[t] = 0;
          end[t] = a.causal ? std::min<int64_t>(S, t + 1) : S;
        }
        has_key[t] = 0;  // a key in [start, end) that the mask keeps
        for (int64_t j = start[t]; j < end[t] && !has_key[t]; ++j) has_key[t] = h.keep == nullptr || h.keep[j];
        if (start[t] < end[t]) h.begin = std::min(h.begin, start[t]), h.last = std::max(h.last, end[t]);
        row_bad[t] = zeroed(q + b * a.qs[0] + hq * a.qs[1] + t * a.qs[2], D, qz.data() + t * D);
      }
      if (h.begin > h.last) h.begin = h.last;
      h.q = qz.data(), h.start = start.data(), h.end = end.data();
      h.k = k + b * a.ks[0] + hk * a.ks[1], h.k_row = a.ks[2];
      h.v = v + b * a.vs[0] + hk * a.vs[1], h.v_row = a.vs[2];
      bool ok = true;
      run_head(a, h, scale, sc.data(), acc.data(), m.data(), sum.data(), &ok);
      if (!ok) {  // a key or value the rows read holds a NaN/inf (or a score overflowed): the plain
        // math's rows. A row that attends a key whose value holds one, or whose score is NaN or +inf,
        // is NaN; a key whose score is -inf (a -inf entry) weighs 0 in its row. The others' rows again
        // from copies with the bad entries zeroed, by the same arithmetic, those keys excluded.
        kz.resize(h.last * D), vz.resize(h.last * Dv);
        k_bad.assign(h.last, 0), v_bad.assign(h.last, 0), excluded.assign(T * h.last, 0);
        for (int64_t j = h.begin; j < h.last; ++j) {
          if (h.keep != nullptr && !h.keep[j]) continue;
          k_bad[j] = zeroed(h.k + j * h.k_row, D, kz.data() + j * D);
          v_bad[j] = zeroed(h.v + j * h.v_row, Dv, vz.data() + j * Dv);
        }
        for (int64_t t = 0; t < T; ++t)
          for (int64_t j = start[t]; j < end[t] && !row_bad[t]; ++j) {
            if (h.keep != nullptr && !h.keep[j]) continue;
            if (v_bad[j]) {
              row_bad[t] = 1;
            } else if (k_bad[j]) {  // the row's score of the key as it is (the row's q is finite here)
              const float s = scale * dot(qz.data() + t * D, h.k + j * h.k_row, D);
              if (s == -kInf)
                excluded[t * h.last + j] = 1;
              else
                row_bad[t] = 1;
            }
          }
        Head<float> z{h.q,   kz.data(), D,      vz.data(),       Dv,     h.keep,
                      h.start, h.end,   excluded.data(), h.begin, h.last};
        run_head(a, z, scale, sc.data(), acc.data(), m.data(), sum.data(), &ok);
      }
      for (int64_t t = 0; t < T; ++t) {
        E* dst = out + b * a.os[0] + hq * a.os[1] + t * a.os[2];
        if (a.lse != nullptr) a.lse[bh * T + t] = m[t] == -kInf ? -kInf : m[t] + std::log(sum[t]);
        if (!has_key[t]) {
          std::fill(dst, dst + Dv, E(0.0f));  // a row that may attend to nothing: exactly 0
        } else if (row_bad[t] || m[t] == -kInf) {  // (every score -inf: the plain math's NaN)
          std::fill(dst, dst + Dv, E(std::numeric_limits<float>::quiet_NaN()));
        } else {
          const float* src = acc.data() + t * Dv;
          for (int64_t c = 0; c < Dv; ++c) dst[c] = E(src[c] / sum[t]);  // (bfloat16: rounded once)
        }
      }
    }
  });
}

// qkv_few_rows's arguments read into a (see there), false (and last_error) for bad sizes or dtype.
bool read_args(const int64_t* p, Args& a) {
  a.q = reinterpret_cast<const void*>(p[0]);
  a.k = reinterpret_cast<const void*>(p[1]);
  a.v = reinterpret_cast<const void*>(p[2]);
  a.out = reinterpret_cast<void*>(p[3]);
  a.lse = reinterpret_cast<float*>(p[4]);
  a.keep = reinterpret_cast<const uint8_t*>(p[5]);
  a.B = p[6], a.H = p[7], a.G = p[8], a.T = p[9], a.S = p[10], a.D = p[11], a.Dv = p[12];
  for (int i = 0; i < 3; ++i) a.qs[i] = p[13 + i], a.ks[i] = p[16 + i], a.vs[i] = p[19 + i], a.os[i] = p[22 + i];
  a.keep_sb = p[25], a.causal = p[26];
  std::memcpy(&a.scale, p + 27, sizeof(double));
  a.dtype = p[28];
  a.lo = reinterpret_cast<const int64_t*>(p[29]);
  a.hi = reinterpret_cast<const int64_t*>(p[30]);
  a.range_sb = p[31];
  if (a.T < 1 || a.S < 1 || a.D < 1 || a.Dv < 1 || a.G < 1 || a.H % a.G != 0) {
    std::snprintf(last_error, sizeof(last_error), "bad sizes: H=%lld G=%lld T=%lld S=%lld D=%lld Dv=%lld",
                  (long long)a.H, (long long)a.G, (long long)a.T, (long long)a.S, (long long)a.D,
                  (long long)a.Dv);
    return false;
  }
  if (a.dtype < 0 || a.dtype > 2) {
    std::snprintf(last_error, sizeof(last_error), "bad dtype code %lld", (long long)a.dtype);
    return false;
  }
  return true;
}

void run(const Args& a) {
  if (a.dtype == 0)
    attend<float>(a);
  else if (a.dtype == 1)
    attend<bf16>(a);
  else
    attend<f16>(a);
}

// qkv_few_rows (new_rows: qkv_few_rows_step, see there): the arguments read, the new rows copied, the call
// run; 0 on success, 1 on an error (last_error says which).
int call(const int64_t* p, bool new_rows) {
  try {
    Args a;
    if (!read_args(p, a)) return 1;
    if (new_rows) {  // each (batch, key head)'s new key and value row into row S - 1 of k and v
      const int64_t size = a.dtype == 0 ? 4 : 2;
      const char* q = static_cast<const char*>(a.q);
      char* k = static_cast<char*>(const_cast<void*>(a.k));
      char* v = static_cast<char*>(const_cast<void*>(a.v));
      const int64_t row = a.S - 1;
      for (int64_t b = 0; b < a.B; ++b) {
        for (int64_t g = 0; g < a.G; ++g) {
          const int64_t from = b * p[34] + g * p[35];
          std::memcpy(k + (b * a.ks[0] + g * a.ks[1] + row * a.ks[2]) * size, q + (p[32] + from) * size,
                      a.D * size);
          std::memcpy(v + (b * a.vs[0] + g * a.vs[1] + row * a.vs[2]) * size, q + (p[33] + from) * size,
                      a.Dv * size);
        }
      }
    }
    if (a.B * a.H == 0) return 0;
    run(a);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(last_error, sizeof(last_error), "%s", e.what());
    return 1;
  }
}

}  // namespace

extern "C" {

const char* qkv_few_rows_error() { return last_error; }

// The packed arguments (int64 each; pointers as addresses, the scale as a double's bits):
//  0 q, 1 k, 2 v, 3 out, 4 lse (B * H * T float32 contiguous, or 0), 5 keep (or 0),
//  6 B, 7 H, 8 G, 9 T, 10 S, 11 D, 12 Dv,
//  13-15 q's (batch, head, row) strides, 16-18 k's, 19-21 v's, 22-24 out's, 25 keep's batch stride,
//  26 causal, 27 scale, 28 dtype (0 float32, 1 bfloat16, 2 float16: q, k, v and out alike), 29 lo and 30 hi
//  ((B or 1, T) int64 rows' key ranges, or 0: none), 31 their batch stride.
// 0 on success, 1 on an error (qkv_few_rows_error says which); out is then undefined.
int qkv_few_rows(const int64_t* p) { return call(p, false); }

// A decoding step's call (nn/_step.py): qkv_few_rows's 32 arguments, then the new key and value
// row of each (batch, key head) copied into row S - 1 of k and v before the call reads them, bit for
// bit: 32 and 33 their offsets from q, in elements; 34 and 35 their batch and head strides. In a
// fused in-projection's output (B, 1, (H + 2G) * D), whose first H heads are q, the new keys start
// H heads past q and the values H + G. 0 on success, 1 on an error (nothing written then).
int qkv_few_rows_step(const int64_t* p) { return call(p, true); }

}  // extern "C"
