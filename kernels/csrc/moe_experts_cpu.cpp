// The experts of a mixture-of-experts layer on the CPU, grouped: one call for all of a step's
// tokens and experts.
//
// Hugging Face's experts loop over the experts in Python (or call torch._grouped_mm, which
// loops in C++ over one GEMM per expert), each GEMM on a few rows (a decode step of 64 tokens
// with 8 experts and 2 per token gives each expert about 16 rows), threaded inside, so two cores
// mostly wait on each other and on the loop. Here:
//
//   1. the (token, k) pairs are sorted by expert (a stable counting sort: within an expert, in
//      token order) and their hidden states gathered, widened, into rows [S = T * top_k, H];
//   2. gate|up: each expert's rows times its packed [2I, H] weight, as work items of (expert,
//      chunk of rows, group of 16-column panels) spread over the threads, each item one
//      single-threaded micro-kernel sweep (batch_invariant_gemm.h);
//   3. act = silu(gate) * up, rounded as the model's dtype rounds it;
//   4. down: the same over the packed [H, I] weights;
//   5. out[t] = sum over j of weight[t, j] * down[t, j], j in order, in float32.
//
// Every output is one chain of fused multiply-adds in increasing k (the batch-invariant GEMM's
// order) and the sum over j has a fixed order, so a token's result does not depend on the other
// tokens of the step, on how many there are or on the thread count. The weights are packed
// once per load (`moe_pack`: [E, N, K] -> [E, ceil(N / 16), K, 16], zeros past N).
//
// `moe_grouped_linear` is step 2 (or 4) alone, on rows the caller sorted by expert: for a step
// that adds LoRA deltas between the projections (rollout_engine/worker/lora/expert_deltas.py).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "batch_invariant_gemm.h"
#include "batch_invariant_vec.h"

namespace {

using batch_invariant::AccFor;
using batch_invariant::Blocking;
using batch_invariant::kPanel;
using batch_invariant::kRowChunk;
using batch_invariant::VecFor;

// One work item of a grouped GEMM: rows [m0, m1) of one expert times panels [first, +count).
struct Item {
  int64_t expert, m0, m1, first, count;
};

// Each expert's rows [offsets[e], offsets[e + 1]) in chunks of kRowChunk, times groups of
// `group` panels: the items of one grouped GEMM.
std::vector<Item> items_of(const std::vector<int64_t>& offsets, int64_t panels, int64_t group) {
  std::vector<Item> items;
  for (int64_t e = 0; e + 1 < static_cast<int64_t>(offsets.size()); ++e)
    for (int64_t m = offsets[e]; m < offsets[e + 1]; m += kRowChunk)
      for (int64_t first = 0; first < panels; first += group)
        items.push_back({e, m, std::min(offsets[e + 1], m + kRowChunk), first,
                         std::min(group, panels - first)});
  return items;
}

// out [S, N] = x [S, K] (widened, contiguous) times each item's expert's packed weight.
template <typename scalar_t>
void grouped_gemm(const std::vector<Item>& items, const AccFor<scalar_t>* x, int64_t K,
                  const at::Tensor& packed, scalar_t* out, int64_t N) {
  const scalar_t* wp = packed.data_ptr<scalar_t>();
  const int64_t expert_stride = packed.stride(0);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const Item& item = items[i];
      batch_invariant::rows_times_panels<scalar_t, scalar_t>(
          x, item.m0, item.m1, K, wp + item.expert * expert_stride, item.first, item.count,
          nullptr, out, N, N);
    }
  });
}

// act [S, I] (widened) = silu(gate) * up of h [S, 2I], each product rounded to scalar_t as
// the model's own `act_fn(gate) * up` rounds it.
template <typename scalar_t>
void silu_and_mul_rows(const scalar_t* h, int64_t S, int64_t I, AccFor<scalar_t>* act) {
  using V = VecFor<scalar_t>;
  using Acc = AccFor<scalar_t>;
  at::parallel_for(0, S, 16, [&](int64_t begin, int64_t end) {
    alignas(64) Acc e[kPanel];
    for (int64_t s = begin; s < end; ++s) {
      const scalar_t* gate = h + s * 2 * I;
      const scalar_t* up = gate + I;
      Acc* dst = act + s * I;
      for (int64_t i0 = 0; i0 < I; i0 += kPanel) {
        const int64_t n = std::min(kPanel, I - i0);
        if (n == kPanel) {
          V::exp(V::mul(V::load(gate + i0), V::broadcast(Acc(-1)))).store(e);
        } else {
          for (int64_t j = 0; j < n; ++j)
            e[j] = batch_invariant::exp_lane(-static_cast<Acc>(gate[i0 + j]));
        }
        for (int64_t j = 0; j < n; ++j) {
          const Acc g = static_cast<Acc>(gate[i0 + j]);
          const scalar_t silu = static_cast<scalar_t>(g / (Acc(1) + e[j]));
          dst[i0 + j] = static_cast<Acc>(
              static_cast<scalar_t>(static_cast<Acc>(silu) * static_cast<Acc>(up[i0 + j])));
        }
      }
    }
  });
}

