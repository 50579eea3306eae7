// Sixteen-lane float32 vectors for the batch-invariant kernels: one summation order whatever
// the CPU's vector width (AVX-512: one register, AVX2: two, elsewhere sixteen scalars), see
// batch_invariant_cpu.cpp. Loads widen bfloat16 and float16 to float32.

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

namespace batch_invariant {

constexpr int64_t kLanes = 16;

// exp(x) in float32 as a sequence of exactly rounded steps (Cephes' expf: x = n ln2 + r with
// ln2 in two parts, a degree-7 polynomial in r, times 2^n; within 2 ulp), so that every lane of
// every build computes the same bits; 0 below -87.3 (and for -inf). The vector versions below
// are this function, a lane at a time.
namespace exp_constants {
constexpr float kLow = -87.33654f, kHigh = 88.37626f, kLog2e = 1.44269504088896341f;
constexpr float kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kP0 = 1.9875691500e-4f, kP1 = 1.3981999507e-3f, kP2 = 8.3334519073e-3f,
                kP3 = 4.1665795894e-2f, kP4 = 1.6666665459e-1f, kP5 = 5.0000001201e-1f;
}  // namespace exp_constants

inline float exp_lane(float x) {
  using namespace exp_constants;
  const bool underflows = x < kLow;
  const float v = std::min(std::max(x, kLow), kHigh);
  const float n = std::floor(std::fma(v, kLog2e, 0.5f));
  float r = std::fma(n, -kLn2High, v);
  r = std::fma(n, -kLn2Low, r);
  float poly = std::fma(kP0, r, kP1);
  poly = std::fma(poly, r, kP2);
  poly = std::fma(poly, r, kP3);
  poly = std::fma(poly, r, kP4);
  poly = std::fma(poly, r, kP5);
  const float r2 = r * r;
  float y = std::fma(poly, r2, r);
  y = y + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  y = y * scale;
  return underflows ? 0.0f : y;
}

// Sixteen lanes as plain scalars: the portable path (float) and double inputs.
template <typename T>
struct Lanes16 {
  T v[kLanes];
  static Lanes16 zero() { return Lanes16{}; }
  template <typename U>
  static Lanes16 load(const U* p) {
    Lanes16 out;
    for (int64_t i = 0; i < kLanes; ++i) out.v[i] = static_cast<T>(p[i]);
    return out;
  }
  static Lanes16 broadcast(T x) {
    Lanes16 out;
    for (int64_t i = 0; i < kLanes; ++i) out.v[i] = x;
    return out;
  }
  static Lanes16 fma(Lanes16 a, Lanes16 b, Lanes16 c) {
    for (int64_t i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
  }
  static Lanes16 add(Lanes16 a, Lanes16 b) {
    for (int64_t i = 0; i < kLanes; ++i) a.v[i] = a.v[i] + b.v[i];
    return a;
  }
  static Lanes16 mul(Lanes16 a, Lanes16 b) {
    for (int64_t i = 0; i < kLanes; ++i) a.v[i] = a.v[i] * b.v[i];
    return a;
  }
  static Lanes16 sub(Lanes16 a, Lanes16 b) {
    for (int64_t i = 0; i < kLanes; ++i) a.v[i] = a.v[i] - b.v[i];
    return a;
  }
  static Lanes16 div(Lanes16 a, Lanes16 b) {
    for (int64_t i = 0; i < kLanes; ++i) a.v[i] = a.v[i] / b.v[i];
    return a;
  }
  T max() const { return *std::max_element(v, v + kLanes); }  // exact in any order
  void store(T* p) const { std::copy(v, v + kLanes, p); }
  static Lanes16 exp(Lanes16 x) {
    for (int64_t i = 0; i < kLanes; ++i) x.v[i] = exp_lane(x.v[i]);
    return x;
  }
  T tree_sum() const {
    T s[kLanes];
    std::copy(v, v + kLanes, s);
    for (int64_t width = kLanes / 2; width >= 1; width /= 2)
      for (int64_t i = 0; i < width; ++i) s[i] = s[i] + s[i + width];
    return s[0];
  }
};

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// Lanes i + i+4, then i + i+2, then i + i+1 of a sum already halved to eight lanes.
inline float tree_sum8(__m256 s8) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  __m128 s1 = _mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 0x55));
  return _mm_cvtss_f32(s1);
}
#endif

