// Attention scores of bfloat16 inputs in float32: out (BH, T, S) = scale * q (BH, T, D) @ k (BH, S, D)^T,
// each product of two bfloat16 exact in float32 and summed in float32, never rounded to bfloat16.
//
// Built by qkv/ops/bf16_scores.py through torch.utils.cpp_extension at first use (ops/_native_build.py)
// and called through ctypes on raw pointers. torch 2.13 has no CPU bmm of bfloat16 with a float32 output,
// and its float32 GEMM of the widened inputs is ~9x slower than this on an AMX CPU. Two GEMMs run it (the
// caller names one per call, see Gemm below): oneDNN's batch-reduce micro-kernel as libtorch_cpu exports
// it (at::native::cpublas::brgemm/pack, bf16 x bf16 -> f32 on AMX, the kernel of torch's own CPU flash
// attention), and qkv's own micro-kernel on AVX512-BF16's dot product for CPUs without AMX (AMD Zen 4:
// there torch's own bfloat16 SDPA ran at 12-17 GFLOP/s, one thread, T=1024).
//
// Supports: contiguous q (BH, T, D) and k (BH, S, D) in bfloat16 with D even (the caller pads an odd D
// with a zero column: VNNI pairs); out float32 with unit column stride and any row and head strides.
// Does not support: float16, other dtypes, CPUs with neither AMX nor AVX512-BF16 (qkv_bf16_gemm_usable()
// says 0 for both, and the caller keeps its float32 GEMM).
//
// Layout: k is packed per head as one (D, Sp) matrix in the VNNI layout the GEMMs read (Sp: S rounded up
// to 64 keys, kN; zero keys past S; each pair of a key's entries moved once from its row). Then every
// (head, block of kM query rows) is one task: for each block of 64 keys one GEMM call (M rows, N=64, K=D)
// into a thread-local tile, scaled and copied into out. Each output element is summed by one GEMM call over D in
// a fixed order, so results do not depend on the thread count.
//
// qkv_bf16_attend: bfloat16 attention whose rows attend ranges of keys (plain, causal, sliding windows,
// key lengths), with or without its weights, fused per (head, block of query rows): the scores of the
// keys the block's rows see (whole blocks of kN) by a GEMM into a float32 tile (never rounded to bfloat16),
// the softmax of each row in float32, the weights rounded once into `probs` when wanted, the lse in
// float32, and the output as the float32 weights times the values: the weights are split into
// hi = bf16(p) (the rounded weights returned) and lo = bf16(p - hi), and hi @ v + lo @ v is summed in
// float32 by two GEMM calls (|p - (hi + lo)| <= 2^-16 p, far below the output's one rounding to
// bfloat16), then rounded once. Without weights the exps e are split unnormalised as they are made
// (hi = bf16(e), lo = bf16(e - hi): one pass over a row instead of two) and the two GEMMs' sum is divided
// by the row's sum of e before that rounding. Nothing (T, S)-sized is allocated besides the weights
// returned. Values are
// packed per head like the keys, in blocks of kN keys and of up to 64 value columns.
#if defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX512)
#define CPU_CAPABILITY_AVX512  // at::vec's 512-bit Vectorized<float> (its own namespace, not libtorch's)
#elif defined(__AVX2__) && !defined(__AVX512F__) && !defined(CPU_CAPABILITY_AVX2)
#define CPU_CAPABILITY_AVX2
#endif
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <initializer_list>
#include <limits>
#include <utility>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <exception>
#include <memory>
#include <vector>

