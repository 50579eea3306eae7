// The batch-invariant GEMM's register micro-kernel (see batch_invariant_cpu.cpp), shared by the
// linear layer and the mixture-of-experts kernel (moe_experts_cpu.cpp): every output one chain
// of fused multiply-adds in increasing k, over a weight packed in panels of 16 columns.

#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "batch_invariant_vec.h"

namespace batch_invariant {

constexpr int64_t kPanel = kLanes;  // output columns per packed panel
constexpr int64_t kRowChunk = 96;   // rows per parallel work item (a multiple of every kRows)

// Accumulators held in registers: kRows x kPanels vectors of 16 lanes.
template <typename scalar_t>
struct Blocking {
#if defined(__AVX512F__)
  static constexpr int kRows = std::is_same_v<scalar_t, double> ? 4 : 8;
  static constexpr int kPanels = std::is_same_v<scalar_t, double> ? 1 : 2;
#elif defined(__AVX2__) && defined(__FMA__)
  static constexpr int kRows = std::is_same_v<scalar_t, double> ? 4 : 6;
  static constexpr int kPanels = 1;
#else
  static constexpr int kRows = 4;
  static constexpr int kPanels = 1;
#endif
};

// out[m0 + r, n0 + c] for R rows and P panels (16 P columns, the last ones past N skipped).
// x: R rows of K widened inputs; panel: the first of P packed panels (weights of scalar_t);
// bias: padded or null; out: rounded to out_t (the weights' dtype, or the accumulator's).
template <typename scalar_t, typename out_t, int R, int P>
inline void micro_kernel(const AccFor<scalar_t>* x, int64_t x_stride, const scalar_t* panel,
                         int64_t K, const AccFor<scalar_t>* bias, out_t* out,
                         int64_t out_stride, int64_t n0, int64_t N) {
  using V = VecFor<scalar_t>;
  using Acc = AccFor<scalar_t>;
  const int64_t panel_stride = K * kPanel;
  V acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) acc[r][p] = V::zero();
  for (int64_t k = 0; k < K; ++k) {
    V w[P];
    for (int p = 0; p < P; ++p) w[p] = V::load(panel + p * panel_stride + k * kPanel);
    for (int r = 0; r < R; ++r) {
      const V a = V::broadcast(x[r * x_stride + k]);
      for (int p = 0; p < P; ++p) acc[r][p] = V::fma(a, w[p], acc[r][p]);
    }
  }
  alignas(64) Acc lanes[kPanel];
  for (int r = 0; r < R; ++r)
    for (int p = 0; p < P; ++p) {
      V v = acc[r][p];
      if (bias != nullptr) v = V::add(v, V::load(bias + p * kPanel));
      const int64_t col = n0 + p * kPanel;
      const int64_t valid = std::min(kPanel, N - col);
      out_t* dst = out + r * out_stride + col;
      if constexpr (std::is_same_v<out_t, Acc>) {
        if (valid == kPanel) {
          v.store(dst);
          continue;
        }
      }
      v.store(lanes);
      for (int64_t j = 0; j < valid; ++j) dst[j] = static_cast<out_t>(lanes[j]);
    }
}

// The last rows of a chunk (fewer than kRows) run the same chains with fewer accumulators.
template <typename scalar_t, typename out_t, int R, int P>
inline void micro_rows(int64_t rows, const AccFor<scalar_t>* x, int64_t x_stride,
                       const scalar_t* panel, int64_t K, const AccFor<scalar_t>* bias,
                       out_t* out, int64_t out_stride, int64_t n0, int64_t N) {
  if (rows == R) {
    micro_kernel<scalar_t, out_t, R, P>(x, x_stride, panel, K, bias, out, out_stride, n0, N);
  } else if constexpr (R > 1) {
    micro_rows<scalar_t, out_t, R - 1, P>(rows, x, x_stride, panel, K, bias, out, out_stride,
                                          n0, N);
  }
}

// Rows [m0, m1) of x (widened, row stride K) times `panels` packed panels from `first`,
// into out (row stride out_stride, columns of the panels; N columns in all): the whole
// micro-kernel sweep of one work item.
template <typename scalar_t, typename out_t>
inline void rows_times_panels(const AccFor<scalar_t>* x, int64_t m0, int64_t m1, int64_t K,
                              const scalar_t* packed, int64_t first, int64_t panels,
                              const AccFor<scalar_t>* bias, out_t* out, int64_t out_stride,
                              int64_t N) {
  constexpr int R = Blocking<scalar_t>::kRows;
  constexpr int P = Blocking<scalar_t>::kPanels;
  const scalar_t* panel = packed + first * K * kPanel;
  const AccFor<scalar_t>* panel_bias = bias ? bias + first * kPanel : nullptr;
  for (int64_t m = m0; m < m1; m += R) {
    const int64_t rows = std::min<int64_t>(R, m1 - m);
    if (panels == P) {
      micro_rows<scalar_t, out_t, R, P>(rows, x + m * K, K, panel, K, panel_bias,
                                        out + m * out_stride, out_stride, first * kPanel, N);
    } else {
      micro_rows<scalar_t, out_t, R, 1>(rows, x + m * K, K, panel, K, panel_bias,
                                        out + m * out_stride, out_stride, first * kPanel, N);
    }
  }
}

}  // namespace batch_invariant
