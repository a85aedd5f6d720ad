// Causal attention of one bf16 prompt chunk over its sequence's keys and values with Intel AMX
// tiles (see chunk_attention_amx.py for why and how it is built).
//
// q: [n, Hq, D] (positions start .. start+n-1), k, v: [Hkv, start+n, D] (positions 0 ..), all
// bf16 bits with unit stride along D; out: [n, Hq, D] contiguous bf16. The g = Hq / Hkv query
// heads of a KV head are its "columns": row r of a KV head is position r / g, head r % g, and the
// rows are taken 16 at a time (one tile of columns), and up to 8 tiles of a KV head share a pass
// over its keys, which go by in fixed blocks of 128 from position 0 (online softmax: each block of
// K and V^T is read from memory once for the group, not once per tile). Per tile and key block:
//   scores (AMX): S^T[key][col] = K[key] . Q[col], 16 keys at a time, into a float32 buffer;
//   softmax (AVX-512, one vector per key holds the 16 columns): the block's max over visible keys;
//                 where a column's running max m grows, its sum l and O^T so far are scaled by
//                 exp(scale * (m_old - m_new)); e = exp(scale * (s - m)) (0 where not visible),
//                 l += e in key order, e rounded to bf16 in the pair layout AMX takes as B;
//   O^T (AMX):    O^T[d][col] += sum over the block's keys V^T[d][key] e[key][col].
// At the end O = O^T / l, rounded. Every column's result depends only on its own query and on
// keys taken in fixed blocks from position 0, never on which other rows share its tile or group:
// a chunk gives the same bits however the prompt was cut into chunks (keys past a column's
// position add exact zeros, and a block it sees none of leaves its state as it was).
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "bf16_bits.h"
#include "vec_exp2.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
#define CF_HAVE_AMX 1
#else
#define CF_HAVE_AMX 0
#endif

namespace {

constexpr int kCols = 16;     // columns (query rows) per tile
constexpr int kKeys1 = 16;    // keys per pass-1 block (rows of the S^T tile)
constexpr int kKeys2 = 32;    // keys per pass-2 block (the bf16 pairs of one B tile)
constexpr int kMaxHeadDim = 256;
// keys per block of the online softmax (a multiple of kKeys2): a block's K and V^T (16 KiB each
// at D = 64) stay in L1 while the group's tiles take it in turn; 512 made them L2 reads each time
constexpr int64_t kKeyBlock = 128;
constexpr int64_t kMaxGroup = 8;    // tiles that share each block of K and V^T

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

#if CF_HAVE_AMX

void configure_tiles() {  // every tile 16 rows x 64 bytes
  cf_amx::configure({16, 16, 16, 16, 16, 16, 16, 16});
}

using cf_vec::exp2_nonpositive;  // vec_exp2.h

// In: r[i] = row i of a 16 x 16 float32 matrix; out: r[j] = its column j.
inline void transpose16x16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD);
    t[i + 8] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_f32x4(r[i + 8], r[i + 12], 0xDD);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xDD);
    r[i + 4] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_f32x4(t[i + 4], t[i + 12], 0xDD);
  }
}

struct Shapes {
  int64_t n, hq, hkv, d, d32, start, ctx, ctx32, g, rows, tiles;
  float scale;
};

// One tile of 16 columns of a KV head, while the keys go by block: its columns' positions, its
// queries as AMX's B operand, and its running softmax state (max m and sum l per column, the
// unnormalized O^T in float32).
struct TileState {
  alignas(64) int32_t pos[kCols];
  int64_t r0, r1, pmin, kv_end;
  uint16_t* qb;  // [d32 / 2][kCols][2]
  float* ot;     // [d][kCols]
  __m512 m, l;
};

