// Attention whose every output is computed in one fixed order, whatever the batch, the padding,
// the sequence's length beyond the query or how the keys were chunked.
//
// A query vector attends to its visible keys (causal, or as a mask says) taken in order and cut
// into groups of 16: the i-th visible key is in group i / 16, so the groups do not depend on
// padding, on where the sequence sits in a padded batch or on the keys after the query. For
// each group, in order:
//
//   - scores s_j = dot(q, k_j) * scale, the dot product in the linear layer's order (16 FMA
//     lanes over the head dimension, a fixed tree; batch_invariant_vec.h); bfloat16 on a CPU
//     with AVX512_BF16 (head dims of whole 32s): lane i adds, per 32 dims in order, the pair
//     (2i, 2i + 1) of exact products with vdpbf16ps, then the same tree (`dot16_dpbf16`; so
//     bfloat16 bits differ between CPUs with and without it, as the linear layer's do;
//     ROLLOUT_ENGINE_BI_DPBF16=0 turns both off);
//   - m' = max(m, max_j s_j) (a maximum is exact in any order); alpha = exp(m - m');
//     every exp is `exp_lane` (batch_invariant_vec.h), sixteen at a time where the CPU can:
//     libm's exp could differ between machines and would cost a call per score;
//   - l = fma(l, alpha, sum_j exp(s_j - m')), the group's sum in `tree_sum`'s order (lane j
//     holds key j, a partial group's missing keys 0; lanes i + i+8, i + i+4, i + i+2, i + i+1);
//   - acc[d] = acc[d] * alpha, then acc[d] = fma(exp(s_j - m'), v_j[d], acc[d]) for j in order;
//
// and out[d] = acc[d] / l, rounded to the input dtype (zeros where no key is visible). All math
// in float32; bfloat16 and float16 are widened as they are loaded. `attend_keys` does the groups
// for query vectors of one key/value head (each on its own, reading each key once for all)
// given the keys' and values' row pointers, and is not inlined, so every caller (this dense
// entry point; a paged one reading a KV cache, which also takes the decode tokens of a prompt's
// samples together over their shared blocks) runs the same instructions.
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
#include <tuple>
#include <vector>

#include "batch_invariant_dpbf16.h"
#include "batch_invariant_vec.h"

namespace {

using batch_invariant::accumulate_values;
using batch_invariant::dot;
using batch_invariant::dot16;
using batch_invariant::kLanes;
using batch_invariant::load_group;
using batch_invariant::kTogether;
using batch_invariant::Vec16;

constexpr int64_t kGroup = 16;  // keys per softmax group
constexpr int64_t kDot16From = 4;  // a partial group of this many keys takes dot16 (not tuned)
static_assert(kGroup == kLanes, "dot16 computes one group's scores");

#ifdef BATCH_INVARIANT_DPBF16
// The scores of a group's 16 keys (a partial group's missing keys: any row, their scores are
// dropped) for kQueries bfloat16 query vectors (given widened: narrowing them back is exact):
// per key, lane i adds the pairs (2i, 2i + 1) of exact products of each 32 dims in order
// (vdpbf16ps), then dot16's tree over the lanes. Each key row is loaded once for the queries;
// the keys in two halves so that the accumulators fit the registers. A query's operations are
// those it gets alone.
template <int kQueries>
inline void dot16_dpbf16(const float* const* queries, const at::BFloat16* const* keys,
                         int64_t dim, float (*out)[kGroup]) {
  __m512 r1[kQueries][8];
  for (int half = 0; half < 2; ++half) {
    __m512 a[kQueries][8];  // slot t: key 4 half + t (t < 4), key 4 half + t + 4 (t >= 4)
    for (int u = 0; u < kQueries; ++u)
      for (int t = 0; t < 8; ++t) a[u][t] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 32) {
      __m512bh x[kQueries];
      for (int u = 0; u < kQueries; ++u)
        x[u] = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(queries[u] + d + 16),
                                   _mm512_loadu_ps(queries[u] + d));
      for (int t = 0; t < 8; ++t) {
        const __m512bh k =
            (__m512bh)_mm512_loadu_si512(keys[4 * half + (t < 4 ? t : t + 4)] + d);
        for (int u = 0; u < kQueries; ++u) a[u][t] = _mm512_dpbf16_ps(a[u][t], x[u], k);
      }
    }
    for (int u = 0; u < kQueries; ++u)
      for (int t = 0; t < 4; ++t)
        r1[u][4 * half + t] = batch_invariant::dot16_level1(a[u][t], a[u][t + 4]);
  }
  for (int u = 0; u < kQueries; ++u) batch_invariant::dot16_finish(r1[u], out[u]);
}
#endif

