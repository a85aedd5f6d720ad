// Paged decode attention on AMX tiles: bf16 queries over a bf16 cache, one (sequence, kv head) at
// a time, for head dims 64, 128 and 256, 1, 2, 4 or 8 query heads per kv head and block sizes that
// are multiples of 16 (included by paged_decode_cpu.cpp, whose AVX-512 path takes every other
// case). Three steps:
//   scores (AMX):  S[key][g] = K[key] . Q[g]. 16 keys of a block are a tile as they lie in the
//                  cache (AMX's A operand: 16 rows of 32 dims, the row stride D), Q^T is the B
//                  operand with G columns, and each tile of scores is stored G floats a key: S is
//                  [keys][G] in one buffer, 4 tiles of keys in flight.
//   softmax:       lane l of every 16-float vector of S holds head l % G, so each head's max and sum
//                  come from lanes combined by swapping halves, quarters, ... down to G lanes;
//                  e = 2^(s c - m c) (c = scale log2 e, vec_exp2.h), summed in float32, rounded
//                  to bf16 (as the chunk kernels round their numerators) and moved to E [G][keys],
//                  zero past the context.
//   E V (AMX):     O[g][d] += E[g][32 keys] V[32 keys][d]: V's rows are paired by key (two rows
//                  interleaved by unpacklo/hi_epi16: AMX's B layout) into a 4 KiB stage per 32
//                  keys, 64 dims (4 tiles of O) a pass; O's columns come out in unpack order and are
//                  put back in order at the end, divided by the sum and rounded once.
// Keys past the context inside the last block are read as the block holds them (their scores are
// never used) for K, and taken as zero rows for V (a zero weight times a stale value could be NaN).
#pragma once

#include <immintrin.h>

#include <cfloat>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "bf16_bits.h"
#include "vec_exp2.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512DQ__)
#define CF_PAGED_AMX 1

