// LoRA deltas of a step's tokens, added into the base linears' outputs in one call per LoRA
// point (the CPU's take on Punica's BGMV): out_i[t] += B_i[slot(t)] @ (A[slot(t)] @ x[t]) for
// every token t that runs under an adapter, where a point is one linear or linears sharing
// their input (q|k|v, gate|up) and the adapter's scaling is folded into B.
//
// With torch ops, each group of tokens under one adapter costs a shrink GEMM and an expand GEMM
// per linear, about 20 us each at these sizes whatever their work: at 8 adapters in a decode
// step that was a quarter of the step. Here rows go four at a time, each block through its
// adapter's weights (the rows of a group need not be contiguous: they come as indexes), in two
// phases split across threads:
// - shrink, per block of rows: s[m][c] = dot(x[m], A[slot][c]) for the adapter's rank rows of
//   every linear it targets (float32 sums);
// - expand, per group and panel of 256 outputs of a linear (its Bt columns read once from
//   memory for all the group's rows): out_i[m] += sum_c s[m][c] * Bt_i[slot][c] (Bt_i = B_i
//   transposed, [rank, out_i]), rounded once to the model dtype.
// float32, bfloat16 and float16 (all of a call in one dtype); sixteen lanes with AVX-512, plain
// loops elsewhere and for the tails.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

constexpr int64_t kRows = 4;           // rows per block

template <typename scalar_t>
inline float to_float(scalar_t v) {
  return static_cast<float>(v);
}

template <typename scalar_t>
constexpr bool kVec16 = !std::is_same_v<scalar_t, double>;

#if defined(ROLLOUT_CPU_VEC16)
inline float hsum16(__m512 v) { return _mm512_reduce_add_ps(v); }

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // round to nearest even, NaN kept quiet
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  __m512i out = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  out = _mm512_mask_mov_epi32(out, nan, _mm512_set1_epi32(0x7FC00000));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(out, 16)));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
#endif

// shrunk[m * stride + c] = dot(x rows[m], a row c) for c < num_cols, m < num_rows: four
// columns at a time (sixteen accumulators: eight loads feed sixteen multiply-adds).
template <typename scalar_t>
void shrink(const scalar_t* const* x, int64_t num_rows, const scalar_t* a, int64_t num_cols,
            int64_t in, float* shrunk, int64_t stride) {
  int64_t c = 0;
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    if (in % 16 == 0) {
      for (; c + 4 <= num_cols; c += 4) {
        __m512 acc[kRows][4];
        for (auto& row : acc)
          for (auto& v : row) v = _mm512_setzero_ps();
        for (int64_t i = 0; i < in; i += 16) {
          __m512 av[4];
          for (int64_t j = 0; j < 4; ++j) av[j] = cpu_vec::load16(a + (c + j) * in + i);
          for (int64_t m = 0; m < kRows; ++m) {  // missing rows repeat row 0 (not stored)
            const __m512 xv = cpu_vec::load16(x[m] + i);
            for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(xv, av[j], acc[m][j]);
          }
        }
        for (int64_t m = 0; m < num_rows; ++m)
          for (int64_t j = 0; j < 4; ++j) shrunk[m * stride + c + j] = hsum16(acc[m][j]);
      }
    }
  }
#endif
  for (; c < num_cols; ++c) {
    const scalar_t* a_row = a + c * in;
    float sums[kRows] = {0.f, 0.f, 0.f, 0.f};
    for (int64_t i = 0; i < in; ++i) {
      const float av = to_float(a_row[i]);
      for (int64_t m = 0; m < kRows; ++m) sums[m] += to_float(x[m][i]) * av;
    }
    for (int64_t m = 0; m < num_rows; ++m) shrunk[m * stride + c] = sums[m];
  }
}