// Sixteen float32 lanes in whatever registers the CPU has.
#if defined(__AVX512F__)
struct Vec16 {
  __m512 v;
  static Vec16 zero() { return {_mm512_setzero_ps()}; }
  static Vec16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec16 load(const at::BFloat16* p) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16))};
  }
  static Vec16 load(const at::Half* p) {
    return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
  }
  static Vec16 broadcast(float x) { return {_mm512_set1_ps(x)}; }
  static Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  static Vec16 add(Vec16 a, Vec16 b) { return {_mm512_add_ps(a.v, b.v)}; }
  static Vec16 mul(Vec16 a, Vec16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
  static Vec16 sub(Vec16 a, Vec16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
  static Vec16 div(Vec16 a, Vec16 b) { return {_mm512_div_ps(a.v, b.v)}; }
  float max() const { return _mm512_reduce_max_ps(v); }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  static Vec16 exp(Vec16 x) {  // exp_lane, sixteen at a time
    using namespace exp_constants;
    const __m512 low = _mm512_set1_ps(kLow);
    const __mmask16 underflows = _mm512_cmp_ps_mask(x.v, low, _CMP_LT_OQ);
    const __m512 v = _mm512_min_ps(_mm512_max_ps(x.v, low), _mm512_set1_ps(kHigh));
    const __m512 n = _mm512_roundscale_ps(
        _mm512_fmadd_ps(v, _mm512_set1_ps(kLog2e), _mm512_set1_ps(0.5f)),
        _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2High), v);
    r = _mm512_fmadd_ps(n, _mm512_set1_ps(-kLn2Low), r);
    __m512 poly = _mm512_fmadd_ps(_mm512_set1_ps(kP0), r, _mm512_set1_ps(kP1));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kP2));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kP3));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kP4));
    poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(kP5));
    __m512 y = _mm512_fmadd_ps(poly, _mm512_mul_ps(r, r), r);
    y = _mm512_add_ps(y, _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(
        _mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
    y = _mm512_mul_ps(y, _mm512_castsi512_ps(bits));
    return {_mm512_maskz_mov_ps(static_cast<__mmask16>(~underflows), y)};
  }
  float tree_sum() const {
    const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return tree_sum8(_mm256_add_ps(_mm512_castps512_ps256(v), high));
  }
};
#elif defined(__AVX2__) && defined(__FMA__)
struct Vec16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
  static Vec16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
  static Vec16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
  static __m256 widen_bf16(const at::BFloat16* p) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  static Vec16 load(const at::BFloat16* p) { return {widen_bf16(p), widen_bf16(p + 8)}; }
  static Vec16 load(const at::Half* p) {
    float wide[kLanes];
    for (int64_t i = 0; i < kLanes; ++i) wide[i] = static_cast<float>(p[i]);
    return load(wide);
  }
  static Vec16 broadcast(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
  static Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
  static Vec16 add(Vec16 a, Vec16 b) {
    return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)};
  }
  static Vec16 mul(Vec16 a, Vec16 b) {
    return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)};
  }
  static Vec16 sub(Vec16 a, Vec16 b) {
    return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)};
  }
  static Vec16 div(Vec16 a, Vec16 b) {
    return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)};
  }
  float max() const {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, _mm256_max_ps(lo, hi));
    return *std::max_element(lanes, lanes + 8);
  }
  void store(float* p) const {
    _mm256_storeu_ps(p, lo);
    _mm256_storeu_ps(p + 8, hi);
  }
  static __m256 exp8(__m256 x) {  // exp_lane, eight at a time
    using namespace exp_constants;
    const __m256 low = _mm256_set1_ps(kLow);
    const __m256 underflows = _mm256_cmp_ps(x, low, _CMP_LT_OQ);
    const __m256 v = _mm256_min_ps(_mm256_max_ps(x, low), _mm256_set1_ps(kHigh));
    const __m256 n =
        _mm256_floor_ps(_mm256_fmadd_ps(v, _mm256_set1_ps(kLog2e), _mm256_set1_ps(0.5f)));
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2High), v);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Low), r);
    __m256 poly = _mm256_fmadd_ps(_mm256_set1_ps(kP0), r, _mm256_set1_ps(kP1));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kP2));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kP3));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kP4));
    poly = _mm256_fmadd_ps(poly, r, _mm256_set1_ps(kP5));
    __m256 y = _mm256_fmadd_ps(poly, _mm256_mul_ps(r, r), r);
    y = _mm256_add_ps(y, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    return _mm256_andnot_ps(underflows, y);
  }
  static Vec16 exp(Vec16 x) { return {exp8(x.lo), exp8(x.hi)}; }
  float tree_sum() const { return tree_sum8(_mm256_add_ps(lo, hi)); }
};
#else
using Vec16 = Lanes16<float>;
#endif

// The same order in double, for double inputs (gradient checks): always the portable loops.
using Vec16d = Lanes16<double>;

template <typename scalar_t>
using VecFor = std::conditional_t<std::is_same_v<scalar_t, double>, Vec16d, Vec16>;
template <typename scalar_t>
using AccFor = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

