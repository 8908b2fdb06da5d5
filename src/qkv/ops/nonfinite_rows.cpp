// The NaN/inf contract's passes over rows (ops/nonfinite.py), each in one pass of C++ where the
// tensor ops take two or three: which rows hold a NaN/inf, copies with them zeroed, and the output
// rows set to NaN or 0 after the kernel.
//
// Built by qkv/ops/nonfinite_rows.py through torch.utils.cpp_extension at first use
// (ops/_native_build.py) and called through ctypes on raw pointers, for CPU tensors without
// gradient, outside tracing. What decides a row is read and written inside the pass, never
// returned to the caller: the work a call dispatches does not depend on the values (issue 38: no
// host reads).
//
// Supports: float32, float64, bfloat16, float16 (told non-finite by their exponent bits, so no
// float arithmetic and no rounding: a copy is bit for bit); rows of E contiguous elements, indexed
// by three leading dims of any strides (0 for a broadcast dim). Does not support: a last dim with a
// stride other than 1 (the caller's torch ops take those).
//
// Shape alphabet: rows (n0, n1, n2), E elements each (D, Dv or the key length's row).
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512  // at::vec's 512-bit Vectorized<float> (its own namespace, not libtorch's)
#elif defined(__AVX2__) && !defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/intrinsics.h>
#include <ATen/cpu/vec/vec.h>

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// A row's elements as unsigned integers of the float's width, its exponent mask and a quiet NaN.
template <typename U, U kExp, U kNaN>
struct Bits {
  using word = U;
  static constexpr U exp = kExp;
  static constexpr U nan = kNaN;
};
using F32 = Bits<uint32_t, 0x7f800000u, 0x7fc00000u>;
using F64 = Bits<uint64_t, 0x7ff0000000000000ull, 0x7ff8000000000000ull>;
using BF16 = Bits<uint16_t, 0x7f80u, 0x7fc0u>;
using F16 = Bits<uint16_t, 0x7c00u, 0x7e00u>;

struct Rows {  // three leading dims of a tensor of rows
  int64_t n0, n1, n2;
  int64_t count() const { return n0 * n1 * n2; }
};

struct Strides {  // of the three leading dims, in elements (0 along a broadcast dim)
  int64_t s0, s1, s2;
};

// Where row r (of n0 x n1 x n2, row-major) starts.
inline int64_t offset(int64_t r, const Rows& n, const Strides& s) {
  const int64_t i2 = r % n.n2, i01 = r / n.n2;
  return (i01 / n.n1) * s.s0 + (i01 % n.n1) * s.s1 + i2 * s.s2;
}

// Calls f(first, last) for the runs of rows [first, last) within [begin, end) that share their
// first two indices: consecutive along the last row dim, so a run of rows of stride E is one span.
template <typename F>
inline void runs(const Rows& n, int64_t begin, int64_t end, F&& f) {
  for (int64_t r = begin; r < end;) {
    const int64_t last = std::min(end, (r / n.n2 + 1) * n.n2);
    f(r, last);
    r = last;
  }
}

template <typename B>
inline bool nonfinite(const typename B::word* x, int64_t count) {
  typename B::word bad = 0;
  for (int64_t e = 0; e < count; ++e) {
    bad |= static_cast<typename B::word>((x[e] & B::exp) == B::exp);
  }
  return bad != 0;
}

// Whether x's count elements are all zero (either sign): a kernel's row where every score was NaN or
// -inf (torch's CPU flash kernel and tiled's give such a row 0, as if it had no key; the plain math
// gives NaN), or a row that is 0 by its values.
template <typename B>
inline bool zero(const typename B::word* x, int64_t count) {
  using W = typename B::word;
  constexpr W magnitude = static_cast<W>(~(W(1) << (sizeof(W) * 8 - 1)));
  W any = 0;
  for (int64_t e = 0; e < count; ++e) any |= static_cast<W>(x[e] & magnitude);
  return count > 0 && any == 0;
}

#if defined(__AVX2__)
// The largest of a row's magnitudes as unsigned integers, 32 bytes at a time, 16 or 32 bits an
// element (float64 takes the scalar loop: AVX2 has no 64-bit unsigned max).
template <typename W>
inline __m256i splat(W w) {
  if constexpr (sizeof(W) == 2) return _mm256_set1_epi16(static_cast<int16_t>(w));
  else return _mm256_set1_epi32(static_cast<int32_t>(w));
}
template <typename W>
inline __m256i larger(__m256i x, __m256i y) {
  if constexpr (sizeof(W) == 2) return _mm256_max_epu16(x, y);
  else return _mm256_max_epu32(x, y);
}
#endif