namespace {

namespace cpublas = at::native::cpublas;
using bf16 = c10::BFloat16;

constexpr int64_t kStreamBytes = int64_t{4} << 20;  // returned weights streamed past the caches above
constexpr int64_t kN = 64;  // keys per packed block: oneDNN's pack takes N in {16, 32, 48, 64}
constexpr int64_t kM = 64;  // query rows per task

char last_error[512] = "";

// The bfloat16 x bfloat16 -> float32 GEMMs this file runs on, chosen per call by the caller
// (ops/bf16_scores.py, QKV_BF16_GEMM):
// * kAmx: oneDNN's batch-reduce micro-kernel as libtorch_cpu exports it (cpublas::brgemm), on AMX tiles,
//   with B packed by cpublas::pack; runs where oneDNN packs bfloat16 (cpublas::could_pack).
// * kDot: qkv's own micro-kernel on AVX512-BF16's dot product (vdpbf16ps: each lane adds the two exact
//   products of a pair of bfloat16 to a float32 sum, inputs and outputs below 2^-126 flushed to 0, as
//   AMX's tiles do), with B in the same VNNI layout packed here; runs where the CPU has AVX512-BF16 and
//   this build is AVX-512 (AMD Zen 4 and later, Intel Cooper Lake and later).
// Both read B (K, N) in VNNI pairs: element (k, n) at (k / 2) * 2 * ld + 2 * n + k % 2, so that row k
// (even) of it starts at k * ld. K is even (the callers pad D; the value blocks are whole blocks of kN).
enum Gemm : int64_t { kAmx = 1, kDot = 2 };

bool dot_usable() {
#if defined(CPU_CAPABILITY_AVX512)
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

bool amx_usable() { return cpublas::could_pack(at::kBFloat16); }

// B (K, N) row-major with row stride ld_in -> its VNNI layout with row stride ld_out (N <= ld_out).
void pack_b(Gemm gemm, int64_t K, int64_t N, int64_t ld_in, int64_t ld_out, const bf16* src, bf16* dst) {
  if (gemm == kAmx) return cpublas::pack(K, N, ld_in, ld_out, at::kBFloat16, at::kBFloat16, src, dst);
  for (int64_t k = 0; k < K; k += 2) {
    const bf16 *even = src + k * ld_in, *odd = even + ld_in;
    bf16* row = dst + k * ld_out;
    int64_t n = 0;
#if defined(CPU_CAPABILITY_AVX512)
    if (k + 1 < K) {  // 32 columns of the two rows interleaved by two permutes (AVX512-BW)
      const __m512i lo_idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8,
                                              39, 7, 38, 6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
      const __m512i hi_idx = _mm512_add_epi16(lo_idx, _mm512_set1_epi16(16));
      for (; n + 32 <= N; n += 32) {
        const __m512i e = _mm512_loadu_si512(even + n), o = _mm512_loadu_si512(odd + n);
        _mm512_storeu_si512(row + 2 * n, _mm512_permutex2var_epi16(e, lo_idx, o));
        _mm512_storeu_si512(row + 2 * n + 32, _mm512_permutex2var_epi16(e, hi_idx, o));
      }
    }
#endif
    for (; n < N; ++n) row[2 * n] = even[n], row[2 * n + 1] = k + 1 < K ? odd[n] : bf16(0.0f);
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// C (MR, 16 NV) (+)= A (MR, K) @ B (K, 16 NV) in VNNI pairs, all in registers: per pair of k one load of
// each B vector, one broadcast of each row's pair of A, MR x NV dot products. The sums run over k in
// order, the same for every M, N and thread count.
template <int MR, int NV>
__attribute__((target("avx512f,avx512bw,avx512bf16"))) void dot_tile(int64_t K, const bf16* A, int64_t lda,
                                                                    const bf16* B, int64_t ldb, float* C,
                                                                    int64_t ldc, bool add) {
  __m512 acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = add ? _mm512_loadu_ps(C + m * ldc + 16 * v) : _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 2) {
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(B + k * ldb + 32 * v);
    for (int m = 0; m < MR; ++m) {
      int32_t pair;
      std::memcpy(&pair, A + m * lda + k, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int v = 0; v < NV; ++v) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], a, b[v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(C + m * ldc + 16 * v, acc[m][v]);
}

constexpr int kMR = 6;  // rows per register tile: 6 x 4 accumulators, 4 B vectors and a broadcast
using DotTile = void (*)(int64_t, const bf16*, int64_t, const bf16*, int64_t, float*, int64_t, bool);

template <int MR>
DotTile dot_tile_of(int64_t nv) {
  switch (nv) {
    case 1: return dot_tile<MR, 1>;
    case 2: return dot_tile<MR, 2>;
    case 3: return dot_tile<MR, 3>;
    default: return dot_tile<MR, 4>;
  }
}

DotTile dot_tile_for(int64_t mr, int64_t nv) {
  switch (mr) {
    case 1: return dot_tile_of<1>(nv);
    case 2: return dot_tile_of<2>(nv);
    case 3: return dot_tile_of<3>(nv);
    case 4: return dot_tile_of<4>(nv);
    case 5: return dot_tile_of<5>(nv);
    default: return dot_tile_of<kMR>(nv);
  }
}
#endif

// C (M, N) (+ C where add_c) = A (M, K) row-major @ B (K, N) in VNNI pairs, float32 sums; N a multiple of 16
// for kDot (kN and the value blocks are).
void gemm_b(Gemm gemm, int64_t M, int64_t N, int64_t K, int64_t lda, int64_t ldb, int64_t ldc, bool add_c,
            const bf16* A, const bf16* B, float* C) {
  if (gemm == kAmx) return cpublas::brgemm(M, N, K, lda, ldb, ldc, add_c, A, B, C, true);
#if defined(CPU_CAPABILITY_AVX512)
  if (N % 16 || K % 2) throw std::invalid_argument("gemm_b: N must be a multiple of 16 and K even");
  for (int64_t n0 = 0; n0 < N; n0 += 64) {
    const int64_t nv = std::min<int64_t>(4, (N - n0) / 16);
    for (int64_t m0 = 0; m0 < M; m0 += kMR) {
      const int64_t mr = std::min<int64_t>(kMR, M - m0);
      dot_tile_for(mr, nv)(K, A + m0 * lda, lda, B + 2 * n0, ldb, C + m0 * ldc + n0, ldc, add_c);
    }
  }
#else
  throw std::invalid_argument("the AVX512-BF16 GEMM needs an AVX-512 build");
#endif
}

// After a thread's GEMMs: AMX keeps a tile state per thread, released here.
void gemm_done(Gemm gemm) {
  if (gemm == kAmx) cpublas::brgemm_release(true);
}

// Memory a call needs for its duration, kept by the thread for its next call. A fresh allocation of
// the packed keys and values (1 MiB each at 8 heads of 64, T=1024) went back to the system at every
// call's end, so the next call's was mapped and faulted in again: 11% of a window's call (one thread,
// perf: page faults, unmapping). A thread keeps up to Tag::kKeep bytes of it per Tag (a call's buffers
// and its tasks' are apart: the thread that makes the call runs tasks too). The thread that makes the
// call keeps 64 MiB (the packed keys and values of 8 heads of 64 take 32 MiB at 16k keys); each thread
// that runs tasks keeps 16 MiB (every thread of the pool keeps its own; a task's score rows stay under
// 8 MiB up to 64k keys). A larger need is allocated for the call and freed after. The memory is not
// cleared: `zeroed` clears what a caller asks.
constexpr size_t kAlign = 64;

template <typename Tag>
class Scratch {
 public:
  // room for buffers of the given byte sizes, each aligned to kAlign
  explicit Scratch(std::initializer_list<size_t> sizes) {
    size_t total = 0;
    for (size_t n : sizes) offsets_.push_back(total), total += (n + kAlign - 1) / kAlign * kAlign;
    static thread_local Kept kept;
    if (total > Tag::kKeep) {
      own_.reset(allocate(total));
      base_ = own_.get();
    } else {
      if (kept.bytes < total) kept.memory.reset(allocate(total)), kept.bytes = total;
      base_ = kept.memory.get();
    }
  }
  template <typename T>
  T* at(size_t i) const { return reinterpret_cast<T*>(base_ + offsets_[i]); }
  template <typename T>
  T* zeroed(size_t i, size_t n) const {
    T* p = at<T>(i);
    std::memset(static_cast<void*>(p), 0, n * sizeof(T));
    return p;
  }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  struct Kept {
    std::unique_ptr<char, Free> memory;
    size_t bytes = 0;
  };
  static char* allocate(size_t bytes) {
    void* p = std::aligned_alloc(kAlign, std::max<size_t>(bytes, kAlign));
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<char*>(p);
  }
  std::vector<size_t> offsets_;
  std::unique_ptr<char, Free> own_;
  char* base_ = nullptr;
};
struct CallTag {
  static constexpr size_t kKeep = size_t{64} << 20;
};
struct TaskTag {
  static constexpr size_t kKeep = size_t{16} << 20;
};

// Rows of a (B, H / group, L, E) tensor with unit last stride and any other strides, heads flattened
// as bh = b * H + h: row(bh, l) points at its E entries, of head h / group (GQA: the key and value
// heads a group of `group` query heads shares, read where they lie; 1 else).
template <typename P>
struct Rows {
  P* p;
  int64_t H, sB, sH, sL, group = 1;
  P* row(int64_t bh, int64_t l) const { return p + (bh / H) * sB + ((bh % H) / group) * sH + l * sL; }
};
using InRows = Rows<const bf16>;
using OutRows = Rows<bf16>;

// Whether x[0, n) is all finite: a bfloat16 is NaN/inf where its exponent bits are all ones
// (a loop of integer ops the compiler vectorises; isfinite per element was 5% of a call).
bool finite_row(const bf16* x, int64_t n) {
  const auto* bits = reinterpret_cast<const uint16_t*>(x);
  uint16_t any = 0;
  for (int64_t i = 0; i < n; ++i) any |= static_cast<uint16_t>((bits[i] & 0x7F80) == 0x7F80);
  return any == 0;
}

// x[0, n) with NaN/inf entries as 0, in place.
void zero_nonfinite(bf16* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(static_cast<float>(x[i]))) x[i] = bf16(0.0f);
}

#if defined(CPU_CAPABILITY_AVX512)
// r[0..15] (16 rows of 16 32-bit words) transposed in place: r[i] word j <- r[j] word i.
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int h = 0; h < 16; h += 8)
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_i32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
  }
}
#endif

// A block of kN keys packed straight from their rows (rows of D entries, D even, row stride sL) into a
// head's keys in VNNI pairs, (D / 2, ld) words: the word of entries (2i, 2i+1) of key n is word (i, n)
// from dst (dst: the block's first column), keys past nb zeros. `scratch` (kN x D entries) takes the rows
// whose NaN/inf entries are zeroed first (where `zero`). No transpose: each word is moved once.
void pack_keys_block(const bf16* src, int64_t sL, int64_t nb, int64_t D, int64_t ld, bool zero, bf16* scratch,
                     bf16* dst) {
  const bf16* rows[kN];
  for (int64_t n = 0; n < kN; ++n) {
    const bf16* row = n < nb ? src + n * sL : nullptr;
    if (row != nullptr && zero && !finite_row(row, D)) {
      std::copy(row, row + D, scratch + n * D);
      zero_nonfinite(scratch + n * D, D);
      row = scratch + n * D;
    }
    rows[n] = row;
  }
#if defined(CPU_CAPABILITY_AVX512)
  // 16 keys x 16 words at a time, transposed in registers (the scalar loop below moved a word a
  // cycle or two: 13% of a T=16 call, 3% at T=256); the same words to the same places
  const int64_t W = D / 2;  // words per key
  for (int64_t i0 = 0; i0 < W; i0 += 16) {
    const int64_t w = std::min<int64_t>(16, W - i0);
    const __mmask16 m = static_cast<__mmask16>((1u << w) - 1);
    for (int64_t n0 = 0; n0 < kN; n0 += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j)
        r[j] = rows[n0 + j] != nullptr ? _mm512_maskz_loadu_epi32(m, rows[n0 + j] + 2 * i0)
                                       : _mm512_setzero_si512();
      transpose16(r);  // r[i]: word i0 + i of keys n0 .. n0 + 15
      for (int64_t i = 0; i < w; ++i) _mm512_storeu_si512(dst + 2 * ((i0 + i) * ld + n0), r[i]);
    }
  }
  return;
#endif
  for (int64_t i = 0; i < D / 2; ++i) {  // each row of words written in order (ld apart: a head's keys)
    bf16* out = dst + 2 * i * ld;
    for (int64_t n = 0; n < kN; ++n) {
      uint32_t w = 0;
      if (rows[n] != nullptr) std::memcpy(&w, rows[n] + 2 * i, sizeof(w));
      std::memcpy(out + 2 * n, &w, sizeof(w));
    }
  }
}

