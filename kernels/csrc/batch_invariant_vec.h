// Sixteen-lane float32 vectors for the batch-invariant kernels: one summation order whatever
// the CPU's vector width (AVX-512: one register, AVX2: two, elsewhere sixteen scalars), see
// batch_invariant_cpu.cpp. Loads widen bfloat16 and float16 to float32.

#pragma once

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace batch_invariant {

constexpr int64_t kLanes = 16;

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
  static Lanes16 fma(Lanes16 a, Lanes16 b, Lanes16 c) {
    for (int64_t i = 0; i < kLanes; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
    return c;
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
  static Vec16 fma(Vec16 a, Vec16 b, Vec16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
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
  static Vec16 fma(Vec16 a, Vec16 b, Vec16 c) {
    return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
  }
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

}  // namespace batch_invariant