// Whether a row of [first, last) of x (E elements each, stride s) holds a non-finite element, or
// (with zeros) is all zero: each row read once for both. An element is non-finite where its
// magnitude's bits reach the exponent mask's, and a row all zero where its largest magnitude is 0:
// with AVX2 one max a vector, one vptest a row, and the rows' largest compared once (the check
// after every call of a kernel whose rows see every key: a scalar or per-row reduction took 1-2%
// of a call at T = 1024).
template <typename B>
inline bool any_row_wrong(const typename B::word* x, const Rows& n, const Strides& s, int64_t E,
                          int64_t first, int64_t last, bool zeros) {
  using W = typename B::word;
  constexpr W magnitude = static_cast<W>(~(W(1) << (sizeof(W) * 8 - 1)));
  const W* p = x + offset(first, n, s);
#if defined(__AVX2__)
  if constexpr (sizeof(W) <= 4) {
    constexpr int64_t L = 32 / sizeof(W);
    const int64_t body = E - E % L;
    const __m256i magv = splat<W>(magnitude);
    __m256i most = _mm256_setzero_si256();  // the largest magnitude of every row so far
    W most_tail = 0;
    for (int64_t r = first; r < last; ++r, p += s.s2) {
      __m256i row = _mm256_setzero_si256();
      W row_tail = 0;
      for (int64_t e = 0; e < body; e += L) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + e));
        row = larger<W>(row, _mm256_and_si256(v, magv));
      }
      for (int64_t e = body; e < E; ++e) row_tail = std::max(row_tail, static_cast<W>(p[e] & magnitude));
      if (zeros && E > 0 && row_tail == 0 && _mm256_testz_si256(row, row)) return true;
      most = larger<W>(most, row);
      most_tail = std::max(most_tail, row_tail);
    }
    // some magnitude >= the exponent mask (inf's own bits included): max(most, exp - 1) != exp - 1
    const __m256i below = splat<W>(static_cast<W>(B::exp - 1));
    const __m256i over = _mm256_xor_si256(larger<W>(most, below), below);
    return most_tail >= B::exp || !_mm256_testz_si256(over, over);
  }
#endif
  for (int64_t r = first; r < last; ++r, p += s.s2) {
    W bad = 0, any = 0;
    for (int64_t e = 0; e < E; ++e) {
      bad |= static_cast<W>((p[e] & B::exp) == B::exp);
      any |= static_cast<W>(p[e] & magnitude);
    }
    if (bad != 0 || (zeros && E > 0 && any == 0)) return true;
  }
  return false;
}

// Whether rows [first, last) of x (E elements each, stride s) hold a non-finite element; one
// span when the rows are consecutive.
template <typename B>
inline bool any_nonfinite(const typename B::word* x, const Rows& n, const Strides& s, int64_t E,
                          int64_t first, int64_t last) {
  const typename B::word* p = x + offset(first, n, s);
  if (s.s2 == E || last - first == 1) return nonfinite<B>(p, (last - first) * E);
  for (int64_t r = first; r < last; ++r, p += s.s2) {
    if (nonfinite<B>(p, E)) return true;
  }
  return false;
}

// y = x with its non-finite elements zeroed; whether there was one.
template <typename B>
inline bool zeroed_copy(const typename B::word* x, typename B::word* y, int64_t count) {
  using W = typename B::word;
  W bad = 0;
  for (int64_t e = 0; e < count; ++e) {
    const W v = x[e];
    const W nf = static_cast<W>((v & B::exp) == B::exp);
    y[e] = nf ? W(0) : v;
    bad |= nf;
  }
  return bad != 0;
}

// dst = src with non-finite elements zeroed (zero_nonfinite), or as is; rows with keep == 0 all
// zero; flags[r] = 1 where a kept row held a non-finite element (left as it was elsewhere).
template <typename B>
void copy(const Rows n, int64_t E, const void* src_, const Strides s, void* dst_,
          const uint8_t* keep, const Strides k, int zero_nonfinite, float* flags) {
  using W = typename B::word;
  const W* src = static_cast<const W*>(src_);
  W* dst = static_cast<W*>(dst_);
  const int64_t grain = 1 + (1 << 15) / (E > 0 ? E : 1);  // ~32k elements a task
  at::parallel_for(0, n.count(), grain, [&](int64_t begin, int64_t end) {
    runs(n, begin, end, [&](int64_t first, int64_t last) {
      const W* x = src + offset(first, n, s);
      if (dst == nullptr) {  // the flags alone: a clean span in one sweep, its rows if not
        if ((s.s2 == E || last - first == 1) && !nonfinite<B>(x, (last - first) * E)) return;
        for (int64_t r = first; r < last; ++r, x += s.s2)
          if (nonfinite<B>(x, E)) flags[r] = 1.0f;
        return;
      }
      W* y = dst + first * E;
      if (keep == nullptr && (s.s2 == E || last - first == 1)) {  // one span: copy, then flag
        const int64_t count = (last - first) * E;
        bool bad = false;
        if (zero_nonfinite) {
          bad = zeroed_copy<B>(x, y, count);
        } else {
          std::memcpy(y, x, count * sizeof(W));
          bad = flags != nullptr && nonfinite<B>(x, count);
        }
        if (!bad || flags == nullptr) return;  // (else find its rows: rare)
        for (int64_t r = first; r < last; ++r) {
          if (nonfinite<B>(x + (r - first) * E, E)) flags[r] = 1.0f;
        }
        return;
      }
      const uint8_t* kept = keep == nullptr ? nullptr : keep + offset(first, n, k);
      for (int64_t r = first; r < last; ++r, x += s.s2, y += E) {
        if (kept != nullptr && kept[(r - first) * k.s2] == 0) {
          std::memset(y, 0, E * sizeof(W));
          continue;
        }
        bool bad;
        if (zero_nonfinite) {
          bad = zeroed_copy<B>(x, y, E);
        } else {
          std::memcpy(y, x, E * sizeof(W));
          bad = flags != nullptr && nonfinite<B>(x, E);
        }
        if (bad && flags != nullptr) flags[r] = 1.0f;
      }
    });
  });
}

