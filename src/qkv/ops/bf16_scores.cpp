// Attention scores of bfloat16 inputs in float32: out (BH, T, S) = scale * q (BH, T, D) @ k (BH, S, D)^T,
// each product of two bfloat16 exact in float32 and summed in float32, never rounded to bfloat16.
//
// Built by qkv/ops/bf16_scores.py through torch.utils.cpp_extension at first use (ops/_native_build.py)
// and called through ctypes on raw pointers. It runs on oneDNN's batch-reduce GEMM micro-kernel as
// libtorch_cpu exports it (at::native::cpublas::brgemm/pack, bf16 x bf16 -> f32, AMX), the kernel of
// torch's own CPU flash attention: torch 2.13 has no CPU bmm of bfloat16 with a float32 output, and its
// float32 GEMM of the widened inputs is ~9x slower than this on an AMX CPU.
//
// Supports: contiguous q (BH, T, D) and k (BH, S, D) in bfloat16 with D even (the caller pads an odd D
// with a zero column: VNNI pairs); out float32 with unit column stride and any row and head strides.
// Does not support: float16, other dtypes, CPUs without AMX (qkv_bf16_scores_usable() says 0, and
// the caller keeps its float32 GEMM).
//
// Layout: k is packed per head in blocks of 64 keys (kN): each block transposed to (D, 64), zero rows past
// S, and packed by cpublas::pack into the VNNI layout brgemm reads (oneDNN packs only N in 16..64).
// Then every (head, block of kM query rows) is one task: for each key block one brgemm call (M rows,
// N=64, K=D) into a thread-local tile, scaled and copied into out. Each output element is summed by one
// brgemm call over D in a fixed order, so results do not depend on the thread count.
#include <ATen/Parallel.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <memory>
#include <vector>

namespace {

namespace cpublas = at::native::cpublas;
using bf16 = c10::BFloat16;

constexpr int64_t kN = 64;  // keys per packed block: oneDNN's pack takes N in {16, 32, 48, 64}
constexpr int64_t kM = 64;  // query rows per task

char last_error[512] = "";

void pack_keys(const bf16* k, bf16* packed, int64_t BH, int64_t S, int64_t D) {
  const int64_t nS = (S + kN - 1) / kN;
  at::parallel_for(0, BH * nS, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> kt(D * kN);  // one block of keys transposed: (D, kN)
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / nS, j = task % nS;
      const int64_t n0 = j * kN, nb = std::min(kN, S - n0);
      const bf16* src = k + (bh * S + n0) * D;
      for (int64_t d = 0; d < D; ++d) {
        bf16* row = kt.data() + d * kN;
        for (int64_t n = 0; n < nb; ++n) row[n] = src[n * D + d];
        for (int64_t n = nb; n < kN; ++n) row[n] = bf16(0.0f);
      }
      cpublas::pack(D, kN, kN, kN, at::kBFloat16, at::kBFloat16, kt.data(),
                    packed + (bh * nS + j) * D * kN);
    }
  });
}

void scores(const bf16* q, const bf16* packed, float* out, int64_t BH, int64_t T, int64_t S,
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
        const bf16* b = packed + (bh * nS + j) * D * kN;
        if (nb == kN) {  // a whole block straight into out, scaled there while in cache
          cpublas::brgemm(mb, kN, D, D, kN, out_t, false, a, b, dst, true);
          for (int64_t r = 0; r < mb; ++r) {
            float* row = dst + r * out_t;
            for (int64_t n = 0; n < kN; ++n) row[n] *= scale;
          }
        } else {  // the last, partial block of keys: through the tile
          cpublas::brgemm(mb, kN, D, D, kN, kN, false, a, b, tile.data(), true);
          for (int64_t r = 0; r < mb; ++r) {
            const float* src = tile.data() + r * kN;
            for (int64_t n = 0; n < nb; ++n) dst[r * out_t + n] = src[n] * scale;
          }
        }
      }
    }
    cpublas::brgemm_release(true);  // the AMX tile state of this thread
  });
}

}  // namespace

extern "C" {

// 1 where this kernel can run here (oneDNN packs bfloat16 for AMX), else 0.
int qkv_bf16_scores_usable() {
  try {
    return cpublas::could_pack(at::kBFloat16) ? 1 : 0;
  } catch (const std::exception& e) {
    std::snprintf(last_error, sizeof(last_error), "%s", e.what());
    return 0;
  }
}

const char* qkv_bf16_scores_error() { return last_error; }

// 0 on success, 1 on an error (qkv_bf16_scores_error says which); out is then undefined.
int qkv_bf16_scores(const bf16* q, const bf16* k, float* out, int64_t BH, int64_t T, int64_t S,
                    int64_t D, int64_t out_bh, int64_t out_t, float scale) {
  try {
    const int64_t nS = (S + kN - 1) / kN;
    std::unique_ptr<bf16[]> packed(new bf16[BH * nS * D * kN]);
    pack_keys(k, packed.get(), BH, S, D);
    scores(q, packed.get(), out, BH, T, S, D, out_bh, out_t, scale);
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(last_error, sizeof(last_error), "%s", e.what());
    return 1;
  }
}

}  // extern "C"
