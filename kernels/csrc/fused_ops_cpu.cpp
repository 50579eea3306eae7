// The decoder's elementwise work between the GEMMs, one pass over each row instead of a chain
// of torch ops: RMSNorm (with the residual add before it), rotary embedding of q and k in place,
// SiLU(gate) * up, and the write of a step's keys and values into the paged caches.
//
// At the engine's decode batches (a few hundred rows of a few hundred to a few thousand
// features) each torch op is a pass over memory plus a parallel region of its own, and the
// decoder runs some thirty of them per layer: in bfloat16 they took a sixth of a GRPO step on a
// 2-core AVX-512 machine. Here each op reads its inputs once and writes its outputs once, rows
// split across threads. The sixteen-lane paths need AVX-512; elsewhere (and for a row's tail)
// the same math runs in plain loops.
//
// Every result is rounded where Hugging Face's modeling code rounds it (the model dtype after
// each torch op), so a bfloat16 model gets the bits its torch ops would give but for the order
// of the one sum of squares (RMSNorm) and the last bit of exp (SiLU):
// - rms_norm: y = w * dtype(x * rsqrt(mean(x^2) + eps)), the mean in float32;
// - add_rms_norm: residual = dtype(x + residual), then x = rms_norm(residual), in place;
// - rotary: q = dtype(dtype(q * cos) + dtype(rotate_half(q) * sin)), cos and sin rounded to the
//   dtype first (the table holds float32), the same for k, in place;
// - silu_and_mul: out = dtype(dtype(silu(gate)) * up), gate and up the halves of one row.
//
// With `invariant` (batch invariance, `rollout_engine/batch_invariant.py`) the sum of squares
// and exp follow one order of their own, the one that mode also gives torch's `mean` over the
// last dimension and `F.silu` (`invariant_mean`, `invariant_silu` here): the fused ops then
// equal Hugging Face's unfused torch ops in that mode bit for bit, in every build (the sixteen
// lanes of batch_invariant_vec.h):
// - a row's sum: element i into lane i mod 16, in order, then the lanes' fixed tree; its mean
//   sum / n; RMSNorm's inverse 1 / sqrt(mean + eps), every step rounded (torch's rsqrt);
// - silu(x) = x / (1 + exp(-x)), exp being batch_invariant::exp_lane (exp(-x) of x below -88.4
//   is its clamp's, so silu there is about x / 2.4e38 where the true value is nearer 0).

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "batch_invariant_vec.h"
#include "cpu_vec.h"

// A product and a sum stay two roundings, as torch's ops do them: no fused multiply-add
// contracted from them (GCC contracts by default, vector types included).
#pragma GCC optimize("fp-contract=off")

namespace {

// The value a float32 result has once stored in scalar_t (the rounding a torch op in that
// dtype applies to its output).
template <typename scalar_t>
inline float rounded(float v) {
  return static_cast<float>(static_cast<scalar_t>(v));
}

#if defined(ROLLOUT_CPU_VEC16)
// Sixteen lanes of float32 through the model dtype: `round16` gives the value a store and a
// reload would (round to nearest even, NaN kept quiet, as c10's conversion does), `store16`
// stores it.
template <typename scalar_t>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<scalar_t, at::BFloat16>) {
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
    const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
    __m512i out = _mm512_and_si512(_mm512_add_epi32(bits, bias), _mm512_set1_epi32(0xFFFF0000));
    const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    out = _mm512_mask_mov_epi32(out, nan, _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(out);
  } else if constexpr (std::is_same_v<scalar_t, at::Half>) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  } else {
    return v;
  }
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {  // v already rounded: its top halves
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

template <typename scalar_t>
constexpr bool kVec16 = !std::is_same_v<scalar_t, double>;
#endif

// Rows per task: enough work per task to outweigh handing it out.
inline int64_t grain_rows(int64_t row_elements) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(row_elements, 1));
}

namespace bi = batch_invariant;

// The batch-invariant ops run float32, bfloat16 and float16 (the math is float32).
template <typename scalar_t>
constexpr bool kInvariantDtype = !std::is_same_v<scalar_t, double>;

// Sixteen lanes as scalar_t holds them (each lane rounded as a torch op's output is).
template <typename scalar_t>
inline bi::Vec16 to_dtype(bi::Vec16 v) {
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) return {round16<scalar_t>(v.v)};
#endif
  float lanes[bi::kLanes];
  v.store(lanes);
  for (float& lane : lanes) lane = rounded<scalar_t>(lane);
  return bi::Vec16::load(lanes);
}

