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

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kRows = 4;      // outputs computed together: kRows x kCols
constexpr int64_t kCols = 4;
constexpr int64_t kChunk = 64;    // columns per parallel work item

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