// Whether bfloat16 scores run on `dot16_dpbf16` (for every group, whole or partial).
template <typename scalar_t>
inline bool scores_on_pairs(int64_t dim) {
#ifdef BATCH_INVARIANT_DPBF16
  return std::is_same_v<scalar_t, at::BFloat16> && dim % 32 == 0 &&
         batch_invariant::dpbf16::available();
#else
  return false;
#endif
}

// A group's scores for `together` (1 or kTogether) queries on `dot16_dpbf16`, where
// `scores_on_pairs` said so.
template <typename scalar_t>
inline void scores_by_pairs(const float* const* queries, int64_t together,
                            const scalar_t* const* group, int64_t dim, float (*out)[kGroup]) {
#ifdef BATCH_INVARIANT_DPBF16
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    if (together == 2) return dot16_dpbf16<2>(queries, group, dim, out);
    return dot16_dpbf16<1>(queries, group, dim, out);
  }
#endif
}

// Blocks of a paged cache lie anywhere, so the hardware cannot guess the next one: while a
// group is computed, the rows kPrefetchGroups groups ahead are asked for, into L2 (as
// paged_attention_cpu.cpp does). A prefetch changes no result.
constexpr int64_t kPrefetchGroups = 8;

template <typename scalar_t>
inline void prefetch_rows(const scalar_t* const* rows, int64_t n, int64_t dim) {
  const int64_t bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < n; ++j)
    for (int64_t b = 0; b < bytes; b += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(rows[j]) + b, 0, 1);  // prefetcht2
}

// Running softmax state of `num_queries` query vectors: m and l per query, acc value_dim
// floats per query (pointers into the caller's scratch; a subset is a sub-range of each).
struct Running {
  float* maxima;
  float* sums;
  float* acc;
};

inline void attend_begin(Running st, int64_t num_queries, int64_t value_dim) {
  for (int64_t i = 0; i < num_queries; ++i) {
    st.maxima[i] = -std::numeric_limits<float>::infinity();
    st.sums[i] = 0.f;
  }
  std::fill(st.acc, st.acc + num_queries * value_dim, 0.f);
}

