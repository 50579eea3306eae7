// A linear layer whose every output is computed in one fixed order, whatever the batch.
//
// A BLAS picks its kernel, its blocking over the reduced dimension and its split across threads
// from the shapes and the thread count: the same row of x times the same weights gives other
// bits alone (a GEMV) than inside a batch of 2 or 64 (a GEMM, perhaps split over K), and the
// trainer's padded full-sequence forward differs again from the engine's ragged steps. Here
// out[m, n] = dot(x[m, :], w[n, :]) + bias[n] always in this order:
//
//   - 16 lane sums: lane j accumulates x[k] * w[k] for k = j, j + 16, j + 32, ... in increasing
//     k, each step one fused multiply-add in float32 (double for double inputs); a last partial
//     group of 16 is read as if padded with zeros;
//   - the 16 lane sums are added as a fixed tree: lane i + lane i+8, then i + i+4, i + i+2,
//     i + i+1;
//   - the bias is added last, then the sum is rounded to the output dtype.
//
// Nothing in that depends on M, on the row's place in the batch, on which thread computes it or
// on how many threads there are: each output is computed whole by one thread, by the same
// sequence of roundings. The AVX-512 path (one 16-lane register), the AVX2 path (two 8-lane
// registers) and the portable path (16 scalars) all follow it, so the bits do not depend on the
// CPU's vector width either (fused multiply-add is exactly rounded everywhere). bfloat16 and
// float16 inputs are widened to float32 as they are loaded. Weights are in nn.Linear's layout
// [N, K] with a unit stride on K; x is [M, K] with a unit stride on K.
//
// Blocking (4 rows x 4 columns of outputs at a time, columns split across threads in chunks of
// 64) only decides which outputs are computed together, never the order inside one.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>

#include "batch_invariant_vec.h"

namespace {

constexpr int64_t kRows = 4;      // outputs computed together: kRows x kCols
constexpr int64_t kCols = 4;
constexpr int64_t kChunk = 64;    // columns per parallel work item

using batch_invariant::AccFor;
using batch_invariant::kLanes;
using batch_invariant::load_group;
using batch_invariant::VecFor;

// out[r, c] for rows m0..m0+R-1 and columns n0..n0+C-1 (R <= kRows, C <= kCols).
template <typename scalar_t, int64_t R, int64_t C>
inline void tile(const scalar_t* x, int64_t x_stride, const scalar_t* w, int64_t w_stride,
                 const scalar_t* bias, scalar_t* out, int64_t out_stride, int64_t K) {
  using V = VecFor<scalar_t>;
  using Acc = AccFor<scalar_t>;
  V acc[R][C];
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) acc[r][c] = V::zero();
  for (int64_t k = 0; k < K; k += kLanes) {
    const int64_t valid = K - k;
    V xs[R], ws[C];
    for (int64_t r = 0; r < R; ++r) xs[r] = load_group<V>(x + r * x_stride + k, valid);
    for (int64_t c = 0; c < C; ++c) ws[c] = load_group<V>(w + c * w_stride + k, valid);
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) acc[r][c] = V::fma(xs[r], ws[c], acc[r][c]);
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) {
      Acc sum = acc[r][c].tree_sum();
      if (bias != nullptr) sum = sum + static_cast<Acc>(bias[c]);
      out[r * out_stride + c] = static_cast<scalar_t>(sum);
    }
}

// Rows m0.. (R of them) against columns [n0, n1): full kCols tiles, then single columns.
template <typename scalar_t, int64_t R>
inline void row_block(const scalar_t* x, int64_t x_stride, const scalar_t* w, int64_t w_stride,
                      const scalar_t* bias, scalar_t* out, int64_t out_stride, int64_t K,
                      int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + kCols <= n1; n += kCols)
    tile<scalar_t, R, kCols>(x, x_stride, w + n * w_stride, w_stride,
                             bias ? bias + n : nullptr, out + n, out_stride, K);
  for (; n < n1; ++n)
    tile<scalar_t, R, 1>(x, x_stride, w + n * w_stride, w_stride, bias ? bias + n : nullptr,
                         out + n, out_stride, K);
}

template <typename scalar_t>
void linear_kernel(const at::Tensor& x, const at::Tensor& w, const at::Tensor* bias,
                   at::Tensor& out) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  const scalar_t* wp = w.data_ptr<scalar_t>();
  const scalar_t* bp = bias ? bias->data_ptr<scalar_t>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t xs = x.stride(0), ws = w.stride(0), os = out.stride(0);
  const int64_t chunks = (N + kChunk - 1) / kChunk;
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t chunk = begin; chunk < end; ++chunk) {
      const int64_t n0 = chunk * kChunk, n1 = std::min(N, n0 + kChunk);
      int64_t m = 0;
      for (; m + kRows <= M; m += kRows)
        row_block<scalar_t, kRows>(xp + m * xs, xs, wp, ws, bp, op + m * os, os, K, n0, n1);
      for (; m < M; ++m)
        row_block<scalar_t, 1>(xp + m * xs, xs, wp, ws, bp, op + m * os, os, K, n0, n1);
    }
  });
}

// x [M, K], weight [N, K], bias [N] or none -> [M, N] in x's dtype.
at::Tensor batch_invariant_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "batch_invariant_linear: x [M, K], weight [N, K]");
  TORCH_CHECK(x.size(1) == weight.size(1), "batch_invariant_linear: x has ", x.size(1),
              " features, weight ", weight.size(1));
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(),
              "batch_invariant_linear: x and weight dtypes differ");
  const at::Tensor xc = x.stride(1) == 1 ? x : x.contiguous();
  const at::Tensor wc = weight.stride(1) == 1 ? weight : weight.contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == weight.size(0),
                "batch_invariant_linear: bias must be [N]");
    b = bias->to(x.scalar_type()).contiguous();
  }
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "batch_invariant_linear", [&] {
    linear_kernel<scalar_t>(xc, wc, b.defined() ? &b : nullptr, out);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("batch_invariant_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("batch_invariant_linear", &batch_invariant_linear);
}