void start_tile(const Shapes& s, int64_t h, int64_t tile, const uint16_t* q, int64_t q_st, int64_t q_sh,
                TileState& t) {
  t.r0 = tile * kCols;
  t.r1 = std::min(s.rows, t.r0 + kCols);
  for (int c = 0; c < kCols; ++c) t.pos[c] = t.r0 + c < t.r1 ? static_cast<int32_t>(s.start + (t.r0 + c) / s.g) : -1;
  t.pmin = s.start + t.r0 / s.g;
  t.kv_end = s.start + (t.r1 - 1) / s.g + 1;  // keys the tile's last column sees
  // Q^T as AMX's B operand: qb[dh][pair][col][2] = Q[col][dh * 32 + 2 * pair + {0, 1}]
  // (a pair of bf16 is one 32-bit word: word w of a query row goes to qb32[w * 16 + col])
  std::memset(t.qb, 0, sizeof(uint16_t) * s.d32 * kCols);
  uint32_t* qb32 = reinterpret_cast<uint32_t*>(t.qb);
  for (int c = 0; c < kCols; ++c) {
    if (t.pos[c] < 0) continue;
    const int64_t r = t.r0 + c;
    const uint16_t* src = q + (r / s.g) * q_st + (h * s.g + r % s.g) * q_sh;
    for (int64_t w = 0; w < s.d / 2; ++w) {
      uint32_t word;
      std::memcpy(&word, src + 2 * w, sizeof word);
      qb32[w * kCols + c] = word;
    }
  }
  std::memset(t.ot, 0, sizeof(float) * s.d * kCols);
  t.m = _mm512_set1_ps(-INFINITY);
  t.l = _mm512_setzero_ps();
}

