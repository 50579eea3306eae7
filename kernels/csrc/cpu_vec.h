// Eight-lane float helpers for the CPU attention kernel (AVX2 + FMA), and sixteen-lane ones
// (AVX-512F) beside them, used where the compiler targets them (`-march=native` on a CPU that
// has them); elsewhere the kernel keeps its portable loops. Loads widen bfloat16 and float16 to
// float32; all math is float32.

#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define ROLLOUT_CPU_VEC 1

#include <ATen/ATen.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace cpu_vec {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }

inline __m256 load8(const at::BFloat16* p) {  // bfloat16 is the top half of a float32
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
}

inline __m256 load8(const at::Half* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float wide[8];
  for (int i = 0; i < 8; ++i) wide[i] = static_cast<float>(p[i]);
  return _mm256_load_ps(wide);
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

// All bits set in lanes 0..n-1, clear in the others (for n >= 8, all set).
inline __m256 lanes_below(int64_t n) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i limit = _mm256_set1_epi32(static_cast<int>(std::min<int64_t>(n, 8)));
  return _mm256_castsi256_ps(_mm256_cmpgt_epi32(limit, lane));
}

// The lane sums of four vectors: {hsum(a), hsum(b), hsum(c), hsum(d)}.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  // hadd(hadd(a, b), hadd(c, d)) holds each vector's sum of lanes 0-3 in the low half and of
  // lanes 4-7 in the high half, in the order a, b, c, d.
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// exp(x), relative error below 2e-7 (Cephes' polynomial on [-ln2/2, ln2/2], then 2^n by the
// exponent bits). Inputs are clamped to [-87.3, 88]: exp of anything smaller is the smallest
// normal float (about 1.2e-38) instead of 0, which no softmax here can tell apart.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3365f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  // r = x - n ln2, with ln2 split in two so that n * ln2_hi is exact.
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 r2 = _mm256_mul_ps(r, r);
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, r2, r), _mm256_set1_ps(1.f));
  const __m256i pow2n = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(pow2n));
}

// tanh(x) (for the logit softcap), within about two ulp of float32's: below |x| = 0.625,
// x + x^3 P(x^2) with P a least-squares fit (relative error under 5e-9 before rounding); above
// it, 1 - 2 / (exp(2|x|) + 1), which cancels nothing there (the result is at least 0.55) and is
// 1 for large |x| (exp8's clamp keeps it finite); then x's sign.
inline __m256 tanh8(__m256 x) {
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  const __m256 a = _mm256_andnot_ps(sign_bit, x);
  const __m256 u = _mm256_mul_ps(a, a);
  __m256 p = _mm256_set1_ps(-5.691985663248322e-3f);
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(2.0626291823316753e-2f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(-5.373531884945931e-2f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(1.3331381354360305e-1f));
  p = _mm256_fmadd_ps(p, u, _mm256_set1_ps(-3.3333279208370575e-1f));
  const __m256 near_zero = _mm256_fmadd_ps(_mm256_mul_ps(a, u), p, a);
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 far = _mm256_sub_ps(
      one, _mm256_div_ps(_mm256_set1_ps(2.f), _mm256_add_ps(exp8(_mm256_add_ps(a, a)), one)));
  const __m256 small = _mm256_cmp_ps(a, _mm256_set1_ps(0.625f), _CMP_LT_OQ);
  return _mm256_or_ps(_mm256_blendv_ps(far, near_zero, small), _mm256_and_ps(x, sign_bit));
}

#if defined(__AVX512F__)
#define ROLLOUT_CPU_VEC16 1

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The two eight-lane halves of v added: the same lane sums in half the width.
inline __m256 fold8(__m512 v) {
  const __m256 high = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return _mm256_add_ps(_mm512_castps512_ps256(v), high);
}

// Lanes begin..end-1 (clipped to 0..15) set.
inline __mmask16 lanes_between(int64_t begin, int64_t end) {
  const auto below = [](int64_t n) -> uint32_t {
    return n <= 0 ? 0u : n >= 16 ? 0xFFFFu : (1u << n) - 1u;
  };
  return static_cast<__mmask16>(below(end) & ~below(begin));
}

// exp8 sixteen lanes wide: the same clamp, polynomial and rounding, so the same results.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3365f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 r2 = _mm512_mul_ps(r, r);
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(p, r2, r), _mm512_set1_ps(1.f));
  const __m512i pow2n = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(y, _mm512_castsi512_ps(pow2n));
}

// tanh8 sixteen lanes wide: the same steps, so the same results (AVX-512F only: the bitwise
// float ops are AVX-512DQ, so the sign goes back through the integer ones).
inline __m512 tanh16(__m512 x) {
  const __m512 a = _mm512_abs_ps(x);
  const __m512 u = _mm512_mul_ps(a, a);
  __m512 p = _mm512_set1_ps(-5.691985663248322e-3f);
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(2.0626291823316753e-2f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(-5.373531884945931e-2f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(1.3331381354360305e-1f));
  p = _mm512_fmadd_ps(p, u, _mm512_set1_ps(-3.3333279208370575e-1f));
  const __m512 near_zero = _mm512_fmadd_ps(_mm512_mul_ps(a, u), p, a);
  const __m512 one = _mm512_set1_ps(1.f);
  const __m512 far = _mm512_sub_ps(
      one, _mm512_div_ps(_mm512_set1_ps(2.f), _mm512_add_ps(exp16(_mm512_add_ps(a, a)), one)));
  const __mmask16 small = _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.625f), _CMP_LT_OQ);
  const __m512i magnitude = _mm512_castps_si512(_mm512_mask_blend_ps(small, far, near_zero));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(INT32_MIN));
  return _mm512_castsi512_ps(_mm512_or_si512(magnitude, sign));
}

#endif  // __AVX512F__

}  // namespace cpu_vec

#endif