// Each head's keys as one (D, Sp) matrix in VNNI pairs (Sp = S rounded up to kN, zero keys past S), from
// packed + bh * D * Sp: a row block's scores of all the keys it sees are then one GEMM call (N = the
// keys, ldb = Sp; per block of kN keys, the calls and their wrapper's lookups were 3-6% of a call, the
// same bits). bad (optional, BH x S): set to 1 for a key holding NaN/inf, whose such entries are packed
// as 0.
void pack_keys(InRows k, bf16* packed, int64_t BH, int64_t S, int64_t D, uint8_t* bad = nullptr) {
  const int64_t nS = (S + kN - 1) / kN, Sp = nS * kN;
  at::parallel_for(0, BH * nS, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> scratch(kN * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nS, j = task % nS;
      const int64_t n0 = j * kN, nb = std::min(kN, S - n0);
      const bf16* src = k.row(bh, n0);
      bool clean = true;  // no NaN/inf in this block's keys
      if (bad != nullptr)
        for (int64_t n = 0; n < nb; ++n)
          if (!finite_row(src + n * k.sL, D)) bad[bh * S + n0 + n] = 1, clean = false;
      pack_keys_block(src, k.sL, nb, D, Sp, !clean, scratch.data(), packed + bh * D * Sp + 2 * n0);
    }
  });
}

void scores(Gemm gemm, const bf16* q, const bf16* packed, float* out, int64_t BH, int64_t T, int64_t S,
            int64_t D, int64_t out_bh, int64_t out_t, float scale) {
  const int64_t nS = (S + kN - 1) / kN, nT = (T + kM - 1) / kM;
  at::parallel_for(0, BH * nT, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> tile(kM * kN);  // (kM, kN) float32
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nT, i = task % nT;
      const int64_t t0 = i * kM, mb = std::min(kM, T - t0);
      const bf16* a = q + (bh * T + t0) * D;
      for (int64_t j = 0; j < nS; ++j) {
        const int64_t n0 = j * kN, nb = std::min(kN, S - n0);
        float* dst = out + bh * out_bh + t0 * out_t + n0;
        const bf16* b = packed + bh * D * nS * kN + 2 * n0;  // (pack_keys' layout)
        if (nb == kN) {  // a whole block straight into out, scaled there while in cache
          gemm_b(gemm, mb, kN, D, D, nS * kN, out_t, false, a, b, dst);
          for (int64_t r = 0; r < mb; ++r) {
            float* row = dst + r * out_t;
            for (int64_t n = 0; n < kN; ++n) row[n] *= scale;
          }
        } else {  // the last, partial block of keys: through the tile
          gemm_b(gemm, mb, kN, D, D, nS * kN, kN, false, a, b, tile.data());
          for (int64_t r = 0; r < mb; ++r) {
            const float* src = tile.data() + r * kN;
            for (int64_t n = 0; n < nb; ++n) dst[r * out_t + n] = src[n] * scale;
          }
        }
      }
    }
    gemm_done(gemm);  // the AMX tile state of this thread
  });
}


using Vec = at::vec::Vectorized<float>;
constexpr int64_t kV = Vec::size();

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Value columns per packed block: oneDNN's pack takes N in {16, 32, 48, 64}; Dv is padded to 16.
int64_t value_block(int64_t Dvp, int64_t c0) { return std::min<int64_t>(64, Dvp - c0); }

// v (BH, S, Dv) -> per head, per block of <= 64 columns (Dv padded to Dvp, a multiple of 16), the VNNI
// layout of the (Sp, width) matrix, zero rows past S and zero columns past Dv.
void pack_values(Gemm gemm, InRows v, bf16* packed, int64_t BH, int64_t S, int64_t Dv, int64_t Sp,
                 int64_t Dvp, uint8_t* bad) {
  const int64_t nS = Sp / kN;
  at::parallel_for(0, BH * nS, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> blk(kN * 64);  // (kN keys, <= 64 columns)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nS, j = task % nS;
      const int64_t n0 = j * kN, nb = std::min(kN, std::max<int64_t>(S - n0, 0));
      for (int64_t c0 = 0; c0 < Dvp; c0 += 64) {
        const int64_t w = value_block(Dvp, c0);
        const int64_t wv = std::max<int64_t>(0, std::min(w, Dv - c0));  // real value columns
        for (int64_t n = 0; n < kN; ++n) {
          bf16* dst = blk.data() + n * w;
          std::fill(dst, dst + w, bf16(0.0f));
          if (n >= nb) continue;
          std::copy(v.row(bh, n0 + n) + c0, v.row(bh, n0 + n) + c0 + wv, dst);
          if (!finite_row(dst, wv)) zero_nonfinite(dst, wv), bad[bh * S + n0 + n] = 1;
        }
        // this column block of head bh: (Sp, w) in VNNI; keys n0.. start at row n0 of it
        bf16* dst = packed + bh * Sp * Dvp + c0 * Sp + n0 * w;
        pack_b(gemm, kN, w, w, w, blk.data(), dst);
      }
    }
  });
}

template <typename F>
float lanes(const Vec& x, float init, F op) {
  alignas(64) float buf[kV];
  x.store(buf);
  for (int64_t i = 0; i < kV; ++i) init = op(init, buf[i]);
  return init;
}

#if defined(CPU_CAPABILITY_AVX512)
// float32 -> bfloat16 rounded to nearest even (NaN stays NaN), 16 at a time, as c10::BFloat16(float)
inline __m256i to_bf16(__m512 x) {
  const __m512i bits = _mm512_castps_si512(x);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
  r = _mm512_srli_epi32(r, 16);
  r = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), _mm512_set1_epi32(0x7fc0), r);
  return _mm512_cvtepi32_epi16(r);
}

