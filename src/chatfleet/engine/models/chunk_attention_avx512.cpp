// Causal attention of one float32 prompt chunk over its sequence's keys and values with AVX-512
// (see chunk_attention_avx512.py for why and how it is built).
//
// q: [n, Hq, D] (positions start .. start+n-1), k, v: [Hkv, start+n, D] (positions 0 ..), all
// float32 with unit stride along D; out: [n, Hq, D] contiguous float32. The g = Hq / Hkv query
// heads of a KV head are its "columns": row r of a KV head is position r / g, head r % g, and the
// rows are taken 32 at a time (two vectors of columns). For each tile, per KV head:
//   pass 1: S^T[key][col] = K[key] . Q[col], the sum over d in order (one fused multiply-add per
//           d), 8 keys x 32 columns at a time, into a float32 buffer that stays in L2; then the
//           maximum over the keys each column sees;
//   softmax: e = 2^(s * c - m * c), c = scale * log2(e) (0 where not visible); l = sum of e in
//           key order; e written over s;
//   pass 2: O[col][d] = sum over keys, in key order, of e[key][col] V[key][d], then O / l.
// Every column's result depends only on its own query and on the keys in order from position 0,
// never on which other rows share its tile: a chunk gives the same bits however the prompt was
// cut into chunks (keys past a column's position add exact zeros).
//
// bf16 operands, on a CPU with AVX512_BF16 (cf_chunk_attention_avx512_bf16), take the same plan
// with vdpbf16ps, which multiplies pairs of bf16 exactly and adds both products to a float32 sum:
//   pass 1: Q^T is stored as pairs (Q[col][2p], Q[col][2p+1]), each key's pair of d broadcast:
//           S^T[key][col] summed over d in pairs, in order;
//   softmax: as above, in float32;
//   pass 2: e rounded to bf16 (as the AMX kernel's) and paired by key (e[2j][col], e[2j+1][col]),
//           V stored as key pairs (V[2j][d], V[2j+1][d]) once per call: O summed over key pairs in
//           order from position 0, then O / l rounded to bf16 once.
// Pairs are fixed by position (d from 0, keys from position 0), so the chunk invariance holds too.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"

#if defined(__AVX512F__)
#define CF_HAVE_AVX512 1
#else
#define CF_HAVE_AVX512 0
#endif
#if CF_HAVE_AVX512 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define CF_HAVE_BF16_DOTS 1
#else
#define CF_HAVE_BF16_DOTS 0
#endif

namespace {

constexpr int kCols = 32;   // columns (query rows) per tile: two vectors
constexpr int kKeys1 = 8;   // keys per pass-1 block
constexpr int kMaxHeadDim = 256;

#if CF_HAVE_AVX512

// 2^x for x <= 0: 2^round(x) * 2^f with f in [-1/2, 1/2] by its Taylor polynomial of degree 7
// (relative error < 1e-8, under float32's rounding). Inputs below -100 give ~2^-100 (negligible
// next to the maximum's 1), never a subnormal: subnormal arithmetic takes microcode assists.
inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
  const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(x, n);
  __m512 p = _mm512_set1_ps(1.5252733804e-5f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393e-4f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

struct Shapes {
  int64_t n, hq, hkv, d, start, g, rows, tiles;
  int64_t q_st, q_sh, k_sh, k_st, v_sh, v_st;
  float scale;
};

// n elements of T, 64-byte aligned, freed with it; false where the allocation failed.
template <typename T>
struct Buffer {
  T* p;
  explicit Buffer(int64_t n) : p(static_cast<T*>(std::aligned_alloc(64, (sizeof(T) * n + 63) / 64 * 64))) {}
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  Buffer(Buffer&& o) noexcept : p(o.p) { o.p = nullptr; }
  explicit operator bool() const { return p != nullptr; }
};

// attend(h, tile, scratch) for every (KV head, tile) on `threads` threads, each with its own
// scratch from make(), the longest tiles (last rows: most keys) first for the dynamic schedule.
// Returns 0, or 4 where a thread's scratch could not be allocated (its tiles are then not written).
template <typename Make, typename Attend>
int for_each_tile(const Shapes& s, int threads, Make make, Attend attend) {
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    const auto w = make();
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < s.hkv * s.tiles; ++i) {
      if (!w.ok()) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      attend(i % s.hkv, s.tiles - 1 - i / s.hkv, w);
    }
  }
  return failed ? 4 : 0;
}

