// A linear layer whose every output is computed in one fixed order, whatever the batch.
//
// A BLAS picks its kernel, its blocking over the reduced dimension and its split across threads
// from the shapes and the thread count: the same row of x times the same weights gives other
// bits alone (a GEMV) than inside a batch of 2 or 64 (a GEMM, perhaps split over K), and the
// trainer's padded full-sequence forward differs again from the engine's ragged steps. Here
// every output is one chain of fused multiply-adds in increasing k:
//
//   acc = 0;  for k = 0 .. K-1:  acc = fma(x[m, k], w[n, k], acc);  out[m, n] = acc + bias[n]
//
// in float32 (double for double inputs), rounded to the output dtype at the end. bfloat16 and
// float16 inputs are widened to float32 (exactly) before they enter the chain.
//
// Nothing in that depends on M, on the row's place in the batch, on which thread computes it or
// on how many threads there are, nor on the CPU's vector width: a vector lane runs the same
// chain as a scalar loop would (fused multiply-add is exactly rounded everywhere), so the
// AVX-512, AVX2 and portable builds agree bit for bit. Blocking only decides which chains run
// side by side, never the order inside one.
//
// Speed comes from the layout: the weight is packed once (`batch_invariant_pack`) into panels
// of 16 output columns, [ceil(N / 16), K, 16] with zeros past N, so that one step of k loads 16
// consecutive weights and broadcasts one x per row: an outer-product micro-kernel of kRows rows
// x kPanels panels of accumulators, all in registers for the whole of K (no tree, no split of
// K). Rows are cut into chunks of kRowChunk and chunks x panel groups are spread over threads.
//
// bfloat16 on a CPU with AMX or AVX512_BF16 runs their pair dot products instead, in an order
// of their own that is just as fixed (batch_invariant_amx.h, batch_invariant_dpbf16.h): there
// bf16 bits differ from the FMA chain's, and so from those of a CPU without the unit.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "batch_invariant_amx.h"
#include "batch_invariant_dpbf16.h"
#include "batch_invariant_gemm.h"
#include "batch_invariant_vec.h"

namespace {

using batch_invariant::AccFor;
using batch_invariant::Blocking;
using batch_invariant::kPanel;
using batch_invariant::kRowChunk;

// x: [M, K] widened and contiguous; packed: [ceil(N / 16), K, 16]; bias: padded to whole
// panels or undefined; out: [M, N].
template <typename scalar_t>
void linear_packed_kernel(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias,
                          at::Tensor& out, int64_t N) {
  using Acc = AccFor<scalar_t>;
  constexpr int P = Blocking<scalar_t>::kPanels;
  const int64_t M = x.size(0), K = x.size(1), panels = packed.size(0);
  const Acc* xp = x.data_ptr<Acc>();
  const scalar_t* wp = packed.data_ptr<scalar_t>();
  const Acc* bp = bias.defined() ? bias.data_ptr<Acc>() : nullptr;
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t os = out.stride(0);
  const int64_t groups = (panels + P - 1) / P;
  const int64_t chunks = (M + kRowChunk - 1) / kRowChunk;
  at::parallel_for(0, chunks * groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t chunk = item / groups, group = item % groups;
      const int64_t m1 = std::min(M, (chunk + 1) * kRowChunk);
      const int64_t first = group * P, count = std::min<int64_t>(P, panels - first);
      batch_invariant::rows_times_panels<scalar_t, scalar_t>(xp, chunk * kRowChunk, m1, K, wp,
                                                             first, count, bp, op, os, N);
    }
  });
}

// weight [N, K] (any strides) -> [ceil(N / 16), K, 16], columns past N zero; bfloat16 where
// the CPU has AMX or AVX512_BF16: k pairs, [ceil(N / 16), Kp / 2, 16, 2] (Kp: K rounded up to
// 32 for the tiles, batch_invariant_amx.h, to 2 for vdpbf16ps, batch_invariant_dpbf16.h).
at::Tensor batch_invariant_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2, "batch_invariant_pack: weight [N, K]");
  if (weight.scalar_type() == at::kBFloat16 && batch_invariant::amx::available())
    return batch_invariant::amx::pack(weight);
  if (weight.scalar_type() == at::kBFloat16 && batch_invariant::dpbf16::available())
    return batch_invariant::dpbf16::pack_pairs(weight, 2);
  const int64_t N = weight.size(0), K = weight.size(1), panels = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({panels * kPanel, K}, weight.options());
  padded.narrow(0, 0, N).copy_(weight);
  return padded.view({panels, kPanel, K}).transpose(1, 2).contiguous();
}