// Keys [j0, j1) of one tile (j0 a multiple of kKeys2, j1 <= the tile's kv_end): scores on AMX into
// st, the block's max, the running state rescaled where a column's max grew, the numerators in
// bf16 pairs (pb), and O^T += V^T E on AMX. st, pb: scratch for kKeyBlock keys.
void tile_block(const Shapes& s, TileState& t, int64_t j0, int64_t j1, const uint16_t* kp, const uint16_t* vt,
                float* st, uint16_t* pb) {
  const __m512i posv = _mm512_load_si512(t.pos);
  const int64_t nkb = (j1 - j0 + kKeys1 - 1) / kKeys1;
  const int64_t nd = s.d32 / 32;
  const int kstride = static_cast<int>(s.d32 * 2);
  // this block's max over the keys each column sees, in 4 chains (key % 4) so that the maxes
  // overlap instead of waiting on each other (max is exact: any order gives the same value)
  __m512 mx[4] = {_mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY),
                  _mm512_set1_ps(-INFINITY)};
  _tile_loadd(0, t.qb, 64);
  if (nd == 2) _tile_loadd(1, t.qb + 512, 64);
  for (int64_t kb = 0; kb < nkb; kb += 4) {
    const int64_t blocks = std::min<int64_t>(4, nkb - kb);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t dh = 0; dh < nd; ++dh) {
      if (nd > 2) _tile_loadd(0, t.qb + dh * 512, 64);
      const bool high = nd == 2 && dh == 1;
      const uint16_t* kd = kp + (j0 + kb * kKeys1) * s.d32 + dh * 32;
#define CF_SCORES(ACC, KT, I)                                  \
      if ((I) < blocks) {                                      \
        _tile_loadd(KT, kd + (I) * kKeys1 * s.d32, kstride);   \
        if (high) {                                            \
          _tile_dpbf16ps(ACC, KT, 1);                          \
        } else {                                               \
          _tile_dpbf16ps(ACC, KT, 0);                          \
        }                                                      \
      }
      CF_SCORES(4, 2, 0)
      CF_SCORES(5, 3, 1)
      CF_SCORES(6, 2, 2)
      CF_SCORES(7, 3, 3)
#undef CF_SCORES
    }
    float* block = st + kb * kKeys1 * kCols;
    _tile_stored(4, block, 64);
    if (blocks > 1) _tile_stored(5, block + 256, 64);
    if (blocks > 2) _tile_stored(6, block + 512, 64);
    if (blocks > 3) _tile_stored(7, block + 768, 64);
    const int64_t a = j0 + kb * kKeys1;
    const int64_t b = std::min(j1, a + blocks * kKeys1);
    const int64_t full = std::min(b, t.pmin + 1);  // keys every column sees
    int64_t j = a;
    for (; j + 4 <= full; j += 4)
      for (int u = 0; u < 4; ++u) mx[u] = _mm512_max_ps(mx[u], _mm512_loadu_ps(st + (j + u - j0) * kCols));
    for (; j < full; ++j) mx[0] = _mm512_max_ps(mx[0], _mm512_loadu_ps(st + (j - j0) * kCols));
    for (; j < b; ++j) {
      const __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(j)), posv);
      mx[j & 3] = _mm512_mask_max_ps(mx[j & 3], seen, mx[j & 3], _mm512_loadu_ps(st + (j - j0) * kCols));
    }
  }
  const __m512 m = _mm512_max_ps(_mm512_max_ps(mx[0], mx[1]), _mm512_max_ps(mx[2], mx[3]));
  // e = exp(scale * (s - m)) = 2^(s * c - m * c), c = scale * log2(e). Where a column's running
  // max grows, its sum and O^T so far are scaled by 2^((m_old - m_new) * c) (lanes whose max
  // stays keep exactly what they had).
  const __m512 c = _mm512_set1_ps(s.scale * 1.44269504088896341f);
  const __m512 m_new = _mm512_max_ps(t.m, m);  // a column that sees no key here keeps its max
  const __mmask16 grew = _mm512_cmp_ps_mask(m_new, t.m, _CMP_GT_OQ);
  if (grew) {
    // the first block: every column's old max is -inf and its sum and O^T are zero
    const __m512 alpha = _mm512_mask_blend_ps(
        grew, _mm512_set1_ps(1.0f),
        _mm512_mask_blend_ps(_mm512_cmp_ps_mask(t.m, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ),
                             exp2_nonpositive(_mm512_mul_ps(_mm512_sub_ps(t.m, m_new), c)), _mm512_setzero_ps()));
    t.l = _mm512_mul_ps(t.l, alpha);
    for (int64_t dd = 0; dd < s.d; ++dd)
      _mm512_store_ps(t.ot + dd * kCols, _mm512_mul_ps(_mm512_load_ps(t.ot + dd * kCols), alpha));
  }
  t.m = m_new;
  const __m512 mc = _mm512_mul_ps(m_new, c);
  const __m512i pair_index = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const int64_t j2 = j0 + round_up(j1 - j0, kKeys2);
  // the block's numerators summed in 4 chains (key - j0 = 4i + u into chain u), added at the end
  // of the block: independent adds overlap where one running sum made each wait on the last. The
  // blocks start at fixed positions, so every column's sums still go in the same order however
  // the prompt was chunked (keys past its position add exact zeros).
  __m512 ls[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t j = j0; j < j2; j += 4) {
    __m512 e[4];
    for (int u = 0; u < 4; ++u) {
      const int64_t key = j + u;
      if (key >= j1) {
        e[u] = _mm512_setzero_ps();
        continue;
      }
      const __m512 x = _mm512_fmsub_ps(_mm512_loadu_ps(st + (key - j0) * kCols), c, mc);
      if (key <= t.pmin) {  // every column sees it
        e[u] = exp2_nonpositive(x);
      } else {
        const __mmask16 seen = _mm512_cmple_epi32_mask(_mm512_set1_epi32(static_cast<int32_t>(key)), posv);
        e[u] = _mm512_maskz_mov_ps(seen, exp2_nonpositive(x));
      }
      ls[u] = _mm512_add_ps(ls[u], e[u]);
    }
    for (int u = 0; u < 4; u += 2) {
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(e[u + 1], e[u]);  // e[u] low, e[u + 1] high
      _mm512_storeu_si512(pb + (j + u - j0) * kCols, _mm512_permutexvar_epi16(pair_index, both));
    }
  }
  t.l = _mm512_add_ps(t.l, _mm512_add_ps(_mm512_add_ps(ls[0], ls[1]), _mm512_add_ps(ls[2], ls[3])));

  // O^T += V^T E, up to 64 values of D (4 accumulator tiles) at a time
  constexpr int vstride = kKeys2 * 2;  // V^T is stored in [d][32]-key pieces: each tile is 1 KiB in a row
  for (int64_t d0 = 0; d0 < s.d; d0 += 64) {
    const int64_t parts = std::min<int64_t>(4, (s.d - d0) / 16);
    float* o = t.ot + d0 * kCols;
    _tile_loadd(0, o, 64);
    if (parts > 1) _tile_loadd(1, o + 256, 64);
    if (parts > 2) _tile_loadd(2, o + 512, 64);
    if (parts > 3) _tile_loadd(3, o + 768, 64);
    for (int64_t kb = 0; kb < (j2 - j0) / kKeys2; ++kb) {
      _tile_loadd(5, pb + kb * kKeys2 * kCols, 64);
      const uint16_t* a = vt + (j0 / kKeys2 + kb) * s.d * kKeys2 + d0 * kKeys2;
      _tile_loadd(4, a, vstride);
      _tile_dpbf16ps(0, 4, 5);
      if (parts > 1) {
        _tile_loadd(6, a + 16 * kKeys2, vstride);
        _tile_dpbf16ps(1, 6, 5);
      }
      if (parts > 2) {
        _tile_loadd(7, a + 32 * kKeys2, vstride);
        _tile_dpbf16ps(2, 7, 5);
      }
      if (parts > 3) {
        _tile_loadd(4, a + 48 * kKeys2, vstride);
        _tile_dpbf16ps(3, 4, 5);
      }
    }
    _tile_stored(0, o, 64);
    if (parts > 1) _tile_stored(1, o + 256, 64);
    if (parts > 2) _tile_stored(2, o + 512, 64);
    if (parts > 3) _tile_stored(3, o + 768, 64);
  }
}