// Pass 1 for keys j0 .. j0 + NK - 1: S^T rows into st (NK x 32 floats). DV: D / 16.
template <int DV, int NK>
inline void scores_block(const float* qt, const float* kh, int64_t k_st, int64_t j0, float* st) {
  constexpr int D = DV * 16;
  __m512 acc[NK][2];
  for (int t = 0; t < NK; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  const float* kr[NK];
  for (int t = 0; t < NK; ++t) kr[t] = kh + (j0 + t) * k_st;
#pragma GCC unroll 4
  for (int dd = 0; dd < D; ++dd) {
    const __m512 q0 = _mm512_load_ps(qt + dd * kCols);
    const __m512 q1 = _mm512_load_ps(qt + dd * kCols + 16);
    for (int t = 0; t < NK; ++t) {
      const __m512 kv = _mm512_set1_ps(kr[t][dd]);
      acc[t][0] = _mm512_fmadd_ps(kv, q0, acc[t][0]);
      acc[t][1] = _mm512_fmadd_ps(kv, q1, acc[t][1]);
    }
  }
  for (int t = 0; t < NK; ++t) {
    _mm512_store_ps(st + (j0 + t) * kCols, acc[t][0]);
    _mm512_store_ps(st + (j0 + t) * kCols + 16, acc[t][1]);
  }
}

template <int N>
using Count = std::integral_constant<int, N>;

// Pass 1's last keys (fewer than kKeys1): block(Count<nk>{}), the count a compile-time constant.
template <typename Block>
inline void scores_tail(int64_t nk, Block&& block) {
  static_assert(kKeys1 == 8, "one case per tail length");
  switch (nk) {
    case 1: block(Count<1>{}); break;
    case 2: block(Count<2>{}); break;
    case 3: block(Count<3>{}); break;
    case 4: block(Count<4>{}); break;
    case 5: block(Count<5>{}); break;
    case 6: block(Count<6>{}); break;
    case 7: block(Count<7>{}); break;
    default: break;
  }
}

// Pass 2 for columns c0 .. c0 + NC - 1: O[col][:] = sum over keys < kv_end of e[key][col] V[key][:].
template <int DV, int NC>
inline void values_block(const float* st, const float* vh, int64_t v_st, int64_t kv_end, int c0,
                         __m512 (&acc)[NC][DV]) {
  for (int c = 0; c < NC; ++c)
    for (int i = 0; i < DV; ++i) acc[c][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < kv_end; ++j) {
    const float* vr = vh + j * v_st;
    __m512 vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = _mm512_loadu_ps(vr + 16 * i);
    const float* e = st + j * kCols + c0;
    for (int c = 0; c < NC; ++c) {
      const __m512 ec = _mm512_set1_ps(e[c]);
      for (int i = 0; i < DV; ++i) acc[c][i] = _mm512_fmadd_ps(ec, vv[i], acc[c][i]);
    }
  }
}

// The columns of one tile: which position each sees up to (-1: past the chunk's rows), the lowest,
// and the keys its last column sees.
struct Tile {
  int64_t r0, r1, pmin, kv_end;
  alignas(64) int32_t pos[kCols];
  Tile(const Shapes& s, int64_t tile) {
    r0 = tile * kCols;
    r1 = std::min(s.rows, r0 + kCols);
    for (int c = 0; c < kCols; ++c) pos[c] = r0 + c < r1 ? static_cast<int32_t>(s.start + (r0 + c) / s.g) : -1;
    pmin = s.start + r0 / s.g;
    kv_end = s.start + (r1 - 1) / s.g + 1;
  }
};

// After pass 1 (S^T[key][col] in st for keys < kv_end): each column's maximum over the keys it
// sees, the softmax numerators e written over s (0 where not visible), and 1 / l per column in inv.
inline void softmax_columns(const Shapes& s, const Tile& t, float* st, float* inv) {
  const int64_t pmin = t.pmin, kv_end = t.kv_end;
  const __m512i pos0 = _mm512_load_si512(t.pos);
  const __m512i pos1 = _mm512_load_si512(t.pos + 16);
  __m512 m0 = _mm512_set1_ps(-INFINITY), m1 = m0;
  const int64_t full = std::min(kv_end, pmin + 1);  // keys every column sees
  int64_t j = 0;
  for (; j < full; ++j) {
    m0 = _mm512_max_ps(m0, _mm512_load_ps(st + j * kCols));
    m1 = _mm512_max_ps(m1, _mm512_load_ps(st + j * kCols + 16));
  }
  for (; j < kv_end; ++j) {
    const __m512i jv = _mm512_set1_epi32(static_cast<int32_t>(j));
    m0 = _mm512_mask_max_ps(m0, _mm512_cmple_epi32_mask(jv, pos0), m0, _mm512_load_ps(st + j * kCols));
    m1 = _mm512_mask_max_ps(m1, _mm512_cmple_epi32_mask(jv, pos1), m1, _mm512_load_ps(st + j * kCols + 16));
  }
  // columns that see no key (past the chunk's rows): any finite maximum; they are never stored
  m0 = _mm512_mask_mov_ps(m0, _mm512_cmplt_epi32_mask(pos0, _mm512_setzero_si512()), _mm512_setzero_ps());
  m1 = _mm512_mask_mov_ps(m1, _mm512_cmplt_epi32_mask(pos1, _mm512_setzero_si512()), _mm512_setzero_ps());

  // softmax numerators, per column (lane), in place
  const __m512 c = _mm512_set1_ps(s.scale * 1.44269504088896341f);
  const __m512 mc0 = _mm512_mul_ps(m0, c), mc1 = _mm512_mul_ps(m1, c);
  __m512 l0 = _mm512_setzero_ps(), l1 = l0;
  for (j = 0; j < kv_end; ++j) {
    float* row = st + j * kCols;
    __m512 e0 = exp2_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(row), c, mc0));
    __m512 e1 = exp2_nonpositive(_mm512_fmsub_ps(_mm512_load_ps(row + 16), c, mc1));
    if (j > pmin) {  // not every column sees it
      const __m512i jv = _mm512_set1_epi32(static_cast<int32_t>(j));
      e0 = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(jv, pos0), e0);
      e1 = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(jv, pos1), e1);
    }
    l0 = _mm512_add_ps(l0, e0);
    l1 = _mm512_add_ps(l1, e1);
    _mm512_store_ps(row, e0);
    _mm512_store_ps(row + 16, e1);
  }
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l0));
  _mm512_store_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l1));
}

