// bfloat16 linear layers on AVX-512-BF16's pair dot product, each output in one fixed order
// whatever the batch.
//
// Where the CPU has AVX512_BF16 (and AMX is not there or is turned off: AMX goes first),
// bfloat16 weights are packed in k pairs and every output is
//
//   acc = 0;  for each pair (2i, 2i + 1) in increasing i:  acc = vdpbf16ps(acc, x[m, 2i:2i+2],
//   w[n, 2i:2i+2]);  out[m, n] = bf16(acc + bias[n])
//
// vdpbf16ps adds the two exact bfloat16 products of a pair to a float32 accumulator in the
// hardware's own fixed rounding (per the instruction's definition: the odd product, then the
// even one, each rounded to nearest even, denormals flushed). That is one chain per output, the
// same for every row whatever M, the row's place, the thread or the thread count; it is not the
// portable path's one-FMA-per-k chain, so bfloat16 bits differ between CPUs with and without
// AVX512_BF16, as they do with AMX (the engine and a trainer on one machine agree). Against the
// widened chain it does twice the multiply-adds per instruction and never widens the weights:
// the bfloat16 GEMM at oneDNN's speed on CPUs without AMX.
//
// Layouts: x is copied to [M, Kp] (Kp = K rounded up to even, a zero past K); the weight is
// packed as [ceil(N / 16), Kp / 2, 16, 2] (the AMX layout, with K rounded up to 2, not 32).
//
// ROLLOUT_ENGINE_BI_DPBF16=0 turns the path off (the portable order then runs for bfloat16).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "batch_invariant_gemm.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define BATCH_INVARIANT_DPBF16 1
#endif

namespace batch_invariant::dpbf16 {

constexpr int64_t kCols = kPanel;   // output columns per panel (the FMA chain's panels)
constexpr int64_t kRows = 8;        // rows of accumulators in registers
constexpr int64_t kPanels = 2;      // panels of accumulators in registers
static_assert(kRowChunk % kRows == 0, "a work item's rows are whole register blocks");

// weight [N, K] bfloat16 -> [ceil(N / 16), Kp / 2, 16, 2], Kp = K rounded up to `k_multiple`
// (even), zeros past N and K: each panel's rows of k pairs, 16 columns each.
inline at::Tensor pack_pairs(const at::Tensor& weight, int64_t k_multiple) {
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t panels = (N + kCols - 1) / kCols;
  const int64_t Kp = (std::max<int64_t>(K, 1) + k_multiple - 1) / k_multiple * k_multiple;
  at::Tensor padded = at::zeros({panels * kCols, Kp}, weight.options());
  padded.narrow(0, 0, N).narrow(1, 0, K).copy_(weight);
  return padded.view({panels, kCols, Kp / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#ifdef BATCH_INVARIANT_DPBF16
inline bool available() {
  static const bool ok = [] {
    const char* flag = std::getenv("ROLLOUT_ENGINE_BI_DPBF16");
    return !(flag != nullptr && std::strcmp(flag, "0") == 0);
  }();
  return ok;
}

// out[m0 + r, col0 + c] for R rows and P panels: x rows of Kp bfloat16 (stride Kp), panel p at
// panel0 + p * panel_size; bias float32 (padded) or null.
template <int R, int P>
inline void micro_kernel(const at::BFloat16* x, int64_t Kp, const at::BFloat16* panel0,
                         int64_t panel_size, const float* bias, at::BFloat16* out,
                         int64_t out_stride, int64_t col0, int64_t N) {
  __m512 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_setzero_ps();
  for (int64_t i = 0; i < Kp / 2; ++i) {
    __m512bh w[P];
    for (int p = 0; p < P; ++p) {
      w[p] = (__m512bh)_mm512_loadu_si512(panel0 + p * panel_size + i * 2 * kCols);
    }
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, x + r * Kp + 2 * i, sizeof(pair));
      const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
      for (int p = 0; p < P; ++p) acc[r][p] = _mm512_dpbf16_ps(acc[r][p], a, w[p]);
    }
  }
  alignas(64) float lanes[kCols];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      __m512 v = acc[r][p];
      const int64_t col = col0 + p * kCols;
      if (bias != nullptr) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col));
      _mm512_store_ps(lanes, v);
      const int64_t valid = std::min(kCols, N - col);
      at::BFloat16* dst = out + r * out_stride + col;
      for (int64_t j = 0; j < valid; ++j) dst[j] = static_cast<at::BFloat16>(lanes[j]);
    }
}

// The last rows of a chunk (fewer than kRows) run the same chains with fewer accumulators.
template <int R, int P>
inline void micro_rows(int64_t rows, const at::BFloat16* x, int64_t Kp,
                       const at::BFloat16* panel0, int64_t panel_size, const float* bias,
                       at::BFloat16* out, int64_t out_stride, int64_t col0, int64_t N) {
  if (rows == R) {
    micro_kernel<R, P>(x, Kp, panel0, panel_size, bias, out, out_stride, col0, N);
  } else if constexpr (R > 1) {
    micro_rows<R - 1, P>(rows, x, Kp, panel0, panel_size, bias, out, out_stride, col0, N);
  }
}

// x: [M, Kp] (zero past K); packed: [panels, Kp / 2, 16, 2]; bias: float32 padded to whole
// panels or null; out: [M, N] rows out_stride apart.
inline void linear(const at::BFloat16* x, int64_t M, int64_t Kp, const at::BFloat16* packed,
                   int64_t panels, const float* bias, at::BFloat16* out, int64_t out_stride,
                   int64_t N) {
  const int64_t panel_size = Kp / 2 * kCols * 2;
  const int64_t groups = (panels + kPanels - 1) / kPanels;
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, chunks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / groups, first = item % groups * kPanels;
      const int64_t m1 = std::min(M, (chunk + 1) * kRowChunk);
      const at::BFloat16* panel0 = packed + first * panel_size;
      const int64_t col0 = first * kCols;
      for (int64_t m = chunk * kRowChunk; m < m1; m += kRows) {
        const int64_t rows = std::min(kRows, m1 - m);
        if (first + kPanels <= panels) {
          micro_rows<kRows, kPanels>(rows, x + m * Kp, Kp, panel0, panel_size, bias,
                                     out + m * out_stride, out_stride, col0, N);
        } else {
          micro_rows<kRows, 1>(rows, x + m * Kp, Kp, panel0, panel_size, bias,
                               out + m * out_stride, out_stride, col0, N);
        }
      }
    }
  });
}
#else
inline bool available() { return false; }
inline void linear(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t,
                   const float*, at::BFloat16*, int64_t, int64_t) {
  TORCH_CHECK(false, "batch_invariant_linear: built without AVX512_BF16");
}
#endif

}  // namespace batch_invariant::dpbf16
