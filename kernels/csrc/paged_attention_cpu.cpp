// Paged attention for short queries (decode rows, draft verification) on the CPU, read in place.
//
// The torch path gathers each request's KV blocks into a padded copy before two batched
// matmuls; at a few hundred decode rows that copy, the padding and the masking cost as much as
// the model's dense layers. This kernel walks the block tables and reads keys and values where
// they lie, with an online softmax (one pass, no score matrix).
//
// Work items are (group, KV head). A group is a set of requests whose first `shared` blocks are
// the same (the n samples of one prompt): every query vector of every member attends to those
// blocks together, each key loaded once for all of them, and then each member goes on over its
// own blocks with the same running softmax state. That is the cascade of the torch path without
// its merge step. The prefix is wholly before every member's first query position (the caller's
// grouping guarantees it), so it needs no causal mask; the own blocks are masked per token.
// A request that shares nothing is a group of one with `shared` = 0. With AVX-512, a group's
// shared blocks go sixteen query vectors at a time through the lanes path (`attend_lanes16`:
// one vector per lane, no horizontal sums), its own blocks through tiles of the query heads of
// one token (`attend_tile16`: head dims in the lanes), several consecutive blocks per softmax
// update (a span, `kSpanKeys`). Blocks are asked for ahead only where they start a new stream
// in memory (`kPrefetchAhead`).
//
// A sliding window W > 0 (a per-layer setting) hides the keys more than W - 1 positions before
// a token's own: each vector's keys are [first_key, last_key], and blocks wholly before every
// vector's first key are not read at all.
//
// Two more per-layer settings, as Hugging Face computes them. A logit softcap c > 0 (Gemma 2)
// bends each block's scores to c * tanh(s / c) before their maximum is taken. Sinks (gpt-oss,
// one logit per query head) are a key that every vector sees first, with a zero value: each
// vector's running state starts at m = sink, l = exp(sink - m) = 1 instead of m = -inf, l = 0,
// and the usual rescaling by exp(m_old - m_new) carries it through every later block.
//
// Contract: the same as `paged_attention_ref` for the listed requests; rows of other requests in
// `out` are left untouched. The caches are the logical [num_blocks, block_size, num_kv_heads,
// head_dim] (keys) and [..., value_head_dim] (values, which may be narrower or wider: multi-head
// latent attention) views with any strides but a unit stride on the last dim (heads-major and
// block-major storage both work); out is [T, H, value_head_dim]. Math in float32 whatever the
// dtype. The unrolled and vectorised paths take head_dim 64 and 128 with values as wide; every
// other pair of widths takes the portable loops.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_vec.h"

namespace {

// kDim > 0: head_dim known at compile time (unrolled, vectorised); 0: `dim` at run time.
template <int kDim, typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  const int64_t n = kDim > 0 ? kDim : dim;
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < n; ++d) acc += q[d] * static_cast<float>(k[d]);
  return acc;
}

template <int kDim, typename scalar_t>
inline void axpy(float* acc, float p, const scalar_t* v, int64_t dim) {
  const int64_t n = kDim > 0 ? kDim : dim;
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) acc[d] += p * static_cast<float>(v[d]);
}

// One block read by one work item: its keys first..first+rows-1 for vectors [v0, v1).
struct Visit {
  int64_t block, v0, v1, first, rows;
  bool masked;  // causal: keys past a vector's own position are skipped
};

// Where a block lies right after the one read before it (the next id of the engine's runs, with
// block stride = rows x row stride), the read goes on as one stream that the hardware prefetcher
// follows. A block elsewhere starts a new stream, which the hardware cannot guess: the kernel
// asks for it this many visits ahead while it computes the current one. Measured on an Intel
// Xeon (AVX-512; GRPO decode at a 4,096 context, 2 threads, `benchmarks/cpu_attention.py`):
// asking for every block cost 5% against none with blocks in runs (and 40% with the KV in
// cache: the prefetch instructions themselves), and saved 6% with scattered blocks; asking only
// where a stream starts matched the better of the two in both.
constexpr size_t kPrefetchAhead = 8;

// Whether visit `b` goes on where visit `a` ends, for the same vectors: the next block of a
// span (see kSpanKeys). Only a whole block is followed by another.
inline bool continues_span(const Visit& a, const Visit& b, int64_t block_size) {
  return b.v0 == a.v0 && b.v1 == a.v1 && b.masked == a.masked && a.rows == block_size &&
         b.first == a.first + a.rows;
}

// Whether visit `a`'s block continues the stream of visit `a - 1`'s (see kPrefetchAhead).
inline bool continues_stream(const std::vector<Visit>& visits, size_t a, bool runs_are_streams) {
  return runs_are_streams && a > 0 && visits[a].block == visits[a - 1].block + 1;
}

// Asks for `rows` rows of `dim` values, `stride` elements apart, to be brought into L2, not L1.
// Measured on Zen 4 with the cache in memory (GRPO decode, one thread): prefetching into L1,
// one block ahead or several, was hardly faster than no prefetch; into L2, 4 to 32 blocks
// ahead, 1.6x faster (L1 has few miss buffers for the requests to wait in).
template <typename scalar_t>
inline void prefetch_rows(const scalar_t* p, int64_t stride, int64_t rows, int64_t dim) {
  constexpr int64_t kLine = 64;
  const int64_t row_bytes = dim * static_cast<int64_t>(sizeof(scalar_t));
  for (int64_t j = 0; j < rows; ++j) {
    const char* row = reinterpret_cast<const char*>(p + j * stride);
    for (int64_t byte = 0; byte < row_bytes; byte += kLine) {
      __builtin_prefetch(row + byte, 0, 1);  // read, locality 1: prefetcht2
    }
  }
}

// The most query vectors that attend to a block together, each key and value row loaded once
// for all of them (the vectorised path; the portable one takes one vector at a time).
constexpr int kMaxTile = 2;

// Whether the unrolled vector paths take these keys and values: both kDim wide, kDim a multiple
// of 64 (the accumulators go eight registers at a time), and not float64.
template <int kDim, typename scalar_t>
constexpr bool kUnrolled = kDim > 0 && kDim % 64 == 0 && !std::is_same_v<scalar_t, double>;

// The tiles (`attend_tile16`) take consecutive blocks of the same vectors (a member's own
// blocks) together, up to this many keys, in one softmax update: one maximum, one rescaling of
// the accumulators and one sum per span instead of per block. Measured on the Intel Xeon (GRPO
// decode from memory, 16-token blocks, 2 threads, `benchmarks/cpu_attention.py`) against one
// block per update: 24-25 ms against 28 at a 4,096 context, 6.5 against 7.2 at 1,024, 4% less
// at 256; 64 keys came out about as 128.
constexpr int64_t kSpanKeys = 128, kMaxSpanBlocks = 8;

// How many blocks of `block_size` keys a span holds.
inline int64_t span_blocks(int64_t block_size) {
  return std::clamp<int64_t>(kSpanKeys / block_size, 1, kMaxSpanBlocks);
}