template <int DV>
void attend_tile(const Shapes& s, int64_t h, int64_t tile, const float* q, const float* k, const float* v,
                 float* out, float* qt, float* st) {
  constexpr int D = DV * 16;
  const Tile t(s, tile);
  const int64_t r0 = t.r0, r1 = t.r1, kv_end = t.kv_end;
  const float* kh = k + h * s.k_sh;
  const float* vh = v + h * s.v_sh;

  // Q^T: qt[d][col] (columns past the chunk's rows are zeros)
  std::memset(qt, 0, sizeof(float) * D * kCols);
  for (int c = 0; c < kCols; ++c) {
    if (t.pos[c] < 0) continue;
    const int64_t r = r0 + c;
    const float* src = q + (r / s.g) * s.q_st + (h * s.g + r % s.g) * s.q_sh;
    for (int dd = 0; dd < D; ++dd) qt[dd * kCols + c] = src[dd];
  }

  // pass 1, then softmax
  const int64_t full_blocks = kv_end / kKeys1;
  for (int64_t b = 0; b < full_blocks; ++b) scores_block<DV, kKeys1>(qt, kh, s.k_st, b * kKeys1, st);
  scores_tail(kv_end - full_blocks * kKeys1, [&](auto nk) {
    scores_block<DV, decltype(nk)::value>(qt, kh, s.k_st, full_blocks * kKeys1, st);
  });
  alignas(64) float inv[kCols];
  softmax_columns(s, t, st, inv);

  // pass 2, NC columns at a time (NC * DV accumulators: 16)
  constexpr int NC = DV >= 16 ? 1 : 16 / DV;
  const int live = static_cast<int>(r1 - r0);
  for (int c0 = 0; c0 < live; c0 += NC) {
    __m512 acc[NC][DV];
    values_block<DV, NC>(st, vh, s.v_st, kv_end, c0, acc);
    for (int cc = 0; cc < NC && c0 + cc < live; ++cc) {
      const int64_t r = r0 + c0 + cc;
      float* dst = out + ((r / s.g) * s.hq + h * s.g + r % s.g) * D;
      const __m512 iv = _mm512_set1_ps(inv[c0 + cc]);
      for (int i = 0; i < DV; ++i) _mm512_storeu_ps(dst + 16 * i, _mm512_mul_ps(acc[cc][i], iv));
    }
  }
}

