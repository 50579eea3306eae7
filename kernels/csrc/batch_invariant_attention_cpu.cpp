// Attention whose every output is computed in one fixed order, whatever the batch, the padding,
// the sequence's length beyond the query or how the keys were chunked.
//
// A query vector attends to its visible keys (causal, or as a mask says) taken in order and cut
// into groups of 16: the i-th visible key is in group i / 16, so the groups do not depend on
// padding, on where the sequence sits in a padded batch or on the keys after the query. For
// each group, in order:
//
//   - scores s_j = dot(q, k_j) * scale, the dot product in the linear layer's order (16 FMA
//     lanes over the head dimension, a fixed tree; batch_invariant_vec.h);
//   - m' = max(m, max_j s_j) (a maximum is exact in any order); alpha = exp(m - m');
//     every exp is `exp_lane` (batch_invariant_vec.h), sixteen at a time where the CPU can:
//     libm's exp could differ between machines and would cost a call per score;
//   - l = l * alpha, then l = l + exp(s_j - m') for j in order;
//   - acc[d] = acc[d] * alpha, then acc[d] = fma(exp(s_j - m'), v_j[d], acc[d]) for j in order;
//
// and out[d] = acc[d] / l, rounded to the input dtype (zeros where no key is visible). All math
// in float32; bfloat16 and float16 are widened as they are loaded. `attend` does this for the
// query vectors of one key/value head (each on its own, reading each key once for all) given
// the keys' and values' row pointers, and is not inlined, so every caller (this dense entry
// point; a paged one reading a KV cache) runs the same instructions.
//
// Dense entry point (sdpa's layout): q [B, H, Lq, D], k [B, Hk, Lk, D], v [B, Hk, Lk, Dv] with H
// a multiple of Hk (grouped-query attention), unit stride on the last dims; mask, if given, a
// bool tensor broadcastable to [B, H, Lq, Lk] (true = visible); else is_causal (query i sees
// keys 0..i) or all keys. Work is split across threads by query position and key/value head.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "batch_invariant_vec.h"

namespace {

using batch_invariant::kLanes;
using batch_invariant::load_group;
using batch_invariant::Vec16;

constexpr int64_t kGroup = 16;  // keys per softmax group

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  Vec16 acc = Vec16::zero();
  for (int64_t d = 0; d < dim; d += kLanes)
    acc = Vec16::fma(load_group<Vec16>(q + d, dim - d), load_group<Vec16>(k + d, dim - d), acc);
  return acc.tree_sum();
}

// acc[d] = acc[d] * alpha, then acc[d] = fma(p[j], v_j[d], acc[d]) for j in order: sixteen d
// at a time in registers, the rest one at a time (the same operations, lane by lane).
template <typename scalar_t>
inline void accumulate_values(const scalar_t* const* values, int64_t n, const float* p,
                              float alpha, int64_t value_dim, float* acc) {
  int64_t d = 0;
  for (; d + kLanes <= value_dim; d += kLanes) {
    Vec16 a = Vec16::mul(Vec16::load(acc + d), Vec16::broadcast(alpha));
    for (int64_t j = 0; j < n; ++j)
      a = Vec16::fma(Vec16::broadcast(p[j]), Vec16::load(values[j] + d), a);
    a.store(acc + d);
  }
  for (; d < value_dim; ++d) {
    float a = acc[d] * alpha;
    for (int64_t j = 0; j < n; ++j) a = std::fma(p[j], static_cast<float>(values[j][d]), a);
    acc[d] = a;
  }
}