// A group of 16 elements from p, zeros past `valid` (a last partial group).
template <typename V, typename scalar_t>
inline V load_group(const scalar_t* p, int64_t valid) {
  if (valid >= kLanes) return V::load(p);
  scalar_t padded[kLanes];
  for (int64_t i = 0; i < kLanes; ++i) padded[i] = i < valid ? p[i] : scalar_t(0);
  return V::load(padded);
}

template <typename scalar_t>
inline float dot(const float* q, const scalar_t* k, int64_t dim) {
  Vec16 acc = Vec16::zero();
  for (int64_t d = 0; d < dim; d += kLanes)
    acc = Vec16::fma(load_group<Vec16>(q + d, dim - d), load_group<Vec16>(k + d, dim - d), acc);
  return acc.tree_sum();
}

#if defined(__AVX512F__)
// The levels after the first of dot16's reduction: r1[p] holds keys p | p + 8 with lanes i and
// i + 8 added (p < 8); out[j] = key j's sum.
inline void dot16_finish(const __m512* r1, float* out) {
  __m512 r2[4], r3[2];
  for (int p = 0; p < 4; ++p)  // keys p | p + 8 | p + 4 | p + 12: lanes i + i+4
    r2[p] = _mm512_add_ps(_mm512_shuffle_f32x4(r1[p], r1[p + 4], 0x88),
                          _mm512_shuffle_f32x4(r1[p], r1[p + 4], 0xDD));
  for (int p = 0; p < 2; ++p)  // two keys per 128-bit lane: lanes i + i+2
    r3[p] = _mm512_add_ps(_mm512_shuffle_ps(r2[p], r2[p + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                          _mm512_shuffle_ps(r2[p], r2[p + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 r4 =  // lanes i + i+1: keys 0 2 1 3 8 10 9 11 4 6 5 7 12 14 13 15
      _mm512_add_ps(_mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(2, 0, 2, 0)),
                    _mm512_shuffle_ps(r3[0], r3[1], _MM_SHUFFLE(3, 1, 3, 1)));
  const __m512i kOrder = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  _mm512_storeu_ps(out, _mm512_permutexvar_ps(kOrder, r4));
}

// Keys p and p + 8's first reduction level (lanes i + i+8, two keys per register).
inline __m512 dot16_level1(__m512 key_p, __m512 key_p8) {
  return _mm512_add_ps(_mm512_shuffle_f32x4(key_p, key_p8, 0x44),
                       _mm512_shuffle_f32x4(key_p, key_p8, 0xEE));
}
#endif

// out[j] = dot(q, keys[j], dim) for the sixteen keys of a whole group, bit for bit: with
// AVX-512 and a head dim of whole vectors, the sixteen FMA chains side by side, then
// `tree_sum`'s additions (lanes i + i+8, i + i+4, i + i+2, i + i+1) for all sixteen keys at
// once, each level adding the same lanes it adds for one key, shuffled into fewer registers
// (a key's sum ends at lane kOrder[key], put back in key order at the end).
template <typename scalar_t>
inline void dot16(const float* q, const scalar_t* const* keys, int64_t dim, float* out) {
#if defined(__AVX512F__)
  if (dim % kLanes == 0) {
    __m512 acc[kLanes];
    for (int64_t j = 0; j < kLanes; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += kLanes) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int64_t j = 0; j < kLanes; ++j)
        acc[j] = _mm512_fmadd_ps(qv, Vec16::load(keys[j] + d).v, acc[j]);
    }
    __m512 r1[8];
    for (int p = 0; p < 8; ++p) r1[p] = dot16_level1(acc[p], acc[p + 8]);
    return dot16_finish(r1, out);
  }
#endif
  for (int64_t j = 0; j < kLanes; ++j) out[j] = dot(q, keys[j], dim);
}

// dot16 for two query vectors at once, each key row loaded (and widened) once for both: the
// keys in two halves (p and p + 8 for p < 4, then p >= 4) so that both queries' chains fit in
// the registers; every operation of a key's sum is dot16's.
template <typename scalar_t>
inline void dot16_pair(const float* q0, const float* q1, const scalar_t* const* keys,
                       int64_t dim, float* out0, float* out1) {
#if defined(__AVX512F__)
  if (dim % kLanes == 0) {
    __m512 r1[2][8];
    for (int half = 0; half < 2; ++half) {
      __m512 a[2][8];  // slot s: key 4 half + s (s < 4), key 4 half + s + 4 (s >= 4)
      for (int s = 0; s < 8; ++s) a[0][s] = a[1][s] = _mm512_setzero_ps();
      for (int64_t d = 0; d < dim; d += kLanes) {
        const __m512 x0 = _mm512_loadu_ps(q0 + d), x1 = _mm512_loadu_ps(q1 + d);
        for (int s = 0; s < 8; ++s) {
          const __m512 k = Vec16::load(keys[4 * half + (s < 4 ? s : s + 4)] + d).v;
          a[0][s] = _mm512_fmadd_ps(x0, k, a[0][s]);
          a[1][s] = _mm512_fmadd_ps(x1, k, a[1][s]);
        }
      }
      for (int u = 0; u < 2; ++u)
        for (int s = 0; s < 4; ++s) r1[u][4 * half + s] = dot16_level1(a[u][s], a[u][s + 4]);
    }
    dot16_finish(r1[0], out0);
    return dot16_finish(r1[1], out1);
  }
#endif
  dot16(q0, keys, dim, out0);
  dot16(q1, keys, dim, out1);
}

// Query vectors whose values attention accumulates side by side (`accumulate_values`): with
// AVX-512's 32 registers two queries' accumulators fit beside each other for head dims up to 128.
#if defined(__AVX512F__)
constexpr int kTogether = 2;
#else
constexpr int kTogether = 1;
#endif

// For kQueries query vectors u, each with its weights p[u] and rescale alpha[u]: acc_u[d] =
// acc_u[d] * alpha[u], then acc_u[d] = fma(p[u][j], v_j[d], acc_u[d]) for j < n in order.
// kChunks x 16 values per row (head dims 64 and 128): every accumulator in a register for the
// whole group, each value row loaded once for all the queries (their independent chains keep
// the FMA units busy); per lane the same operations as one query alone.
template <int kQueries, int kChunks, typename scalar_t>
inline void accumulate_whole(const scalar_t* const* values, int64_t n, const float (*p)[kLanes],
                             const float* alpha, float* acc, int64_t acc_stride) {
  Vec16 a[kQueries][kChunks];
  for (int u = 0; u < kQueries; ++u)
    for (int c = 0; c < kChunks; ++c)
      a[u][c] = Vec16::mul(Vec16::load(acc + u * acc_stride + c * kLanes),
                           Vec16::broadcast(alpha[u]));
  for (int64_t j = 0; j < n; ++j) {
    Vec16 weight[kQueries];
    for (int u = 0; u < kQueries; ++u) weight[u] = Vec16::broadcast(p[u][j]);
    for (int c = 0; c < kChunks; ++c) {
      const Vec16 v = Vec16::load(values[j] + c * kLanes);
      for (int u = 0; u < kQueries; ++u) a[u][c] = Vec16::fma(weight[u], v, a[u][c]);
    }
  }
  for (int u = 0; u < kQueries; ++u)
    for (int c = 0; c < kChunks; ++c) a[u][c].store(acc + u * acc_stride + c * kLanes);
}

// The same for `queries` (at most kTogether) vectors whose accumulators follow each other in
// `acc` (value_dim apart), any value_dim: sixteen d at a time, then the rest one at a time.
template <typename scalar_t>
inline void accumulate_values(const scalar_t* const* values, int64_t n,
                              const float (*p)[kLanes], const float* alpha, int64_t queries,
                              int64_t value_dim, float* acc) {
  if (queries == kTogether && value_dim == 4 * kLanes)
    return accumulate_whole<kTogether, 4>(values, n, p, alpha, acc, value_dim);
  if (queries == kTogether && value_dim == 8 * kLanes)
    return accumulate_whole<kTogether, 8>(values, n, p, alpha, acc, value_dim);
  for (int64_t u = 0; u < queries; ++u) {
    float* out = acc + u * value_dim;
    if (value_dim == 4 * kLanes) {
      accumulate_whole<1, 4>(values, n, p + u, alpha + u, out, value_dim);
      continue;
    }
    if (value_dim == 8 * kLanes) {
      accumulate_whole<1, 8>(values, n, p + u, alpha + u, out, value_dim);
      continue;
    }
    int64_t d = 0;
    for (; d + kLanes <= value_dim; d += kLanes) {
      Vec16 a = Vec16::mul(Vec16::load(out + d), Vec16::broadcast(alpha[u]));
      for (int64_t j = 0; j < n; ++j)
        a = Vec16::fma(Vec16::broadcast(p[u][j]), Vec16::load(values[j] + d), a);
      a.store(out + d);
    }
    for (; d < value_dim; ++d) {
      float a = out[d] * alpha[u];
      for (int64_t j = 0; j < n; ++j) a = std::fma(p[u][j], static_cast<float>(values[j][d]), a);
      out[d] = a;
    }
  }
}

}  // namespace batch_invariant