inline __m512 from_bf16(__m256i h) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// The largest (Top) or the smallest of x[0, n), n >= 1; NaN if any is NaN. A row's softmax needs one:
// the largest scaled score is the largest raw one, or the smallest for a negative scale.
template <bool Top>
float reduce_extreme(const float* x, int64_t n) {
  const float inf = std::numeric_limits<float>::infinity();
  const auto pick_vec = [](const Vec& a, const Vec& b) {
    return Top ? at::vec::maximum(a, b) : at::vec::minimum(a, b);
  };
  Vec e(Top ? -inf : inf);
  int64_t i = 0;
  if (n >= 4 * kV) {  // four chains: one waits on its last compare (4-5 cycles), not on all
    Vec e1(e), e2(e), e3(e);
    for (; i + 4 * kV <= n; i += 4 * kV) {
      e = pick_vec(e, Vec::loadu(x + i));
      e1 = pick_vec(e1, Vec::loadu(x + i + kV));
      e2 = pick_vec(e2, Vec::loadu(x + i + 2 * kV));
      e3 = pick_vec(e3, Vec::loadu(x + i + 3 * kV));
    }
    e = pick_vec(pick_vec(e, e1), pick_vec(e2, e3));  // (the extreme of all: the same value)
  }
  for (; i + kV <= n; i += kV) e = pick_vec(e, Vec::loadu(x + i));
  const auto pick = [](float a, float b) { return (std::isnan(b) || (Top ? b > a : b < a)) ? b : a; };
  float r = lanes(e, Top ? -inf : inf, pick);
  for (; i < n; ++i) r = pick(r, x[i]);
  return r;
}

// p[0, n) -> hi = bf16(p) (into hi, and probs unless null) and lo = bf16(p - hi), both rounded to
// nearest even.
void split_generic(const float* e, float inv, int64_t n, bf16* probs, bf16* hi, bf16* lo) {
  int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 vinv = _mm512_set1_ps(inv);
  for (; c + 16 <= n; c += 16) {
    const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(e + c), vinv);
    const __m256i h = to_bf16(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + c), h);
    if (probs != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + c), h);
    const __m256i l = to_bf16(_mm512_sub_ps(p, from_bf16(h)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + c), l);
  }
#endif
  for (; c < n; ++c) {
    const float p = e[c] * inv;
    const bf16 h(p);
    hi[c] = h;
    if (probs != nullptr) probs[c] = h;
    lo[c] = bf16(p - static_cast<float>(h));
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// The same by AVX512-BF16's conversion (one instruction for 16, rounding to nearest even as above;
// tests/test_bf16_weights.py checks both ways bit for bit), where the CPU has it.
// `stream`: the weights go past the caches (non-temporal stores, no read of their lines first)
// where probs + c is 32-byte aligned: for returned weights larger than the caches, which the call
// never reads again (the caller fences before it returns).
__attribute__((target("avx512bf16"))) void split_bf16(const float* e, float inv, int64_t n,
                                                      bf16* probs, bf16* hi, bf16* lo,
                                                      bool stream = false) {
  const __m512 vinv = _mm512_set1_ps(inv);
  int64_t c = 0;
  stream = stream && probs != nullptr && (reinterpret_cast<uintptr_t>(probs) & 31) == 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 p = _mm512_mul_ps(_mm512_loadu_ps(e + c), vinv);
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(p);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + c), h);
    if (stream)
      _mm256_stream_si256(reinterpret_cast<__m256i*>(probs + c), h);
    else if (probs != nullptr)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(probs + c), h);
    const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, from_bf16(h)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + c), l);
  }
  split_generic(e + c, inv, n - c, probs == nullptr ? nullptr : probs + c, hi + c, lo + c);
}
#endif

bool has_bf16_convert() {
#if defined(CPU_CAPABILITY_AVX512)
  static const bool yes = __builtin_cpu_supports("avx512bf16") && !std::getenv("QKV_BF16_GENERIC_CVT");
  return yes;
#else
  return false;
#endif
}

// e = exp(scale * s - shift) of kV scores at a time (the rows' softmax: scale * s - shift <= 0, or -inf,
// or NaN on a row set NaN anyway). On AVX-512: e^x = 2^t with t = x log2(e) (one multiply-add of s, the
// scale and the shift folded), 2^t = 2^(t - n) 2^n for n = round(t): a degree-6 polynomial (Taylor's of
// e^(r ln 2), |r| <= 1/2) scaled by 2^n (vscalefps); 0 where t < -126, as at::vec's exp_u20 gives 0
// below ln(FLT_MIN), and where t is -inf (a hidden key's score: r is NaN there, and vscalefps of a NaN is
// NaN by Intel's manual, where AMD Zen 4 gives 0; the mask makes it 0 on both). 9 vector operations
// against exp_u20's ~20 and one more multiply-add: the
// row's exps and split took 0.25 ns a score against 0.38 (Zen 4, one core), and measured 4.1e-7 against
// 6.4e-7 relative error. Elsewhere exp_u20.
struct ExpOf {
#if defined(CPU_CAPABILITY_AVX512)
  __m512 scale2, shift2;
  ExpOf(float scale, float shift)
      : scale2(_mm512_set1_ps(scale * 1.44269504088896341f)),
        shift2(_mm512_set1_ps(-shift * 1.44269504088896341f)) {}
  Vec operator()(const float* s) const {
    const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(s), scale2, shift2);
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(t, n);
    __m512 p = _mm512_fmadd_ps(r, _mm512_set1_ps(1.5403530393381606e-4f), _mm512_set1_ps(1.3333558146428443e-3f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(9.618129107628477e-3f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(5.550410866482158e-2f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.2402265069591007f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(0.6931471805599453f));
    p = _mm512_fmadd_ps(r, p, _mm512_set1_ps(1.0f));
    const __mmask16 live = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);  // NaN kept
    return Vec(_mm512_maskz_scalef_ps(live, p, n));
  }
#else
  Vec scale, shift;
  ExpOf(float s, float sh) : scale(s), shift(-sh) {}
  Vec operator()(const float* s) const { return at::vec::fmadd(Vec::loadu(s), scale, shift).exp_u20(); }
#endif
};

// s[0, n) -> e = exp(scale * s - shift), split as it is made into hi = bf16(e) and lo = bf16(e - hi)
// (rounded to nearest even); returns the sum of the e (in the order of softmax_row's). For rows
// whose weights are not wanted: the GEMMs take the unnormalised split and the output is divided
// by the sum after them, so the exps are not written and read again.
// The elements [i, n) of exp_split_*'s row one by one, sum the vectors' sum so far.
inline float exp_split_tail(const float* s, int64_t i, int64_t n, float scale, float shift, bf16* hi,
                            bf16* lo, float sum) {
  for (; i < n; ++i) {
    const float e = std::exp(std::fma(s[i], scale, -shift));
    sum += e;
    const bf16 h(e);
    hi[i] = h;
    lo[i] = bf16(e - static_cast<float>(h));
  }
  return sum;
}

float exp_split_generic(const float* s, int64_t n, float scale, float shift, bf16* hi, bf16* lo) {
  Vec vs(0.0f);
  int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
  const ExpOf exp_of(scale, shift);
  for (; i + kV <= n; i += kV) {
    const Vec e = exp_of(s + i);
    vs = vs + e;
    const __m256i h = to_bf16(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), to_bf16(_mm512_sub_ps(e, from_bf16(h))));
  }
#endif
  return exp_split_tail(s, i, n, scale, shift, hi, lo, lanes(vs, 0.0f, std::plus<float>()));
}