// `num_queries` query vectors (widened to float32) that share one key/value head, each over
// the same `count` visible keys, each in the order of the header: a query's bits are those it
// gets alone. Taking the queries of a grouped-query head together reads each key and value
// once for all of them. Scratch: `acc` num_queries x value_dim floats, `state` 2 x num_queries.
template <typename scalar_t>
__attribute__((noinline)) void attend(const float* const* queries, int64_t num_queries,
                                      int64_t dim, const scalar_t* const* keys,
                                      const scalar_t* const* values, int64_t count,
                                      int64_t value_dim, float scale, float* acc, float* state,
                                      scalar_t* const* outs) {
  if (count == 0) {
    for (int64_t i = 0; i < num_queries; ++i)
      for (int64_t d = 0; d < value_dim; ++d) outs[i][d] = scalar_t(0);
    return;
  }
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  float* maxima = state;               // m per query
  float* sums = state + num_queries;   // l per query
  for (int64_t i = 0; i < num_queries; ++i) {
    maxima[i] = kNone;
    sums[i] = 0.f;
  }
  std::fill(acc, acc + num_queries * value_dim, 0.f);
  alignas(64) float s[kGroup], p[kGroup], alpha_lanes[kGroup];
  for (int64_t g = 0; g < count; g += kGroup) {
    const int64_t n = std::min(kGroup, count - g);
    for (int64_t i = 0; i < num_queries; ++i) {
      float group_max = kNone;
      for (int64_t j = 0; j < n; ++j) {
        s[j] = dot(queries[i], keys[g + j], dim) * scale;
        group_max = std::max(group_max, s[j]);
      }
      const float m = maxima[i], m_new = std::max(m, group_max);
      for (int64_t j = 0; j < kGroup; ++j) s[j] = j < n ? s[j] - m_new : kNone;
      Vec16::exp(Vec16::load(s)).store(p);
      Vec16::exp(Vec16::broadcast(m - m_new)).store(alpha_lanes);
      const float alpha = alpha_lanes[0];  // 0 for the first group (m = -inf)
      float l = sums[i] * alpha;
      for (int64_t j = 0; j < n; ++j) l = l + p[j];
      sums[i] = l;
      maxima[i] = m_new;
      accumulate_values(values + g, n, p, alpha, value_dim, acc + i * value_dim);
    }
  }
  for (int64_t i = 0; i < num_queries; ++i)
    for (int64_t d = 0; d < value_dim; ++d)
      outs[i][d] = static_cast<scalar_t>(acc[i * value_dim + d] / sums[i]);
}

template <typename scalar_t>
void dense_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor* mask, bool is_causal, float scale, at::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hk = k.size(1), Lk = k.size(2), Dv = v.size(3);
  const int64_t per_kv = H / Hk;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k.data_ptr<scalar_t>();
  const scalar_t* vp = v.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const bool* mp = mask ? mask->data_ptr<bool>() : nullptr;
  // The query heads of one key/value head go together when they see the same keys (no mask,
  // or one broadcast over heads, as Hugging Face's masks are).
  const int64_t together = mp == nullptr || mask->stride(1) == 0 ? per_kv : 1;
  const int64_t head_groups = H / together;
  at::parallel_for(0, B * head_groups * Lq, 1, [&](int64_t begin, int64_t end) {
    std::vector<const scalar_t*> keys, values;
    std::vector<float> qf(together * D), acc(together * Dv), state(2 * together);
    std::vector<const float*> queries(together);
    std::vector<scalar_t*> outs(together);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / (head_groups * Lq), h0 = (item / Lq) % head_groups * together;
      const int64_t i = item % Lq, hk = h0 / per_kv;
      for (int64_t g = 0; g < together; ++g) {
        const scalar_t* qrow =
            qp + b * q.stride(0) + (h0 + g) * q.stride(1) + i * q.stride(2);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[d]);
        queries[g] = qf.data() + g * D;
        outs[g] = op + ((b * H + h0 + g) * Lq + i) * Dv;
      }
      const scalar_t* kbase = kp + b * k.stride(0) + hk * k.stride(1);
      const scalar_t* vbase = vp + b * v.stride(0) + hk * v.stride(1);
      const bool* mrow = mp ? mp + b * mask->stride(0) + h0 * mask->stride(1) +
                                  i * mask->stride(2)
                            : nullptr;
      keys.clear();
      values.clear();
      const int64_t last = mrow == nullptr && is_causal ? std::min(i + 1, Lk) : Lk;
      for (int64_t j = 0; j < last; ++j) {
        if (mrow != nullptr && !mrow[j * mask->stride(3)]) continue;
        keys.push_back(kbase + j * k.stride(2));
        values.push_back(vbase + j * v.stride(2));
      }
      attend<scalar_t>(queries.data(), together, D, keys.data(), values.data(),
                       static_cast<int64_t>(keys.size()), Dv, scale, acc.data(), state.data(),
                       outs.data());
    }
  });
}