// O = O^T's columns / l, rounded, into out: 16 x 16 pieces transposed, 16 values at a time.
void finish_tile(const Shapes& s, int64_t h, const TileState& t, uint16_t* out) {
  const __m512 inv_l = _mm512_div_ps(_mm512_set1_ps(1.0f), t.l);
  for (int64_t part = 0; part < s.d / 16; ++part) {
    __m512 rows[16];
    for (int i = 0; i < 16; ++i) rows[i] = _mm512_mul_ps(_mm512_load_ps(t.ot + (part * 16 + i) * kCols), inv_l);
    transpose16x16(rows);
    for (int c = 0; c < kCols; ++c) {
      if (t.pos[c] < 0) continue;
      const int64_t r = t.r0 + c;
      uint16_t* dst = out + ((r / s.g) * s.hq + h * s.g + r % s.g) * s.d + part * 16;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), cf_bf16::from_floats(rows[c]));
    }
  }
}

// Tiles [first, first + count) of KV head h, the keys taken kKeyBlock at a time for all of them,
// so that each block of K and V^T is read from memory once for the group (it stays in L1/L2 for
// the group's other tiles) instead of once per tile. kp: [ctx32][d32] (zero-padded K of head h),
// vt: [ctx32 / 32][d][32] (V^T of head h, zero-padded, in pieces of 32 keys: a piece's tiles are
// contiguous 1 KiB reads where rows ctx32 apart each touched another page).
void attend_group(const Shapes& s, int64_t h, int64_t first, int64_t count, const uint16_t* q, int64_t q_st,
                  int64_t q_sh, const uint16_t* kp, const uint16_t* vt, uint16_t* out, TileState* tiles, float* st,
                  uint16_t* pb) {
  int64_t kv_end = 0;
  for (int64_t i = 0; i < count; ++i) {
    start_tile(s, h, first + i, q, q_st, q_sh, tiles[i]);
    kv_end = std::max(kv_end, tiles[i].kv_end);
  }
  for (int64_t j0 = 0; j0 < kv_end; j0 += kKeyBlock)
    for (int64_t i = 0; i < count; ++i)
      if (j0 < tiles[i].kv_end) tile_block(s, tiles[i], j0, std::min(j0 + kKeyBlock, tiles[i].kv_end), kp, vt, st, pb);
  for (int64_t i = 0; i < count; ++i) finish_tile(s, h, tiles[i], out);
}

#endif  // CF_HAVE_AMX

}  // namespace

// 0: AMX tiles usable in this process; 1: not built for AMX; 2: the kernel refused the permission.
extern "C" int cf_amx_init() {
#if CF_HAVE_AMX
  return cf_amx::request_tile_state() ? 0 : 2;
#else
  return 1;
#endif
}