// `num_queries` query vectors (widened to float32) that share one key/value head, each over
// the same `count` keys, continuing their running state, each in the order of the header: a
// query's bits are those it gets alone. Taking the queries of a grouped-query head (or of the
// requests sharing a prefix, `paged_kernel`) together reads each key and value once for all of
// them. A query's keys may come in several calls, each but the last a whole number of groups
// (kGroup keys): the groups, and so every operation, are those of one call over all its keys.
template <typename scalar_t>
__attribute__((noinline)) void attend_keys(const float* const* queries, int64_t num_queries,
                                           int64_t dim, const scalar_t* const* keys,
                                           const scalar_t* const* values, int64_t count,
                                           int64_t value_dim, float scale, Running st) {
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  alignas(64) float s[kTogether][kGroup], p[kTogether][kGroup];
  const bool pairs = scores_on_pairs<scalar_t>(dim);
  for (int64_t g = 0; g < count; g += kGroup) {
    const int64_t n = std::min(kGroup, count - g);
    // The first call asks for its first groups, then each group for the one kPrefetchGroups on.
    for (int64_t ahead = g == 0 ? 0 : g + kPrefetchGroups * kGroup;
         ahead <= g + kPrefetchGroups * kGroup && ahead < count; ahead += kGroup) {
      const int64_t rows = std::min(kGroup, count - ahead);
      prefetch_rows(keys + ahead, rows, dim);
      prefetch_rows(values + ahead, rows, value_dim);
    }
    const scalar_t* group[kGroup];  // a partial group's missing keys: its first again
    for (int64_t j = 0; j < kGroup; ++j) group[j] = keys[g + (j < n ? j : 0)];
    // kTogether queries at a time: their weights one by one, then their values together.
    for (int64_t i0 = 0; i0 < num_queries; i0 += kTogether) {
      const int64_t together = std::min<int64_t>(kTogether, num_queries - i0);
      float alpha[kTogether];
      if (pairs)
        scores_by_pairs(queries + i0, together, group, dim, s);
      else if (n >= kDot16From && together == 2)
        batch_invariant::dot16_pair(queries[i0], queries[i0 + 1], group, dim, s[0], s[1]);
      else if (n >= kDot16From)
        dot16(queries[i0], group, dim, s[0]);
      for (int64_t u = 0; u < together; ++u) {
        const int64_t i = i0 + u;
        Vec16 scores;  // dot * scale; -inf past a partial group's keys (weight 0)
        if (pairs || n >= kDot16From) {
          for (int64_t j = n; j < kGroup; ++j) s[u][j] = kNone;
          scores = Vec16::mul(Vec16::load(s[u]), Vec16::broadcast(scale));
        } else {
          for (int64_t j = 0; j < kGroup; ++j)
            s[u][j] = j < n ? dot(queries[i], keys[g + j], dim) * scale : kNone;
          scores = Vec16::load(s[u]);
        }
        const float m = st.maxima[i], m_new = std::max(m, scores.max());
        const Vec16 weights = Vec16::exp(Vec16::sub(scores, Vec16::broadcast(m_new)));
        weights.store(p[u]);
        alpha[u] = batch_invariant::exp_lane(m - m_new);  // 0 for the first group (m = -inf)
        st.sums[i] = std::fma(st.sums[i], alpha[u], weights.tree_sum());
        st.maxima[i] = m_new;
      }
      accumulate_values(values + g, n, p, alpha, together, value_dim, st.acc + i0 * value_dim);
    }
  }
}

// out = acc / l per query, rounded to the dtype (zeros where the query saw no key).
template <typename scalar_t>
inline void attend_finish(Running st, int64_t num_queries, int64_t value_dim, bool saw_keys,
                          scalar_t* const* outs) {
  alignas(64) float quotient[kLanes];
  for (int64_t i = 0; i < num_queries; ++i) {
    const float* acc = st.acc + i * value_dim;
    int64_t d = 0;
    for (; saw_keys && d + kLanes <= value_dim; d += kLanes) {  // the same divisions, 16 wide
      Vec16::div(Vec16::load(acc + d), Vec16::broadcast(st.sums[i])).store(quotient);
      for (int64_t j = 0; j < kLanes; ++j) outs[i][d + j] = static_cast<scalar_t>(quotient[j]);
    }
    for (; d < value_dim; ++d)
      outs[i][d] = saw_keys ? static_cast<scalar_t>(acc[d] / st.sums[i]) : scalar_t(0);
  }
}

// A query row widened to float32 (exactly).
template <typename scalar_t>
inline void widen_row(const scalar_t* row, int64_t dim, float* out) {
  int64_t d = 0;
  for (; d + kLanes <= dim; d += kLanes) Vec16::load(row + d).store(out + d);
  for (; d < dim; ++d) out[d] = static_cast<float>(row[d]);
}

// The queries over the same `count` keys, from a fresh state to their outputs. Scratch: `acc`
// num_queries x value_dim floats, `state` 2 x num_queries.
template <typename scalar_t>
void attend(const float* const* queries, int64_t num_queries, int64_t dim,
            const scalar_t* const* keys, const scalar_t* const* values, int64_t count,
            int64_t value_dim, float scale, float* acc, float* state, scalar_t* const* outs) {
  const Running st{state, state + num_queries, acc};
  attend_begin(st, num_queries, value_dim);
  attend_keys<scalar_t>(queries, num_queries, dim, keys, values, count, value_dim, scale, st);
  attend_finish<scalar_t>(st, num_queries, value_dim, count > 0, outs);
}