// Consecutive blocks that the same vectors read: the keys of block b are keys b * block_size..
// of the span.
template <typename scalar_t>
struct Span {
  const scalar_t* kblocks[kMaxSpanBlocks];
  const scalar_t* vblocks[kMaxSpanBlocks];
  int64_t num_blocks = 0, block_size = 0;
};

// Running softmax state of the query vectors of one work item.
struct State {
  std::vector<float> q, acc, m, l;  // q: head_dim per vector, acc: value_head_dim
  // bfloat16 queries as given (unscaled), where the scores run on vdpbf16ps (see
  // `attend_tile16`); `scale` multiplies those scores.
  std::vector<at::BFloat16> qb;
  float scale = 1.f;
  // A span's scores, then weights (`attend_tile16`; a block's on the other paths): kMaxTile
  // rows of score_stride.
  std::vector<float> scores;
  int64_t score_stride = 0;  // whole sixteen-lane vectors
  // The lanes path (`attend_lanes16`): the scaled queries transposed, sixteen vectors to a
  // chunk ([chunk][dim][16], 0 past the last vector); a block's scores, then weights, one
  // sixteen-lane row per key; a block's keys widened to float32 (half-precision caches).
  std::vector<float> qt, lane_scores, keys32;
  std::vector<int64_t> first_key;  // sliding window: the earliest key it sees (0 without one)
  std::vector<int64_t> last_key;  // causal limit: the token's own position
  float softcap = 0.f;  // > 0: scores s become softcap * tanh(s / softcap)

  void resize(int64_t num_vec, int64_t dim, int64_t value_dim, int64_t block_size) {
    const int64_t block_stride = (block_size + 15) / 16 * 16;
    score_stride = (span_blocks(block_size) * block_size + 15) / 16 * 16;
    scores.resize(kMaxTile * score_stride);
    lane_scores.resize(block_stride * 16);
    keys32.resize(block_stride * dim);
    if (static_cast<int64_t>(m.size()) >= num_vec) return;
    q.resize(num_vec * dim);
    qb.resize(num_vec * dim);
    acc.resize(num_vec * value_dim);
    m.resize(num_vec);
    l.resize(num_vec);
    first_key.resize(num_vec);
    last_key.resize(num_vec);
  }
};

// acc += sum_j p[j] * v[j] over n value rows. With head_dim known at compile time the
// accumulator lives in registers for the whole block instead of a store per row.
template <int kDim, typename scalar_t>
inline void accumulate(float* __restrict__ acc, const float* __restrict__ p,
                       const scalar_t* __restrict__ v, int64_t row_stride, int64_t n,
                       int64_t dim) {
  if constexpr (kDim > 0) {
    float r[kDim];
    for (int64_t d = 0; d < kDim; ++d) r[d] = acc[d];
    for (int64_t j = 0; j < n; ++j) {
      const scalar_t* row = v + j * row_stride;
#pragma omp simd
      for (int64_t d = 0; d < kDim; ++d) r[d] += p[j] * static_cast<float>(row[d]);
    }
    for (int64_t d = 0; d < kDim; ++d) acc[d] = r[d];
  } else {
    for (int64_t j = 0; j < n; ++j) axpy<0>(acc, p[j], v + j * row_stride, dim);
  }
}

// The logit softcap on a block's scores s[0..n): s = cap * tanh(s / cap). Where eight-lane
// vectors exist it works on whole ones, up to n rounded up to 8 (the scores' rows are whole
// sixteen-lane vectors, so those lanes exist; what they held is overwritten or ignored).
inline void softcap_scores(float* s, int64_t n, float cap) {
#ifdef ROLLOUT_CPU_VEC
  const __m256 c = _mm256_set1_ps(cap), inv = _mm256_set1_ps(1.f / cap);
  for (int64_t j = 0; j < n; j += 8) {
    _mm256_storeu_ps(s + j, _mm256_mul_ps(c, cpu_vec::tanh8(_mm256_mul_ps(_mm256_loadu_ps(s + j),
                                                                          inv))));
  }
#else
  const float inv = 1.f / cap;
  for (int64_t j = 0; j < n; ++j) s[j] = cap * std::tanh(s[j] * inv);
#endif
}

// Which keys of a block (positions first..first+n-1) vector i sees: keys begin..begin+visible-1
// of the block; false if none. Keys past the token's own position are in its future (only in
// its last own block, `masked`); keys before its first key are outside its sliding window.
inline bool visible_keys(const State& st, int64_t i, int64_t first, int64_t n, bool masked,
                         int64_t& begin, int64_t& visible) {
  begin = std::max<int64_t>(0, st.first_key[i] - first);
  const int64_t end = masked ? std::min(n, st.last_key[i] - first + 1) : n;
  visible = end - begin;
  return visible > 0;
}

// Vectors [v0, v1) of `st` attend to keys first..first+n-1 of one block. kDim > 0: keys and
// values both that wide; 0: keys `dim` wide, values `value_dim`.
template <int kDim, typename scalar_t>
inline void attend_block(State& st, int64_t v0, int64_t v1, const scalar_t* kblock,
                         const scalar_t* vblock, int64_t kp, int64_t vp, int64_t first, int64_t n,
                         int64_t dim, int64_t value_dim, bool masked) {
  float* __restrict__ s = st.scores.data();  // this vector's scores, then its weights
  for (int64_t i = v0; i < v1; ++i) {
    int64_t begin, visible;
    if (!visible_keys(st, i, first, n, masked, begin, visible)) continue;
    const scalar_t* keys = kblock + begin * kp;
    const scalar_t* values = vblock + begin * vp;
    const float* __restrict__ q = &st.q[i * dim];
    for (int64_t j = 0; j < visible; ++j) s[j] = dot<kDim>(q, keys + j * kp, dim);
    if (st.softcap > 0.f) softcap_scores(s, visible, st.softcap);
    float block_max = s[0];
    for (int64_t j = 1; j < visible; ++j) block_max = std::max(block_max, s[j]);
    const float new_m = std::max(st.m[i], block_max);
    float* __restrict__ a = &st.acc[i * value_dim];
    if (new_m != st.m[i]) {
      // 0 on the first block without a sink (acc and l are 0); with one, the sink's weight.
      const float correction = std::exp(st.m[i] - new_m);
      st.l[i] *= correction;
      for (int64_t d = 0; d < (kDim > 0 ? kDim : value_dim); ++d) a[d] *= correction;
      st.m[i] = new_m;
    }
    float mass = 0.f;
    for (int64_t j = 0; j < visible; ++j) {
      s[j] = std::exp(s[j] - new_m);
      mass += s[j];
    }
    st.l[i] += mass;
    accumulate<kDim>(a, s, values, vp, visible, value_dim);
  }
}