template <typename scalar_t>
void experts_kernel(const at::Tensor& x, const at::Tensor& index, const at::Tensor& weights,
                    const at::Tensor& gate_up, const at::Tensor& down, int64_t I,
                    at::Tensor& out) {
  using Acc = AccFor<scalar_t>;
  constexpr int64_t P = Blocking<scalar_t>::kPanels;
  const int64_t T = x.size(0), H = x.size(1), top_k = index.size(1), E = gate_up.size(0);
  const int64_t S = T * top_k;
  const int64_t* ids = index.data_ptr<int64_t>();

  // 1. Stable counting sort of the (token, k) pairs by expert.
  std::vector<int64_t> offsets(E + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(ids[s] >= 0 && ids[s] < E, "moe_experts: expert id ", ids[s], " outside [0, ",
                E, ")");
    ++offsets[ids[s] + 1];
  }
  for (int64_t e = 0; e < E; ++e) offsets[e + 1] += offsets[e];
  std::vector<int64_t> next(offsets.begin(), offsets.end() - 1), pair_at(S), place_of(S);
  for (int64_t s = 0; s < S; ++s) {
    const int64_t p = next[ids[s]]++;
    pair_at[p] = s;
    place_of[s] = p;
  }
  const auto acc_options = x.options().dtype(c10::CppTypeToScalarType<Acc>::value);
  at::Tensor rows = at::empty({S, H}, acc_options);  // [S, H] widened, sorted by expert
  const scalar_t* xp = x.data_ptr<scalar_t>();
  Acc* rp = rows.data_ptr<Acc>();
  at::parallel_for(0, S, 16, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const scalar_t* src = xp + (pair_at[p] / top_k) * H;
      std::transform(src, src + H, rp + p * H, [](scalar_t v) { return static_cast<Acc>(v); });
    }
  });

  // 2-4. gate|up, silu * up, down.
  at::Tensor h = at::empty({S, 2 * I}, x.options());  // [S, 2I]
  grouped_gemm<scalar_t>(items_of(offsets, gate_up.size(1), P), rp, H, gate_up,
                         h.data_ptr<scalar_t>(), 2 * I);
  at::Tensor act = at::empty({S, I}, acc_options);  // [S, I] widened
  silu_and_mul_rows<scalar_t>(h.data_ptr<scalar_t>(), S, I, act.data_ptr<Acc>());
  at::Tensor y = at::empty({S, H}, x.options());  // [S, H]
  grouped_gemm<scalar_t>(items_of(offsets, down.size(1), P), act.data_ptr<Acc>(), I, down,
                         y.data_ptr<scalar_t>(), H);

  // 5. Each token's top_k outputs weighed and summed in order.
  const float* wp = weights.data_ptr<float>();
  const scalar_t* yp = y.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, T, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H);
    for (int64_t t = begin; t < end; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = 0; j < top_k; ++j) {
        const float w = wp[t * top_k + j];
        const scalar_t* src = yp + place_of[t * top_k + j] * H;
        for (int64_t c = 0; c < H; ++c) acc[c] += w * static_cast<float>(src[c]);
      }
      for (int64_t c = 0; c < H; ++c) op[t * H + c] = static_cast<scalar_t>(acc[c]);
    }
  });
}