#if CF_HAVE_BF16_DOTS

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
}

inline uint32_t pair_at(const uint16_t* p) {  // p[0] in the low half, p[1] in the high half
  uint32_t w;
  std::memcpy(&w, p, sizeof w);
  return w;
}

// Pass 1 with bf16 pairs for keys j0 .. j0 + NK - 1: qp[p][col] holds (Q[col][2p], Q[col][2p+1]).
template <int DV, int NK>
inline void scores_block_bf16(const uint32_t* qp, const uint16_t* kh, int64_t k_st, int64_t j0, float* st) {
  constexpr int P = DV * 8;  // pairs of d per row
  __m512 acc[NK][2];
  for (int t = 0; t < NK; ++t) acc[t][0] = acc[t][1] = _mm512_setzero_ps();
  const uint16_t* kr[NK];
  for (int t = 0; t < NK; ++t) kr[t] = kh + (j0 + t) * k_st;
#pragma GCC unroll 4
  for (int pp = 0; pp < P; ++pp) {
    const __m512i q0 = _mm512_load_si512(qp + pp * kCols);
    const __m512i q1 = _mm512_load_si512(qp + pp * kCols + 16);
    for (int t = 0; t < NK; ++t) {
      const __m512i kv = _mm512_set1_epi32(static_cast<int32_t>(pair_at(kr[t] + 2 * pp)));
      acc[t][0] = dot_pairs(acc[t][0], q0, kv);
      acc[t][1] = dot_pairs(acc[t][1], q1, kv);
    }
  }
  for (int t = 0; t < NK; ++t) {
    _mm512_store_ps(st + (j0 + t) * kCols, acc[t][0]);
    _mm512_store_ps(st + (j0 + t) * kCols + 16, acc[t][1]);
  }
}