#ifdef ROLLOUT_CPU_VEC
// attend_block for head_dim 64 or 128 with eight-lane vectors: four keys' scores per pass with
// the query in registers, the weights' exp eight at a time, and the accumulator in registers
// for the whole block's values. Measured on a GRPO decode step's shapes: 1.6x faster than the
// portable loops with the cache in L3, and the whole kernel 1.4x faster with it in memory.
template <int kDim, typename scalar_t>
inline void attend_block_vec(State& st, int64_t v0, int64_t v1, const scalar_t* kblock,
                             const scalar_t* vblock, int64_t kp, int64_t vp, int64_t first,
                             int64_t n, bool masked) {
  using namespace cpu_vec;
  static_assert(kDim % 64 == 0, "the accumulator is kept eight registers at a time");
  constexpr int kVecs = kDim / 8;
  float* __restrict__ s = st.scores.data();  // this vector's scores, then its weights
  for (int64_t i = v0; i < v1; ++i) {
    int64_t begin, visible;
    if (!visible_keys(st, i, first, n, masked, begin, visible)) continue;
    const scalar_t* keys = kblock + begin * kp;
    const scalar_t* values = vblock + begin * vp;
    __m256 q[kVecs];
    for (int c = 0; c < kVecs; ++c) q[c] = _mm256_loadu_ps(&st.q[i * kDim + 8 * c]);
    int64_t j = 0;
    for (; j + 4 <= visible; j += 4) {
      // Two chains per key (even and odd eighths): eight FMAs in flight hide their latency.
      const scalar_t* k = keys + j * kp;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0;
      for (int c = 0; c < kVecs; c += 2) {
        a0 = _mm256_fmadd_ps(q[c], load8(k + 8 * c), a0);
        a1 = _mm256_fmadd_ps(q[c], load8(k + kp + 8 * c), a1);
        a2 = _mm256_fmadd_ps(q[c], load8(k + 2 * kp + 8 * c), a2);
        a3 = _mm256_fmadd_ps(q[c], load8(k + 3 * kp + 8 * c), a3);
        b0 = _mm256_fmadd_ps(q[c + 1], load8(k + 8 * c + 8), b0);
        b1 = _mm256_fmadd_ps(q[c + 1], load8(k + kp + 8 * c + 8), b1);
        b2 = _mm256_fmadd_ps(q[c + 1], load8(k + 2 * kp + 8 * c + 8), b2);
        b3 = _mm256_fmadd_ps(q[c + 1], load8(k + 3 * kp + 8 * c + 8), b3);
      }
      _mm_storeu_ps(s + j, hsum4(_mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1),
                                 _mm256_add_ps(a2, b2), _mm256_add_ps(a3, b3)));
    }
    for (; j < visible; ++j) {
      __m256 a = _mm256_setzero_ps();
      const scalar_t* k = keys + j * kp;
      for (int c = 0; c < kVecs; ++c) a = _mm256_fmadd_ps(q[c], load8(k + 8 * c), a);
      s[j] = hsum(a);
    }
    if (st.softcap > 0.f) softcap_scores(s, visible, st.softcap);
    for (j = visible; j % 8 != 0; ++j) s[j] = -FLT_MAX;  // padding lanes: weight 0 below
    __m256 max8 = _mm256_loadu_ps(s);
    for (j = 8; j < visible; j += 8) max8 = _mm256_max_ps(max8, _mm256_loadu_ps(s + j));
    const float new_m = std::max(st.m[i], hmax(max8));
    // 1 if the maximum stayed; (about) 0 on the first block without a sink, where acc and l are
    // 0 anyway; with a sink, exp(sink - new_m) scales its l = 1 as it would any earlier mass.
    const float correction = _mm256_cvtss_f32(exp8(_mm256_set1_ps(st.m[i] - new_m)));
    st.m[i] = new_m;
    max8 = _mm256_set1_ps(new_m);
    __m256 mass = _mm256_setzero_ps();
    for (j = 0; j < visible; j += 8) {
      const __m256 w = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), max8)),
                                     lanes_below(visible - j));
      _mm256_storeu_ps(s + j, w);
      mass = _mm256_add_ps(mass, w);
    }
    st.l[i] = st.l[i] * correction + hsum(mass);
    float* a = &st.acc[i * kDim];
    const __m256 scale_old = _mm256_set1_ps(correction);
    for (int c0 = 0; c0 < kVecs; c0 += 8) {
      __m256 acc[8];
      for (int c = 0; c < 8; ++c) {
        acc[c] = _mm256_mul_ps(_mm256_loadu_ps(a + 8 * (c0 + c)), scale_old);
      }
      for (j = 0; j < visible; ++j) {
        const __m256 p = _mm256_set1_ps(s[j]);
        const scalar_t* row = values + j * vp + 8 * c0;
        for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(p, load8(row + 8 * c), acc[c]);
      }
      for (int c = 0; c < 8; ++c) _mm256_storeu_ps(a + 8 * (c0 + c), acc[c]);
    }
  }
}
#endif

#ifdef ROLLOUT_CPU_VEC16
// The scores of keys [lo, hi) of a block for kTile query vectors (the scaled float32 queries,
// the keys widened), into st.scores' rows from column `offset` on (the block's place in its
// span): four keys per pass, the queries in registers.
template <int kDim, int kTile, typename scalar_t>
inline void tile_scores(State& st, int64_t v0, const scalar_t* kblock, int64_t kp, int64_t lo,
                        int64_t hi, int64_t offset) {
  using namespace cpu_vec;
  constexpr int kVecs = kDim / 16;
  float* __restrict__ s = st.scores.data() + offset;
  const int64_t stride = st.score_stride;
  __m512 q[kTile][kVecs];
  for (int t = 0; t < kTile; ++t) {
    for (int c = 0; c < kVecs; ++c) q[t][c] = _mm512_loadu_ps(&st.q[(v0 + t) * kDim + 16 * c]);
  }
  int64_t j = lo;
  for (; j + 4 <= hi; j += 4) {
    const scalar_t* k = kblock + j * kp;
    __m512 a[kTile][4];
    for (int t = 0; t < kTile; ++t) {
      for (int r = 0; r < 4; ++r) a[t][r] = _mm512_setzero_ps();
    }
    for (int c = 0; c < kVecs; ++c) {
      for (int r = 0; r < 4; ++r) {
        const __m512 key = load16(k + r * kp + 16 * c);
        for (int t = 0; t < kTile; ++t) a[t][r] = _mm512_fmadd_ps(q[t][c], key, a[t][r]);
      }
    }
    for (int t = 0; t < kTile; ++t) {
      _mm_storeu_ps(s + t * stride + j, hsum4(fold8(a[t][0]), fold8(a[t][1]), fold8(a[t][2]),
                                              fold8(a[t][3])));
    }
  }
  for (; j < hi; ++j) {
    const scalar_t* k = kblock + j * kp;
    for (int t = 0; t < kTile; ++t) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < kVecs; ++c) a = _mm512_fmadd_ps(q[t][c], load16(k + 16 * c), a);
      s[t * stride + j] = _mm512_reduce_add_ps(a);
    }
  }
}
#endif