// The first `valid` lanes of v (already rounded by to_dtype) stored to p.
template <typename scalar_t>
inline void store_group(scalar_t* p, bi::Vec16 v, int64_t valid) {
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    if (valid >= bi::kLanes) return store16(p, v.v);
  }
#endif
  float lanes[bi::kLanes];
  v.store(lanes);
  for (int64_t i = 0; i < std::min(valid, bi::kLanes); ++i) p[i] = static_cast<scalar_t>(lanes[i]);
}

// The batch-invariant sum of a row's elements (or of their squares, each rounded to float32):
// a last partial group padded with zeros, which leave every lane's sum as it is. (Never called
// for double: check_invariant_dtype refuses it first.)
template <typename scalar_t, bool kSquares>
inline float invariant_sum(const scalar_t* x, int64_t n) {
  if constexpr (kInvariantDtype<scalar_t>) {
    bi::Vec16 acc = bi::Vec16::zero();
    for (int64_t i = 0; i < n; i += bi::kLanes) {
      const bi::Vec16 v = bi::load_group<bi::Vec16>(x + i, n - i);
      acc = bi::Vec16::add(acc, kSquares ? bi::Vec16::mul(v, v) : v);
    }
    return acc.tree_sum();
  }
  return std::nanf("");
}

// 1 / sqrt(mean(x^2) + eps) of a row, the mean in float32.
template <typename scalar_t>
inline float inverse_rms(const scalar_t* x, int64_t n, float eps, bool invariant) {
  if (invariant) {
    const float mean = invariant_sum<scalar_t, true>(x, n) / static_cast<float>(n);
    return 1.f / std::sqrt(mean + eps);
  }
  float sum = 0.f;
  int64_t i = 0;
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) {
      const __m512 v = cpu_vec::load16(x + i);
      acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
    }
    sum = _mm512_reduce_add_ps(acc);
  }
#endif
#pragma omp simd reduction(+ : sum)
  for (int64_t j = i; j < n; ++j) {
    const float v = static_cast<float>(x[j]);
    sum += v * v;
  }
  return 1.f / std::sqrt(sum * (1.f / static_cast<float>(n)) + eps);
}

template <typename scalar_t>
inline void norm_row(const scalar_t* x, const scalar_t* w, scalar_t* out, int64_t n, float eps,
                     bool invariant) {
  const float inv = inverse_rms(x, n, eps, invariant);
  int64_t i = 0;
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    const __m512 scale = _mm512_set1_ps(inv);
    for (; i + 16 <= n; i += 16) {
      const __m512 normed = round16<scalar_t>(_mm512_mul_ps(cpu_vec::load16(x + i), scale));
      store16(out + i, round16<scalar_t>(_mm512_mul_ps(cpu_vec::load16(w + i), normed)));
    }
  }
#endif
  for (; i < n; ++i) {
    const float normed = rounded<scalar_t>(static_cast<float>(x[i]) * inv);
    out[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * normed);
  }
}

template <typename scalar_t>
inline void add_norm_row(scalar_t* x, scalar_t* residual, const scalar_t* w, int64_t n,
                         float eps, bool invariant) {
  int64_t i = 0;
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    for (; i + 16 <= n; i += 16) {
      const __m512 sum = _mm512_add_ps(cpu_vec::load16(x + i), cpu_vec::load16(residual + i));
      store16(residual + i, round16<scalar_t>(sum));
    }
  }
#endif
  for (; i < n; ++i)
    residual[i] = static_cast<scalar_t>(static_cast<float>(x[i]) + static_cast<float>(residual[i]));
  norm_row(residual, w, x, n, eps, invariant);
}

void check_rows(const at::Tensor& x, const at::Tensor& weight, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), name, ": CPU tensors expected");
  TORCH_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, ": rows with a unit stride expected");
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == x.size(-1),
              name, ": weight [features] expected");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), name, ": weight and input dtypes differ");
}

void check_invariant_dtype(const at::Tensor& x, bool invariant, const char* name) {
  TORCH_CHECK(!invariant || x.scalar_type() != at::kDouble, name,
              ": the batch-invariant op runs float32, bfloat16 and float16");
}

// x [..., n] (rows with a unit stride) -> a new contiguous tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool invariant) {
  check_rows(x, weight, "rms_norm");
  check_invariant_dtype(x, invariant, "rms_norm");
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t n = rows.size(1), in_stride = rows.stride(0);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    const scalar_t* in = rows.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        norm_row(in + r * in_stride, w, o + r * n, n, static_cast<float>(eps), invariant);
    });
  });
  return out;
}