// out rows[m][:num_out] += sum_k s[m * stride + k] * bt row k (rows bt_stride apart), k < rank,
// m < num_rows: 64 outputs at a time (sixteen accumulators: four loads and four broadcasts feed
// sixteen multiply-adds).
template <typename scalar_t>
void expand(scalar_t* const* out, int64_t num_rows, const float* s, int64_t stride,
            const scalar_t* bt, int64_t rank, int64_t num_out, int64_t bt_stride) {
  int64_t o = 0;
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    for (; o + 64 <= num_out; o += 64) {
      __m512 acc[kRows][4];
      for (auto& row : acc)
        for (auto& v : row) v = _mm512_setzero_ps();
      for (int64_t k = 0; k < rank; ++k) {
        __m512 bv[4];
        for (int64_t j = 0; j < 4; ++j) bv[j] = cpu_vec::load16(bt + k * bt_stride + o + 16 * j);
        for (int64_t m = 0; m < kRows; ++m) {
          const __m512 sv = _mm512_set1_ps(s[m * stride + k]);
          for (int64_t j = 0; j < 4; ++j) acc[m][j] = _mm512_fmadd_ps(sv, bv[j], acc[m][j]);
        }
      }
      for (int64_t m = 0; m < num_rows; ++m)
        for (int64_t j = 0; j < 4; ++j) {
          scalar_t* p = out[m] + o + 16 * j;
          store16(p, _mm512_add_ps(cpu_vec::load16(p), acc[m][j]));
        }
    }
    for (; o + 16 <= num_out; o += 16) {
      __m512 acc[kRows] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                           _mm512_setzero_ps()};
      for (int64_t k = 0; k < rank; ++k) {
        const __m512 bv = cpu_vec::load16(bt + k * bt_stride + o);
        for (int64_t m = 0; m < kRows; ++m)
          acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(s[m * stride + k]), bv, acc[m]);
      }
      for (int64_t m = 0; m < num_rows; ++m)
        store16(out[m] + o, _mm512_add_ps(cpu_vec::load16(out[m] + o), acc[m]));
    }
  }
#endif
  for (; o < num_out; ++o) {
    for (int64_t m = 0; m < num_rows; ++m) {
      float acc = 0.f;
      for (int64_t k = 0; k < rank; ++k) acc += s[m * stride + k] * to_float(bt[k * bt_stride + o]);
      out[m][o] = static_cast<scalar_t>(to_float(out[m][o]) + acc);
    }
  }
}

struct Block {
  int64_t group;
  int64_t first;  // index into rows
  int64_t count;
};

// A piece of phase 2: one group's rows through one linear's outputs [begin, end).
struct Panel {
  int64_t group;
  int64_t linear;
  int64_t begin;
  int64_t end;
};

constexpr int64_t kPanel = 256;  // outputs per panel: its Bt columns stay in L1 across rows