#if defined(ROLLOUT_CPU_VEC16) && defined(__AVX512BF16__)
// The scores of keys [lo, hi) of a bfloat16 block for kTile query vectors, into st.scores'
// rows from column `offset` on, on vdpbf16ps: each instruction adds 16 pairs of exact bfloat16
// products (the query as given, the key as stored; no widening), the block's scale applied to
// the sums. Twice the products per instruction of the widened FMAs; the sums' order differs
// (pairs, then lanes), which the reference tolerances allow. Four keys per pass, the queries in
// registers.
template <int kDim, int kTile>
inline void tile_scores_dpbf16(State& st, int64_t v0, const at::BFloat16* kblock, int64_t kp,
                               int64_t lo, int64_t hi, int64_t offset) {
  using namespace cpu_vec;
  constexpr int kPairs = kDim / 32;  // 32 bfloat16 values per register
  float* __restrict__ s = st.scores.data() + offset;
  const int64_t stride = st.score_stride;
  __m512bh q[kTile][kPairs];
  for (int t = 0; t < kTile; ++t) {
    for (int c = 0; c < kPairs; ++c)
      q[t][c] = (__m512bh)_mm512_loadu_si512(&st.qb[(v0 + t) * kDim + 32 * c]);
  }
  const __m128 scale4 = _mm_set1_ps(st.scale);
  int64_t j = lo;
  for (; j + 4 <= hi; j += 4) {
    const at::BFloat16* k = kblock + j * kp;
    __m512 a[kTile][4];
    for (int t = 0; t < kTile; ++t) {
      for (int r = 0; r < 4; ++r) a[t][r] = _mm512_setzero_ps();
    }
    for (int c = 0; c < kPairs; ++c) {
      for (int r = 0; r < 4; ++r) {
        const __m512bh key = (__m512bh)_mm512_loadu_si512(k + r * kp + 32 * c);
        for (int t = 0; t < kTile; ++t) a[t][r] = _mm512_dpbf16_ps(a[t][r], q[t][c], key);
      }
    }
    for (int t = 0; t < kTile; ++t) {
      _mm_storeu_ps(s + t * stride + j,
                    _mm_mul_ps(hsum4(fold8(a[t][0]), fold8(a[t][1]), fold8(a[t][2]),
                                     fold8(a[t][3])), scale4));
    }
  }
  for (; j < hi; ++j) {
    const at::BFloat16* k = kblock + j * kp;
    for (int t = 0; t < kTile; ++t) {
      __m512 a = _mm512_setzero_ps();
      for (int c = 0; c < kPairs; ++c)
        a = _mm512_dpbf16_ps(a, q[t][c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
      s[t * stride + j] = _mm512_reduce_add_ps(a) * st.scale;
    }
  }
}
#endif

#ifdef ROLLOUT_CPU_VEC16
// attend_block for head_dim 64 or 128 with sixteen-lane vectors, for kTile vectors at once
// (the query heads of a token that share this KV head), over a span of blocks (keys
// first..first+n-1): each key row is loaded once for the tile's scores (four keys per pass, the
// queries in registers), each value row once for the tile's accumulators (in registers for the
// whole span). A vector's keys outside its visible range, which may differ within the tile
// (causal limit, window), get weight exactly 0. The scores are those of the eight-lane path, in
// the same order (bfloat16 scores on a CPU with AVX512_BF16 excepted: `tile_scores_dpbf16`);
// the softmax's sums run per span, not per block. Measured on a GRPO decode step's shapes with
// the cache in L3: 1.9x faster than the eight-lane path; from memory, where the loads take most
// of the time, 5-10%.
template <int kDim, int kTile, typename scalar_t>
inline void attend_tile16(State& st, int64_t v0, const Span<scalar_t>& span, int64_t kp,
                          int64_t vp, int64_t first, int64_t n, bool masked) {
  using namespace cpu_vec;
  static_assert(kDim % 16 == 0 && kTile <= kMaxTile, "whole vectors, rows of st.scores");
  constexpr int kVecs = kDim / 16;
  int64_t begin[kTile], end[kTile];
  int64_t lo = n, hi = 0;  // the rows some vector of the tile sees
  for (int t = 0; t < kTile; ++t) {
    int64_t visible;
    if (visible_keys(st, v0 + t, first, n, masked, begin[t], visible)) {
      lo = std::min(lo, begin[t]);
      hi = std::max(hi, begin[t] + visible);
    }
    end[t] = begin[t] + visible;
  }
  if (lo >= hi) return;
  float* __restrict__ s = st.scores.data();  // row t: vector t's scores, then its weights
  const int64_t stride = st.score_stride;
  int64_t j;
  for (int64_t b = 0; b < span.num_blocks; ++b) {  // block b: rows [b0, b0 + block_size)
    const int64_t b0 = b * span.block_size;
    const int64_t from = std::max(lo, b0) - b0, to = std::min(hi, b0 + span.block_size) - b0;
    if (from >= to) continue;
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
      tile_scores_dpbf16<kDim, kTile>(st, v0, span.kblocks[b], kp, from, to, b0);
    } else {
      tile_scores<kDim, kTile>(st, v0, span.kblocks[b], kp, from, to, b0);
    }
#else
    tile_scores<kDim, kTile>(st, v0, span.kblocks[b], kp, from, to, b0);
#endif
  }
  if (st.softcap > 0.f) {  // rows [lo, hi) of every vector hold scores, whatever it sees
    const __m512 cap = _mm512_set1_ps(st.softcap), inv = _mm512_set1_ps(1.f / st.softcap);
    for (int t = 0; t < kTile; ++t) {
      float* row = s + t * stride;
      for (j = lo; j < hi; j += 16) {
        const __mmask16 lanes = lanes_between(0, hi - j);
        const __m512 x = _mm512_maskz_loadu_ps(lanes, row + j);
        _mm512_mask_storeu_ps(row + j, lanes, _mm512_mul_ps(cap, tanh16(_mm512_mul_ps(x, inv))));
      }
    }
  }
  float correction[kTile];
  for (int t = 0; t < kTile; ++t) {
    float* row = s + t * stride;
    __m512 max16 = _mm512_set1_ps(-FLT_MAX);
    for (j = lo; j < hi; j += 16) {
      const __mmask16 seen = lanes_between(begin[t] - j, end[t] - j);
      max16 = _mm512_mask_max_ps(max16, seen, max16, _mm512_maskz_loadu_ps(seen, row + j));
    }
    const int64_t i = v0 + t;
    const float new_m = std::max(st.m[i], _mm512_reduce_max_ps(max16));
    // 1 if the maximum stayed (or the vector sees none of these keys); (about) 0 on its first
    // block without a sink, where acc and l are 0 anyway; with a sink, exp(sink - new_m) scales
    // its l = 1 as it would any earlier mass.
    correction[t] = _mm512_cvtss_f32(exp16(_mm512_set1_ps(st.m[i] - new_m)));
    st.m[i] = new_m;
    const __m512 m16 = _mm512_set1_ps(new_m);
    __m512 mass = _mm512_setzero_ps();
    for (j = lo; j < hi; j += 16) {
      const __mmask16 seen = lanes_between(begin[t] - j, end[t] - j);
      const __m512 w = _mm512_maskz_mov_ps(
          seen, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(seen, row + j), m16)));
      _mm512_mask_storeu_ps(row + j, lanes_between(0, hi - j), w);  // 0 where unseen
      mass = _mm512_add_ps(mass, w);
    }
    st.l[i] = st.l[i] * correction[t] + _mm512_reduce_add_ps(mass);
  }
  __m512 acc[kTile][kVecs];
  for (int t = 0; t < kTile; ++t) {
    const __m512 scale_old = _mm512_set1_ps(correction[t]);
    for (int c = 0; c < kVecs; ++c) {
      acc[t][c] = _mm512_mul_ps(_mm512_loadu_ps(&st.acc[(v0 + t) * kDim + 16 * c]), scale_old);
    }
  }
  for (int64_t b = 0; b < span.num_blocks; ++b) {
    const int64_t b0 = b * span.block_size;
    for (j = std::max(lo, b0); j < std::min(hi, b0 + span.block_size); ++j) {
      const scalar_t* row = span.vblocks[b] + (j - b0) * vp;
      __m512 p[kTile];
      for (int t = 0; t < kTile; ++t) p[t] = _mm512_set1_ps(s[t * stride + j]);
      for (int c = 0; c < kVecs; ++c) {
        const __m512 value = load16(row + 16 * c);
        for (int t = 0; t < kTile; ++t) acc[t][c] = _mm512_fmadd_ps(p[t], value, acc[t][c]);
      }
    }
  }
  for (int t = 0; t < kTile; ++t) {
    for (int c = 0; c < kVecs; ++c) _mm512_storeu_ps(&st.acc[(v0 + t) * kDim + 16 * c], acc[t][c]);
  }
}
#endif