// One KV head's values as key pairs: vp[j][d] = (V[2j][d], V[2j+1][d]), a missing key 2j+1 as 0.
template <int DV>
void pair_values(const uint16_t* vh, int64_t v_st, int64_t keys, uint32_t* vp) {
  constexpr int D = DV * 16;
  for (int64_t j = 0; 2 * j < keys; ++j) {
    const uint16_t* a = vh + 2 * j * v_st;
    const uint16_t* b = 2 * j + 1 < keys ? a + v_st : nullptr;
    for (int i = 0; i < DV; ++i) {
      const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 16 * i)));
      const __m512i hi = b ? _mm512_slli_epi32(_mm512_cvtepu16_epi32(
                                 _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 * i))), 16)
                           : _mm512_setzero_si512();
      _mm512_store_si512(vp + j * D + 16 * i, _mm512_or_si512(lo, hi));
    }
  }
}

// The numerators e (float32, in st) rounded to bf16 and paired by key: ep[j][col] = (e[2j][col],
// e[2j+1][col]), the key past kv_end as 0.
inline void pair_numerators(const float* st, int64_t kv_end, uint32_t* ep) {
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                              23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  for (int64_t j = 0; 2 * j < kv_end; ++j) {
    const float* a = st + 2 * j * kCols;
    const bool has_b = 2 * j + 1 < kv_end;
    for (int half = 0; half < 2; ++half) {
      const __m512 lo = _mm512_load_ps(a + 16 * half);
      const __m512 hi = has_b ? _mm512_load_ps(a + kCols + 16 * half) : _mm512_setzero_ps();
      const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // lo's 16 low, hi's 16 high
      _mm512_store_si512(ep + j * kCols + 16 * half, _mm512_permutexvar_epi16(interleave, both));
    }
  }
}

// Pass 2 with bf16 pairs for columns c0 .. c0 + NC - 1, over key pairs < pairs.
template <int DV, int NC>
inline void values_block_bf16(const uint32_t* ep, const uint32_t* vp, int64_t pairs, int c0,
                              __m512 (&acc)[NC][DV]) {
  constexpr int D = DV * 16;
  for (int c = 0; c < NC; ++c)
    for (int i = 0; i < DV; ++i) acc[c][i] = _mm512_setzero_ps();
  for (int64_t j = 0; j < pairs; ++j) {
    __m512i vv[DV];
    for (int i = 0; i < DV; ++i) vv[i] = _mm512_load_si512(vp + j * D + 16 * i);
    const uint32_t* e = ep + j * kCols + c0;
    for (int c = 0; c < NC; ++c) {
      const __m512i ec = _mm512_set1_epi32(static_cast<int32_t>(e[c]));
      for (int i = 0; i < DV; ++i) acc[c][i] = dot_pairs(acc[c][i], ec, vv[i]);
    }
  }
}

// Per-thread scratch of the bf16 path (freed with it; ok() false where an allocation failed).
struct Bf16Scratch {
  Buffer<uint32_t> qp;  // [D / 2][32]
  Buffer<float> st;     // [ctx + 1][32]
  Buffer<uint32_t> ep;  // [ctx / 2 + 1][32]
  Bf16Scratch(int64_t d, int64_t ctx) : qp(d / 2 * kCols), st((ctx + 1) * kCols), ep((ctx / 2 + 1) * kCols) {}
  bool ok() const { return qp && st && ep; }
};