namespace cf_paged_amx {

constexpr int kMaxGroup = 8;
constexpr int kMaxHeadDim = 256;
// No software prefetch: the tile loads and the hardware prefetcher keep the line fill buffers busy
// by themselves, and prefetches on top stalled on them (AMX Xeon, 2 threads, bf16 b8 x 6,000
// tokens x 8 layers over scattered blocks: 13.2-13.4 ms with 8 runs of K and 64 keys of V
// prefetched ahead, 10.7-11.2 ms without; b32 x 530 the same).

// One thread's buffers, reused across the (sequence, kv head) items it takes.
struct Scratch {
  std::vector<float> scores;  // S: [keys, rounded up to 64][G]
  std::vector<uint16_t> e;    // E: [G][keys, rounded up to 32] bf16
  alignas(64) uint32_t qt[kMaxHeadDim / 2 * kMaxGroup];  // Q^T: [D / 32][16 pairs][G] bf16 pairs
  alignas(64) uint16_t stage[2][4][16 * 32];               // V paired, twice: 4 B tiles of [16 pairs][16 dims][2]
  alignas(64) float o[4][kMaxGroup * 16];                  // O's 4 tiles: [G][16]
};

// The first n of 16 lanes (none for n <= 0, all for n >= 16).
inline __mmask16 lanes(int64_t n) { return static_cast<__mmask16>((1u << (n < 0 ? 0 : n > 16 ? 16 : n)) - 1); }

// Lane l of the result: the max (Max) or sum of x's lanes l' with l' = l mod G.
template <int G, bool Max>
inline __m512 per_head(__m512 x) {
  auto op = [](__m512 a, __m512 b) { return Max ? _mm512_max_ps(a, b) : _mm512_add_ps(a, b); };
  if constexpr (G <= 8) x = op(x, _mm512_shuffle_f32x4(x, x, 0x4E));  // lane l ^ 8
  if constexpr (G <= 4) x = op(x, _mm512_shuffle_f32x4(x, x, 0xB1));  // l ^ 4
  if constexpr (G <= 2) x = op(x, _mm512_permute_ps(x, 0x4E));        // l ^ 2
  if constexpr (G <= 1) x = op(x, _mm512_permute_ps(x, 0xB1));        // l ^ 1
  return x;
}

// Where the 32 bf16 of 32 / G keys x G heads ([key][g]) go to be [g][key]: index[g * 32 / G + j] = j G + g.
template <int G>
inline __m512i by_head_index() {
  alignas(64) uint16_t idx[32];
  for (int k = 0; k < 32; ++k) idx[k] = static_cast<uint16_t>((k % (32 / G)) * G + k / (32 / G));
  return _mm512_load_si512(idx);
}

// S for keys 0 .. ctx - 1 (see the top). key: the cache at this kv head's first slot's row 0.
template <int D, int G>
void scores(const uint16_t* q, const uint16_t* key, const int64_t* table, int64_t ctx, int block_size, Scratch& s) {
  constexpr int ND = D / 32;  // tile products per 16 keys
  constexpr int kStride = D * 2;
  constexpr int kQ = 4 * G;  // bytes of a Q^T or S row
  for (int g = 0; g < G; ++g)
    for (int w = 0; w < D / 2; ++w) std::memcpy(&s.qt[w * G + g], q + g * D + 2 * w, sizeof(uint32_t));
  // tiles 0-3: S (16 keys x G), 4-5: K (16 keys x 32 dims), 6-7: Q^T (16 pairs x G)
  cf_amx::configure({16, 16, 16, 16, 16, 16, 16, 16}, {kQ, kQ, kQ, kQ, 64, 64, kQ, kQ});
  if constexpr (ND == 2) {
    _tile_loadd(6, s.qt, kQ);
    _tile_loadd(7, s.qt + 16 * G, kQ);
  }
  const int64_t runs = (ctx + 15) / 16;
  auto run_at = [&](int64_t r) {
    const int64_t t = r * 16;
    return key + (table[t / block_size] * block_size + t % block_size) * D;
  };
  float* st = s.scores.data();
  for (int64_t r0 = 0; r0 < runs; r0 += 4) {
    const int64_t n = runs - r0 < 4 ? runs - r0 : 4;
    const uint16_t* k0 = run_at(r0);
    const uint16_t* k1 = n > 1 ? run_at(r0 + 1) : k0;
    const uint16_t* k2 = n > 2 ? run_at(r0 + 2) : k0;
    const uint16_t* k3 = n > 3 ? run_at(r0 + 3) : k0;
    _tile_zero(0);
    if (n > 1) _tile_zero(1);
    if (n > 2) _tile_zero(2);
    if (n > 3) _tile_zero(3);
    for (int dh = 0; dh < ND; ++dh) {
      const int off = 32 * dh;
#define CF_RUNS(QT)                                           \
      _tile_loadd(4, k0 + off, kStride);                      \
      _tile_dpbf16ps(0, 4, QT);                               \
      if (n > 1) {                                            \
        _tile_loadd(5, k1 + off, kStride);                    \
        _tile_dpbf16ps(1, 5, QT);                             \
      }                                                       \
      if (n > 2) {                                            \
        _tile_loadd(4, k2 + off, kStride);                    \
        _tile_dpbf16ps(2, 4, QT);                             \
      }                                                       \
      if (n > 3) {                                            \
        _tile_loadd(5, k3 + off, kStride);                    \
        _tile_dpbf16ps(3, 5, QT);                             \
      }
      if (ND == 2 && dh == 1) {
        CF_RUNS(7)
      } else {
        if constexpr (ND != 2) _tile_loadd(6, s.qt + dh * 16 * G, kQ);
        CF_RUNS(6)
      }
#undef CF_RUNS
    }
    float* dst = st + r0 * 16 * G;
    _tile_stored(0, dst, kQ);
    if (n > 1) _tile_stored(1, dst + 16 * G, kQ);
    if (n > 2) _tile_stored(2, dst + 32 * G, kQ);
    if (n > 3) _tile_stored(3, dst + 48 * G, kQ);
  }
}

// The softmax numerators of S into E (see the top); returns each head's 1 / sum in lane g.
template <int G>
__m512 numerators(int64_t ctx, int64_t ctx32, float scale, Scratch& s) {
  const float* st = s.scores.data();
  const int64_t n = ctx * G;  // S's floats
  __m512 mx[4] = {_mm512_set1_ps(-FLT_MAX), _mm512_set1_ps(-FLT_MAX), _mm512_set1_ps(-FLT_MAX),
                  _mm512_set1_ps(-FLT_MAX)};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) mx[(i >> 4) & 3] = _mm512_max_ps(mx[(i >> 4) & 3], _mm512_loadu_ps(st + i));
  if (i < n) mx[0] = _mm512_mask_max_ps(mx[0], lanes(n - i), mx[0], _mm512_maskz_loadu_ps(lanes(n - i), st + i));
  const __m512 m = per_head<G, true>(_mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3])));
  const __m512 c = _mm512_set1_ps(scale * 1.44269504088896341f);
  const __m512 mc = _mm512_mul_ps(m, c);
  const __m512i by_head = by_head_index<G>();
  constexpr int kChunk = 64 / G;  // bytes of one head's keys in 32 bf16
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  uint16_t* e = s.e.data();
  for (i = 0; i < ctx32 * G; i += 32) {  // 32 / G keys at a time
    const __mmask16 m0 = lanes(n - i), m1 = lanes(n - i - 16);
    const __m512 e0 = _mm512_maskz_mov_ps(
        m0, cf_vec::exp2_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m0, st + i), c, mc)));
    const __m512 e1 = _mm512_maskz_mov_ps(
        m1, cf_vec::exp2_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m1, st + i + 16), c, mc)));
    sum[0] = _mm512_add_ps(sum[0], e0);
    sum[1] = _mm512_add_ps(sum[1], e1);
    __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e1, e0);  // e0's 16 low, e1's high
    if constexpr (G > 1) both = _mm512_permutexvar_epi16(by_head, both);
    alignas(64) uint8_t chunk[64];
    _mm512_store_si512(chunk, both);
    const int64_t t = i / G;  // the first key
    for (int g = 0; g < G; ++g) std::memcpy(e + g * ctx32 + t, chunk + g * kChunk, kChunk);
  }
  return _mm512_div_ps(_mm512_set1_ps(1.0f), per_head<G, false>(_mm512_add_ps(sum[0], sum[1])));
}