// Whether a mask row's visible keys are one run [first, first + count) (causal, padding).
inline bool visible_run(const bool* row, int64_t stride, int64_t length, int64_t& first,
                        int64_t& count) {
  int64_t j = 0;
  while (j < length && !row[j * stride]) ++j;
  first = j;
  while (j < length && row[j * stride]) ++j;
  count = j - first;
  while (j < length && !row[j * stride]) ++j;
  return j == length;
}

// `lse` (may be null): each query's log-sum-exp of its scaled scores, m + log(l), [B, H, Lq]
// float32, 0 for a query that sees no key (sdpa's flash kernel's convention; the backward
// needs it finite there).
template <typename scalar_t>
void dense_kernel(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                  const at::Tensor* mask, bool is_causal, float scale, at::Tensor& out,
                  float* lse) {
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
    // Row pointers of every key and value of the current (b, hk), built once for all its
    // queries: a query whose visible keys are one run (causal, padding) reads a sub-range.
    std::vector<const scalar_t*> all_keys(Lk), all_values(Lk), keys, values;
    int64_t rows_of = -1;
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
      const bool* mrow = mp ? mp + b * mask->stride(0) + h0 * mask->stride(1) +
                                  i * mask->stride(2)
                            : nullptr;
      if (b * Hk + hk != rows_of) {
        for (int64_t j = 0; j < Lk; ++j) {
          all_keys[j] = kp + b * k.stride(0) + hk * k.stride(1) + j * k.stride(2);
          all_values[j] = vp + b * v.stride(0) + hk * v.stride(1) + j * v.stride(2);
        }
        rows_of = b * Hk + hk;
      }
      int64_t first = 0, count = mrow == nullptr && is_causal ? std::min(i + 1, Lk) : Lk;
      const scalar_t* const* row_keys = all_keys.data();
      const scalar_t* const* row_values = all_values.data();
      if (mrow != nullptr && !visible_run(mrow, mask->stride(3), Lk, first, count)) {
        keys.clear(), values.clear();  // not one run: gather the visible keys
        for (int64_t j = 0; j < Lk; ++j)
          if (mrow[j * mask->stride(3)])
            keys.push_back(all_keys[j]), values.push_back(all_values[j]);
        row_keys = keys.data(), row_values = values.data(), first = 0;
        count = static_cast<int64_t>(keys.size());
      }
      attend<scalar_t>(queries.data(), together, D, row_keys + first, row_values + first, count,
                       Dv, scale, acc.data(), state.data(), outs.data());
      for (int64_t g = 0; lse != nullptr && g < together; ++g)  // state: maxima, then sums
        lse[(b * H + h0 + g) * Lq + i] =
            count > 0 ? state[g] + std::log(state[together + g]) : 0.f;
    }
  });
}

std::tuple<at::Tensor, at::Tensor> dense_attention(const at::Tensor& query,
                                                   const at::Tensor& key,
                                                   const at::Tensor& value,
                                                   const std::optional<at::Tensor>& mask,
                                                   bool is_causal, double scale, bool with_lse) {
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
  at::Tensor lse = with_lse ? at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(
                                  at::kFloat))
                            : at::Tensor();
  float* lp = with_lse ? lse.data_ptr<float>() : nullptr;
  const float s = static_cast<float>(scale);
  const at::Tensor* mp = m.defined() ? &m : nullptr;
  if (dtype == at::kFloat) dense_kernel<float>(q, k, v, mp, is_causal, s, out, lp);
  else if (dtype == at::kBFloat16) dense_kernel<at::BFloat16>(q, k, v, mp, is_causal, s, out, lp);
  else dense_kernel<at::Half>(q, k, v, mp, is_causal, s, out, lp);
  return {out, lse};
}

at::Tensor batch_invariant_attention(const at::Tensor& query, const at::Tensor& key,
                                     const at::Tensor& value,
                                     const std::optional<at::Tensor>& mask, bool is_causal,
                                     double scale) {
  return std::get<0>(dense_attention(query, key, value, mask, is_causal, scale, false));
}