template <int DV>
void attend_tile_bf16(const Shapes& s, int64_t h, int64_t tile, const uint16_t* q, const uint16_t* k,
                      const uint32_t* vp, uint16_t* out, const Bf16Scratch& w) {
  constexpr int D = DV * 16;
  const Tile t(s, tile);
  const int64_t r0 = t.r0, r1 = t.r1, kv_end = t.kv_end;
  const uint16_t* kh = k + h * s.k_sh;

  // Q^T as pairs (columns past the chunk's rows are zeros)
  std::memset(w.qp.p, 0, sizeof(uint32_t) * (D / 2) * kCols);
  for (int c = 0; c < kCols; ++c) {
    if (t.pos[c] < 0) continue;
    const int64_t r = r0 + c;
    const uint16_t* src = q + (r / s.g) * s.q_st + (h * s.g + r % s.g) * s.q_sh;
    for (int pp = 0; pp < D / 2; ++pp) w.qp.p[pp * kCols + c] = pair_at(src + 2 * pp);
  }

  const int64_t full_blocks = kv_end / kKeys1;
  for (int64_t b = 0; b < full_blocks; ++b) scores_block_bf16<DV, kKeys1>(w.qp.p, kh, s.k_st, b * kKeys1, w.st.p);
  scores_tail(kv_end - full_blocks * kKeys1, [&](auto nk) {
    scores_block_bf16<DV, decltype(nk)::value>(w.qp.p, kh, s.k_st, full_blocks * kKeys1, w.st.p);
  });
  alignas(64) float inv[kCols];
  softmax_columns(s, t, w.st.p, inv);
  pair_numerators(w.st.p, kv_end, w.ep.p);

  constexpr int NC = DV >= 16 ? 1 : 16 / DV;
  const int live = static_cast<int>(r1 - r0);
  for (int c0 = 0; c0 < live; c0 += NC) {
    __m512 acc[NC][DV];
    values_block_bf16<DV, NC>(w.ep.p, vp + h * ((s.start + s.n + 1) / 2) * D, (kv_end + 1) / 2, c0, acc);
    for (int cc = 0; cc < NC && c0 + cc < live; ++cc) {
      const int64_t r = r0 + c0 + cc;
      uint16_t* dst = out + ((r / s.g) * s.hq + h * s.g + r % s.g) * D;
      const __m512 iv = _mm512_set1_ps(inv[c0 + cc]);
      for (int i = 0; i < DV; ++i) cf_bf16::store16(dst + 16 * i, _mm512_mul_ps(acc[cc][i], iv));
    }
  }
}

template <int DV>
int run_bf16(const Shapes& s, const uint16_t* q, const uint16_t* k, const uint16_t* v, uint16_t* out,
             int threads) {
  constexpr int D = DV * 16;
  const int64_t ctx = s.start + s.n;
  const int64_t pairs = (ctx + 1) / 2;
  const Buffer<uint32_t> vp(s.hkv * pairs * D);
  if (!vp) return 4;
  for (int64_t h = 0; h < s.hkv; ++h) pair_values<DV>(v + h * s.v_sh, s.v_st, ctx, vp.p + h * pairs * D);
  return for_each_tile(s, threads, [&] { return Bf16Scratch(D, ctx); },
                       [&](int64_t h, int64_t tile, const Bf16Scratch& w) {
                         attend_tile_bf16<DV>(s, h, tile, q, k, vp.p, out, w);
                       });
}

#endif  // CF_HAVE_BF16_DOTS

// Per-thread scratch of the float32 path.
struct Float32Scratch {
  Buffer<float> qt;  // [D][32]
  Buffer<float> st;  // [ctx + 1][32]: one row more than the keys, pass 2's last group of columns may read it
  Float32Scratch(int64_t d, int64_t ctx) : qt(d * kCols), st((ctx + 1) * kCols) {}
  bool ok() const { return qt && st; }
};

template <int DV>
int run(const Shapes& s, const float* q, const float* k, const float* v, float* out, int threads) {
  const int64_t ctx = s.start + s.n;
  return for_each_tile(s, threads, [&] { return Float32Scratch(DV * 16, ctx); },
                       [&](int64_t h, int64_t tile, const Float32Scratch& w) {
                         attend_tile<DV>(s, h, tile, q, k, v, out, w.qt.p, w.st.p);
                       });
}

// run(Count<d / 16>{}) for the head dims compiled (HEAD_DIMS in the .py), 3 for any other.
template <typename Run>
int with_head_dim(int64_t d, Run&& run) {
  switch (d / 16) {
    case 1: return run(Count<1>{});
    case 2: return run(Count<2>{});
    case 3: return run(Count<3>{});
    case 4: return run(Count<4>{});
    case 5: return run(Count<5>{});
    case 6: return run(Count<6>{});
    case 7: return run(Count<7>{});
    case 8: return run(Count<8>{});
    case 12: return run(Count<12>{});
    case 16: return run(Count<16>{});
    default: return 3;
  }
}