at::Tensor batch_invariant_attention(const at::Tensor& query, const at::Tensor& key,
                                     const at::Tensor& value,
                                     const std::optional<at::Tensor>& mask, bool is_causal,
                                     double scale) {
  TORCH_CHECK(query.dim() == 4 && key.dim() == 4 && value.dim() == 4,
              "batch_invariant_attention: q, k, v must be [B, H, L, D]");
  TORCH_CHECK(key.size(0) == query.size(0) && value.size(0) == query.size(0),
              "batch_invariant_attention: batch sizes differ");
  TORCH_CHECK(key.size(1) == value.size(1) && query.size(1) % key.size(1) == 0,
              "batch_invariant_attention: query heads must be a multiple of key/value heads");
  TORCH_CHECK(key.size(2) == value.size(2) && key.size(3) == query.size(3),
              "batch_invariant_attention: key and value lengths, or q and k head dims, differ");
  TORCH_CHECK(query.scalar_type() == key.scalar_type() &&
                  query.scalar_type() == value.scalar_type(),
              "batch_invariant_attention: q, k, v dtypes differ");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf,
              "batch_invariant_attention: float32, bfloat16 or float16, got ", dtype);
  auto unit_last = [](const at::Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); };
  const at::Tensor q = unit_last(query), k = unit_last(key), v = unit_last(value);
  at::Tensor m;
  if (mask.has_value() && mask->defined()) {
    TORCH_CHECK(mask->scalar_type() == at::kBool,
                "batch_invariant_attention: the mask must be bool (true = visible)");
    m = mask->expand({q.size(0), q.size(1), q.size(2), k.size(2)});
  }
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
  const float s = static_cast<float>(scale);
  const at::Tensor* mp = m.defined() ? &m : nullptr;
  if (dtype == at::kFloat) dense_kernel<float>(q, k, v, mp, is_causal, s, out);
  else if (dtype == at::kBFloat16) dense_kernel<at::BFloat16>(q, k, v, mp, is_causal, s, out);
  else dense_kernel<at::Half>(q, k, v, mp, is_causal, s, out);
  return out;
}

template <typename scalar_t>
void paged_kernel(const at::Tensor& q, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc, float scale,
                  int64_t sliding_window, at::Tensor& out) {
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t block_size = key_cache.size(1), Hk = key_cache.size(2);
  const int64_t Dv = value_cache.size(3), per_kv = H / Hk;
  const int64_t R = seq_lens.size(0);
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  std::vector<int64_t> request_of(T, -1);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t t = starts[r]; t < starts[r + 1]; ++t) request_of[t] = r;
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = key_cache.data_ptr<scalar_t>();
  const scalar_t* vp = value_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  // The query heads of one key/value head go together: they see the same keys.
  at::parallel_for(0, T * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<const scalar_t*> keys, values;
    std::vector<float> qf(per_kv * D), acc(per_kv * Dv), state(2 * per_kv);
    std::vector<const float*> queries(per_kv);
    std::vector<scalar_t*> outs(per_kv);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / Hk, hk = item % Hk, h0 = hk * per_kv;
      for (int64_t g = 0; g < per_kv; ++g) outs[g] = op + (t * H + h0 + g) * Dv;
      const int64_t r = request_of[t];
      if (r < 0) {  // a padding row of the step: attends to nothing
        for (int64_t g = 0; g < per_kv; ++g)
          for (int64_t d = 0; d < Dv; ++d) outs[g][d] = scalar_t(0);
        continue;
      }
      const int64_t q_len = starts[r + 1] - starts[r];
      const int64_t position = lens[r] - q_len + (t - starts[r]);
      const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, position - sliding_window + 1)
                                               : 0;
      for (int64_t g = 0; g < per_kv; ++g) {
        const scalar_t* qrow = qp + t * q.stride(0) + (h0 + g) * q.stride(1);
        for (int64_t d = 0; d < D; ++d) qf[g * D + d] = static_cast<float>(qrow[d]);
        queries[g] = qf.data() + g * D;
      }
      keys.clear();
      values.clear();
      for (int64_t j = first; j <= position; ++j) {
        const int64_t block = tables[r * table_stride + j / block_size], slot = j % block_size;
        keys.push_back(kp + block * key_cache.stride(0) + slot * key_cache.stride(1) +
                       hk * key_cache.stride(2));
        values.push_back(vp + block * value_cache.stride(0) + slot * value_cache.stride(1) +
                         hk * value_cache.stride(2));
      }
      attend<scalar_t>(queries.data(), per_kv, D, keys.data(), values.data(),
                       static_cast<int64_t>(keys.size()), Dv, scale, acc.data(), state.data(),
                       outs.data());
    }
  });
}