void lora_add(const at::Tensor& x, const at::Tensor& a, at::TensorList bt, at::TensorList outs,
              const at::Tensor& rows, const at::Tensor& group_offsets,
              const at::Tensor& group_slots, const at::Tensor& linear_blocks,
              const at::Tensor& ranks) {
  const int64_t num_linears = static_cast<int64_t>(bt.size());
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "lora_add: x [tokens, in] with unit stride");
  TORCH_CHECK(a.dim() == 3 && a.is_contiguous() && a.size(2) == x.size(1),
              "lora_add: a [slots, columns, in] contiguous");
  TORCH_CHECK(num_linears >= 1 && static_cast<int64_t>(outs.size()) == num_linears,
              "lora_add: one Bt and one output per linear");
  TORCH_CHECK(linear_blocks.dim() == 2 && linear_blocks.size(0) == a.size(0) &&
                  linear_blocks.size(1) == num_linears && ranks.size(0) == a.size(0),
              "lora_add: linear_blocks [slots, linears] and ranks [slots]");
  for (int64_t i = 0; i < num_linears; ++i) {
    TORCH_CHECK(bt[i].dim() == 3 && bt[i].is_contiguous() && bt[i].size(0) == a.size(0) &&
                    bt[i].size(1) == bt[0].size(1),
                "lora_add: Bt [slots, max rank, out] contiguous");
    TORCH_CHECK(outs[i].dim() == 2 && outs[i].stride(1) == 1 && outs[i].size(0) == x.size(0) &&
                    outs[i].size(1) == bt[i].size(2),
                "lora_add: outputs [tokens, out] with unit stride");
    TORCH_CHECK(bt[i].scalar_type() == x.scalar_type() &&
                    outs[i].scalar_type() == x.scalar_type(),
                "lora_add: one dtype for every tensor");
  }
  TORCH_CHECK(a.scalar_type() == x.scalar_type(), "lora_add: one dtype for every tensor");
  for (const at::Tensor* t : {&rows, &group_offsets, &group_slots, &linear_blocks, &ranks})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "lora_add: int64 indexes");

  const int64_t* row_ids = rows.data_ptr<int64_t>();
  const int64_t* offsets = group_offsets.data_ptr<int64_t>();
  const int64_t* slots = group_slots.data_ptr<int64_t>();
  const int64_t* blocks_of = linear_blocks.data_ptr<int64_t>();
  const int64_t* rank_of = ranks.data_ptr<int64_t>();
  const int64_t num_groups = group_slots.size(0);
  const int64_t num_tokens = x.size(0), num_slots = a.size(0), num_cols = a.size(1);
  const int64_t max_rank = bt[0].size(1), in = x.size(1);
  TORCH_CHECK(group_offsets.size(0) == num_groups + 1 && offsets[0] == 0,
              "lora_add: group offsets out of range");
  std::vector<Block> blocks;
  std::vector<Panel> panels;
  for (int64_t g = 0; g < num_groups; ++g) {
    TORCH_CHECK(slots[g] >= 0 && slots[g] < num_slots, "lora_add: slot out of range");
    TORCH_CHECK(offsets[g] <= offsets[g + 1] && offsets[g + 1] <= rows.size(0),
                "lora_add: group offsets out of range");
    for (int64_t first = offsets[g]; first < offsets[g + 1]; first += kRows)
      blocks.push_back({g, first, std::min(kRows, offsets[g + 1] - first)});
    if (offsets[g] == offsets[g + 1] || rank_of[slots[g]] == 0) continue;
    for (int64_t i = 0; i < num_linears; ++i) {
      if (blocks_of[slots[g] * num_linears + i] < 0) continue;
      for (int64_t o = 0; o < bt[i].size(2); o += kPanel)
        panels.push_back({g, i, o, std::min(o + kPanel, bt[i].size(2))});
    }
  }
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < num_tokens, "lora_add: row out of range");
  for (int64_t s = 0; s < num_slots; ++s) {
    TORCH_CHECK(rank_of[s] >= 0 && rank_of[s] <= max_rank, "lora_add: rank out of range");
    for (int64_t i = 0; i < num_linears; ++i)
      TORCH_CHECK(blocks_of[s * num_linears + i] < 0 ||
                      (blocks_of[s * num_linears + i] + 1) * rank_of[s] <= num_cols,
                  "lora_add: a linear's block out of range");
  }

  // Phase 1, row blocks across threads: every row's shrunk values, [rows, columns] float32.
  std::vector<float> shrunk(static_cast<size_t>(rows.size(0) * num_cols));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "lora_add", [&] {
    const scalar_t* x_data = x.data_ptr<scalar_t>();
    const scalar_t* a_data = a.data_ptr<scalar_t>();
    at::parallel_for(0, static_cast<int64_t>(blocks.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) {
        const Block& block = blocks[b];
        const int64_t slot = slots[block.group], rank = rank_of[slot];
        int64_t num_blocks = 0;
        for (int64_t i = 0; i < num_linears; ++i) num_blocks += blocks_of[slot * num_linears + i] >= 0;
        if (rank == 0 || num_blocks == 0) continue;
        const scalar_t* x_rows[kRows];
        for (int64_t m = 0; m < kRows; ++m)
          x_rows[m] = x_data + row_ids[block.first + (m < block.count ? m : 0)] * x.stride(0);
        shrink(x_rows, block.count, a_data + slot * num_cols * in, num_blocks * rank, in,
               shrunk.data() + block.first * num_cols, num_cols);
      }
    });
    // Phase 2, panels across threads: a group's rows through a slice of a linear's outputs,
    // four rows at a time over the same Bt columns.
    at::parallel_for(0, static_cast<int64_t>(panels.size()), 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) {
        const Panel& panel = panels[p];
        const int64_t slot = slots[panel.group], rank = rank_of[slot];
        const int64_t block = blocks_of[slot * num_linears + panel.linear];
        const at::Tensor& out = outs[panel.linear];
        scalar_t* out_data = out.data_ptr<scalar_t>() + panel.begin;
        const int64_t num_out = bt[panel.linear].size(2);
        const scalar_t* bt_data =
            bt[panel.linear].data_ptr<scalar_t>() + slot * max_rank * num_out + panel.begin;
        for (int64_t first = offsets[panel.group]; first < offsets[panel.group + 1];
             first += kRows) {
          const int64_t count = std::min(kRows, offsets[panel.group + 1] - first);
          scalar_t* out_rows[kRows];
          for (int64_t m = 0; m < kRows; ++m)
            out_rows[m] = out_data + row_ids[first + (m < count ? m : 0)] * out.stride(0);
          expand(out_rows, count, shrunk.data() + first * num_cols + block * rank, num_cols,
                 bt_data, rank, panel.end - panel.begin, num_out);
        }
      }
    });
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("lora_add(Tensor x, Tensor a, Tensor[] bt, Tensor(a!)[] outs, Tensor rows, "
        "Tensor group_offsets, Tensor group_slots, Tensor linear_blocks, Tensor ranks) -> ()");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) { m.impl("lora_add", &lora_add); }