// residual = x + residual, then x = rms_norm(residual): both [T, n], contiguous, in place.
void add_rms_norm(at::Tensor x, at::Tensor residual, const at::Tensor& weight, double eps,
                  bool invariant) {
  check_rows(x, weight, "add_rms_norm");
  check_invariant_dtype(x, invariant, "add_rms_norm");
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && x.sizes() == residual.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: contiguous x and residual of one shape and dtype expected");
  const int64_t n = x.size(-1), num_rows = x.numel() / std::max<int64_t>(n, 1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    scalar_t* xs = x.data_ptr<scalar_t>();
    scalar_t* res = residual.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        add_norm_row(xs + r * n, res + r * n, w, n, static_cast<float>(eps), invariant);
    });
  });
}

// One head vector of `dim` values rotated in place by the rotate-half form; cos and sin as
// the model dtype holds them.
template <typename scalar_t>
inline void rotate_head(scalar_t* v, const float* cos, const float* sin, int64_t half) {
  int64_t i = 0;
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    for (; i + 16 <= half; i += 16) {
      const __m512 a = cpu_vec::load16(v + i), b = cpu_vec::load16(v + i + half);
      const __m512 neg_b = _mm512_sub_ps(_mm512_setzero_ps(), b);
      const __m512 lo = _mm512_add_ps(
          round16<scalar_t>(_mm512_mul_ps(a, _mm512_loadu_ps(cos + i))),
          round16<scalar_t>(_mm512_mul_ps(neg_b, _mm512_loadu_ps(sin + i))));
      const __m512 hi = _mm512_add_ps(
          round16<scalar_t>(_mm512_mul_ps(b, _mm512_loadu_ps(cos + i + half))),
          round16<scalar_t>(_mm512_mul_ps(a, _mm512_loadu_ps(sin + i + half))));
      store16(v + i, round16<scalar_t>(lo));
      store16(v + i + half, round16<scalar_t>(hi));
    }
  }
#endif
  for (; i < half; ++i) {
    const float a = static_cast<float>(v[i]), b = static_cast<float>(v[i + half]);
    // first half: a * cos - b * sin; second: b * cos + a * sin (rotate_half is [-b, a])
    const float lo = rounded<scalar_t>(a * cos[i]) + rounded<scalar_t>(-b * sin[i]);
    const float hi = rounded<scalar_t>(b * cos[i + half]) + rounded<scalar_t>(a * sin[i + half]);
    v[i] = static_cast<scalar_t>(lo);
    v[i + half] = static_cast<scalar_t>(hi);
  }
}

// q [T, Hq, D], k [T, Hk, D] (any strides but a unit one on D) rotated in place by the rows of
// cos_sin ([2, P, D] float32) at `positions` ([T] int64).
void rotary(at::Tensor q, at::Tensor k, const at::Tensor& cos_sin, const at::Tensor& positions) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "rotary: q [T, Hq, D] and k [T, Hk, D] expected");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && q.scalar_type() == k.scalar_type(),
              "rotary: q and k of one dtype with a unit stride on D expected");
  TORCH_CHECK(q.size(2) % 2 == 0, "rotary: head_dim must be even");
  TORCH_CHECK(cos_sin.scalar_type() == at::kFloat && cos_sin.is_contiguous() &&
                  cos_sin.dim() == 3 && cos_sin.size(0) == 2 && cos_sin.size(2) == q.size(2),
              "rotary: a contiguous float32 cos_sin [2, P, D] expected");
  TORCH_CHECK(positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                  positions.numel() == q.size(0),
              "rotary: int64 positions [T] expected");
  const int64_t num_tokens = q.size(0), dim = q.size(2), half = dim / 2;
  const int64_t max_pos = cos_sin.size(1);
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(pos[t] >= 0 && pos[t] < max_pos, "rotary: position ", pos[t], " out of range");
  const float* table = cos_sin.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rotary", [&] {
    at::parallel_for(0, num_tokens, grain_rows(dim * (q.size(1) + k.size(1))),
                     [&](int64_t begin, int64_t end) {
      std::vector<float> cos(dim), sin(dim);
      for (int64_t t = begin; t < end; ++t) {
        const float* c = table + pos[t] * dim;
        const float* s = table + (max_pos + pos[t]) * dim;
        for (int64_t i = 0; i < dim; ++i) {  // the tables as the model dtype holds them
          cos[i] = rounded<scalar_t>(c[i]);
          sin[i] = rounded<scalar_t>(s[i]);
        }
        for (const at::Tensor* x : {&q, &k}) {
          scalar_t* row = x->data_ptr<scalar_t>() + t * x->stride(0);
          for (int64_t h = 0; h < x->size(1); ++h)
            rotate_head(row + h * x->stride(1), cos.data(), sin.data(), half);
        }
      }
    });
  });
}