// x [S, K] sorted by expert (expert e's rows [offsets[e], offsets[e + 1])), packed [E, ceil(N /
// 16), K, 16] from moe_pack -> [S, N] in x's dtype: each row times its expert's weight.
at::Tensor moe_grouped_linear(const at::Tensor& x, const at::Tensor& expert_offsets,
                              const at::Tensor& packed, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && packed.dim() == 4 && packed.size(3) == kPanel &&
                  packed.is_contiguous() && packed.size(2) == x.size(1) &&
                  (out_features + kPanel - 1) / kPanel == packed.size(1),
              "moe_grouped_linear: x [S, K] and a weight [E, N, K] packed by moe_pack");
  TORCH_CHECK(x.scalar_type() == packed.scalar_type(),
              "moe_grouped_linear: x and expert weights dtypes differ");
  const int64_t E = packed.size(0), S = x.size(0), K = x.size(1);
  TORCH_CHECK(expert_offsets.dim() == 1 && expert_offsets.size(0) == E + 1,
              "moe_grouped_linear: expert_offsets [num_experts + 1]");
  const at::Tensor offsets_long = expert_offsets.to(at::kLong).contiguous();
  const int64_t* op = offsets_long.data_ptr<int64_t>();
  std::vector<int64_t> offsets(op, op + E + 1);
  TORCH_CHECK(offsets[0] == 0 && offsets[E] == S, "moe_grouped_linear: offsets must run from 0 to ",
              S, " rows");
  for (int64_t e = 0; e < E; ++e)
    TORCH_CHECK(offsets[e] <= offsets[e + 1], "moe_grouped_linear: offsets must not decrease");
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({S, out_features}, x.options());
  if (S == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(),
                                  "moe_grouped_linear", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "moe_grouped_linear: float64 is not supported");
    } else {
      using Acc = AccFor<scalar_t>;
      at::Tensor widened = xc.to(c10::CppTypeToScalarType<Acc>::value).contiguous();
      grouped_gemm<scalar_t>(items_of(offsets, packed.size(1), Blocking<scalar_t>::kPanels),
                             widened.data_ptr<Acc>(), K, packed, out.data_ptr<scalar_t>(),
                             out_features);
    }
  });
  return out;
}

// weights [E, N, K] -> [E, ceil(N / 16), K, 16], columns past N zero (a copy).
at::Tensor moe_pack(const at::Tensor& weights) {
  TORCH_CHECK(weights.dim() == 3, "moe_pack: weights [num_experts, N, K]");
  const int64_t E = weights.size(0), N = weights.size(1), K = weights.size(2);
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::Tensor padded = at::zeros({E, panels * kPanel, K}, weights.options());
  padded.narrow(1, 0, N).copy_(weights);
  return padded.view({E, panels, kPanel, K}).transpose(2, 3).contiguous();
}

// x [T, H], top_k_index [T, k] (int64), top_k_weights [T, k], gate_up [E, ceil(2I / 16), H, 16]
// and down [E, ceil(H / 16), I, 16] from moe_pack -> [T, H] in x's dtype.
at::Tensor moe_experts(const at::Tensor& x, const at::Tensor& top_k_index,
                       const at::Tensor& top_k_weights, const at::Tensor& gate_up,
                       const at::Tensor& down, int64_t intermediate_size) {
  TORCH_CHECK(x.dim() == 2 && top_k_index.dim() == 2 && top_k_index.size(0) == x.size(0) &&
                  top_k_weights.sizes() == top_k_index.sizes(),
              "moe_experts: x [T, H], top_k_index and top_k_weights [T, top_k]");
  TORCH_CHECK(gate_up.dim() == 4 && down.dim() == 4 && gate_up.size(3) == kPanel &&
                  down.size(3) == kPanel && gate_up.is_contiguous() && down.is_contiguous(),
              "moe_experts: weights packed by moe_pack");
  const int64_t H = x.size(1), I = intermediate_size;
  TORCH_CHECK(gate_up.size(0) == down.size(0) && gate_up.size(2) == H && down.size(2) == I &&
                  (2 * I + kPanel - 1) / kPanel == gate_up.size(1) &&
                  (H + kPanel - 1) / kPanel == down.size(1),
              "moe_experts: packed weights do not match hidden size ", H,
              " and intermediate size ", I);
  TORCH_CHECK(x.scalar_type() == gate_up.scalar_type() && x.scalar_type() == down.scalar_type(),
              "moe_experts: x and expert weights dtypes differ");
  const at::Tensor xc = x.contiguous();
  const at::Tensor index = top_k_index.to(at::kLong).contiguous();
  const at::Tensor weights = top_k_weights.to(at::kFloat).contiguous();
  at::Tensor out = at::empty_like(xc);
  if (x.size(0) == 0) return out;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "moe_experts", [&] {
    if constexpr (std::is_same_v<scalar_t, double>) {
      TORCH_CHECK(false, "moe_experts: float64 is not supported");
    } else {
      experts_kernel<scalar_t>(xc, index, weights, gate_up, down, I, out);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("moe_pack(Tensor weights) -> Tensor");
  m.def("moe_experts(Tensor x, Tensor top_k_index, Tensor top_k_weights, Tensor gate_up, "
        "Tensor down, int intermediate_size) -> Tensor");
  m.def("moe_grouped_linear(Tensor x, Tensor expert_offsets, Tensor packed, int out_features) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("moe_pack", &moe_pack);
  m.impl("moe_experts", &moe_experts);
  m.impl("moe_grouped_linear", &moe_grouped_linear);
}