// The bits of x read as a To (of x's size).
template <typename To, typename From>
inline To bits_as(From x) {
  static_assert(sizeof(To) == sizeof(From), "bits_as keeps the size");
  To y;
  std::memcpy(&y, &x, sizeof y);
  return y;
}
// A row's element as a double (exact for every input dtype).
inline double wide(uint32_t w, F32) { return bits_as<float>(w); }
inline double wide(uint64_t w, F64) { return bits_as<double>(w); }
inline double wide(uint16_t w, BF16) { return bits_as<float>(static_cast<uint32_t>(w) << 16); }
inline double wide(uint16_t w, F16) { return static_cast<double>(c10::Half(w, c10::Half::from_bits())); }
// A double rounded to nearest even in the row's dtype, as its word.
inline uint32_t word(double x, F32) { return bits_as<uint32_t>(static_cast<float>(x)); }
inline uint64_t word(double x, F64) { return bits_as<uint64_t>(x); }
inline uint16_t word(double x, BF16) { return c10::BFloat16(static_cast<float>(x)).x; }
inline uint16_t word(double x, F16) { return c10::Half(static_cast<float>(x)).x; }

// A row's elements widened to float32 (exact for float32, bfloat16 and float16).
inline void widen_row(const uint32_t* x, int64_t n, float* y) { std::memcpy(y, x, n * sizeof(float)); }
inline void widen_row(const uint16_t* x, int64_t n, float* y, BF16) {
  for (int64_t i = 0; i < n; ++i) y[i] = bits_as<float>(static_cast<uint32_t>(x[i]) << 16);
}
inline void widen_row(const uint16_t* x, int64_t n, float* y, F16) {
  for (int64_t i = 0; i < n; ++i) y[i] = static_cast<float>(c10::Half(x[i], c10::Half::from_bits()));
}
template <typename B>
inline const float* as_floats(const typename B::word* x, int64_t n, float* buf) {
  if constexpr (std::is_same_v<B, F32>) {
    return reinterpret_cast<const float*>(x);  // (float32: read in place)
  } else {
    widen_row(x, n, buf, B{});
    return buf;
  }
}

// Products summed by fused multiply-adds (each rounded once) into kLanes partial sums, lane l taking
// elements l, l + kLanes, ..., then the lanes added in order: the same bits whatever the vector width
// (at::vec's 8 floats with AVX2, 16 with AVX-512), so a build for either ISA level gives the same rows.
constexpr int64_t kLanes = 16;
using Vec = at::vec::Vectorized<float>;
constexpr int64_t kParts = kLanes / Vec::size();

inline float dot(const float* a, const float* b, int64_t n) {
  Vec acc[kParts];
  for (int64_t p = 0; p < kParts; ++p) acc[p] = Vec(0.0f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int64_t p = 0; p < kParts; ++p) {
      const int64_t o = i + p * Vec::size();
      acc[p] = at::vec::fmadd(Vec::loadu(a + o), Vec::loadu(b + o), acc[p]);
    }
  float part[kLanes];
  for (int64_t p = 0; p < kParts; ++p) acc[p].store(part + p * Vec::size());
  for (int64_t l = 0; i + l < n; ++l) part[l] = std::fma(a[i + l], b[i + l], part[l]);
  float sum = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) sum += part[l];
  return sum;
}

// y += p * x, each element by one fused multiply-add (vector or std::fma: the same bits).
inline void axpy(float p, const float* x, float* y, int64_t n) {
  const Vec vp(p);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size())
    at::vec::fmadd(vp, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  for (; i < n; ++i) y[i] = std::fma(p, x[i], y[i]);
}