// The vector body takes exp from cpu_vec's polynomial, the tail (and CPUs without AVX-512) from
// libm: both within an ulp or two of torch's.
inline float silu(float v) { return v / (1.f + std::exp(-v)); }

template <typename scalar_t>
inline void silu_mul_row(const scalar_t* gate, const scalar_t* up, scalar_t* y, int64_t width) {
  int64_t i = 0;
#if defined(ROLLOUT_CPU_VEC16)
  if constexpr (kVec16<scalar_t>) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= width; i += 16) {
      const __m512 g = cpu_vec::load16(gate + i);
      const __m512 e = cpu_vec::exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
      const __m512 act = round16<scalar_t>(_mm512_div_ps(g, _mm512_add_ps(one, e)));
      store16(y + i, round16<scalar_t>(_mm512_mul_ps(act, cpu_vec::load16(up + i))));
    }
  }
#endif
  for (; i < width; ++i) {
    const float act = rounded<scalar_t>(silu(static_cast<float>(gate[i])));
    y[i] = static_cast<scalar_t>(act * static_cast<float>(up[i]));
  }
}

// The batch-invariant silu of `width` values of gate, times up's (unless up is null), into y
// (never called for double, as invariant_sum).
template <typename scalar_t>
inline void invariant_silu_row(const scalar_t* gate, const scalar_t* up, scalar_t* y,
                               int64_t width) {
  if constexpr (kInvariantDtype<scalar_t>) {
    using V = bi::Vec16;
    const V one = V::broadcast(1.f);
    for (int64_t i = 0; i < width; i += bi::kLanes) {
      const V g = bi::load_group<V>(gate + i, width - i);
      V out = to_dtype<scalar_t>(V::div(g, V::add(one, V::exp(V::sub(V::zero(), g)))));
      if (up != nullptr)
        out = to_dtype<scalar_t>(V::mul(out, bi::load_group<V>(up + i, width - i)));
      store_group(y + i, out, width - i);
    }
  }
}

// gate_up [..., 2 I] (gate | up, rows with a unit stride) -> silu(gate) * up [..., I].
at::Tensor silu_and_mul(const at::Tensor& gate_up, bool invariant) {
  TORCH_CHECK(gate_up.device().is_cpu() && gate_up.dim() >= 1 && gate_up.stride(-1) == 1 &&
                  gate_up.size(-1) % 2 == 0,
              "silu_and_mul: CPU rows [..., 2 I] with a unit stride expected");
  check_invariant_dtype(gate_up, invariant, "silu_and_mul");
  const at::Tensor rows = gate_up.reshape({-1, gate_up.size(-1)});
  const int64_t width = rows.size(1) / 2, in_stride = rows.stride(0);
  std::vector<int64_t> shape(gate_up.sizes().begin(), gate_up.sizes().end());
  shape.back() = width;
  at::Tensor out = at::empty(shape, gate_up.options());
  const auto dtype = gate_up.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, dtype, "silu_and_mul", [&] {
    const scalar_t* in = rows.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows.size(0), grain_rows(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = in + r * in_stride;
        if (invariant)
          invariant_silu_row(gate, gate + width, o + r * width, width);
        else
          silu_mul_row(gate, gate + width, o + r * width, width);
      }
    });
  });
  return out;
}

// The batch-invariant ops that the mode gives torch's functions (the trainer's side of the
// fused ops above): the mean of each row of x [..., n] (rows with a unit stride) -> [...], and
// silu of each element -> a new contiguous tensor of x's shape.
at::Tensor invariant_mean(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() >= 1 && x.stride(-1) == 1,
              "invariant_mean: CPU rows [..., n] with a unit stride expected");
  check_invariant_dtype(x, true, "invariant_mean");
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const int64_t n = rows.size(1), in_stride = rows.stride(0);
  at::Tensor out = at::empty(x.sizes().slice(0, x.dim() - 1), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "invariant_mean", [&] {
    const scalar_t* in = rows.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        o[r] = static_cast<scalar_t>(invariant_sum<scalar_t, false>(in + r * in_stride, n) /
                                     static_cast<float>(n));
    });
  });
  return out;
}