#if defined(CPU_CAPABILITY_AVX512)
// The same by AVX512-BF16's conversion (the same bits as above).
__attribute__((target("avx512bf16"))) float exp_split_bf16(const float* s, int64_t n, float scale,
                                                          float shift, bf16* hi, bf16* lo) {
  const ExpOf exp_of(scale, shift);
  Vec vs(0.0f);
  int64_t i = 0;
  for (; i + kV <= n; i += kV) {
    const Vec e = exp_of(s + i);
    vs = vs + e;
    const __m256i h = (__m256i)_mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + i), h);
    const __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(e, from_bf16(h)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(lo + i), l);
  }
  return exp_split_tail(s, i, n, scale, shift, hi, lo, lanes(vs, 0.0f, std::plus<float>()));
}
#endif

// One row of raw scores s[0, K) (q.k, not yet scaled, keys kb0 + [0, K)) whose keys are [a, b) of it:
// the weights of softmax(scale * s[a, b)) into hi/lo[0, K) (zeros outside [a, b)) and, unless null,
// probs (the row's S weights, from key kb0 + a; zeros elsewhere, written by the caller); returns the lse
// (-inf for a row with no key, a < b false). s is overwritten. scale * s - max(scale * s) is one fused
// multiply-add per score, the max taken from a raw extreme (the smallest raw score is the largest
// scaled one for a negative scale). Without probs, hi/lo hold the exps unnormalised instead (split as
// they are made) and *norm = 1 / their sum, the factor of the row's output after the GEMMs (1 with
// probs).
float softmax_row(float* s, int64_t a, int64_t b, float scale, int64_t K, bf16* probs, bf16* hi,
                  bf16* lo, float* norm, bool stream = false) {
  *norm = 1.0f;
  std::fill(hi, hi + std::max<int64_t>(a, 0), bf16(0.0f));
  std::fill(lo, lo + std::max<int64_t>(a, 0), bf16(0.0f));
  if (a >= b) {
    std::fill(hi, hi + K, bf16(0.0f));
    std::fill(lo, lo + K, bf16(0.0f));
    return -std::numeric_limits<float>::infinity();
  }
  s += a, hi += a, lo += a;
  const int64_t n = b - a;
  // the largest of the scaled scores
  const float m = scale >= 0.0f ? scale * reduce_extreme<true>(s, n) : scale * reduce_extreme<false>(s, n);
  if (m == -std::numeric_limits<float>::infinity()) {  // every key masked (documents): no key
    std::fill(hi - a, hi - a + K, bf16(0.0f));
    std::fill(lo - a, lo - a + K, bf16(0.0f));
    if (probs != nullptr) std::fill(probs, probs + n, bf16(0.0f));
    return m;
  }
  // a row whose largest score is +inf or NaN: NaN throughout, as exp(s - m) is in torch's softmax
  const float shift = std::isfinite(m) ? m : 0.0f;
  if (probs == nullptr) {  // no weights wanted: hi + lo split unnormalised, the output times *norm
    float sum;
#if defined(CPU_CAPABILITY_AVX512)
    if (has_bf16_convert())
      sum = exp_split_bf16(s, n, scale, shift, hi, lo);
    else
#endif
      sum = exp_split_generic(s, n, scale, shift, hi, lo);
    if (!std::isfinite(m)) sum = std::numeric_limits<float>::quiet_NaN();
    *norm = 1.0f / sum;
    std::fill(hi + n, hi + (K - a), bf16(0.0f));
    std::fill(lo + n, lo + (K - a), bf16(0.0f));
    return m + std::log(sum);
  }
  const ExpOf exp_of(scale, shift);
  Vec vs(0.0f);
  int64_t i = 0;
  for (; i + kV <= n; i += kV) {
    const Vec e = exp_of(s + i);
    e.store(s + i);
    vs = vs + e;
  }
  float sum = lanes(vs, 0.0f, [](float x, float y) { return x + y; });
  for (; i < n; ++i) {
    s[i] = std::exp(std::fma(s[i], scale, -shift));
    sum += s[i];
  }
  if (!std::isfinite(m)) sum = std::numeric_limits<float>::quiet_NaN();
#if defined(CPU_CAPABILITY_AVX512)
  if (has_bf16_convert())
    split_bf16(s, 1.0f / sum, n, probs, hi, lo, stream);
  else
#endif
    split_generic(s, 1.0f / sum, n, probs, hi, lo);
  std::fill(hi + n, hi + (K - a), bf16(0.0f));
  std::fill(lo + n, lo + (K - a), bf16(0.0f));
  return m + std::log(sum);
}

// Each query row's keys [lo, hi): (B or 1, T) int64 arrays, batch stride sB (0: one for all). With
// document ids (q_ids (B or 1, T), kv_ids (B or 1, S), batch strides qs, ks; else null), of those only
// the keys whose id is the row's.
struct Ranges {
  const int64_t *lo, *hi;
  int64_t H, sB;
  const int64_t *q_ids, *kv_ids;
  int64_t qs, ks;
  const uint8_t* mixed;  // (B or 1, T), batch stride qs: 0 where the row's range holds its id only
  bool compare(int64_t bh, int64_t t) const {
    return q_ids != nullptr && (mixed == nullptr || mixed[(bh / H) * qs + t] != 0);
  }
  int64_t at(const int64_t* x, int64_t bh, int64_t t) const { return x[(bh / H) * sB + t]; }
  int64_t q_id(int64_t bh, int64_t t) const { return q_ids[(bh / H) * qs + t]; }
  const int64_t* kv_row(int64_t bh) const { return kv_ids + (bh / H) * ks; }
};

// bad_before (BH x (S + 1)): keys before each position whose key or value holds NaN/inf.
// probs: null, or (BH, T, S) written whole.
// Whether row t of head bh may attend a key holding NaN/inf among [a, b) (of its id, with documents).
bool bad_in_range(const uint8_t* bad, const int32_t* before, int64_t a, int64_t b, const Ranges& ranges,
                  int64_t bh, int64_t t) {
  if (before[b] == before[a]) return false;
  if (!ranges.compare(bh, t)) return true;
  const int64_t id = ranges.q_id(bh, t), *kid = ranges.kv_row(bh);
  for (int64_t j = a; j < b; ++j)
    if (bad[j] && kid[j] == id) return true;
  return false;
}