// Causal attention of a step's tokens over a paged KV cache, each token attending to keys 0..p
// of its request (p its position; the last W with a sliding window W > 0) through `attend`:
// the same bits as the dense entry point gives that token in a full-sequence forward. query
// [T, H, D]; caches the logical [num_blocks, block_size, Hk, D or Dv] views (unit stride on the
// last dim); block_tables [R, max_blocks], seq_lens [R] and query_start_loc [R + 1] int32.
at::Tensor batch_invariant_paged_attention(const at::Tensor& query, const at::Tensor& key_cache,
                                           const at::Tensor& value_cache,
                                           const at::Tensor& block_tables,
                                           const at::Tensor& seq_lens,
                                           const at::Tensor& query_start_loc, double scale,
                                           int64_t sliding_window) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "batch_invariant_paged_attention: query [T, H, D], caches [blocks, size, Hk, D]");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0 && key_cache.size(3) == query.size(2),
              "batch_invariant_paged_attention: heads or head dims do not fit the cache");
  TORCH_CHECK(query.scalar_type() == key_cache.scalar_type() &&
                  query.scalar_type() == value_cache.scalar_type(),
              "batch_invariant_paged_attention: query and cache dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_start_loc.scalar_type() == at::kInt,
              "batch_invariant_paged_attention: block_tables, seq_lens, query_start_loc int32");
  TORCH_CHECK(key_cache.stride(3) == 1 && value_cache.stride(3) == 1 && query.stride(2) == 1,
              "batch_invariant_paged_attention: unit stride on the head dim");
  const auto dtype = query.scalar_type();
  at::Tensor out = at::empty({query.size(0), query.size(1), value_cache.size(3)},
                             query.options());
  const at::Tensor tables = block_tables.contiguous(), lens = seq_lens.contiguous(),
                   starts = query_start_loc.contiguous();
  const float s = static_cast<float>(scale);
  if (dtype == at::kFloat)
    paged_kernel<float>(query, key_cache, value_cache, tables, lens, starts, s, sliding_window,
                        out);
  else if (dtype == at::kBFloat16)
    paged_kernel<at::BFloat16>(query, key_cache, value_cache, tables, lens, starts, s,
                               sliding_window, out);
  else if (dtype == at::kHalf)
    paged_kernel<at::Half>(query, key_cache, value_cache, tables, lens, starts, s,
                           sliding_window, out);
  else
    TORCH_CHECK(false, "batch_invariant_paged_attention: float32, bfloat16 or float16");
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def(
      "batch_invariant_attention(Tensor query, Tensor key, Tensor value, Tensor? mask, "
      "bool is_causal, float scale) -> Tensor");
  m.def(
      "batch_invariant_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("batch_invariant_attention", &batch_invariant_attention);
  m.impl("batch_invariant_paged_attention", &batch_invariant_paged_attention);
}