// st.qt from st.q: vectors [0, num_vec) of `dim` scaled float32 queries, sixteen to a chunk
// (the lanes path's layout; plain code, so every build has it).
inline void transpose_queries(State& st, int64_t num_vec, int64_t dim) {
  const int64_t chunks = (num_vec + 15) / 16;
  st.qt.assign(chunks * dim * 16, 0.f);
  for (int64_t i = 0; i < num_vec; ++i) {
    float* dst = &st.qt[(i / 16) * dim * 16 + i % 16];
    for (int64_t d = 0; d < dim; ++d) dst[d * 16] = st.q[i * dim + d];
  }
}

// Off with ROLLOUT_ENGINE_CPU_ATTN_LANES=0 (the tiles then take every block), read at every
// call: for A/B runs in one process.
inline bool lanes_enabled() {
  const char* flag = std::getenv("ROLLOUT_ENGINE_CPU_ATTN_LANES");
  return !(flag != nullptr && std::strcmp(flag, "0") == 0);
}

#ifdef ROLLOUT_CPU_VEC16
// The lanes path: a shared prefix block for many query vectors at once. The tiles above put a
// vector's head dims in the lanes, so every score ends in a horizontal sum and every block in a
// per-vector maximum, exp and sum; with the n samples of a prompt over its blocks (GRPO: 8
// samples x 2 query heads per KV head = 16 vectors), the lanes hold sixteen vectors instead:
// a key's scores are kDim FMAs of the transposed queries with the key's dims broadcast, the
// softmax's maximum, exp and sums run across keys lane by lane, and nothing is summed across
// lanes. A chunk pays for all sixteen lanes whatever it fills; below kMinLanes vectors the
// tiles are cheaper (measured: see `benchmarks/README.md`).
constexpr int64_t kMinLanes = 8;

// Scores of kRows keys (rows of `keys`, float32, `stride` apart) for the sixteen lanes of the
// chunk `qt` ([kDim][16]), into rows of `out` (sixteen floats each).
template <int kDim, int kRows>
inline void score_lanes(const float* qt, const float* keys, int64_t stride, float* out) {
  __m512 s[kRows];
  for (int r = 0; r < kRows; ++r) s[r] = _mm512_setzero_ps();
  for (int d0 = 0; d0 < kDim; d0 += 8) {
    __m512 q[8];
    for (int e = 0; e < 8; ++e) q[e] = _mm512_loadu_ps(qt + (d0 + e) * 16);
    for (int r = 0; r < kRows; ++r) {
      const float* k = keys + r * stride + d0;
      for (int e = 0; e < 8; ++e) s[r] = _mm512_fmadd_ps(q[e], _mm512_set1_ps(k[e]), s[r]);
    }
  }
  for (int r = 0; r < kRows; ++r) _mm512_storeu_ps(out + 16 * r, s[r]);
}

// acc of kT vectors (lanes t0..t0+kT-1 of the chunk) += their weights (rows of `w`, sixteen
// floats per key) times the block's n value rows; the old acc scaled by `correction` first.
template <int kDim, int kT, typename scalar_t>
inline void lane_values(float* acc, const float* w, const float* correction, int t0,
                        const scalar_t* values, int64_t vp, int64_t n) {
  using namespace cpu_vec;
  constexpr int kVecs = kDim / 16;
  __m512 a[kT][kVecs];
  for (int t = 0; t < kT; ++t) {
    const __m512 c = _mm512_set1_ps(correction[t0 + t]);
    for (int v = 0; v < kVecs; ++v)
      a[t][v] = _mm512_mul_ps(_mm512_loadu_ps(acc + t * kDim + 16 * v), c);
  }
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* row = values + j * vp;
    __m512 p[kT];
    for (int t = 0; t < kT; ++t) p[t] = _mm512_set1_ps(w[16 * j + t0 + t]);
    for (int v = 0; v < kVecs; ++v) {
      const __m512 value = load16(row + 16 * v);
      for (int t = 0; t < kT; ++t) a[t][v] = _mm512_fmadd_ps(p[t], value, a[t][v]);
    }
  }
  for (int t = 0; t < kT; ++t) {
    for (int v = 0; v < kVecs; ++v) _mm512_storeu_ps(acc + t * kDim + 16 * v, a[t][v]);
  }
}