// pk, pv, bad_flags and bad_before are per key head: Hk of them per batch element, each shared by
// H / Hk query heads (GQA; Hk = H else).
void attend(Gemm gemm, InRows q, const bf16* pk, const bf16* pv, const uint8_t* bad_flags,
            const int32_t* bad_before, Ranges ranges,
            bf16* probs, OutRows out, float* lse, int64_t BH, int64_t Hk, int64_t T, int64_t S, int64_t D,
            int64_t Dv, int64_t Sp, int64_t Dvp, int64_t rows, float scale) {
  const int64_t H = ranges.H, group = H / Hk;
  const int64_t nT = (T + rows - 1) / rows;
  // returned weights of more than kStreamBytes: stored past the caches (split_bf16)
  const bool stream = probs != nullptr && BH * T * S * static_cast<int64_t>(sizeof(bf16)) > kStreamBytes;
  at::parallel_for(0, BH * nT, 1, [&](int64_t begin, int64_t end) {
    const Scratch<TaskTag> mem({rows * Sp * sizeof(float), rows * Dvp * sizeof(float), rows * Sp * sizeof(bf16),
                                rows * Sp * sizeof(bf16), rows * D * sizeof(bf16), rows * sizeof(uint8_t),
                                rows * sizeof(float)});
    float *const sc = mem.at<float>(0), *const acc = mem.at<float>(1), *const norm = mem.at<float>(6);
    bf16 *const hi = mem.at<bf16>(2), *const lo = mem.at<bf16>(3), *const qz = mem.at<bf16>(4);
    uint8_t* const row_bad = mem.at<uint8_t>(5);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nT, i = task % nT;
      const int64_t kvh = (bh / H) * Hk + (bh % H) / group;  // its key and value head
      const int64_t t0 = i * rows, mb = std::min(rows, T - t0);
      // the keys some row of this block sees, in whole blocks of kN: [kb0, kb1)
      int64_t first = S, last = 0;
      for (int64_t r = 0; r < mb; ++r) {
        const int64_t a = ranges.at(ranges.lo, bh, t0 + r), b = ranges.at(ranges.hi, bh, t0 + r);
        if (a < b) first = std::min(first, a), last = std::max(last, b);
      }
      const int64_t kb0 = first < last ? first / kN * kN : 0;
      const int64_t kb1 = first < last ? round_up(last, kN) : 0;
      const int64_t K = kb1 - kb0;  // a multiple of kN: few distinct brgemm shapes
      // the block's query rows with NaN/inf entries as 0 (the contract's zeroed inputs)
      for (int64_t r = 0; r < mb; ++r) {
        const bf16* src = q.row(bh, t0 + r);
        std::copy(src, src + D, qz + r * D);
        row_bad[r] = !finite_row(src, D);
        if (row_bad[r]) zero_nonfinite(qz + r * D, D);
      }
      if (K > 0)  // the scores of every key the block sees, one call (pack_keys' layout)
        gemm_b(gemm, mb, K, D, D, Sp, Sp, false, qz, pk + kvh * D * Sp + 2 * kb0, sc);
      for (int64_t r = 0; r < mb; ++r) {
        const int64_t a = ranges.at(ranges.lo, bh, t0 + r), b = ranges.at(ranges.hi, bh, t0 + r);
        bf16* prow = probs == nullptr ? nullptr : probs + (bh * T + t0 + r) * S;
        if (prow != nullptr) {
          std::fill(prow, prow + std::max<int64_t>(a, 0), bf16(0.0f));
          std::fill(prow + std::max(a, b), prow + S, bf16(0.0f));
        }
        float row_scale = scale;
        if (a < b && ranges.compare(bh, t0 + r)) {  // documents: other ids' keys -inf, scaled here
          float* srow = sc + r * Sp + (a - kb0);
          const int64_t id = ranges.q_id(bh, t0 + r), *kid = ranges.kv_row(bh) + a;
          const float ninf = -std::numeric_limits<float>::infinity();
          for (int64_t c = 0; c < b - a; ++c) srow[c] = kid[c] == id ? srow[c] * scale : ninf;
          row_scale = 1.0f;
        }
        lse[bh * T + t0 + r] = softmax_row(sc + r * Sp, a - kb0, b - kb0, row_scale, K,
                                           prow == nullptr ? nullptr : prow + a,
                                           hi + r * Sp, lo + r * Sp, &norm[r], stream);
      }
      if (K > 0)
        for (int64_t c0 = 0; c0 < Dvp; c0 += 64) {
          const int64_t w = value_block(Dvp, c0);
          const bf16* bv = pv + kvh * Sp * Dvp + c0 * Sp + kb0 * w;  // VNNI rows from key kb0
          gemm_b(gemm, mb, w, K, Sp, w, Dvp, false, hi, bv, acc + c0);
          gemm_b(gemm, mb, w, K, Sp, w, Dvp, true, lo, bv, acc + c0);
        }
      const int32_t* before = bad_before + kvh * (S + 1);
      for (int64_t r = 0; r < mb; ++r) {
        bf16* dst = out.row(bh, t0 + r);
        const float* src = acc + r * Dvp;
        const int64_t a = ranges.at(ranges.lo, bh, t0 + r), b = ranges.at(ranges.hi, bh, t0 + r);
        if (a >= b || lse[bh * T + t0 + r] == -std::numeric_limits<float>::infinity()) {
          // a row that may attend to nothing: exactly 0, never NaN
          std::fill(dst, dst + Dv, bf16(0.0f));
        } else if (row_bad[r] || bad_in_range(bad_flags + kvh * S, before, a, b, ranges, bh, t0 + r)) {
          // NaN on a bad query row and on a row that may attend a bad key (plain math's NaN rows)
          std::fill(dst, dst + Dv, bf16(std::numeric_limits<float>::quiet_NaN()));
        } else {
          const float f = norm[r];  // 1 where the weights were normalised before the GEMMs
          int64_t c = 0;
#if defined(CPU_CAPABILITY_AVX512)
          const __m512 vf = _mm512_set1_ps(f);  // (to_bf16: c10's rounding, bit for bit)
          for (; c + 16 <= Dv; c += 16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                                to_bf16(_mm512_mul_ps(_mm512_loadu_ps(src + c), vf)));
#endif
          for (; c < Dv; ++c) dst[c] = bf16(src[c] * f);
        }
      }
    }
#if defined(CPU_CAPABILITY_AVX512)
    if (stream) _mm_sfence();  // this thread's streamed weights visible before the call returns
#endif
    gemm_done(gemm);
  });
}

// --- a few query rows (a decoding step) on AVX512-BF16: no packing ---------------------------------------
// Packing every key and value (a transpose and an interleave) cost a one-row call 3-4x its products on AMD
// Zen 4 (T=1, S=4096, 8 heads, one thread: 2.5 ms, where reading k and v once took 0.4). With a few rows,
// a head's rows read its keys and values as they lie instead: a score is the dot product of the row with
// the key by AVX512-BF16's instruction (float32 sums of exact products, summed across lanes at the end),
// and the output the float32 weights (hi + lo, as softmax_row splits them) times the values widened to
// float32, by fused multiply-adds in key order. Measured there against the tiles (ms, S=4096 / S=128):
// T=1 0.68 / 0.042 against 2.65 / 0.072, T=4 1.50 / 0.072 against 2.81 / 0.077, T=8 level (2.99 / 0.094
// against 2.88 / 0.090): up to 4 rows. The NaN/inf contract as in attend: NaN/inf entries of q and k count
// as 0 for the weights and the lse, and a bad query row, or a key or value in the row's range holding one,
// gives NaN (if the row has a key; a bad value is therefore not zeroed: the row is NaN whatever it adds).
constexpr int64_t kFewRows = 4;

#if defined(CPU_CAPABILITY_AVX512)
// The dot product of q and k[0, D) (D even), in float32; k with NaN/inf entries as 0 (*bad set to 1).
__attribute__((target("avx512f,avx512bw,avx512bf16"))) float dot_row(const bf16* q, const bf16* k, int64_t D,
                                                                    uint8_t* bad) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 32) {
    const __mmask32 m = D - d >= 32 ? ~__mmask32{0} : (__mmask32{1} << (D - d)) - 1;
    __m512i kv = _mm512_maskz_loadu_epi16(m, k + d);
    const __mmask32 nonfinite = _mm512_cmpeq_epi16_mask(
        _mm512_and_si512(kv, _mm512_set1_epi16(0x7F80)), _mm512_set1_epi16(0x7F80));
    if (nonfinite != 0) *bad = 1, kv = _mm512_maskz_mov_epi16(~nonfinite, kv);
    const __m512i qv = _mm512_maskz_loadu_epi16(m, q + d);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)qv, (__m512bh)kv);
  }
  return _mm512_reduce_add_ps(acc);
}