at::Tensor invariant_silu(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "invariant_silu: a CPU tensor expected");
  check_invariant_dtype(x, true, "invariant_silu");
  const at::Tensor in = x.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  const int64_t numel = in.numel(), chunk = 1024;  // tasks of whole groups of 16
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "invariant_silu", [&] {
    const scalar_t* src = in.data_ptr<scalar_t>();
    scalar_t* dst = out.data_ptr<scalar_t>();
    at::parallel_for(0, (numel + chunk - 1) / chunk, 16, [&](int64_t begin, int64_t end) {
      for (int64_t c = begin; c < end; ++c) {
        const int64_t start = c * chunk;
        invariant_silu_row<scalar_t>(src + start, nullptr, dst + start,
                                     std::min(chunk, numel - start));
      }
    });
  });
  return out;
}

// key [T, Hkv, Dk] and value [T, Hkv, Dv] (unit strides on the last dim) into their slots of
// the caches ([num_blocks, block_size, Hkv, D], any strides but a unit one on D: heads-major
// and block-major storage both), slot_mapping [T] int64. One copy per (token, head) row, where
// torch's index_copy_ on the heads-major view walks its generic strided loop.
void store_kv(const at::Tensor& key, const at::Tensor& value, at::Tensor key_cache,
              at::Tensor value_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(key.dim() == 3 && value.dim() == 3 && key_cache.dim() == 4 && value_cache.dim() == 4,
              "store_kv: key/value [T, Hkv, D], caches [num_blocks, block_size, Hkv, D] expected");
  TORCH_CHECK(key.scalar_type() == key_cache.scalar_type() &&
                  value.scalar_type() == value_cache.scalar_type() &&
                  key.scalar_type() == value.scalar_type(),
              "store_kv: one dtype expected");
  TORCH_CHECK(key.size(0) == value.size(0) && key.size(1) == key_cache.size(2) &&
                  value.size(1) == value_cache.size(2) && key.size(2) == key_cache.size(3) &&
                  value.size(2) == value_cache.size(3) &&
                  key_cache.sizes().slice(0, 3) == value_cache.sizes().slice(0, 3),
              "store_kv: shapes of key, value and caches disagree");
  const at::Tensor* tensors[] = {&key, &value, &key_cache, &value_cache};
  for (const at::Tensor* t : tensors)
    TORCH_CHECK(t->stride(-1) == 1, "store_kv: a unit stride on the last dim expected");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "store_kv: int64 slot_mapping [T] expected");
  const int64_t num_tokens = key.size(0), block_size = key_cache.size(1);
  const int64_t num_slots = key_cache.size(0) * block_size;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "store_kv: slot ", slots[t],
                " out of range");
  const int64_t element = key.element_size();
  const auto copy_rows = [&](const at::Tensor& src, at::Tensor& cache, int64_t t) {
    const int64_t block = slots[t] / block_size, offset = slots[t] % block_size;
    const char* from = static_cast<const char*>(src.data_ptr()) + t * src.stride(0) * element;
    char* to = static_cast<char*>(cache.data_ptr()) +
               (block * cache.stride(0) + offset * cache.stride(1)) * element;
    const int64_t row_bytes = src.size(2) * element;
    for (int64_t h = 0; h < src.size(1); ++h)
      std::memcpy(to + h * cache.stride(2) * element, from + h * src.stride(1) * element,
                  row_bytes);
  };
  at::parallel_for(0, num_tokens, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      copy_rows(key, key_cache, t);
      copy_rows(value, value_cache, t);
    }
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(rollout_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps, bool invariant=False) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) x, Tensor(b!) residual, Tensor weight, float eps, "
        "bool invariant=False) -> ()");
  m.def("rotary(Tensor(a!) q, Tensor(b!) k, Tensor cos_sin, Tensor positions) -> ()");
  m.def("silu_and_mul(Tensor gate_up, bool invariant=False) -> Tensor");
  m.def("invariant_mean(Tensor x) -> Tensor");
  m.def("invariant_silu(Tensor x) -> Tensor");
  m.def("store_kv(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
        "Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(rollout_cpu, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rotary", &rotary);
  m.impl("silu_and_mul", &silu_and_mul);
  m.impl("invariant_mean", &invariant_mean);
  m.impl("invariant_silu", &invariant_silu);
  m.impl("store_kv", &store_kv);
}
