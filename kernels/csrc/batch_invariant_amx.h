// bfloat16 linear layers on Intel AMX tiles, each output in one fixed order whatever the batch.
//
// Where the CPU has AMX-BF16 (and the kernel grants this process the tile state), bfloat16
// weights are packed for the tiles and every output is
//
//   acc = 0;  for each block of 32 k in increasing order:  acc = tdpbf16ps(acc, x[m, block],
//   w[n, block]);  out[m, n] = bf16(acc + bias[n])
//
// tdpbf16ps being the tile unit's own sum of 32 exact bfloat16 products into a float32
// accumulator (its rounding is the hardware's: fixed per element, but not the FMA chain of the
// portable path, so bfloat16 bits differ between CPUs with and without AMX; the engine and a
// trainer on one machine agree). Every row of x goes through a full 16-row tile (rows past M
// and k past K are zeros), so a row's result does not depend on M, on its place in the tile or
// on the thread: the tile unit computes each row of C from that row of A alone.
//
// Layouts: x is copied to [ceil(M / 32) * 32, Kp] (Kp = K rounded up to 32, zeros around);
// the weight is packed as [ceil(N / 16), Kp / 2, 16, 2]: per panel of 16 columns, rows of k
// pairs (the tile unit's VNNI layout).
//
// ROLLOUT_ENGINE_BI_AMX=0 turns the path off (the portable order then runs for bfloat16 too).

#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "batch_invariant_dpbf16.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define BATCH_INVARIANT_AMX 1
#endif

namespace batch_invariant::amx {

constexpr int64_t kTileRows = 16;  // rows of x (and of C) per tile
constexpr int64_t kTileK = 32;     // bfloat16 elements of k per tile step
constexpr int64_t kCols = 16;      // output columns per panel (float32 columns of C)

inline int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

#ifdef BATCH_INVARIANT_AMX
// AMX-TILE and AMX-BF16 in CPUID leaf 7, and the tile state granted by the kernel.
inline bool cpu_grants_tiles() {
  unsigned eax, ebx, ecx, edx;
  if (!__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx)) return false;
  const bool amx_bf16 = edx & (1u << 22), amx_tile = edx & (1u << 24);
  constexpr long kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XTILEDATA
  return amx_bf16 && amx_tile && syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
}

inline bool available() {
  static const bool ok = [] {
    const char* flag = std::getenv("ROLLOUT_ENGINE_BI_AMX");
    return !(flag != nullptr && std::strcmp(flag, "0") == 0) && cpu_grants_tiles();
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// All eight tiles 16 rows x 64 bytes: C in tmm0-3, A in tmm4-5, B in tmm6-7.
inline void configure_tiles() {
  TileConfig config{};
  config.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = kTileRows;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}

// C tiles for RT row tiles x PT panels: tile numbers must be constants, hence the cases.
template <int RT, int PT>
inline void tile_block(const at::BFloat16* x, int64_t Kp, const at::BFloat16* panel0,
                       const at::BFloat16* panel1, float (*c)[kTileRows][kCols]) {
  _tile_zero(0);
  if constexpr (PT == 2) _tile_zero(1);
  if constexpr (RT == 2) _tile_zero(2);
  if constexpr (RT == 2 && PT == 2) _tile_zero(3);
  const int64_t x_stride = Kp * 2, b_stride = kCols * 2 * 2;
  const int64_t x_tile = kTileRows * Kp;
  for (int64_t k = 0; k < Kp; k += kTileK) {
    const int64_t pair_row = k / 2 * kCols * 2;  // kTileK / 2 rows of pairs per step
    _tile_loadd(4, x + k, x_stride);
    if constexpr (RT == 2) _tile_loadd(5, x + x_tile + k, x_stride);
    _tile_loadd(6, panel0 + pair_row, b_stride);
    if constexpr (PT == 2) _tile_loadd(7, panel1 + pair_row, b_stride);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (PT == 2) _tile_dpbf16ps(1, 4, 7);
    if constexpr (RT == 2) _tile_dpbf16ps(2, 5, 6);
    if constexpr (RT == 2 && PT == 2) _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c[0], kCols * 4);
  if constexpr (PT == 2) _tile_stored(1, c[1], kCols * 4);
  if constexpr (RT == 2) _tile_stored(2, c[2], kCols * 4);
  if constexpr (RT == 2 && PT == 2) _tile_stored(3, c[3], kCols * 4);
}

// x: [Mp, Kp] (zero padded, Mp a multiple of 32); packed: [P, Kp / 2, 16, 2]; bias: float32
// padded to P * 16 or null; out: [M, N].
inline void linear(const at::BFloat16* x, int64_t M, int64_t Kp, const at::BFloat16* packed,
                   int64_t panels, const float* bias, at::BFloat16* out, int64_t out_stride,
                   int64_t N) {
  const int64_t row_pairs = (M + 2 * kTileRows - 1) / (2 * kTileRows);
  const int64_t groups = (panels + 1) / 2;
  const int64_t panel_size = Kp / 2 * kCols * 2;
  at::parallel_for(0, row_pairs * groups, 1, [&](int64_t begin, int64_t end) {
    configure_tiles();
    alignas(64) float c[4][kTileRows][kCols];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t m0 = item / groups * 2 * kTileRows, p0 = item % groups * 2;
      const bool two_rows = M - m0 > kTileRows, two_panels = p0 + 1 < panels;
      const at::BFloat16* panel0 = packed + p0 * panel_size;
      const at::BFloat16* panel1 = panel0 + panel_size;
      const at::BFloat16* xs = x + m0 * Kp;
      if (two_rows && two_panels) tile_block<2, 2>(xs, Kp, panel0, panel1, c);
      else if (two_rows) tile_block<2, 1>(xs, Kp, panel0, panel1, c);
      else if (two_panels) tile_block<1, 2>(xs, Kp, panel0, panel1, c);
      else tile_block<1, 1>(xs, Kp, panel0, panel1, c);
      // c[rt * 2 + pt] in the 2 x 2 case; with one row tile c[pt], with one panel c[rt * 2].
      for (int rt = 0; rt < (two_rows ? 2 : 1); ++rt)
        for (int pt = 0; pt < (two_panels ? 2 : 1); ++pt) {
          const float(*tile)[kCols] = c[rt * 2 + pt];
          const int64_t col0 = (p0 + pt) * kCols, valid = std::min(kCols, N - col0);
          const int64_t row0 = m0 + rt * kTileRows;
          const int64_t rows = std::min(kTileRows, M - row0);
          for (int64_t r = 0; r < rows; ++r)
            for (int64_t j = 0; j < valid; ++j) {
              float v = tile[r][j];
              if (bias != nullptr) v = v + bias[col0 + j];
              out[(row0 + r) * out_stride + col0 + j] = static_cast<at::BFloat16>(v);
            }
        }
    }
    _tile_release();
  });
}
#else
inline bool available() { return false; }
inline void linear(const at::BFloat16*, int64_t, int64_t, const at::BFloat16*, int64_t,
                   const float*, at::BFloat16*, int64_t, int64_t) {
  TORCH_CHECK(false, "batch_invariant_linear: built without AMX");
}
#endif

// weight [N, K] bfloat16 -> [ceil(N / 16), Kp / 2, 16, 2], zeros past N and K.
inline at::Tensor pack(const at::Tensor& weight) { return dpbf16::pack_pairs(weight, kTileK); }

}  // namespace batch_invariant::amx