// acc[c0, c0 + 16 NV) = sum over j < n of w[j] * v_j[c0, ...) widened to float32 (v_j = v.row(bh, a + j)),
// multiply-adds in key order, in registers; entries past Dv are not read or written. Returns whether a
// value entry read is NaN/inf (it is not zeroed: the row is NaN then).
template <int NV>
__attribute__((target("avx512f,avx512bw"))) bool weighted_values(const float* w, InRows v, int64_t bh,
                                                                 int64_t a, int64_t n, int64_t c0,
                                                                 int64_t Dv, const int64_t* kid, int64_t id,
                                                                 float* acc) {
  __m512 sum[NV];
  __mmask16 m[NV];
  for (int i = 0; i < NV; ++i) {
    const int64_t left = Dv - c0 - 16 * i;
    m[i] = left >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << left) - 1);
    sum[i] = _mm512_setzero_ps();
  }
  __mmask16 nonfinite = 0;
  const __m256i exponent = _mm256_set1_epi16(0x7F80);
  for (int64_t j = 0; j < n; ++j) {
    if (kid != nullptr && kid[a + j] != id) continue;  // another id's key: weight 0, no effect
    const bf16* row = v.row(bh, a + j) + c0;
    const __m512 vw = _mm512_set1_ps(w[j]);
    for (int i = 0; i < NV; ++i) {
      const __m256i h = _mm256_maskz_loadu_epi16(m[i], row + 16 * i);
      nonfinite |= _mm256_cmpeq_epi16_mask(_mm256_and_si256(h, exponent), exponent);
      const __m512 x = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      sum[i] = _mm512_fmadd_ps(vw, x, sum[i]);
    }
  }
  for (int i = 0; i < NV; ++i) _mm512_mask_storeu_ps(acc + c0 + 16 * i, m[i], sum[i]);
  return nonfinite != 0;
}

// acc[0, Dv) = the row's weights w[0, n) times its values [a, a + n), but for the keys whose id kid[j] is
// not the row's `id` (kid null: none such); whether a value read holds NaN/inf.
bool weighted_row(const float* w, InRows v, int64_t bh, int64_t a, int64_t n, int64_t Dv, const int64_t* kid,
                  int64_t id, float* acc) {
  bool bad = false;
  for (int64_t c0 = 0; c0 < Dv; c0 += 64) {
    switch (std::min<int64_t>(4, (Dv - c0 + 15) / 16)) {
      case 1: bad |= weighted_values<1>(w, v, bh, a, n, c0, Dv, kid, id, acc); break;
      case 2: bad |= weighted_values<2>(w, v, bh, a, n, c0, Dv, kid, id, acc); break;
      case 3: bad |= weighted_values<3>(w, v, bh, a, n, c0, Dv, kid, id, acc); break;
      default: bad |= weighted_values<4>(w, v, bh, a, n, c0, Dv, kid, id, acc);
    }
  }
  return bad;
}

// Each head one task, its rows together: each key and value row is read once from memory for all the rows
// that see it (the rows' scores of keys [a, b), softmax_row, the outputs). With document ids, a row whose
// range holds other ids (ranges.compare) skips their keys: score -inf, never read, no effect.
void attend_few(InRows q, InRows k, InRows v, const Ranges& ranges, bf16* probs, OutRows out, float* lse,
                int64_t BH, int64_t T, int64_t S, int64_t D, int64_t Dv, float scale) {
  at::parallel_for(0, BH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sc(T * S), acc(T * Dv), norm(T), w(S);
    std::vector<bf16> hi(T * S), lo(T * S), qz(T * D);
    std::vector<int64_t> a(T), b(T), id(T);
    std::vector<uint8_t> compare(T);  // rows that compare ids
    std::vector<uint8_t> query_bad(T), any_bad(T);  // any_bad: a key or value in [a, b) with NaN/inf
    for (int64_t bh = begin; bh < end; ++bh) {
      int64_t first = S, last = 0;  // the keys some row sees: [first, last)
      for (int64_t t = 0; t < T; ++t) {
        a[t] = std::clamp<int64_t>(ranges.at(ranges.lo, bh, t), 0, S);
        b[t] = std::max(a[t], std::clamp<int64_t>(ranges.at(ranges.hi, bh, t), 0, S));
        if (a[t] < b[t]) first = std::min(first, a[t]), last = std::max(last, b[t]);
        const bf16* src = q.row(bh, t);
        std::copy(src, src + D, qz.begin() + t * D);
        query_bad[t] = !finite_row(src, D);
        if (query_bad[t]) zero_nonfinite(qz.data() + t * D, D);
        any_bad[t] = 0;
        compare[t] = a[t] < b[t] && ranges.compare(bh, t);
        id[t] = compare[t] ? ranges.q_id(bh, t) : 0;
      }
      const int64_t* kid = ranges.q_ids == nullptr ? nullptr : ranges.kv_row(bh);
      const float ninf = -std::numeric_limits<float>::infinity();
      for (int64_t j = first; j < last; ++j) {
        const bf16* key = k.row(bh, j);
        for (int64_t t = 0; t < T; ++t) {
          if (j < a[t] || j >= b[t]) continue;
          float& score = sc[t * S + j - a[t]];
          if (!compare[t])
            score = dot_row(qz.data() + t * D, key, D, &any_bad[t]);
          else  // documents: scaled here, other ids' keys -inf (as attend does)
            score = kid[j] == id[t] ? dot_row(qz.data() + t * D, key, D, &any_bad[t]) * scale : ninf;
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        bf16* prow = probs == nullptr ? nullptr : probs + (bh * T + t) * S;
        if (prow != nullptr) std::fill(prow, prow + S, bf16(0.0f));
        const int64_t n = b[t] - a[t];
        lse[bh * T + t] = softmax_row(sc.data() + t * S, 0, n, compare[t] ? 1.0f : scale, n,
                                      prow == nullptr ? nullptr : prow + a[t], hi.data() + t * S,
                                      lo.data() + t * S, &norm[t]);
      }
      for (int64_t t = 0; t < T; ++t) {  // the float32 weights (hi + lo) times the values
        const int64_t n = b[t] - a[t];
        for (int64_t i = 0; i < n; ++i)
          w[i] = static_cast<float>(hi[t * S + i]) + static_cast<float>(lo[t * S + i]);
        if (weighted_row(w.data(), v, bh, a[t], n, Dv, compare[t] ? kid : nullptr, id[t], acc.data() + t * Dv))
          any_bad[t] = 1;
      }
      for (int64_t t = 0; t < T; ++t) {
        bf16* dst = out.row(bh, t);
        if (a[t] >= b[t] || lse[bh * T + t] == -std::numeric_limits<float>::infinity()) {
          std::fill(dst, dst + Dv, bf16(0.0f));  // a row that may attend to nothing: exactly 0
        } else if (query_bad[t] || any_bad[t]) {
          std::fill(dst, dst + Dv, bf16(std::numeric_limits<float>::quiet_NaN()));
        } else {
          for (int64_t c = 0; c < Dv; ++c) dst[c] = bf16(acc[t * Dv + c] * norm[t]);
        }
      }
    }
  });
}
#endif