// Scratch of one thread for rows computed again.
struct RowScratch {
  std::vector<double> s, acc;  // float64 rows
  std::vector<float> sf, q, k, v, accf;  // float32 rows
};

// One row of attention over the keys lo <= j < S of k (stride ks) and v (stride vs) with keep[j] != 0
// (keep null: all of them), by the plain math: scores s_j = scale * q . k_j, weights softmax(s) (a NaN
// score, a +inf score or every score -inf gives NaN weights), y = weights @ v; then NaN throughout where y
// is not finite. What a kernel gives a row when no hidden key reaches it. float64 rows in float64;
// the others in float32 by vectorized fused multiply-adds in an order that no ISA level changes (so
// that many rows computed again cost a few kernels' calls, not fifteen as scalar float64 did), rounded
// once.
template <typename B>
void attend_row(const typename B::word* q, int64_t D, const typename B::word* k, int64_t ks,
                const typename B::word* v, int64_t vs, int64_t Dv, const uint8_t* keep, int64_t lo,
                int64_t S, double scale, typename B::word* y, RowScratch& w) {
  if constexpr (std::is_same_v<B, F64>) {
    constexpr double inf = std::numeric_limits<double>::infinity();
    w.s.assign(S, -inf);
    double m = -inf;
    bool nan = false;
    for (int64_t j = lo; j < S; ++j) {
      if (keep != nullptr && keep[j] == 0) continue;
      double dot = 0.0;
      for (int64_t d = 0; d < D; ++d) dot += wide(q[d], B{}) * wide(k[j * ks + d], B{});
      w.s[j] = scale * dot;
      nan |= std::isnan(w.s[j]);
      m = std::max(m, w.s[j]);
    }
    w.acc.assign(Dv, 0.0);
    bool bad = nan || !std::isfinite(m);
    double sum = 0.0;
    for (int64_t j = lo; j < S && !bad; ++j) {
      if (keep != nullptr && keep[j] == 0) continue;
      const double p = std::exp(w.s[j] - m);
      sum += p;
      for (int64_t e = 0; e < Dv; ++e) w.acc[e] += p * wide(v[j * vs + e], B{});
    }
    for (int64_t e = 0; e < Dv && !bad; ++e) {
      w.acc[e] /= sum;
      bad = !std::isfinite(w.acc[e]);
    }
    for (int64_t e = 0; e < Dv; ++e) y[e] = bad ? B::nan : word(w.acc[e], B{});
  } else {
    constexpr float inf = std::numeric_limits<float>::infinity();
    const float fscale = static_cast<float>(scale);
    w.sf.assign(S, -inf);
    w.q.resize(D), w.k.resize(D), w.v.resize(Dv);
    const float* qf = as_floats<B>(q, D, w.q.data());
    float m = -inf;
    bool nan = false;
    for (int64_t j = lo; j < S; ++j) {
      if (keep != nullptr && keep[j] == 0) continue;
      const float x = fscale * dot(qf, as_floats<B>(k + j * ks, D, w.k.data()), D);
      w.sf[j] = x;
      nan |= std::isnan(x);
      m = x > m ? x : m;
    }
    w.accf.assign(Dv, 0.0f);
    bool bad = nan || !std::isfinite(m);
    float sum = 0.0f;
    for (int64_t j = lo; j < S && !bad; ++j) {
      if (keep != nullptr && keep[j] == 0) continue;
      const float p = std::exp(w.sf[j] - m);
      sum += p;
      const float* vj = as_floats<B>(v + j * vs, Dv, w.v.data());
      if (p != 0.0f) {
        axpy(p, vj, w.accf.data(), Dv);
      } else {
        for (int64_t e = 0; e < Dv; ++e) bad |= !std::isfinite(vj[e]);  // 0 * NaN/inf is NaN
      }
    }
    const float inv = 1.0f / sum;
    for (int64_t e = 0; e < Dv && !bad; ++e) {
      w.accf[e] *= inv;
      bad = !std::isfinite(w.accf[e]);
    }
    for (int64_t e = 0; e < Dv; ++e) y[e] = bad ? B::nan : word(static_cast<double>(w.accf[e]), B{});
  }
}

// The keys each row sees as a range [lo, hi) (causal, windows, key lengths) and which keys are bad:
// a row sees a bad key where the bad keys before hi outnumber those before lo. Ranges without
// flags (keys null, lo given): the rows a kernel may have got wrong are found from the rows
// themselves, as without ranges (see restore).
struct KeyRanges {
  const float* keys;  // bad keys (1.0), S of them for each of the first two row dims (or null)
  int64_t k0, k1, S;  // strides of keys along those dims
  const int64_t* lo;  // per row, clamped to [0, S]
  Strides l;
  const int64_t* hi;  // per row, clamped to [0, S]
  Strides u;
};