// The shapes of a call, or false where the kernel does not take them.
bool make_shapes(int64_t q_st, int64_t q_sh, int64_t k_sh, int64_t k_st, int64_t v_sh, int64_t v_st, int64_t n,
                 int64_t hq, int64_t hkv, int64_t d, int64_t start, float scale, Shapes& s) {
  if (n <= 0 || hkv <= 0 || hq % hkv != 0 || d % 16 != 0 || d > kMaxHeadDim || start < 0) return false;
  s.n = n;
  s.hq = hq;
  s.hkv = hkv;
  s.d = d;
  s.start = start;
  s.g = hq / hkv;
  s.rows = n * s.g;
  s.tiles = (s.rows + kCols - 1) / kCols;
  s.q_st = q_st;
  s.q_sh = q_sh;
  s.k_sh = k_sh;
  s.k_st = k_st;
  s.v_sh = v_sh;
  s.v_st = v_st;
  s.scale = scale;
  return true;
}
#endif

}  // namespace

// 0: built with AVX-512; 1: not.
extern "C" int cf_avx512_built() { return CF_HAVE_AVX512 ? 0 : 1; }

// 0: built with AVX512_BF16's pair dot products (cf_chunk_attention_avx512_bf16 runs); 1: not.
extern "C" int cf_avx512_bf16_built() { return CF_HAVE_BF16_DOTS ? 0 : 1; }

// Returns 0, or a nonzero code for shapes it does not take (the caller checks them first).
extern "C" int cf_chunk_attention_avx512(const float* q, int64_t q_st, int64_t q_sh, const float* k, int64_t k_sh,
                                         int64_t k_st, const float* v, int64_t v_sh, int64_t v_st, float* out,
                                         int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t start, float scale,
                                         int threads) {
#if CF_HAVE_AVX512
  Shapes s;
  if (!make_shapes(q_st, q_sh, k_sh, k_st, v_sh, v_st, n, hq, hkv, d, start, scale, s)) return 3;
  if (threads < 1) threads = 1;
  return with_head_dim(d, [&](auto dv) { return run<decltype(dv)::value>(s, q, k, v, out, threads); });
#else
  (void)q; (void)q_st; (void)q_sh; (void)k; (void)k_sh; (void)k_st; (void)v; (void)v_sh; (void)v_st;
  (void)out; (void)n; (void)hq; (void)hkv; (void)d; (void)start; (void)scale; (void)threads;
  return 1;
#endif
}

// The same for bf16 q, k, v and out (bf16 bits), with pair dot products; 1 where not built with them.
extern "C" int cf_chunk_attention_avx512_bf16(const uint16_t* q, int64_t q_st, int64_t q_sh, const uint16_t* k,
                                              int64_t k_sh, int64_t k_st, const uint16_t* v, int64_t v_sh,
                                              int64_t v_st, uint16_t* out, int64_t n, int64_t hq, int64_t hkv,
                                              int64_t d, int64_t start, float scale, int threads) {
#if CF_HAVE_BF16_DOTS
  Shapes s;
  if (!make_shapes(q_st, q_sh, k_sh, k_st, v_sh, v_st, n, hq, hkv, d, start, scale, s)) return 3;
  if (threads < 1) threads = 1;
  return with_head_dim(d, [&](auto dv) { return run_bf16<decltype(dv)::value>(s, q, k, v, out, threads); });
#else
  (void)q; (void)q_st; (void)q_sh; (void)k; (void)k_sh; (void)k_st; (void)v; (void)v_sh; (void)v_st;
  (void)out; (void)n; (void)hq; (void)hkv; (void)d; (void)start; (void)scale; (void)threads;
  return 1;
#endif
}