// The bfloat16 paths of batch_invariant_linear_packed (a weight packed in k pairs): AMX tiles
// where the CPU grants them, else AVX512_BF16's vdpbf16ps.
at::Tensor pairs_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                        const std::optional<at::Tensor>& bias) {
  namespace amx = batch_invariant::amx;
  namespace dpbf16 = batch_invariant::dpbf16;
  const bool tiles = amx::available();
  TORCH_CHECK((tiles || dpbf16::available()) && packed.scalar_type() == at::kBFloat16 &&
                  packed.size(2) == amx::kCols && packed.size(3) == 2 && packed.is_contiguous(),
              "batch_invariant_linear: a weight packed in k pairs needs bfloat16 and AMX or "
              "AVX512_BF16");
  const int64_t M = x.size(0), K = x.size(1), Kp = packed.size(1) * 2, panels = packed.size(0);
  const int64_t k_multiple = tiles ? amx::kTileK : 2;
  TORCH_CHECK(K <= Kp && Kp - K < k_multiple && Kp % k_multiple == 0, "batch_invariant_linear: "
              "x has ", K, " features, the packed weight ", Kp, " (padded)");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "batch_invariant_linear: x and weight dtypes differ");
  TORCH_CHECK(out_features > (panels - 1) * amx::kCols && out_features <= panels * amx::kCols,
              "batch_invariant_linear: ", out_features, " out features do not fit a packed "
              "weight of ", panels, " panels");
  // The tiles read whole 32-row tiles of x; vdpbf16ps reads the rows there are.
  const int64_t rows = tiles ? amx::round_up(M, 2 * amx::kTileRows) : M;
  at::Tensor xp = x.contiguous();
  if (K != Kp || rows != M) {
    xp = at::zeros({rows, Kp}, x.options());
    xp.narrow(0, 0, M).narrow(1, 0, K).copy_(x);
  }
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "batch_invariant_linear: bias must be [N]");
    b = at::zeros({panels * amx::kCols}, x.options().dtype(at::kFloat));
    b.narrow(0, 0, out_features).copy_(bias->to(at::kBFloat16));
  }
  at::Tensor out = at::empty({M, out_features}, x.options());
  const auto* xs = xp.data_ptr<at::BFloat16>();
  const auto* ws = packed.data_ptr<at::BFloat16>();
  const float* bs = b.defined() ? b.data_ptr<float>() : nullptr;
  auto* os = out.data_ptr<at::BFloat16>();
  if (tiles) amx::linear(xs, M, Kp, ws, panels, bs, os, out.stride(0), out_features);
  else dpbf16::linear(xs, M, Kp, ws, panels, bs, os, out.stride(0), out_features);
  return out;
}

// x [M, K], packed [ceil(N / 16), K, 16] from `batch_invariant_pack`, bias [N] or none ->
// [M, N] in x's dtype.
at::Tensor batch_invariant_linear_packed(const at::Tensor& x, const at::Tensor& packed,
                                         int64_t out_features,
                                         const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2, "batch_invariant_linear: x [M, K]");
  if (packed.dim() == 4) return pairs_linear(x, packed, out_features, bias);
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kPanel && packed.is_contiguous(),
              "batch_invariant_linear: packed weight [ceil(N / 16), K, 16] from "
              "batch_invariant_pack");
  TORCH_CHECK(out_features > (packed.size(0) - 1) * kPanel &&
                  out_features <= packed.size(0) * kPanel,
              "batch_invariant_linear: ", out_features, " out features do not fit a packed "
              "weight of ", packed.size(0), " panels");
  TORCH_CHECK(x.size(1) == packed.size(1), "batch_invariant_linear: x has ", x.size(1),
              " features, weight ", packed.size(1));
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(),
              "batch_invariant_linear: x and weight dtypes differ");
  const bool is_double = x.scalar_type() == at::kDouble;
  const auto acc_dtype = is_double ? at::kDouble : at::kFloat;
  const at::Tensor xw = x.to(acc_dtype).contiguous();
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == out_features,
                "batch_invariant_linear: bias must be [N]");
    b = at::zeros({packed.size(0) * kPanel}, x.options().dtype(acc_dtype));
    b.narrow(0, 0, out_features).copy_(bias->to(x.scalar_type()));
  }
  at::Tensor out = at::empty({x.size(0), out_features}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "batch_invariant_linear", [&] {
    linear_packed_kernel<scalar_t>(xw, packed, b, out, out_features);
  });
  return out;
}

// x [M, K], weight [N, K], bias [N] or none -> [M, N] in x's dtype (packs the weight first).
at::Tensor batch_invariant_linear(const at::Tensor& x, const at::Tensor& weight,
                                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "batch_invariant_linear: x [M, K], weight [N, K]");
  return batch_invariant_linear_packed(x, batch_invariant_pack(weight), weight.size(0), bias);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("batch_invariant_linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
  m.def("batch_invariant_pack(Tensor weight) -> Tensor");
  m.def("batch_invariant_linear_packed(Tensor x, Tensor packed, int out_features, "
        "Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("batch_invariant_linear", &batch_invariant_linear);
  m.impl("batch_invariant_pack", &batch_invariant_pack);
  m.impl("batch_invariant_linear_packed", &batch_invariant_linear_packed);
}