// Vectors v0..v0+lanes-1 (v0 a multiple of 16, lanes <= 16) attend to all n keys of a block that
// each of them sees whole (a shared prefix block: no causal limit; no window inside it).
template <int kDim, typename scalar_t>
inline void attend_lanes16(State& st, int64_t v0, int64_t lanes, const scalar_t* kblock,
                           const scalar_t* vblock, int64_t kp, int64_t vp, int64_t n) {
  using namespace cpu_vec;
  const float* keys = nullptr;
  int64_t key_stride = kp;
  if constexpr (std::is_same_v<scalar_t, float>) {
    keys = kblock;
  } else {  // widened once here for all sixteen lanes, not once per broadcast
    for (int64_t j = 0; j < n; ++j) {
      for (int v = 0; v < kDim / 16; ++v)
        _mm512_storeu_ps(&st.keys32[j * kDim + 16 * v], load16(kblock + j * kp + 16 * v));
    }
    keys = st.keys32.data();
    key_stride = kDim;
  }
  const float* qt = &st.qt[v0 * kDim];
  float* __restrict__ w = st.lane_scores.data();  // row j: key j's scores, then weights
  int64_t j = 0;
  for (; j + 16 <= n; j += 16)
    score_lanes<kDim, 16>(qt, keys + j * key_stride, key_stride, w + 16 * j);
  for (; j + 4 <= n; j += 4)
    score_lanes<kDim, 4>(qt, keys + j * key_stride, key_stride, w + 16 * j);
  for (; j < n; ++j) score_lanes<kDim, 1>(qt, keys + j * key_stride, key_stride, w + 16 * j);
  if (st.softcap > 0.f) {
    const __m512 cap = _mm512_set1_ps(st.softcap), inv = _mm512_set1_ps(1.f / st.softcap);
    for (j = 0; j < n; ++j) {
      const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(w + 16 * j), inv);
      _mm512_storeu_ps(w + 16 * j, _mm512_mul_ps(cap, tanh16(x)));
    }
  }
  const __mmask16 live = lanes_between(0, lanes);
  const __m512 m_old = _mm512_mask_loadu_ps(_mm512_set1_ps(-FLT_MAX), live, &st.m[v0]);
  __m512 m_new = m_old;
  for (j = 0; j < n; ++j) m_new = _mm512_max_ps(m_new, _mm512_loadu_ps(w + 16 * j));
  // Lane by lane as in the tiles: 1 where the maximum stayed, (about) 0 on a vector's first
  // block without a sink, where acc and l are 0 anyway.
  const __m512 correction = exp16(_mm512_sub_ps(m_old, m_new));
  __m512 mass = _mm512_setzero_ps();
  for (j = 0; j < n; ++j) {
    const __m512 weight = exp16(_mm512_sub_ps(_mm512_loadu_ps(w + 16 * j), m_new));
    _mm512_storeu_ps(w + 16 * j, weight);
    mass = _mm512_add_ps(mass, weight);
  }
  const __m512 l = _mm512_maskz_loadu_ps(live, &st.l[v0]);
  _mm512_mask_storeu_ps(&st.l[v0], live, _mm512_fmadd_ps(l, correction, mass));
  _mm512_mask_storeu_ps(&st.m[v0], live, m_new);
  alignas(64) float corr[16];
  _mm512_store_ps(corr, correction);
  // Four vectors' accumulators at a time at head_dim 64 (16 registers), two at 128.
  constexpr int kT = kDim == 64 ? 4 : 2;
  int t = 0;
  for (; t + kT <= lanes; t += kT)
    lane_values<kDim, kT>(&st.acc[(v0 + t) * kDim], w, corr, t, vblock, vp, n);
  for (; t < lanes; ++t) lane_values<kDim, 1>(&st.acc[(v0 + t) * kDim], w, corr, t, vblock, vp, n);
}
#endif

// The vectorised block where it applies, else the portable one.
template <int kDim, typename scalar_t>
inline void attend_keys(State& st, int64_t v0, int64_t v1, const Span<scalar_t>& span,
                        int64_t kp, int64_t vp, int64_t first, int64_t n, int64_t dim,
                        int64_t value_dim, bool masked) {
#ifdef ROLLOUT_CPU_VEC16
  if constexpr (kUnrolled<kDim, scalar_t>) {
    int64_t i = v0;
    for (; i + kMaxTile <= v1; i += kMaxTile) {
      attend_tile16<kDim, kMaxTile>(st, i, span, kp, vp, first, n, masked);
    }
    for (; i < v1; ++i) attend_tile16<kDim, 1>(st, i, span, kp, vp, first, n, masked);
    return;
  }
#endif
  for (int64_t b = 0; b < span.num_blocks; ++b) {  // the other paths take one block at a time
    const int64_t b0 = b * span.block_size, rows = std::min(span.block_size, n - b0);
    const scalar_t* kblock = span.kblocks[b];
    const scalar_t* vblock = span.vblocks[b];
#ifdef ROLLOUT_CPU_VEC
    if constexpr (kUnrolled<kDim, scalar_t>) {
      attend_block_vec<kDim>(st, v0, v1, kblock, vblock, kp, vp, first + b0, rows, masked);
      continue;
    }
#endif
    attend_block<kDim>(st, v0, v1, kblock, vblock, kp, vp, first + b0, rows, dim, value_dim,
                       masked);
  }
}

// Whether a group's shared blocks take the lanes path: a prefix, enough vectors to fill half a
// chunk, and head dims the vectorised paths unroll.
template <int kDim, typename scalar_t>
inline bool use_lanes(bool enabled, int64_t shared_blocks, int64_t num_vec) {
#ifdef ROLLOUT_CPU_VEC16
  if constexpr (kUnrolled<kDim, scalar_t>) {
    return enabled && shared_blocks > 0 && num_vec >= kMinLanes;
  }
#endif
  return false;
}