// Returns 0, or a nonzero code for shapes it does not take (the caller checks them first).
extern "C" int cf_chunk_attention_amx(const uint16_t* q, int64_t q_st, int64_t q_sh, const uint16_t* k,
                                      int64_t k_sh, int64_t k_st, const uint16_t* v, int64_t v_sh, int64_t v_st,
                                      uint16_t* out, int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t start,
                                      float scale, int threads) {
#if CF_HAVE_AMX
  if (n <= 0 || hkv <= 0 || hq % hkv != 0 || d % 16 != 0 || d > kMaxHeadDim || start < 0) return 3;
  Shapes s;
  s.n = n;
  s.hq = hq;
  s.hkv = hkv;
  s.d = d;
  s.d32 = round_up(d, 32);
  s.start = start;
  s.ctx = start + n;
  s.ctx32 = round_up(s.ctx, kKeys2);
  s.g = hq / hkv;
  s.rows = n * s.g;
  s.tiles = (s.rows + kCols - 1) / kCols;
  s.scale = scale;
  if (threads < 1) threads = 1;

  // K zero-padded to [ctx32][d32] and V^T to [ctx32 / 32][d][32], per KV head
  std::vector<uint16_t> kp(static_cast<size_t>(hkv * s.ctx32 * s.d32), 0);
  std::vector<uint16_t> vt(static_cast<size_t>(hkv * s.d * s.ctx32), 0);
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t hb = 0; hb < hkv * (s.ctx32 / kKeys2); ++hb) {
    const int64_t h = hb / (s.ctx32 / kKeys2);
    const int64_t j0 = (hb % (s.ctx32 / kKeys2)) * kKeys2;
    const int64_t j1 = std::min(s.ctx, j0 + kKeys2);
    uint16_t* kh = kp.data() + h * s.ctx32 * s.d32;
    uint16_t* piece = vt.data() + h * s.d * s.ctx32 + j0 * d;  // V^T [d][32] for keys j0 .. j0 + 31
    for (int64_t j = j0; j < j1; ++j) {
      std::memcpy(kh + j * s.d32, k + h * k_sh + j * k_st, sizeof(uint16_t) * d);
      const uint16_t* vr = v + h * v_sh + j * v_st;
      for (int64_t dd = 0; dd < d; ++dd) piece[dd * kKeys2 + (j - j0)] = vr[dd];
    }
  }

  const int64_t group = std::max<int64_t>(1, std::min<int64_t>(kMaxGroup, 1024 / s.d));  // O^T: <= 64 KiB
  const int64_t groups = (s.tiles + group - 1) / group;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    configure_tiles();
    std::vector<uint16_t> qb(static_cast<size_t>(group * s.d32 * kCols));
    std::vector<float> ot(static_cast<size_t>(group * s.d * kCols) + 16);
    std::vector<float> st(static_cast<size_t>(kKeyBlock * kCols) + 16);
    std::vector<uint16_t> pb(static_cast<size_t>(kKeyBlock * kCols) + 32);
    std::vector<TileState> tiles(static_cast<size_t>(group));
    float* ot64 = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(ot.data()) + 63) & ~uintptr_t{63});
    for (int64_t i = 0; i < group; ++i) {
      tiles[i].qb = qb.data() + i * s.d32 * kCols;
      tiles[i].ot = ot64 + i * s.d * kCols;
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < hkv * groups; ++w) {
      // the longest groups (last rows: most keys) first, for the dynamic schedule
      const int64_t h = w % hkv;
      const int64_t gi = groups - 1 - w / hkv;
      const int64_t first = gi * group;
      attend_group(s, h, first, std::min(group, s.tiles - first), q, q_st, q_sh, kp.data() + h * s.ctx32 * s.d32,
                   vt.data() + h * s.d * s.ctx32, out, tiles.data(), st.data(), pb.data());
    }
    _tile_release();
  }
  return 0;
#else
  (void)q; (void)q_st; (void)q_sh; (void)k; (void)k_sh; (void)k_st; (void)v; (void)v_sh; (void)v_st;
  (void)out; (void)n; (void)hq; (void)hkv; (void)d; (void)start; (void)scale; (void)threads;
  return 1;
#endif
}