// Whether a row of [first, last) has an empty range of keys (a row that is set to 0).
inline bool any_empty(const KeyRanges& kr, const Rows& n, int64_t first, int64_t last) {
  const int64_t* lo = kr.lo + offset(first, n, kr.l);
  const int64_t* hi = kr.hi + offset(first, n, kr.u);
  for (int64_t i = 0; i < last - first; ++i) {
    if (hi[i * kr.u.s2] <= lo[i * kr.l.s2]) return true;
  }
  return false;
}

// The keys and values of rows computed again (null k: none are): row (b, h) reads key head
// h / group through the strides (b, kv head, key); its keys are its range's with key ranges, else
// the S keys with keep[j] != 0 (keep null: all of them; strides (b, h), unit along keys).
struct Recompute {
  const void* k;
  int64_t kb, kh, ks;
  const void* v;
  int64_t vb, vh, vs;
  int64_t group;
  double scale;
  const uint8_t* keep;
  int64_t mb, mh;
  int64_t S;
  const float* lse;  // the kernel's log-sum-exp per row (null: none), strides ls
  Strides ls;
};

// Whether a row of [first, last) has a log-sum-exp that is not finite: torch's CPU flash kernel's
// for a row that met a NaN or +inf score (where in bfloat16 and float16 its output row may be
// finite), so the row is computed again without a scan of the keys.
inline bool any_lse_bad(const Recompute& rc, const Rows& n, int64_t first, int64_t last) {
  const float* l = rc.lse + offset(first, n, rc.ls);
  for (int64_t i = 0; i < last - first; ++i) {
    if (!std::isfinite(l[i * rc.ls.s2])) return true;
  }
  return false;
}

// Each row of out: 0 where has_key is given and 0 there, or where the row's key range is empty;
// else NaN where flags[r] != 0, or its key range holds a bad key, or a row of q holds a non-finite
// element, or (check_out) the row itself does; else left as it is. With rc.k (and q), a row whose
// query row is finite is computed again by attend_row, the plain math over the keys it sees, instead
// of set to NaN: with flagged key ranges (the kernel run on k and v as they are), where its range
// holds a bad key (a visible key whose scores are all -inf weighs 0 there, where a kernel may give
// anything) or the row is not finite (a hidden bad key reached it, as a NaN); without flags (no
// ranges: every row sees every key, or rc.keep's; or ranges whose keys were not flagged), where the
// row is not finite or is all zero (a kernel gives 0 to a row whose scores are all NaN or -inf, where
// the plain math gives NaN; a row 0 by its values comes out 0 again), and where the kernel's
// log-sum-exp rc.lse is given, each row whose lse is not finite; without it, in bfloat16 and float16
// every row of a head whose keys hold a NaN/inf (KeyScan).
// The keys and the values row (b, h) reads in rows computed again.
template <typename B>
inline const typename B::word* k_of(const Recompute& rc, int64_t b, int64_t h) {
  return static_cast<const typename B::word*>(rc.k) + b * rc.kb + (h / rc.group) * rc.kh;
}
template <typename B>
inline const typename B::word* v_of(const Recompute& rc, int64_t b, int64_t h) {
  return static_cast<const typename B::word*>(rc.v) + b * rc.vb + (h / rc.group) * rc.vh;
}

// Whether the keys row (b, h) reads hold a NaN/inf, asked once per key head in a run of rows: for
// bfloat16 and float16 only, where torch's CPU flash kernel gives a finite row (neither NaN nor the
// plain math's) for a key whose score is +inf, so a row's own bits do not tell.
template <typename B>
struct KeyScan {
  int64_t b = -1, g = -1;
  bool bad = false;
  bool operator()(const Recompute& rc, int64_t D, int64_t b0, int64_t h0) {
    if constexpr (sizeof(typename B::word) != 2) {
      return false;
    } else {
      if (b0 != b || h0 / rc.group != g) {
        b = b0, g = h0 / rc.group, bad = false;
        const typename B::word* k = k_of<B>(rc, b0, h0);
        if (rc.ks == D) {
          bad = nonfinite<B>(k, rc.S * D);
        } else {
          for (int64_t j = 0; j < rc.S && !bad; ++j) bad = nonfinite<B>(k + j * rc.ks, D);
        }
      }
      return bad;
    }
  }
};