// The B tiles of keys t0 .. t0 + 31, dims d0 .. d0 + 63, into stage: V's rows paired by key (see
// the top), rows past the context as zeros. runs: the two runs of 16 keys' first rows (only where
// t0 + 16 < ctx for the second).
template <int D>
inline void stage_values(const uint16_t* const (&runs)[2], int64_t t0, int64_t ctx, int d0,
                         uint16_t (*stage)[16 * 32]) {
  alignas(64) static const uint16_t zeros[D] = {};
  for (int half = 0; half < 2; ++half) {
    const int64_t valid = ctx - t0 - 16 * half;  // rows of this run inside the context
    for (int i = 0; i < 8; ++i) {
      const int r = 2 * i;
      const uint16_t* a = (r < valid ? runs[half] + r * D : zeros) + d0;
      const uint16_t* b = (r + 1 < valid ? runs[half] + (r + 1) * D : zeros) + d0;
      const __m512i x0 = _mm512_loadu_si512(a), x1 = _mm512_loadu_si512(a + 32);
      const __m512i y0 = _mm512_loadu_si512(b), y1 = _mm512_loadu_si512(b + 32);
      const int row = 8 * half + i;
      _mm512_store_si512(stage[0] + 32 * row, _mm512_unpacklo_epi16(x0, y0));
      _mm512_store_si512(stage[1] + 32 * row, _mm512_unpackhi_epi16(x0, y0));
      _mm512_store_si512(stage[2] + 32 * row, _mm512_unpacklo_epi16(x1, y1));
      _mm512_store_si512(stage[3] + 32 * row, _mm512_unpackhi_epi16(x1, y1));
    }
  }
}