template <int kDim, typename scalar_t>
void attend(const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
            const at::Tensor& block_tables, const at::Tensor& seq_lens,
            const at::Tensor& query_start_loc, const at::Tensor& members,
            const at::Tensor& group_starts, const at::Tensor& group_shared, double scale,
            int64_t window, double softcap, const float* sinks, bool lanes_on, at::Tensor& out) {
  const int64_t num_heads = query.size(1), dim = query.size(2), value_dim = value_cache.size(3);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t heads_per_kv = num_heads / num_kv_heads;
  const int64_t num_groups = group_shared.size(0), num_items = num_groups * num_kv_heads;

  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const int64_t q_tok = query.stride(0), q_head = query.stride(1);
  const int64_t o_tok = out.stride(0), o_head = out.stride(1);
  const scalar_t* k_ptr = key_cache.data_ptr<scalar_t>();
  const scalar_t* v_ptr = value_cache.data_ptr<scalar_t>();
  const int64_t kb = key_cache.stride(0), kp = key_cache.stride(1), kh = key_cache.stride(2);
  const int64_t vb = value_cache.stride(0), vp = value_cache.stride(1), vh = value_cache.stride(2);
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int64_t* mem = members.data_ptr<int64_t>();
  const int64_t* gstart = group_starts.data_ptr<int64_t>();
  const int64_t* gshared = group_shared.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  // Consecutive block ids lie one after the other, a head's rows in one strided stream.
  const bool runs_are_streams = kb == block_size * kp && vb == block_size * vp;

  // Items in KV-head-major order: a thread's consecutive items read the same head's blocks.
  at::parallel_for(0, num_items, 1, [&](int64_t begin, int64_t end) {
    State st;
    st.softcap = static_cast<float>(softcap);
    st.scale = fscale;
    std::vector<int64_t> vec_start;  // first vector of each member, plus the end
    std::vector<Visit> visits;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item % num_groups, h = item / num_groups;
      const int64_t* mine = mem + gstart[g];
      const int64_t num_members = gstart[g + 1] - gstart[g];
      vec_start.assign(1, 0);
      for (int64_t k = 0; k < num_members; ++k) {
        const int64_t r = mine[k];
        vec_start.push_back(vec_start.back() + (starts[r + 1] - starts[r]) * heads_per_kv);
      }
      const int64_t num_vec = vec_start.back();
      st.resize(num_vec, dim, value_dim, block_size);
      // Vector i of a member: token t = i / heads_per_kv, head h * heads_per_kv + i % heads_per_kv.
      for (int64_t k = 0; k < num_members; ++k) {
        const int64_t r = mine[k], q_start = starts[r], q_len = starts[r + 1] - starts[r];
        for (int64_t i = vec_start[k]; i < vec_start[k + 1]; ++i) {
          const int64_t t = (i - vec_start[k]) / heads_per_kv;
          const int64_t head = h * heads_per_kv + (i - vec_start[k]) % heads_per_kv;
          const scalar_t* src = q_ptr + (q_start + t) * q_tok + head * q_head;
          for (int64_t d = 0; d < dim; ++d) st.q[i * dim + d] = static_cast<float>(src[d]) * fscale;
          if constexpr (std::is_same_v<scalar_t, at::BFloat16>)
            std::copy(src, src + dim, st.qb.begin() + i * dim);
          st.last_key[i] = lens[r] - q_len + t;
          st.first_key[i] = window > 0 ? std::max<int64_t>(0, st.last_key[i] - window + 1) : 0;
          // A sink is a key seen before all others, of weight exp(sink - m) and value 0.
          st.m[i] = sinks != nullptr ? sinks[head] : -FLT_MAX;
          st.l[i] = sinks != nullptr ? 1.f : 0.f;
        }
      }
      std::fill(st.acc.begin(), st.acc.begin() + num_vec * value_dim, 0.f);
      const bool lanes = use_lanes<kDim, scalar_t>(lanes_on, gshared[g], num_vec);
      if (lanes) transpose_queries(st, num_vec, dim);
      // The blocks in the order they are read: the shared prefix for every member's vectors at
      // once (no causal mask), then each member's own blocks (causal). Blocks that end before
      // the first key of every vector reading them (a sliding window) are skipped.
      visits.clear();
      const int32_t* first_table = tables + mine[0] * table_stride;
      int64_t group_first_key = INT64_MAX;
      for (int64_t i = 0; i < num_vec; ++i) {
        group_first_key = std::min(group_first_key, st.first_key[i]);
      }
      for (int64_t b = group_first_key / block_size; b < gshared[g]; ++b) {
        visits.push_back({first_table[b], 0, num_vec, b * block_size, block_size, false});
      }
      for (int64_t k = 0; k < num_members; ++k) {
        const int64_t r = mine[k], s_len = lens[r];
        const int32_t* table = tables + r * table_stride;
        const int64_t first_own = std::max(gshared[g], st.first_key[vec_start[k]] / block_size);
        for (int64_t b = first_own; b * block_size < s_len; ++b) {
          const int64_t first = b * block_size;
          visits.push_back({table[b], vec_start[k], vec_start[k + 1], first,
                            std::min(block_size, s_len - first), true});
        }
      }
      // The visits in spans (`kSpanKeys`): consecutive blocks of the same vectors, a shared
      // block on the lanes path alone. Before a span is computed, every visit up to
      // kPrefetchAhead past it has been asked for, where it starts a new stream. (Written out
      // here: from a lambda, GCC dropped the prefetches altogether.)
      const int64_t max_span = span_blocks(block_size);
      size_t asked = 0;  // visits [0, asked) have been asked for
      for (size_t n = 0, m; n < visits.size(); n = m) {
        const Visit& v = visits[n];
        m = n + 1;
        const bool alone = lanes && !v.masked;
        while (!alone && m < visits.size() && static_cast<int64_t>(m - n) < max_span &&
               continues_span(visits[m - 1], visits[m], block_size)) {
          ++m;
        }
        for (; asked < std::min(visits.size(), m + kPrefetchAhead); ++asked) {
          if (continues_stream(visits, asked, runs_are_streams)) continue;
          prefetch_rows(k_ptr + visits[asked].block * kb + h * kh, kp, visits[asked].rows, dim);
          prefetch_rows(v_ptr + visits[asked].block * vb + h * vh, vp, visits[asked].rows,
                        value_dim);
        }
        Span<scalar_t> span;
        span.block_size = block_size;
        for (size_t a = n; a < m; ++a, ++span.num_blocks) {
          span.kblocks[span.num_blocks] = k_ptr + visits[a].block * kb + h * kh;
          span.vblocks[span.num_blocks] = v_ptr + visits[a].block * vb + h * vh;
        }
        const int64_t span_rows = visits[m - 1].first + visits[m - 1].rows - v.first;
        int64_t v0 = v.v0;
#ifdef ROLLOUT_CPU_VEC16
        // A shared block (read by vectors 0.., so chunk k of st.qt is vectors 16k..): sixteen
        // vectors at a time on the lanes path while a chunk is full enough and none of its
        // vectors' windows begins inside the block; the rest on the tiles.
        for (; lanes && !v.masked && v0 % 16 == 0 && v0 + kMinLanes <= v.v1; v0 += 16) {
          const int64_t chunk = std::min<int64_t>(16, v.v1 - v0);
          bool whole = true;
          for (int64_t i = v0; i < v0 + chunk; ++i) whole = whole && st.first_key[i] <= v.first;
          if (!whole) break;
          if constexpr (kUnrolled<kDim, scalar_t>) {
            attend_lanes16<kDim>(st, v0, chunk, span.kblocks[0], span.vblocks[0], kp, vp,
                                 v.rows);
          }
        }
        v0 = std::min(v0, v.v1);
#endif
        if (v0 < v.v1) {
          attend_keys<kDim>(st, v0, v.v1, span, kp, vp, v.first, span_rows, dim, value_dim,
                            v.masked);
        }
      }
      for (int64_t k = 0; k < num_members; ++k) {
        const int64_t r = mine[k];
        for (int64_t i = vec_start[k]; i < vec_start[k + 1]; ++i) {
          const int64_t t = (i - vec_start[k]) / heads_per_kv;
          const int64_t head = h * heads_per_kv + (i - vec_start[k]) % heads_per_kv;
          scalar_t* dst = out_ptr + (starts[r] + t) * o_tok + head * o_head;
          const float inv = 1.f / st.l[i];  // l >= 1: the largest weight seen is exp(0)
          for (int64_t d = 0; d < value_dim; ++d) {
            dst[d] = static_cast<scalar_t>(st.acc[i * value_dim + d] * inv);
          }
        }
      }
    }
  });
}