// The same, and each query's log-sum-exp (what sdpa's flash backward takes with the output).
std::tuple<at::Tensor, at::Tensor> batch_invariant_attention_lse(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
    const std::optional<at::Tensor>& mask, bool is_causal, double scale) {
  return dense_attention(query, key, value, mask, is_causal, scale, true);
}

// The n samples of a prompt decode over the same first blocks (the prefix cache gives them the
// same block ids): their tokens attend to those keys together, each key read once for all of
// them, then each goes on over its own keys with its running state. A token's operations stay
// those it gets alone: the shared keys are a whole number of groups, so the groups are the same.
struct Item {
  std::vector<int64_t> tokens;  // decode tokens of requests sharing the first `shared` keys
  int64_t shared = 0;
};

constexpr int64_t kMaxTokensTogether = 16;  // members of one item (bounds its scratch)

// Items of the step: runs of decode requests (one query token, no sliding window) whose block
// tables begin with the same blocks, each with the keys all of them see there; runs of up to
// kMaxTokensTogether tokens of a prefill chunk, with the whole groups the first of them sees;
// every other token (sliding windows) an item of its own.
std::vector<Item> share_prefixes(int64_t R, const int32_t* starts, const int32_t* lens,
                                 const int32_t* tables, int64_t table_stride, int64_t block_size,
                                 bool sliding) {
  std::vector<Item> items;
  std::vector<int64_t> decode;  // requests that may share, ordered by their first block
  for (int64_t r = 0; r < R; ++r) {
    const int64_t q_len = starts[r + 1] - starts[r];
    if (q_len == 1 && !sliding && lens[r] > kGroup) decode.push_back(r);
    else if (q_len == 1 || sliding)
      for (int64_t t = starts[r]; t < starts[r + 1]; ++t) items.push_back({{t}, 0});
    else  // a prefill chunk: runs of its tokens share the whole groups the first one sees
      for (int64_t t0 = starts[r]; t0 < starts[r + 1]; t0 += kMaxTokensTogether) {
        Item item{{}, (lens[r] - q_len + (t0 - starts[r]) + 1) / kGroup * kGroup};
        for (int64_t t = t0; t < std::min<int64_t>(t0 + kMaxTokensTogether, starts[r + 1]); ++t)
          item.tokens.push_back(t);
        items.push_back(std::move(item));
      }
  }
  std::stable_sort(decode.begin(), decode.end(), [&](int64_t a, int64_t b) {
    return tables[a * table_stride] < tables[b * table_stride];
  });
  for (size_t i = 0; i < decode.size();) {
    const int64_t lead = decode[i];
    // Whole blocks the lead sees entirely (its own position's block excluded).
    const int64_t lead_blocks = (lens[lead] - 1) / block_size;
    Item item{{starts[lead]}, lead_blocks};
    size_t next = i + 1;
    for (; next < decode.size() && item.tokens.size() < kMaxTokensTogether; ++next) {
      const int64_t r = decode[next];
      int64_t common = 0;
      const int64_t limit = std::min(item.shared, (lens[r] - 1) / block_size);
      while (common < limit &&
             tables[r * table_stride + common] == tables[lead * table_stride + common])
        ++common;
      if (common * block_size < kGroup) break;  // nothing worth sharing with the lead
      item.shared = common;
      item.tokens.push_back(starts[r]);
    }
    item.shared = item.tokens.size() > 1 ? item.shared * block_size / kGroup * kGroup : 0;
    items.push_back(std::move(item));
    i = next;
  }
  return items;
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
  for (int64_t t = 0; t < T; ++t)  // padding rows of the step attend to nothing
    if (request_of[t] < 0)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t d = 0; d < Dv; ++d) op[(t * H + h) * Dv + d] = scalar_t(0);
  const std::vector<Item> items = share_prefixes(R, starts, lens, tables, table_stride,
                                                 block_size, sliding_window > 0);
  // The query heads of one key/value head go together: they see the same keys.
  const int64_t k_strides[3] = {key_cache.stride(0), key_cache.stride(1), key_cache.stride(2)};
  const int64_t v_strides[3] = {value_cache.stride(0), value_cache.stride(1),
                                value_cache.stride(2)};
  const int64_t q_strides[2] = {q.stride(0), q.stride(1)};
  at::parallel_for(0, static_cast<int64_t>(items.size()) * Hk, 1, [&](int64_t begin,
                                                                      int64_t end) {
    std::vector<const scalar_t*> keys, values;
    std::vector<float> qf, acc, maxima, sums;
    std::vector<const float*> queries;
    std::vector<scalar_t*> outs;
    // Pointers to the keys [from, to) of request r under key/value head hk.
    auto gather = [&](int64_t r, int64_t hk, int64_t from, int64_t to) {
      keys.resize(std::max<int64_t>(to - from, 0));
      values.resize(keys.size());
      const scalar_t* k_head = kp + hk * k_strides[2];
      const scalar_t* v_head = vp + hk * v_strides[2];
      for (int64_t j = from; j < to; ++j) {
        const int64_t block = tables[r * table_stride + j / block_size], slot = j % block_size;
        keys[j - from] = k_head + block * k_strides[0] + slot * k_strides[1];
        values[j - from] = v_head + block * v_strides[0] + slot * v_strides[1];
      }
    };
    for (int64_t index = begin; index < end; ++index) {
      const Item& item = items[index / Hk];
      const int64_t hk = index % Hk, h0 = hk * per_kv;
      const int64_t members = static_cast<int64_t>(item.tokens.size());
      const int64_t num_queries = members * per_kv;
      qf.resize(num_queries * D);
      acc.resize(num_queries * Dv);
      maxima.resize(num_queries);
      sums.resize(num_queries);
      queries.resize(num_queries);
      outs.resize(num_queries);
      for (int64_t m = 0; m < members; ++m) {
        const int64_t t = item.tokens[m];
        for (int64_t g = 0; g < per_kv; ++g) {
          const int64_t i = m * per_kv + g;
          widen_row(qp + t * q_strides[0] + (h0 + g) * q_strides[1], D, qf.data() + i * D);
          queries[i] = qf.data() + i * D;
          outs[i] = op + (t * H + h0 + g) * Dv;
        }
      }
      const Running all{maxima.data(), sums.data(), acc.data()};
      attend_begin(all, num_queries, Dv);
      if (item.shared > 0) {
        gather(request_of[item.tokens[0]], hk, 0, item.shared);
        attend_keys<scalar_t>(queries.data(), num_queries, D, keys.data(), values.data(),
                              item.shared, Dv, scale, all);
      }
      for (int64_t m = 0; m < members; ++m) {
        const int64_t t = item.tokens[m], r = request_of[t];
        const int64_t q_len = starts[r + 1] - starts[r];
        const int64_t position = lens[r] - q_len + (t - starts[r]);
        const int64_t first = sliding_window > 0
                                  ? std::max<int64_t>(0, position - sliding_window + 1)
                                  : item.shared;
        gather(r, hk, first, position + 1);
        const Running own{maxima.data() + m * per_kv, sums.data() + m * per_kv,
                          acc.data() + m * per_kv * Dv};
        attend_keys<scalar_t>(queries.data() + m * per_kv, per_kv, D, keys.data(),
                              values.data(), static_cast<int64_t>(keys.size()), Dv, scale, own);
        const bool saw_keys = item.shared + static_cast<int64_t>(keys.size()) > 0;
        attend_finish<scalar_t>(own, per_kv, Dv, saw_keys, outs.data() + m * per_kv);
      }
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
      "batch_invariant_attention_lse(Tensor query, Tensor key, Tensor value, Tensor? mask, "
      "bool is_causal, float scale) -> (Tensor, Tensor)");
  m.def(
      "batch_invariant_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
      "int sliding_window) -> Tensor");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("batch_invariant_attention", &batch_invariant_attention);
  m.impl("batch_invariant_attention_lse", &batch_invariant_attention_lse);
  m.impl("batch_invariant_paged_attention", &batch_invariant_paged_attention);
}