// out[g] = E[g] V / sum[g] (see the top). value: the cache at this kv head's first slot's row 0.
// The stage is double-buffered: the 32 keys after a chunk are staged before its tiles are loaded,
// so the tile loads never wait on the stores just made.
template <int D, int G>
void weigh_values(const uint16_t* value, const int64_t* table, int64_t ctx, int64_t ctx32, int block_size,
                  __m512 inv_sum, uint16_t* out, Scratch& s) {
  // tiles 0-3: O (G x 16 dims), 4: E (G x 32 keys), 5-6: V paired (16 pairs x 16 dims)
  cf_amx::configure({G, G, G, G, G, 16, 16, 1}, {64, 64, 64, 64, 64, 64, 64, 64});
  auto run_at = [&](int64_t t) -> const uint16_t* {  // the first row of the run of 16 keys from t, or null
    return t < ctx ? value + (table[t / block_size] * block_size + t % block_size) * D : nullptr;
  };
  const uint16_t* e = s.e.data();
  const long e_stride = static_cast<long>(ctx32 * 2);
  alignas(64) float inv[16];
  _mm512_store_ps(inv, inv_sum);
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  auto weigh = [&](int64_t t0, uint16_t (*stage)[16 * 32]) {
    _tile_loadd(4, e + t0, e_stride);
    _tile_loadd(5, stage[0], 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(6, stage[1], 64);
    _tile_dpbf16ps(1, 4, 6);
    _tile_loadd(5, stage[2], 64);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(6, stage[3], 64);
    _tile_dpbf16ps(3, 4, 6);
  };
  for (int d0 = 0; d0 < D; d0 += 64) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    const uint16_t* runs[2] = {run_at(0), run_at(16)};
    for (int64_t t0 = 0; t0 < ctx32; t0 += 32) {
      stage_values<D>(runs, t0, ctx, d0, s.stage[(t0 >> 5) & 1]);
      if (t0) weigh(t0 - 32, s.stage[((t0 >> 5) & 1) ^ 1]);
      runs[0] = run_at(t0 + 32);
      runs[1] = run_at(t0 + 48);
    }
    weigh(ctx32 - 32, s.stage[((ctx32 >> 5) & 1) ^ 1]);
    _tile_stored(0, s.o[0], 64);
    _tile_stored(1, s.o[1], 64);
    _tile_stored(2, s.o[2], 64);
    _tile_stored(3, s.o[3], 64);
    // tile 2j (unpacklo) column c holds dim 8 (c / 4) + c % 4 of these 32, tile 2j + 1 that + 4
    for (int g = 0; g < G; ++g) {
      const __m512 sc = _mm512_set1_ps(inv[g]);
      for (int j = 0; j < 2; ++j) {
        const __m512 lo = _mm512_load_ps(s.o[2 * j] + 16 * g), hi = _mm512_load_ps(s.o[2 * j + 1] + 16 * g);
        uint16_t* dst = out + g * D + d0 + 32 * j;
        cf_bf16::store16(dst, _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), sc));
        cf_bf16::store16(dst + 16, _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), sc));
      }
    }
  }
}

// One (sequence, kv head): q, out [G][D] bf16; key, value: the caches at this kv head's first
// slot; table: the sequence's blocks; ctx >= 1 keys; block_size a multiple of 16.
template <int D, int G>
void attend(const uint16_t* q, const uint16_t* key, const uint16_t* value, uint16_t* out, const int64_t* table,
            int64_t ctx, int block_size, float scale, Scratch& s) {
  static_assert(D > 0 && D % 64 == 0 && D <= kMaxHeadDim && G <= kMaxGroup && 16 % G == 0, "shape");
  const int64_t ctx32 = (ctx + 31) / 32 * 32;
  const size_t score_floats = static_cast<size_t>((ctx + 63) / 64 * 64 * G);
  if (s.scores.size() < score_floats) s.scores.resize(score_floats);
  if (s.e.size() < static_cast<size_t>(G * ctx32)) s.e.resize(static_cast<size_t>(G * ctx32));
  scores<D, G>(q, key, table, ctx, block_size, s);
  const __m512 inv_sum = numerators<G>(ctx, ctx32, scale, s);
  weigh_values<D, G>(value, table, ctx, ctx32, block_size, inv_sum, out, s);
}

}  // namespace cf_paged_amx

#else
#define CF_PAGED_AMX 0
#endif