template <typename B>
void restore(const Rows n, void* out_, const Strides o, int64_t Dv, int check_out, const void* q_,
             const Strides qs, int64_t D, const float* flags, const Strides f,
             const uint8_t* has_key, const Strides h, const KeyRanges kr, const Recompute rc) {
  using W = typename B::word;
  W* out = static_cast<W*>(out_);
  const W* q = static_cast<const W*>(q_);
  // out's rows are read for a non-finite element with check_out, and with rows computed again
  // (and for an all-zero row too: one read a row for both, in the parallel runs)
  const bool again = rc.k != nullptr && q != nullptr;  // rows computed again
  const bool ranged = kr.lo != nullptr;  // each row's keys a range [lo, hi)
  const bool zeros = again && kr.keys == nullptr;  // ... where all zero too (no bad key flagged)
  // check_out's bit 1: out is torch's kernel's own (the caller knows), whose rows tell of a bad query
  const bool rows_tell = (check_out & 2) != 0;
  check_out &= 1;
  const bool read_out = check_out || again;
  // The query rows are swept in the common case only where a row of out tells of them: with rows
  // computed again (zeros), a non-finite query row makes every score of its row NaN or +-inf.
  // Given the kernel's log-sum-exp, that row's lse is not finite (max + log(sum), each term NaN,
  // +-inf, or a sum of exp(NaN | +-inf) that is 0, inf or NaN); torch's kernels in float32 and
  // float64 leave a row that is not finite or all zero; both are read for every row. A half row
  // may be finite and wrong without the lse (a +inf score, see KeyScan), and another kernel's row
  // is not known to tell: their queries are swept.
  const bool sweep_q =
      q != nullptr && !(zeros && (rc.lse != nullptr || (rows_tell && sizeof(W) >= 4)));
  const int64_t grain = 1 + (1 << 15) / (Dv + D > 0 ? Dv + D : 1);
  at::parallel_for(0, n.count(), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> before;  // bad keys before each key position, for one run's (b, h)
    RowScratch scratch;  // a row computed again
    KeyScan<B> scan;  // (zeros: half dtypes)
    runs(n, begin, end, [&](int64_t first, int64_t last) {
      const int64_t i01 = first / n.n2, b0 = i01 / n.n1, h0 = i01 % n.n1;
      const bool head_bad = zeros && rc.lse == nullptr && scan(rc, D, b0, h0);
      const float* lse = zeros && rc.lse != nullptr ? rc.lse + offset(first, n, rc.ls) : nullptr;
      if (kr.keys != nullptr) {  // a run shares its (b, h): the counts of its bad keys, once
        const int64_t i01 = first / n.n2;
        const float* k = kr.keys + (i01 / n.n1) * kr.k0 + (i01 % n.n1) * kr.k1;
        before.assign(kr.S + 1, 0.0f);
        for (int64_t j = 0; j < kr.S; ++j) before[j + 1] = before[j] + k[j];
      }
      // the common case first: no flag, no key missing, no bad key in the run's (b, h), no
      // empty range, every row finite (its spans swept whole): nothing to write
      if (flags == nullptr && has_key == nullptr &&
          (!ranged || ((kr.keys == nullptr || before[kr.S] == 0.0f) &&
                       !any_empty(kr, n, first, last)))) {
        const bool bad = (read_out && any_row_wrong<B>(out, n, o, Dv, first, last, zeros)) ||
                         (sweep_q && any_nonfinite<B>(q, n, qs, D, first, last));
        if (!bad && !head_bad && (lse == nullptr || !any_lse_bad(rc, n, first, last))) return;
      }
      W* y = out + offset(first, n, o);
      const W* x = q == nullptr ? nullptr : q + offset(first, n, qs);
      const float* flag = flags == nullptr ? nullptr : flags + offset(first, n, f);
      const uint8_t* key = has_key == nullptr ? nullptr : has_key + offset(first, n, h);
      const int64_t* lo = ranged ? kr.lo + offset(first, n, kr.l) : nullptr;
      const int64_t* hi = ranged ? kr.hi + offset(first, n, kr.u) : nullptr;
      for (int64_t i = 0; i < last - first; ++i, y += o.s2) {
        bool bad = false;
        if (lo != nullptr) {
          const int64_t a = lo[i * kr.l.s2], b = std::max(hi[i * kr.u.s2], a);
          if (b == a) {
            std::memset(y, 0, Dv * sizeof(W));  // no key in its range
            continue;
          }
          bad = kr.keys != nullptr && before[b] > before[a];
          const bool wrong =
              bad || nonfinite<B>(y, Dv) ||
              (zeros && (head_bad || (lse != nullptr && !std::isfinite(lse[i * rc.ls.s2])) ||
                         zero<B>(y, Dv)));
          if (again && wrong && !nonfinite<B>(x + i * qs.s2, D)) {
            attend_row<B>(x + i * qs.s2, D, k_of<B>(rc, b0, h0), rc.ks, v_of<B>(rc, b0, h0), rc.vs, Dv,
                          nullptr, a, b, rc.scale, y, scratch);
            continue;
          }
        }
        if (key != nullptr && key[i * h.s2] == 0) {
          std::memset(y, 0, Dv * sizeof(W));
          continue;
        }
        if (zeros && !ranged &&
            (head_bad || (lse != nullptr && !std::isfinite(lse[i * rc.ls.s2])) ||
             nonfinite<B>(y, Dv) || zero<B>(y, Dv)) &&
            !nonfinite<B>(x + i * qs.s2, D)) {
          const uint8_t* keep = rc.keep == nullptr ? nullptr : rc.keep + b0 * rc.mb + h0 * rc.mh;
          attend_row<B>(x + i * qs.s2, D, k_of<B>(rc, b0, h0), rc.ks, v_of<B>(rc, b0, h0), rc.vs, Dv,
                        keep, 0, rc.S, rc.scale, y, scratch);
          continue;
        }
        bad = bad || (flag != nullptr && flag[i * f.s2] != 0.0f) ||
              (x != nullptr && nonfinite<B>(x + i * qs.s2, D)) ||
              (check_out && nonfinite<B>(y, Dv));
        if (bad) {
          for (int64_t e = 0; e < Dv; ++e) y[e] = B::nan;
        }
      }
    });
  });
}

