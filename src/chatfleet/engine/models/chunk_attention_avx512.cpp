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
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#define CF_HAVE_AVX512 1
#else
#define CF_HAVE_AVX512 0
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

template <int DV>
inline void scores_tail(const float* qt, const float* kh, int64_t k_st, int64_t j0, int64_t nk, float* st) {
  switch (nk) {
    case 1: scores_block<DV, 1>(qt, kh, k_st, j0, st); break;
    case 2: scores_block<DV, 2>(qt, kh, k_st, j0, st); break;
    case 3: scores_block<DV, 3>(qt, kh, k_st, j0, st); break;
    case 4: scores_block<DV, 4>(qt, kh, k_st, j0, st); break;
    case 5: scores_block<DV, 5>(qt, kh, k_st, j0, st); break;
    case 6: scores_block<DV, 6>(qt, kh, k_st, j0, st); break;
    case 7: scores_block<DV, 7>(qt, kh, k_st, j0, st); break;
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

template <int DV>
void attend_tile(const Shapes& s, int64_t h, int64_t tile, const float* q, const float* k, const float* v,
                 float* out, float* qt, float* st) {
  constexpr int D = DV * 16;
  const int64_t r0 = tile * kCols;
  const int64_t r1 = std::min(s.rows, r0 + kCols);
  alignas(64) int32_t pos[kCols];
  for (int c = 0; c < kCols; ++c) pos[c] = r0 + c < r1 ? static_cast<int32_t>(s.start + (r0 + c) / s.g) : -1;
  const int64_t pmin = s.start + r0 / s.g;
  const int64_t kv_end = s.start + (r1 - 1) / s.g + 1;  // keys the tile's last column sees
  const float* kh = k + h * s.k_sh;
  const float* vh = v + h * s.v_sh;

  // Q^T: qt[d][col] (columns past the chunk's rows are zeros)
  std::memset(qt, 0, sizeof(float) * D * kCols);
  for (int c = 0; c < kCols; ++c) {
    if (pos[c] < 0) continue;
    const int64_t r = r0 + c;
    const float* src = q + (r / s.g) * s.q_st + (h * s.g + r % s.g) * s.q_sh;
    for (int dd = 0; dd < D; ++dd) qt[dd * kCols + c] = src[dd];
  }

  // pass 1, then the maximum over the keys each column sees
  const __m512i pos0 = _mm512_load_si512(pos);
  const __m512i pos1 = _mm512_load_si512(pos + 16);
  const int64_t full_blocks = kv_end / kKeys1;
  for (int64_t b = 0; b < full_blocks; ++b) scores_block<DV, kKeys1>(qt, kh, s.k_st, b * kKeys1, st);
  scores_tail<DV>(qt, kh, s.k_st, full_blocks * kKeys1, kv_end - full_blocks * kKeys1, st);
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
  alignas(64) float inv[kCols];
  _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), l0));
  _mm512_store_ps(inv + 16, _mm512_div_ps(_mm512_set1_ps(1.0f), l1));

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

// Returns 0, or 4 where a thread's scratch could not be allocated (its tiles are then not written).
template <int DV>
int run(const Shapes& s, const float* q, const float* k, const float* v, float* out, int threads) {
  const int64_t ctx = s.start + s.n;
  int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* qt = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * DV * 16 * kCols));
    // one row more than the keys: pass 2's last group of columns may read past a row's 32
    float* st = static_cast<float*>(std::aligned_alloc(64, sizeof(float) * (ctx + 1) * kCols));
#pragma omp for schedule(dynamic, 1)
    for (int64_t w = 0; w < s.hkv * s.tiles; ++w) {
      // the longest tiles (last rows: most keys) first, for the dynamic schedule
      const int64_t h = w % s.hkv;
      const int64_t tile = s.tiles - 1 - w / s.hkv;
      if (qt == nullptr || st == nullptr) {
#pragma omp atomic write
        failed = 1;
        continue;
      }
      attend_tile<DV>(s, h, tile, q, k, v, out, qt, st);
    }
    std::free(st);
    std::free(qt);
  }
  return failed ? 4 : 0;
}

#endif  // CF_HAVE_AVX512

}  // namespace

// 0: built with AVX-512; 1: not.
extern "C" int cf_avx512_built() { return CF_HAVE_AVX512 ? 0 : 1; }

// Returns 0, or a nonzero code for shapes it does not take (the caller checks them first).
extern "C" int cf_chunk_attention_avx512(const float* q, int64_t q_st, int64_t q_sh, const float* k, int64_t k_sh,
                                         int64_t k_st, const float* v, int64_t v_sh, int64_t v_st, float* out,
                                         int64_t n, int64_t hq, int64_t hkv, int64_t d, int64_t start, float scale,
                                         int threads) {
#if CF_HAVE_AVX512
  if (n <= 0 || hkv <= 0 || hq % hkv != 0 || d % 16 != 0 || d > kMaxHeadDim || start < 0) return 3;
  Shapes s;
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
  if (threads < 1) threads = 1;
  switch (d / 16) {
    case 1: return run<1>(s, q, k, v, out, threads);
    case 2: return run<2>(s, q, k, v, out, threads);
    case 3: return run<3>(s, q, k, v, out, threads);
    case 4: return run<4>(s, q, k, v, out, threads);
    case 5: return run<5>(s, q, k, v, out, threads);
    case 6: return run<6>(s, q, k, v, out, threads);
    case 7: return run<7>(s, q, k, v, out, threads);
    case 8: return run<8>(s, q, k, v, out, threads);
    case 12: return run<12>(s, q, k, v, out, threads);
    case 16: return run<16>(s, q, k, v, out, threads);
    default: return 3;
  }
#else
  (void)q; (void)q_st; (void)q_sh; (void)k; (void)k_sh; (void)k_st; (void)v; (void)v_sh; (void)v_st;
  (void)out; (void)n; (void)hq; (void)hkv; (void)d; (void)start; (void)scale; (void)threads;
  return 1;
#endif
}