// The GEMM of a call's argument, refused unless it runs here: kDot on a CPU without AVX512-BF16 would
// stop the process with an illegal instruction.
Gemm checked(int64_t gemm) {
  if (gemm == kAmx && amx_usable()) return kAmx;
  if (gemm == kDot && dot_usable()) return kDot;
  throw std::invalid_argument("bfloat16 GEMM " + std::to_string(gemm) + " does not run here");
}

}  // namespace

extern "C" {

// 1 where the GEMM `gemm` (kAmx, kDot) runs here, else 0.
int qkv_bf16_gemm_usable(int64_t gemm) {
  try {
    return (gemm == kAmx && amx_usable()) || (gemm == kDot && dot_usable()) ? 1 : 0;
  } catch (const std::exception& e) {
    std::snprintf(last_error, sizeof(last_error), "%s", e.what());
    return 0;
  }
}

const char* qkv_bf16_scores_error() { return last_error; }

// 0 on success, 1 on an error (qkv_bf16_scores_error says which); out is then undefined. gemm: kAmx or
// kDot, one that runs here (qkv_bf16_gemm_usable).
int qkv_bf16_scores(const bf16* q, const bf16* k, float* out, int64_t BH, int64_t T, int64_t S,
                    int64_t D, int64_t out_bh, int64_t out_t, float scale, int64_t gemm) {
  try {
    const Gemm g = checked(gemm);
    const int64_t nS = (S + kN - 1) / kN;
    const Scratch<CallTag> mem({static_cast<size_t>(BH * nS * D * kN) * sizeof(bf16)});
    bf16* const packed = mem.at<bf16>(0);
    pack_keys(InRows{k, 1, S * D, 0, D}, packed, BH, S, D);
    scores(g, q, packed, out, BH, T, S, D, out_bh, out_t, scale);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(last_error, sizeof(last_error), "%s", e.what());
    return 1;
  }
}

// bfloat16 attention whose query row t may attend the keys [lo_t, hi_t) (0 <= lo, hi <= S; lo >= hi: no
// key), in one fused pass: q (B, H, T, D), k (B, Hk, S, D), v (B, Hk, S, Dv) and out (B, H, T, Dv) with
// unit last stride and the (batch, head, row) strides given, BH = B * H, Hk dividing H (GQA: query head h
// reads key and value head h / (H / Hk), each packed once), D even, S >= 1; lo and hi (B or 1, T)
// int64 with batch stride range_sB; q_ids (B or 1, T) and kv_ids (B or 1, S) int64 document ids (null:
// none) with batch strides q_ids_sB and kv_ids_sB: a row attends only keys of its own id in its range,
// compared where mixed (bool (B or 1, T) like q_ids, or null: everywhere) says its range holds other ids;
// lse (BH, T) float32 contiguous; probs null (no weights wanted) or
// (BH, T, S) bfloat16 contiguous; out, probs and lse written whole. A row with no key outputs 0, weights 0
// and lse -inf. It keeps qkv's NaN/inf contract itself, as ops/nonfinite.py's eager guard does: NaN/inf
// entries of q, k and v count as 0 for the weights, the lse and the output, and then a query row holding
// one, and every row that may attend a key whose key or value holds one, outputs NaN (if it has a key).
// gemm: kAmx or kDot, one that runs here (qkv_bf16_gemm_usable). 0 on success, 1 on an error
// (qkv_bf16_scores_error).
int qkv_bf16_attend(const bf16* q, const bf16* k, const bf16* v, const int64_t* lo, const int64_t* hi,
                    const int64_t* q_ids, const int64_t* kv_ids, const uint8_t* mixed,
                    int64_t q_ids_sB, int64_t kv_ids_sB,
                    bf16* probs, bf16* out, float* lse, const int64_t* strides, int64_t range_sB,
                    int64_t H, int64_t Hk, int64_t BH, int64_t T, int64_t S, int64_t D, int64_t Dv,
                    float scale, int64_t rows, int64_t gemm) {
  try {
    const Gemm g = checked(gemm);
    if (Hk < 1 || H % Hk != 0)
      throw std::invalid_argument("key heads " + std::to_string(Hk) + " do not divide query heads " +
                                  std::to_string(H));
    const int64_t group = H / Hk, BHk = BH / H * Hk;
    const int64_t Sp = round_up(S, kN), Dvp = round_up(Dv, 16);
    // rows per task: a float32 score tile and two bfloat16 tiles of rows x Sp stay near the cache
    // (rows > 0: as given, for benchmarks of the choice)
    const bool rows_chosen = rows <= 0;  // (else as given: tests and benchmarks pick the tiles)
    if (rows <= 0) rows = std::clamp<int64_t>((int64_t{1} << 18) / Sp / 16 * 16, 16, kM);
    rows = std::min(rows, std::max<int64_t>(T, 1));  // a short call's tiles hold its rows only
    // strides: (batch, head, row) of q, k, v and out, in that order
    // k and v by query head (attend_few), and by key head (packed once per key head)
    const InRows qr{q, H, strides[0], strides[1], strides[2]};
    const InRows kr{k, H, strides[3], strides[4], strides[5], group}, vr{v, H, strides[6], strides[7], strides[8], group};
    const InRows kh{k, Hk, strides[3], strides[4], strides[5]}, vh{v, Hk, strides[6], strides[7], strides[8]};
    const OutRows outr{out, H, strides[9], strides[10], strides[11]};
    const Ranges ranges{lo, hi, H, range_sB, q_ids, kv_ids, q_ids_sB, kv_ids_sB, mixed};
#if defined(CPU_CAPABILITY_AVX512)
    if (g == kDot && T <= kFewRows && rows_chosen) {
      attend_few(qr, kr, vr, ranges, probs, outr, lse, BH, T, S, D, Dv, scale);
      return 0;
    }
#endif
    const Scratch<CallTag> mem({static_cast<size_t>(BHk * Sp * D) * sizeof(bf16),
                               static_cast<size_t>(BHk * Sp * Dvp) * sizeof(bf16), static_cast<size_t>(BHk * S),
                               static_cast<size_t>(BHk * (S + 1)) * sizeof(int32_t)});
    bf16 *const pk = mem.at<bf16>(0), *const pv = mem.at<bf16>(1);
    uint8_t* const bad = mem.zeroed<uint8_t>(2, BHk * S);  // keys whose key or value holds NaN/inf
    pack_keys(kh, pk, BHk, S, D, bad);
    pack_values(g, vh, pv, BHk, S, Dv, Sp, Dvp, bad);
    int32_t* const bad_before = mem.at<int32_t>(3);
    for (int64_t bh = 0; bh < BHk; ++bh) {
      int32_t* before = bad_before + bh * (S + 1);
      before[0] = 0;
      for (int64_t j = 0; j < S; ++j) before[j + 1] = before[j] + bad[bh * S + j];
    }
    attend(g, qr, pk, pv, bad, bad_before, ranges, probs, outr, lse, BH, Hk, T, S, D, Dv, Sp, Dvp, rows, scale);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(last_error, sizeof(last_error), "%s", e.what());
    return 1;
  }
}

}  // extern "C"