// The rows of a key mask's output after a kernel ran it on k and v as they are (hidden keys in
// place): 0 where the row has no key (keep all 0); else, where the row or its query row is not
// finite, or the row is all zero, or its log-sum-exp lse (the kernel's, where given) is not finite,
// or without one (bfloat16, float16) its head's keys hold a NaN/inf (see restore), the row again by attend_row over its visible keys (NaN for a bad query row). A hidden
// key reaches a row only as a NaN (a NaN score is NaN under any mask, a hidden weight 0 times an
// inf value is NaN) or not at all, so a finite row is already the visible keys' row, to the bit.
// Rows (n0, n1, n2) = (B, H, T); k's and v's rows indexed by (b, h / group); keep (S per (b, h)).
template <typename B>
void keymask_rows(const Rows n, void* out_, const Strides o, int64_t Dv, const void* q_,
                  const Strides qs, int64_t D, const void* k_, int64_t kb, int64_t kh, int64_t ks,
                  const void* v_, int64_t vb, int64_t vh, int64_t vs, int64_t group,
                  const uint8_t* keep, int64_t mb, int64_t mh, int64_t S, double scale,
                  const float* lse, const Strides ls) {
  using W = typename B::word;
  W* out = static_cast<W*>(out_);
  const W* q = static_cast<const W*>(q_);
  const W* k = static_cast<const W*>(k_);
  const W* v = static_cast<const W*>(v_);
  const int64_t grain = 1 + (1 << 15) / (Dv + D + S > 0 ? Dv + D + S : 1);
  const Recompute rc{k, kb, kh, ks, v, vb, vh, vs, group, scale, keep, mb, mh, S, lse, ls};
  at::parallel_for(0, n.count(), grain, [&](int64_t begin, int64_t end) {
    RowScratch scratch;
    KeyScan<B> scan;  // (half dtypes without an lse: see restore)
    int64_t seen = -1;  // the (b, h) whose keys `any` tells (a task's rows share a few)
    bool any = false;
    for (int64_t r = begin; r < end; ++r) {
      const int64_t i01 = r / n.n2, b = i01 / n.n1, h = i01 % n.n1;
      const uint8_t* kept = keep + b * mb + h * mh;
      W* y = out + offset(r, n, o);
      if (i01 != seen) {
        seen = i01;
        any = false;
        for (int64_t j = 0; j < S && !any; ++j) any = kept[j] != 0;
      }
      if (!any) {
        std::memset(y, 0, Dv * sizeof(W));
        continue;
      }
      const W* x = q + offset(r, n, qs);
      if (nonfinite<B>(x, D)) {
        for (int64_t e = 0; e < Dv; ++e) y[e] = B::nan;
      } else if (nonfinite<B>(y, Dv) || zero<B>(y, Dv) ||
                 (lse != nullptr ? !std::isfinite(lse[offset(r, n, ls)]) : scan(rc, D, b, h))) {
        const int64_t g = h / group;
        attend_row<B>(x, D, k + b * kb + g * kh, ks, v + b * vb + g * vh, vs, Dv, kept, 0, S,
                      scale, y, scratch);
      }
    }
  });
}

template <typename F>
int by_dtype(int dtype, F&& f) {
  switch (dtype) {
    case 0: f(F32{}); return 0;
    case 1: f(F64{}); return 0;
    case 2: f(BF16{}); return 0;
    case 3: f(F16{}); return 0;
    default: return 1;
  }
}

}  // namespace