// Every index the kernel will follow, checked before any is read.
void check_inputs(const at::Tensor& query, const at::Tensor& key_cache,
                  const at::Tensor& value_cache, const at::Tensor& block_tables,
                  const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                  const at::Tensor& members, const at::Tensor& group_starts,
                  const at::Tensor& group_shared, int64_t window, double softcap,
                  const std::optional<at::Tensor>& sinks, const at::Tensor& out) {
  TORCH_CHECK(window >= 0, "sliding_window must be >= 0 (0: none)");
  TORCH_CHECK(softcap >= 0 && std::isfinite(softcap), "softcap must be finite and >= 0 (0: none)");
  TORCH_CHECK(query.device().is_cpu(), "paged_attention_short runs on the CPU");
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "query [T, H, D] and caches [num_blocks, block_size, Hkv, D] expected");
  TORCH_CHECK(out.dim() == 3 && out.size(0) == query.size(0) && out.size(1) == query.size(1) &&
                  out.size(2) == value_cache.size(3),
              "out must be [T, H, value_head_dim]");
  if (sinks.has_value() && sinks->defined()) {
    TORCH_CHECK(sinks->device().is_cpu() && sinks->scalar_type() == at::kFloat &&
                    sinks->dim() == 1 && sinks->size(0) == query.size(1) && sinks->is_contiguous(),
                "sinks must be a contiguous float32 [num_heads] CPU tensor");
  }
  TORCH_CHECK(query.stride(2) == 1 && out.stride(2) == 1 && key_cache.stride(3) == 1 &&
                  value_cache.stride(3) == 1,
              "head_dim must be contiguous");
  const auto dtype = query.scalar_type();
  TORCH_CHECK(key_cache.scalar_type() == dtype && value_cache.scalar_type() == dtype &&
                  out.scalar_type() == dtype,
              "query, caches and out must share a dtype");
  TORCH_CHECK(key_cache.sizes().slice(0, 3) == value_cache.sizes().slice(0, 3),
              "key and value caches differ in shape (but for head_dim)");
  TORCH_CHECK(query.size(2) == key_cache.size(3), "head_dim differs between query and cache");
  TORCH_CHECK(query.size(1) % key_cache.size(2) == 0, "num_heads must be a multiple of Hkv");
  for (const at::Tensor* t : {&block_tables, &seq_lens, &query_start_loc}) {
    TORCH_CHECK(t->scalar_type() == at::kInt && t->is_contiguous(),
                "int32 contiguous block_tables, seq_lens and query_start_loc expected");
  }
  for (const at::Tensor* t : {&members, &group_starts, &group_shared}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->dim() == 1,
                "int64 contiguous members, group_starts and group_shared expected");
  }
  const int64_t num_reqs = seq_lens.size(0), block_size = key_cache.size(1);
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == num_reqs &&
                  query_start_loc.size(0) == num_reqs + 1,
              "block_tables [N, max_blocks], seq_lens [N] and query_start_loc [N + 1] expected");
  TORCH_CHECK(group_starts.size(0) == group_shared.size(0) + 1, "group_starts [G + 1] expected");
  const int32_t* starts = query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int64_t* mem = members.data_ptr<int64_t>();
  const int64_t* gstart = group_starts.data_ptr<int64_t>();
  const int64_t* gshared = group_shared.data_ptr<int64_t>();
  TORCH_CHECK(starts[0] == 0 && starts[num_reqs] <= query.size(0), "query_start_loc out of range");
  TORCH_CHECK(gstart[0] == 0 && gstart[group_shared.size(0)] == members.size(0),
              "group_starts must cover members");
  for (int64_t g = 0; g < group_shared.size(0); ++g) {
    TORCH_CHECK(gstart[g + 1] > gstart[g], "a group has no members");
    for (int64_t k = gstart[g]; k < gstart[g + 1]; ++k) {
      const int64_t r = mem[k];
      TORCH_CHECK(r >= 0 && r < num_reqs, "request index out of range");
      const int64_t q_len = starts[r + 1] - starts[r], s_len = lens[r];
      TORCH_CHECK(q_len >= 1 && q_len <= s_len, "a request's query length is not in [1, seq_len]");
      TORCH_CHECK(starts[r] >= 0 && starts[r + 1] <= query.size(0), "query rows out of range");
      const int64_t num_blocks = (s_len + block_size - 1) / block_size;
      TORCH_CHECK(num_blocks <= block_tables.size(1), "a KV length exceeds its block table");
      TORCH_CHECK(gshared[g] >= 0 && gshared[g] * block_size <= s_len - q_len,
                  "a shared prefix must end before the member's first query token");
      const int32_t* table = block_tables.data_ptr<int32_t>() + r * block_tables.stride(0);
      const int32_t* first = block_tables.data_ptr<int32_t>() + mem[gstart[g]] * block_tables.stride(0);
      for (int64_t b = 0; b < num_blocks; ++b) {
        TORCH_CHECK(table[b] >= 0 && table[b] < key_cache.size(0), "block id out of range");
        TORCH_CHECK(b >= gshared[g] || table[b] == first[b], "a shared block differs in a member");
      }
    }
  }
}

void paged_attention_short(const at::Tensor& query, const at::Tensor& key_cache,
                           const at::Tensor& value_cache, const at::Tensor& block_tables,
                           const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                           const at::Tensor& members, const at::Tensor& group_starts,
                           const at::Tensor& group_shared, double scale, int64_t sliding_window,
                           at::Tensor out, double softcap, const std::optional<at::Tensor>& sinks) {
  check_inputs(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, members,
               group_starts, group_shared, sliding_window, softcap, sinks, out);
  const float* sink_ptr =
      sinks.has_value() && sinks->defined() ? sinks->data_ptr<float>() : nullptr;
  // The unrolled paths want keys and values of one width; any other pair runs the portable one.
  const int64_t dim = query.size(2);
  const int64_t unrolled = dim == value_cache.size(3) ? dim : 0;
  const bool lanes_on = lanes_enabled();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_attention_short", [&] {
    const auto run = [&](auto kdim) {
      attend<decltype(kdim)::value, scalar_t>(query, key_cache, value_cache, block_tables,
                                              seq_lens, query_start_loc, members, group_starts,
                                              group_shared, scale, sliding_window, softcap,
                                              sink_ptr, lanes_on, out);
    };
    switch (unrolled) {
      case 64:
        return run(std::integral_constant<int, 64>{});
      case 128:
        return run(std::integral_constant<int, 128>{});
      default:
        return run(std::integral_constant<int, 0>{});
    }
  });
}

}  // namespace

TORCH_LIBRARY(rollout_cpu, m) {
  m.def(
      "paged_attention_short(Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, Tensor members, "
      "Tensor group_starts, Tensor group_shared, float scale, int sliding_window, "
      "Tensor(a!) out, float softcap=0., Tensor? sinks=None) -> ()");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) { m.impl("paged_attention_short", &paged_attention_short); }