extern "C" {

// The arguments as one array of int64 (one argument to marshal through ctypes, not twenty):
//   a[0] dtype (0 float32, 1 float64, 2 bfloat16, 3 float16); a[1..3] rows n0, n1, n2;
// then per function, pointers as integers (0 for none) and strides in elements:
//   copy:    a[4] E, a[5] src, a[6..8] its strides, a[9] dst (contiguous), a[10] keep (uint8),
//            a[11..13] its strides, a[14] zero_nonfinite, a[15] flags (float32, contiguous rows)
//   restore: a[4] out, a[5..7] its strides, a[8] Dv, a[9] check_out, a[10] q, a[11..13] its
//            strides, a[14] D, a[15] flags (float32), a[16..18] its strides, a[19] has_key
//            (uint8), a[20..22] its strides, a[23] bad keys (float32, 0 for none: no ranges),
//            a[24..25] its strides along the first two row dims, a[26] S (keys are contiguous),
//            a[27] lo (int64, 0 for no ranges; given with a[23] = 0: ranges without flags),
//            a[28..30] its strides, a[31] hi (int64), a[32..34] its strides,
//            a[35] k (0: no row computed again), a[36..38] its strides (b, kv head, key),
//            a[39] v, a[40..42] its strides, a[43] group (H / G), a[44] scale (a double's bits),
//            a[45] keep (uint8, 0: every key; without key ranges), a[46..47] its strides (b, h),
//            a[48] S (the keys of a row computed again without key ranges), a[49] lse (float32,
//            0 for none: rows without flagged keys whose lse is not finite are computed again,
//            and no key is scanned), a[50..52] its strides over the rows
//   copy with a[9] dst = 0: the flags alone (a pass that reads src only)
// Returns 0, or 1 for an unknown dtype.
int qkv_rows_copy(const int64_t* a) {
  const Rows n{a[1], a[2], a[3]};
  return by_dtype(static_cast<int>(a[0]), [&](auto b) {
    copy<decltype(b)>(n, a[4], reinterpret_cast<const void*>(a[5]), Strides{a[6], a[7], a[8]},
                      reinterpret_cast<void*>(a[9]), reinterpret_cast<const uint8_t*>(a[10]),
                      Strides{a[11], a[12], a[13]}, static_cast<int>(a[14]),
                      reinterpret_cast<float*>(a[15]));
  });
}

int qkv_rows_restore(const int64_t* a) {
  const Rows n{a[1], a[2], a[3]};
  return by_dtype(static_cast<int>(a[0]), [&](auto b) {
    restore<decltype(b)>(n, reinterpret_cast<void*>(a[4]), Strides{a[5], a[6], a[7]}, a[8],
                         static_cast<int>(a[9]), reinterpret_cast<const void*>(a[10]),
                         Strides{a[11], a[12], a[13]}, a[14],
                         reinterpret_cast<const float*>(a[15]), Strides{a[16], a[17], a[18]},
                         reinterpret_cast<const uint8_t*>(a[19]), Strides{a[20], a[21], a[22]},
                         KeyRanges{reinterpret_cast<const float*>(a[23]), a[24], a[25], a[26],
                                   reinterpret_cast<const int64_t*>(a[27]),
                                   Strides{a[28], a[29], a[30]},
                                   reinterpret_cast<const int64_t*>(a[31]),
                                   Strides{a[32], a[33], a[34]}},
                         Recompute{reinterpret_cast<const void*>(a[35]), a[36], a[37], a[38],
                                   reinterpret_cast<const void*>(a[39]), a[40], a[41], a[42],
                                   a[43], bits_as<double>(a[44]),
                                   reinterpret_cast<const uint8_t*>(a[45]), a[46], a[47], a[48],
                                   reinterpret_cast<const float*>(a[49]),
                                   Strides{a[50], a[51], a[52]}});
  });
}

// a[0] dtype; a[1..3] rows (B, H, T); a[4] out, a[5..7] its strides, a[8] Dv; a[9] q, a[10..12]
// its strides, a[13] D; a[14] k, a[15..17] its strides (b, kv head, key); a[18] v, a[19..21] its
// strides; a[22] group (H / G); a[23] keep (uint8, unit key stride), a[24..25] its strides (b, h);
// a[26] S; a[27] scale (a double's bits); a[28] lse (float32, 0 for none: rows whose lse is not
// finite are computed again, and no key is scanned), a[29..31] its strides over the rows.
int qkv_rows_keymask(const int64_t* a) {
  const Rows n{a[1], a[2], a[3]};
  const double scale = bits_as<double>(a[27]);
  return by_dtype(static_cast<int>(a[0]), [&](auto b) {
    keymask_rows<decltype(b)>(n, reinterpret_cast<void*>(a[4]), Strides{a[5], a[6], a[7]}, a[8],
                              reinterpret_cast<const void*>(a[9]), Strides{a[10], a[11], a[12]},
                              a[13], reinterpret_cast<const void*>(a[14]), a[15], a[16], a[17],
                              reinterpret_cast<const void*>(a[18]), a[19], a[20], a[21], a[22],
                              reinterpret_cast<const uint8_t*>(a[23]), a[24], a[25], a[26], scale,
                              reinterpret_cast<const float*>(a[28]), Strides{a[29], a[30], a[31]});
  });
}

}  // extern "C"
