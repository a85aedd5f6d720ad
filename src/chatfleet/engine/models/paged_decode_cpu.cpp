// Paged decode attention on the CPU: one query token per sequence over its K/V read in place
// from the block pool (see cpu_paged_decode.py for why it is hand-written and how it is built).
//
// key/value: [num_kv_heads, num_blocks, block_size, head_dim] (float32 or bfloat16 bits, as q, or
// FP8 e4m3 bytes read as code * k_scale / code * v_scale); q, out: [batch, num_heads, head_dim]
// (float32 or bfloat16 bits); block_tables: [batch, table_width] int64; context_lens: [batch]
// int64. Query heads h * group .. h * group + group - 1 share kv head h. Scores, softmax and the
// weighted sum of V are float32; out is rounded once.
#include <immintrin.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "bf16_bits.h"
#include "paged_decode_amx.h"
#include "vec_exp2.h"

namespace {

cf_amx::Switch g_amx;  // bf16 over a bf16 cache on AMX tiles (cf_paged_amx_init grants, cf_paged_use_amx switches)

// Whether the AVX-512 paths prefetch the block two ahead also where it continues a run of blocks
// in memory (cf_paged_prefetch_runs switches). AMD: no, the hardware prefetcher streams on into it
// and a software prefetch there only competed with it (Zen 4: 0.82x-0.89x the kernel's time in
// runs of 8 blocks without them). Intel: yes, its prefetcher did not keep up alone (AMX Xeon, float32
// b32 x 516 tokens x 8 layers, blocks in order, paired: 0.81x the kernel's time with them at one
// thread, 0.72x at two; 0.87x at 2,000 tokens; whole decode steps 0.92x-0.93x).
int prefetch_runs_here() {
  __builtin_cpu_init();
  return __builtin_cpu_is("amd") ? 0 : 1;
}
int g_prefetch_runs = prefetch_runs_here();

// Per thread: the AVX-512 paths' scores and, where built, the AMX path's buffers.
struct Workspace {
  std::vector<float> scores;
#if CF_PAGED_AMX
  cf_paged_amx::Scratch amx;
  bool tiles_used = false;
#endif
};

// One e4m3 code (s eeee mmm, exponent bias 7, no infinities) as its exact float32 value: normal
// codes by moving the bits (exponent rebased 7 -> 127), zero and subnormal codes as m * 2^-9.
// The NaN code (0x7f / 0xff) is never written to a cache and converts to 480.
inline float fp8_to_float(uint8_t x) {
  const uint32_t n = x & 0x7fu;
  const uint32_t bits = (n << 20) + (120u << 23);
  float normal = 0.f;
  std::memcpy(&normal, &bits, sizeof normal);
  const float f = n >= 8 ? normal : static_cast<float>(n) * (1.f / 512.f);
  return x & 0x80u ? -f : f;
}

template <typename T>
inline void load_row(const T* src, float* dst, int d);

template <>
inline void load_row<uint8_t>(const uint8_t* src, float* dst, int d) {
  for (int i = 0; i < d; ++i) dst[i] = fp8_to_float(src[i]);
}

template <>
inline void load_row<float>(const float* src, float* dst, int d) {
  for (int i = 0; i < d; ++i) dst[i] = src[i];
}

template <>
inline void load_row<uint16_t>(const uint16_t* src, float* dst, int d) {
  for (int i = 0; i < d; ++i) dst[i] = cf_bf16::to_float(src[i]);
}

inline void store_row(const float* src, float* dst, int d, float s) {
  for (int i = 0; i < d; ++i) dst[i] = src[i] * s;
}

inline void store_row(const float* src, uint16_t* dst, int d, float s) {
  for (int i = 0; i < d; ++i) dst[i] = cf_bf16::from_float(src[i] * s);
}

// Calls f(t, row) for positions t = 0 .. ctx - 1 of one kv head, block by block through `table`,
// each row read once in place and widened to float32 in `row` (a stack copy: the callers' loops
// then vectorize freely). Blocks sit anywhere in the pool (a float32 block of 16 x 64 is one
// 4 KiB page) and the hardware prefetcher stops at page boundaries, so the block two ahead is
// requested in software, one row's lines per row read: spread out, the requests never queue up
// behind each other as a whole block's 64 at once did (b32, 520 tokens, 8 layers, float32, one
// thread, Xeon 6/207: 16.8 -> 12.9 ms with scattered blocks, 13.5 -> 12.0 ms with blocks in order).
template <typename T, typename F>
inline void for_each_row(const T* cache, const int64_t* table, int64_t ctx, int64_t head_offset, int block_size,
                         int d, float* row, F&& f) {
  constexpr int kAhead = 2;  // blocks
  const int64_t nblk = (ctx + block_size - 1) / block_size;
  const int64_t row_bytes = static_cast<int64_t>(d) * static_cast<int64_t>(sizeof(T));
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const T* blk = cache + (head_offset + table[bi] * block_size) * d;
    const char* ahead = bi + kAhead < nblk
        ? reinterpret_cast<const char*>(cache + (head_offset + table[bi + kAhead] * block_size) * d) : nullptr;
    const int64_t t0 = bi * block_size;
    const int n = static_cast<int>(ctx - t0 < block_size ? ctx - t0 : block_size);
    for (int o = 0; o < n; ++o) {
      if (ahead) {
        for (int64_t off = 0; off < row_bytes; off += 64) __builtin_prefetch(ahead + o * row_bytes + off);
      }
      load_row<T>(blk + static_cast<int64_t>(o) * d, row, d);
      f(t0 + o, static_cast<const float*>(row));
    }
  }
}

// s[t] = exp(s[t] - max) for the ctx scores of one query head, in place; returns 1 / their sum.
inline float softmax_numerators(float* s, int64_t ctx) {
  float m = -FLT_MAX;  // scores are finite (-ffast-math assumes no infinities)
  for (int64_t t = 0; t < ctx; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
  for (int64_t t = 0; t < ctx; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return 1.f / sum;
}

constexpr int MAX_HEAD_DIM = 512;

// D: the head dim as a compile-time constant (64, 128, 256: the inner loops unroll), or 0 for
// any other head dim up to MAX_HEAD_DIM, read from `head_dim`.
// C: the cache's element (T, or uint8_t for FP8, whose V scale arrives in v_scale; its K scale
// is already in scale).
template <typename T, typename C, int D>
void attend_one(const T* q, const C* key, const C* value, T* out, const int64_t* table, int64_t ctx,
                int group, int64_t head_offset, int block_size, float scale, float v_scale,
                std::vector<float>& scores, int head_dim) {
  constexpr int N = D ? D : MAX_HEAD_DIM;
  const int d = D ? D : head_dim;
  const int G = group;
  scores.resize(static_cast<size_t>(G) * ctx);
  float qf[8][N];
  float acc[8][N];
  float row[N];
  for (int g = 0; g < G; ++g) {
    load_row<T>(q + static_cast<int64_t>(g) * d, qf[g], d);
    for (int i = 0; i < d; ++i) qf[g][i] *= scale;
  }
  // Scores: every key row read once (block by block, in place), dotted with the group's query heads.
  for_each_row(key, table, ctx, head_offset, block_size, d, row, [&](int64_t t, const float* k) {
    for (int g = 0; g < G; ++g) {
      float s = 0.f;
      for (int i = 0; i < d; ++i) s += qf[g][i] * k[i];
      scores[static_cast<size_t>(g) * ctx + t] = s;
    }
  });
  float inv_sum[8];
  for (int g = 0; g < G; ++g) {
    inv_sum[g] = softmax_numerators(scores.data() + static_cast<size_t>(g) * ctx, ctx) * v_scale;
    for (int i = 0; i < d; ++i) acc[g][i] = 0.f;
  }
  // Weighted sum of V: every value row read once.
  for_each_row(value, table, ctx, head_offset, block_size, d, row, [&](int64_t t, const float* v) {
    for (int g = 0; g < G; ++g) {
      const float p = scores[static_cast<size_t>(g) * ctx + t];
      for (int i = 0; i < d; ++i) acc[g][i] += p * v[i];
    }
  });
  for (int g = 0; g < G; ++g) store_row(acc[g], out + static_cast<int64_t>(g) * d, d, inv_sum[g]);
}

#if defined(__AVX512F__)
#define CF_HAVE_AVX512 1

// Per 128-bit lane h: [the sum of a's 4 lanes there, b's, c's, d's] (FourHeads: lane h of each of
// a..d holds one head's 4 partials; sum16: its first two levels).
inline __m512 sum4x4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b));
  const __m512 cd = _mm512_add_ps(_mm512_unpacklo_ps(c, d), _mm512_unpackhi_ps(c, d));
  const __m512d x = _mm512_castps_pd(ab), y = _mm512_castps_pd(cd);
  return _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
}

// r[i] = the sum of v[i]'s 16 lanes, for i = 0 .. 15: pairs of vectors added in 128-bit lanes,
// then pairs of pairs (sum4x4), then the four 128-bit lanes across (45 instructions for 16 sums,
// where one horizontal sum per vector takes ~8 and serializes).
inline __m512 sum16(const __m512* v) {
  __m512 b[4];
  for (int i = 0; i < 4; ++i) b[i] = sum4x4(v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]);
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], 0x88), _mm512_shuffle_f32x4(b[0], b[1], 0xDD));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], 0x88), _mm512_shuffle_f32x4(b[2], b[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, 0x88), _mm512_shuffle_f32x4(c0, c1, 0xDD));
}

// The first n lanes (none for n <= 0, all 16 for n >= 16).
inline __mmask16 first_lanes(int64_t n) {
  return static_cast<__mmask16>((1u << (n < 0 ? 0 : n > 16 ? 16 : n)) - 1);
}

#if defined(__AVX512DQ__)
// softmax_numerators 16 scores at a time, for the bf16 cache (its outputs are rounded to bf16:
// vec_exp2.h's 2^x, relative error < 3e-6, instead of libm's exp; the max and the sum in 4
// chains each). s is padded to a multiple of 16 (the pad is not read: masked loads). b32 x 500
// tokens x 8 layers, bf16, one thread of an AMX Xeon: the softmax 0.85 -> ~0.25 ms of ~5.4.
inline float softmax_numerators16(float* s, int64_t ctx) {
  const int64_t whole = ctx / 16 * 16;
  const __mmask16 tail = first_lanes(ctx - whole);
  __m512 m4[4] = {_mm512_set1_ps(-FLT_MAX), _mm512_set1_ps(-FLT_MAX), _mm512_set1_ps(-FLT_MAX),
                  _mm512_set1_ps(-FLT_MAX)};
  int64_t t = 0;
  for (; t < whole; t += 16) m4[(t >> 4) & 3] = _mm512_max_ps(m4[(t >> 4) & 3], _mm512_loadu_ps(s + t));
  if (tail) m4[0] = _mm512_mask_max_ps(m4[0], tail, m4[0], _mm512_maskz_loadu_ps(tail, s + whole));
  const float m = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m4[0], m4[1]), _mm512_max_ps(m4[2], m4[3])));
  const __m512 c = _mm512_set1_ps(1.44269504088896341f), mc = _mm512_set1_ps(m * 1.44269504088896341f);
  __m512 sum4[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (t = 0; t < whole; t += 16) {
    const __m512 e = cf_vec::exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(s + t), c, mc));
    _mm512_storeu_ps(s + t, e);
    sum4[(t >> 4) & 3] = _mm512_add_ps(sum4[(t >> 4) & 3], e);
  }
  if (tail) {
    const __m512 e = cf_vec::exp2_nonpositive(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(tail, s + whole), c, mc));
    _mm512_mask_storeu_ps(s + whole, tail, e);
    sum4[0] = _mm512_add_ps(sum4[0], _mm512_maskz_mov_ps(tail, e));
  }
  return 1.f / _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(sum4[0], sum4[1]), _mm512_add_ps(sum4[2], sum4[3])));
}
#endif

// 16 values of a row as float32 (bf16 and e4m3 widened exactly).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return cf_bf16::load16(p); }

#if defined(__AVX512BW__)
// 16 e4m3 codes -> 16 floats, exactly as fp8_to_float: normal codes by moving the bits, codes
// under 8 (zero and subnormals) as m * 2^-9, the sign moved from bit 7 to bit 31.
inline __m512 load16(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m512i n = _mm512_and_si512(x, _mm512_set1_epi32(0x7f));
  const __m512 normal = _mm512_castsi512_ps(_mm512_add_epi32(_mm512_slli_epi32(n, 20), _mm512_set1_epi32(120 << 23)));
  const __m512 small = _mm512_mul_ps(_mm512_cvtepi32_ps(n), _mm512_set1_ps(1.f / 512.f));
  const __m512 mag = _mm512_mask_blend_ps(_mm512_cmpge_epi32_mask(n, _mm512_set1_epi32(8)), small, normal);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(x, _mm512_set1_epi32(0x80)), 24);
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(mag), sign));
}

// 32 e4m3 codes -> 32 bf16 bits, exact (every e4m3 value is a bf16): normal codes by moving the
// bits, codes under 8 from a table of m * 2^-9.
inline __m512i fp8_to_bf16_32(const uint8_t* p) {
  const __m512i x = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __m512i n = _mm512_and_si512(x, _mm512_set1_epi16(0x7f));
  const __m512i normal = _mm512_add_epi16(_mm512_slli_epi16(n, 4), _mm512_set1_epi16(120 << 7));
  // m * 2^-9 for m = 0..7 as bf16: 0, 2^-9, 2^-8, 1.5 * 2^-8, 2^-7, 1.25 * 2^-7, 1.5 * 2^-7, 1.75 * 2^-7
  const __m512i table = _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 0, 0, 0, 0, 0, 0, 0, 0x3c60, 0x3c40, 0x3c20, 0x3c00, 0x3bc0, 0x3b80,
                                         0x3b00, 0);
  const __m512i small = _mm512_permutexvar_epi16(n, table);
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_cmpge_epu16_mask(n, _mm512_set1_epi16(8)), small, normal);
  return _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(x, _mm512_set1_epi16(0x80)), 8));
}

// One e4m3 row of D codes widened into the query's element type (bf16 bits or float32), exactly.
template <int D>
inline void widen_fp8_row(const uint8_t* src, uint16_t* dst) {
  for (int j = 0; j < D; j += 32) _mm512_storeu_si512(dst + j, fp8_to_bf16_32(src + j));
}
template <int D>
inline void widen_fp8_row(const uint8_t* src, float* dst) {
  for (int j = 0; j < D; j += 16) _mm512_storeu_ps(dst + j, load16(src + j));
}
#define CF_HAVE_FP8_VEC 1
#else
#define CF_HAVE_FP8_VEC 0
#endif

// A query row in the form its dot products take: float32 vectors for a float32 cache; for bf16,
// with AVX512-BF16, the raw pairs vdpbf16ps multiplies exactly and sums in float32.
#if defined(__AVX512BF16__)
constexpr bool kPairDots = true;
#else
constexpr bool kPairDots = false;
#endif

template <typename T, int D>
struct QueryRow {
  static constexpr bool pairs = kPairDots && std::is_same_v<T, uint16_t>;
  static constexpr int N = pairs ? D / 32 : D / 16;
  __m512 v[N];
  void load(const T* q) {
    for (int j = 0; j < N; ++j) {
      if constexpr (pairs) v[j] = _mm512_castsi512_ps(_mm512_loadu_si512(q + 32 * j));
      else v[j] = load16(q + 16 * j);
    }
  }
  // 16 lanes whose sum is q . k
  __m512 dot_lanes(const T* k) const {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < N; ++j) {
#if defined(__AVX512BF16__)
      if constexpr (pairs) {
        a = _mm512_dpbf16_ps(a, (__m512bh)v[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
        continue;
      }
#endif
      if constexpr (!pairs) a = _mm512_fmadd_ps(v[j], load16(k + 16 * j), a);
    }
    return a;
  }
};

// Four query heads (G = 4) dotted with one key row at once: lane l of the sum holds head l / 4's
// partial over the elements (bf16: pairs of d) 4j + l % 4, so each iteration j broadcasts 16 bytes
// of the key row (4 elements) to the 4 heads' 128-bit lanes, and a key's 4 scores are its 4
// lanes' sums. sum4x4 then adds 4 keys' partials in two levels of unpack-and-add (9 instructions
// for 16 scores, where sum16 takes 45 for 16): the score pass's vector operations drop by ~40%.
// Same products and float32 sums as QueryRow, added in another order. Zen 4, one thread, small
// (8 heads on 2 kv heads), ~530 tokens: 0.76x-0.88x the kernel's time (b8, b32, blocks in order
// or scattered, bf16 and float32); whole decode steps 0.91x-0.98x at b8, 0.94x-0.96x at b32.
template <typename T, int D>
struct FourHeads {
  static constexpr bool pairs = kPairDots && std::is_same_v<T, uint16_t>;
  static constexpr bool ok = pairs || std::is_same_v<T, float>;
  static constexpr int J = pairs ? D / 8 : D / 4;  // iterations: 4 elements a head each
  __m512 v[J];
  void load(const T* q) {  // q: the 4 heads' rows, D values each
    alignas(64) uint32_t lane[16 * J];
    for (int j = 0; j < J; ++j)
      for (int l = 0; l < 16; ++l) {
        const T* e = q + (l / 4) * D + (pairs ? 2 : 1) * (4 * j + l % 4);
        std::memcpy(&lane[16 * j + l], e, sizeof(uint32_t));  // a bf16 pair, or one float32
      }
    for (int j = 0; j < J; ++j) v[j] = _mm512_castsi512_ps(_mm512_load_si512(lane + 16 * j));
  }
  __m512 dot(const T* k) const {
    __m512 a = _mm512_setzero_ps();
    for (int j = 0; j < J; ++j) {
      const auto* chunk = reinterpret_cast<const __m128i*>(k + (pairs ? 8 : 4) * j);  // 4 elements
      const __m512i kb = _mm512_broadcast_i32x4(_mm_loadu_si128(chunk));
#if defined(__AVX512BF16__)
      if constexpr (pairs) {
        a = _mm512_dpbf16_ps(a, (__m512bh)v[j], (__m512bh)kb);
        continue;
      }
#endif
      if constexpr (!pairs) a = _mm512_fmadd_ps(v[j], _mm512_castsi512_ps(kb), a);
    }
    return a;
  }
};

// Head h's 4 scores (128-bit lane h of s) to row h of the scores.
inline void store_lanes(float* dst, int64_t padded, __m512 s) {
  _mm_storeu_ps(dst, _mm512_castps512_ps128(s));
  _mm_storeu_ps(dst + padded, _mm512_extractf32x4_ps(s, 1));
  _mm_storeu_ps(dst + 2 * padded, _mm512_extractf32x4_ps(s, 2));
  _mm_storeu_ps(dst + 3 * padded, _mm512_extractf32x4_ps(s, 3));
}

#if defined(__AVX512BF16__) && CF_HAVE_FP8_VEC
#define CF_PAIR_VALUES 1
// bf16 queries over an FP8 cache weigh V with vdpbf16ps over pairs of keys, where a group's sums
// fit in registers (G * D / 16 <= 16 accumulators): each pair of V rows is widened exactly to
// bf16 (fp8_to_bf16_32, 32 codes in ~10 instructions) and the G heads take D / 16 dot
// instructions per pair, where widening each row to float32 (~9 instructions per 16 codes) and
// float32 FMAs take twice the work. The numerators are rounded to bf16 for it, as the chunk
// kernels' are (chunk_attention_avx512.cpp, _amx.cpp). Zen 4, one thread, small, ~530 tokens:
// 0.74x-0.84x the kernel's time (b8, b32 x 8 layers), 0.94x a whole decode step at b8 and
// 0.91x-0.96x at b32. A bf16 cache keeps the float32 FMAs: there the pairs measured the same step
// time (1.00x, 1.02x), so its bits stay.
template <typename T, typename C, int G, int D>
constexpr bool kPairValues = std::is_same_v<T, uint16_t> && std::is_same_v<C, uint8_t> && G * D <= 256;

// out[g] = inv_sum[g] * sum over keys t of e[g][t] V[t] for the numerators e (float32, in scores:
// G rows of `padded`, positions past ctx unread), e rounded to bf16 and paired by key, V rows
// (2j, 2j + 1) interleaved by unpacklo/hi_epi16 into (d, d) pairs: lane k of a 32-value zmm's lo
// half holds d = 8 (k / 4) + k % 4, of its hi half d + 4; the rows' order is restored once at the
// end. A pair's missing second key (ctx odd) is a zero row with a zero weight: nothing past ctx
// is read. Needs an even block size (a pair never straddles two blocks).
template <int D, int G, typename BlockAt, typename Ahead, typename Prefetch>
void weigh_value_pairs(std::vector<float>& scores, int64_t padded, int64_t ctx, const uint8_t* value, int64_t nblk,
                       int block_size, BlockAt block_at, Ahead prefetch_target, Prefetch prefetch_row,
                       const float* inv_sum, uint16_t* out) {
  constexpr int NZ = D / 32;  // zmm of bf16 per row
  const size_t pairs_at = static_cast<size_t>(G) * static_cast<size_t>(padded);
  scores.resize(pairs_at + static_cast<size_t>(G) * static_cast<size_t>(padded) / 2);
  uint16_t* eb = reinterpret_cast<uint16_t*>(scores.data() + pairs_at);  // [G][padded] bf16
  for (int g = 0; g < G; ++g) {
    const float* sg = scores.data() + static_cast<size_t>(g) * padded;
    for (int64_t t = 0; t < padded; t += 16) {
      const __m256bh e = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(first_lanes(ctx - t), sg + t));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(eb + static_cast<size_t>(g) * padded + t), (__m256i)e);
    }
  }
  __m512 acc[G][2 * NZ];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < 2 * NZ; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t t0 = bi * block_size;
    const int n = static_cast<int>(ctx - t0 < block_size ? ctx - t0 : block_size);
    const char* ahead = prefetch_target(value, bi);
    const uint8_t* blk = block_at(value, bi);
    for (int r = 0; r < n; r += 2) {
      if (ahead) {
        prefetch_row(ahead, r);
        prefetch_row(ahead, r + 1);
      }
      const uint8_t* a = blk + static_cast<int64_t>(r) * D;
      const bool second = r + 1 < n;
      __m512i lo[NZ], hi[NZ];
      for (int i = 0; i < NZ; ++i) {
        const __m512i x = fp8_to_bf16_32(a + 32 * i);
        const __m512i y = second ? fp8_to_bf16_32(a + D + 32 * i) : _mm512_setzero_si512();
        lo[i] = _mm512_unpacklo_epi16(x, y);
        hi[i] = _mm512_unpackhi_epi16(x, y);
      }
      for (int g = 0; g < G; ++g) {
        uint32_t w;
        std::memcpy(&w, eb + static_cast<size_t>(g) * padded + t0 + r, sizeof w);
        const __m512bh p = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(w));
        for (int i = 0; i < NZ; ++i) {
          acc[g][2 * i] = _mm512_dpbf16_ps(acc[g][2 * i], (__m512bh)lo[i], p);
          acc[g][2 * i + 1] = _mm512_dpbf16_ps(acc[g][2 * i + 1], (__m512bh)hi[i], p);
        }
      }
    }
  }
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int g = 0; g < G; ++g) {
    alignas(64) float row[D];
    for (int i = 0; i < NZ; ++i) {
      _mm512_store_ps(row + 32 * i, _mm512_permutex2var_ps(acc[g][2 * i], first, acc[g][2 * i + 1]));
      _mm512_store_ps(row + 32 * i + 16, _mm512_permutex2var_ps(acc[g][2 * i], second, acc[g][2 * i + 1]));
    }
    store_row(row, out + static_cast<int64_t>(g) * D, D, inv_sum[g]);
  }
}
#else
#define CF_PAIR_VALUES 0
#endif

// attend_one with AVX-512, for a head dim D (a multiple of 32) and G query heads per kv head, both
// compile-time: the scores of 16 keys at a time (each key row dotted with each query head into a
// vector of partial sums, the block's 16 vectors summed across lanes by sum16; with G = 4 a whole
// run of 16 takes FourHeads, 8 keys at a time with the 4 heads in one vector), softmax in
// float32, then the weighted sum of V rows widened to float32 (the weights stay float32; bf16
// queries over an FP8 cache: in bf16 pairs, weigh_value_pairs). Blocks
// are walked in place, the block two ahead prefetched one row's lines per row read where it does
// not continue a run in memory (prefetch_target). About 1.2x-1.3x faster than attend_one, whose
// per-score horizontal sums bound it.
//
// An FP8 cache (C = uint8_t): each run of 16 key rows is first widened exactly into a small
// buffer of the query's type (then dotted as a cache of that type would be; half the bytes read
// from memory), each V row widened as it is read; K's scale is in `scale`, V's in `v_scale`.
template <typename T, typename C, int D, int G>
void attend_one_avx512(const T* q, const C* key, const C* value, T* out, const int64_t* table, int64_t ctx,
                       int64_t head_offset, int block_size, float scale, float v_scale,
                       std::vector<float>& scores) {
  static_assert(D % 32 == 0 && D <= 256, "head dim");
  static_assert(std::is_same_v<C, T> || std::is_same_v<C, uint8_t>, "cache element");
  constexpr bool kFp8 = !std::is_same_v<C, T>;
  constexpr int NF = D / 16;  // vectors of 16 floats per row
  constexpr int64_t kRowBytes = D * static_cast<int64_t>(sizeof(C));
  const int64_t nblk = (ctx + block_size - 1) / block_size;
  const int64_t padded = (ctx + 15) / 16 * 16;
  scores.resize(static_cast<size_t>(G) * static_cast<size_t>(padded));
  QueryRow<T, D> qr[G];
  for (int g = 0; g < G; ++g) qr[g].load(q + g * D);
  constexpr bool kFourHeads = G == 4 && FourHeads<T, D>::ok;
  FourHeads<T, kFourHeads ? D : 32> four;
  if constexpr (kFourHeads) four.load(q);
  const __m512 sc = _mm512_set1_ps(scale);
  auto block_at = [&](const C* cache, int64_t bi) { return cache + (head_offset + table[bi] * block_size) * D; };
  // The block two ahead, into L2; on AMD, not where it and the block before it continue a run of
  // blocks in memory (g_prefetch_runs, at the top). Into L1 (T0) the prefetches held the L1's few
  // miss buffers and a thread read 10-13 GB/s. Zen 4, one thread, b32 x 530 tokens x 8 layers,
  // against always T0: 0.72x-0.75x the time with blocks in order or scattered, 0.82x-0.89x in runs
  // of 8 blocks, both dtypes.
  const bool runs_too = g_prefetch_runs;
  auto prefetch_target = [&](const C* cache, int64_t bi) -> const char* {
    if (bi + 2 >= nblk ||
        (!runs_too && table[bi + 2] == table[bi + 1] + 1 && table[bi + 1] == table[bi] + 1))
      return nullptr;
    return reinterpret_cast<const char*>(block_at(cache, bi + 2));
  };
  alignas(64) T widened[kFp8 ? 16 * D : 1];
  auto prefetch_row = [&](const char* ahead, int r) {
    for (int64_t off = 0; off < kRowBytes; off += 64) _mm_prefetch(ahead + r * kRowBytes + off, _MM_HINT_T1);
  };
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t t0 = bi * block_size;
    const int n = static_cast<int>(ctx - t0 < block_size ? ctx - t0 : block_size);
    const char* ahead = prefetch_target(key, bi);
    const C* blk = block_at(key, bi);
    for (int r0 = 0; r0 < n; r0 += 16) {  // 16 keys at a time
      const int m = n - r0 < 16 ? n - r0 : 16;
      const T* rows;  // row r of this run of 16 at rows + r * D
      if constexpr (kFp8) {
        for (int r = 0; r < m; ++r) {
          if (ahead && r0 + r < block_size) prefetch_row(ahead, r0 + r);
          widen_fp8_row<D>(blk + static_cast<int64_t>(r0 + r) * D, widened + r * D);
        }
        rows = widened;
      } else {
        rows = blk + static_cast<int64_t>(r0) * D;
      }
      if constexpr (kFourHeads) {
        if (m == 16) {  // a whole run: 8 keys at a time, the 4 heads together
          for (int r8 = 0; r8 < 16; r8 += 8) {
            __m512 a[8];
            for (int r = 0; r < 8; ++r) {
              if (!kFp8 && ahead) prefetch_row(ahead, r0 + r8 + r);
              a[r] = four.dot(rows + static_cast<int64_t>(r8 + r) * D);
            }
            float* dst = scores.data() + t0 + r0 + r8;
            store_lanes(dst, padded, _mm512_mul_ps(sum4x4(a[0], a[1], a[2], a[3]), sc));
            store_lanes(dst + 4, padded, _mm512_mul_ps(sum4x4(a[4], a[5], a[6], a[7]), sc));
          }
          continue;
        }
      }
      for (int g = 0; g < G; ++g) {
        __m512 lanes[16];
        for (int r = 0; r < 16; ++r) {
          if (!kFp8 && g == 0 && ahead && r0 + r < block_size) prefetch_row(ahead, r0 + r);
          lanes[r] = r < m ? qr[g].dot_lanes(rows + static_cast<int64_t>(r) * D) : _mm512_setzero_ps();
        }
        // only the run's m scores: a block size under 16 starts runs off the rows' 16-multiples,
        // and a whole vector there ran past the row into the next head's scores (or the buffer)
        _mm512_mask_storeu_ps(scores.data() + static_cast<size_t>(g) * padded + t0 + r0, first_lanes(m),
                              _mm512_mul_ps(sum16(lanes), sc));
      }
    }
  }
  float inv_sum[G];
  for (int g = 0; g < G; ++g) {
    float* sg = scores.data() + static_cast<size_t>(g) * padded;
#if defined(__AVX512DQ__)
    inv_sum[g] = std::is_same_v<T, uint16_t> ? softmax_numerators16(sg, ctx) : softmax_numerators(sg, ctx);
#else
    inv_sum[g] = softmax_numerators(sg, ctx);
#endif
    inv_sum[g] *= v_scale;
  }
#if CF_PAIR_VALUES
  if constexpr (kPairValues<T, C, G, D>) {
    if (block_size % 2 == 0) {
      weigh_value_pairs<D, G>(scores, padded, ctx, value, nblk, block_size, block_at, prefetch_target, prefetch_row,
                              inv_sum, out);
      return;
    }
  }
#endif
  __m512 acc[G][NF];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NF; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t bi = 0; bi < nblk; ++bi) {
    const int64_t t0 = bi * block_size;
    const int n = static_cast<int>(ctx - t0 < block_size ? ctx - t0 : block_size);
    const char* ahead = prefetch_target(value, bi);
    const C* blk = block_at(value, bi);
    for (int r = 0; r < n; ++r) {
      if (ahead) prefetch_row(ahead, r);
      const C* v = blk + static_cast<int64_t>(r) * D;
      __m512 vf[NF];
      for (int j = 0; j < NF; ++j) vf[j] = load16(v + 16 * j);
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[static_cast<size_t>(g) * padded + t0 + r]);
        for (int j = 0; j < NF; ++j) acc[g][j] = _mm512_fmadd_ps(p, vf[j], acc[g][j]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    alignas(64) float row[D];
    for (int j = 0; j < NF; ++j) _mm512_store_ps(row + 16 * j, acc[g][j]);
    store_row(row, out + static_cast<int64_t>(g) * D, D, inv_sum[g]);
  }
}
#else
#define CF_HAVE_AVX512 0
#endif

// The AVX-512 path where it is compiled for this head dim, group and cache; false otherwise (the
// caller takes attend_one).
template <typename T, typename C, int D>
bool attend_fast(int group, const T* q, const C* key, const C* value, T* out, const int64_t* table, int64_t ctx,
                 int64_t head_offset, int block_size, float scale, float v_scale, Workspace& ws) {
#if CF_PAGED_AMX
  if constexpr (std::is_same_v<T, uint16_t> && std::is_same_v<C, uint16_t> && (D == 64 || D == 128 || D == 256)) {
    if (g_amx.active() && block_size % 16 == 0) {
      const uint16_t* k = key + head_offset * D;
      const uint16_t* v = value + head_offset * D;
      ws.tiles_used = true;
      switch (group) {
        case 1: cf_paged_amx::attend<D, 1>(q, k, v, out, table, ctx, block_size, scale, ws.amx); return true;
        case 2: cf_paged_amx::attend<D, 2>(q, k, v, out, table, ctx, block_size, scale, ws.amx); return true;
        case 4: cf_paged_amx::attend<D, 4>(q, k, v, out, table, ctx, block_size, scale, ws.amx); return true;
        case 8: cf_paged_amx::attend<D, 8>(q, k, v, out, table, ctx, block_size, scale, ws.amx); return true;
        default: break;
      }
    }
  }
#endif
  std::vector<float>& scores = ws.scores;
#if CF_HAVE_AVX512
  constexpr bool cache_ok = std::is_same_v<C, T> || CF_HAVE_FP8_VEC;
  if constexpr (cache_ok && (D == 64 || D == 128 || D == 256)) {
    switch (group) {
      case 1: attend_one_avx512<T, C, D, 1>(q, key, value, out, table, ctx, head_offset, block_size, scale, v_scale, scores); return true;
      case 2: attend_one_avx512<T, C, D, 2>(q, key, value, out, table, ctx, head_offset, block_size, scale, v_scale, scores); return true;
      case 4: attend_one_avx512<T, C, D, 4>(q, key, value, out, table, ctx, head_offset, block_size, scale, v_scale, scores); return true;
      case 8: attend_one_avx512<T, C, D, 8>(q, key, value, out, table, ctx, head_offset, block_size, scale, v_scale, scores); return true;
      default: return false;
    }
  }
#endif
  (void)group; (void)q; (void)key; (void)value; (void)out; (void)table; (void)ctx; (void)head_offset;
  (void)block_size; (void)scale; (void)v_scale; (void)scores;
  return false;
}

template <typename T, typename C, int D>
void run(const T* q, const C* key, const C* value, T* out, const int64_t* block_tables,
         const int64_t* context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
         int64_t num_blocks, int64_t block_size, int64_t table_width, int64_t head_dim, float scale,
         float v_scale, int threads) {
  const int64_t group = num_heads / num_kv_heads;
  const int64_t items = batch * num_kv_heads;
#pragma omp parallel num_threads(threads) if (threads > 1 && items > 1)
  {
    Workspace ws;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t b = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t qoff = (b * num_heads + h * group) * head_dim;
      if (attend_fast<T, C, D>(static_cast<int>(group), q + qoff, key, value, out + qoff,
                               block_tables + b * table_width, context_lens[b], h * num_blocks * block_size,
                               static_cast<int>(block_size), scale, v_scale, ws))
        continue;
      attend_one<T, C, D>(q + qoff, key, value, out + qoff, block_tables + b * table_width, context_lens[b],
                          static_cast<int>(group), h * num_blocks * block_size, static_cast<int>(block_size),
                          scale, v_scale, ws.scores, static_cast<int>(head_dim));
    }
#if CF_PAGED_AMX
    if (ws.tiles_used) _tile_release();
#endif
  }
}

template <typename T, typename C>
int dispatch(const T* q, const void* key, const void* value, T* out, const int64_t* bt, const int64_t* cl,
             int64_t batch, int64_t nh, int64_t nkv, int64_t nb, int64_t bs, int64_t tw, int64_t d,
             float scale, float v_scale, int threads) {
  const C* k = static_cast<const C*>(key);
  const C* v = static_cast<const C*>(value);
  switch (d) {
    case 64: run<T, C, 64>(q, k, v, out, bt, cl, batch, nh, nkv, nb, bs, tw, d, scale, v_scale, threads); return 0;
    case 128: run<T, C, 128>(q, k, v, out, bt, cl, batch, nh, nkv, nb, bs, tw, d, scale, v_scale, threads); return 0;
    case 256: run<T, C, 256>(q, k, v, out, bt, cl, batch, nh, nkv, nb, bs, tw, d, scale, v_scale, threads); return 0;
    default:
      if (d < 1 || d > MAX_HEAD_DIM) return 1;
      run<T, C, 0>(q, k, v, out, bt, cl, batch, nh, nkv, nb, bs, tw, d, scale, v_scale, threads);
      return 0;
  }
}

}  // namespace

extern "C" {

// 0: bf16 decode over a bf16 cache may run on AMX tiles in this process; 1: not built for AMX; 2:
// the OS refused the tile state.
int cf_paged_amx_init() {
#if CF_PAGED_AMX
  return g_amx.init();
#else
  return 1;
#endif
}

// Switch bf16 decode over a bf16 cache to AMX (1, only where cf_paged_amx_init granted it) or to
// AVX-512 (0); -1 leaves it. Returns whether AMX is now in use.
int cf_paged_use_amx(int on) {
  return g_amx.use(on);  // never granted where not built for AMX: 0
}

// Whether the AVX-512 paths prefetch blocks that continue a run in memory (1) or leave them to the
// hardware prefetcher (0); `on` switches (-1 leaves it). The results are the same bits either way.
// For paired A/B measurements and tests; not thread-safe against a running decode.
int cf_paged_prefetch_runs(int on) {
  if (on >= 0) g_prefetch_runs = on ? 1 : 0;
  return g_prefetch_runs;
}

// Returns 0 on success, nonzero where the shape is not supported (the caller falls back).
// fp8: key/value hold e4m3 codes, read as code * k_scale and code * v_scale (else both scales
// are ignored and key/value are in q's dtype).
int cf_paged_decode(const void* q, const void* key, const void* value, void* out, const int64_t* block_tables,
                    const int64_t* context_lens, int64_t batch, int64_t num_heads, int64_t num_kv_heads,
                    int64_t num_blocks, int64_t block_size, int64_t table_width, int64_t head_dim, float scale,
                    int bf16, int threads, int fp8, float k_scale, float v_scale) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads || num_heads / num_kv_heads > 8) return 2;
  const int64_t bt = batch, nh = num_heads, nkv = num_kv_heads, nb = num_blocks, bs = block_size;
  const int64_t tw = table_width, d = head_dim;
  if (bf16) {
    const auto* qb = static_cast<const uint16_t*>(q);
    auto* ob = static_cast<uint16_t*>(out);
    return fp8 ? dispatch<uint16_t, uint8_t>(qb, key, value, ob, block_tables, context_lens, bt, nh, nkv, nb, bs, tw,
                                             d, scale * k_scale, v_scale, threads)
               : dispatch<uint16_t, uint16_t>(qb, key, value, ob, block_tables, context_lens, bt, nh, nkv, nb, bs,
                                              tw, d, scale, 1.f, threads);
  }
  const auto* qf = static_cast<const float*>(q);
  auto* of = static_cast<float*>(out);
  return fp8 ? dispatch<float, uint8_t>(qf, key, value, of, block_tables, context_lens, bt, nh, nkv, nb, bs, tw, d,
                                        scale * k_scale, v_scale, threads)
             : dispatch<float, float>(qf, key, value, of, block_tables, context_lens, bt, nh, nkv, nb, bs, tw, d,
                                      scale, 1.f, threads);
}

// Gathers blocks of one FP8 cache tensor ([heads, slots_per_head, head_dim] e4m3 codes) into out
// [heads, num_ids * block_size, head_dim] as code * scale, in float32 or bf16 (bf16: the float32
// product rounded once, to nearest even): what gather_blocks and fp8_dequantize do in five passes
// over the copy, in one. Returns 0, or 1 for a block id out of range (nothing is written then).
int cf_gather_fp8(const void* cache, const int64_t* block_ids, int64_t num_ids, int64_t heads,
                  int64_t num_blocks, int64_t block_size, int64_t head_dim, float scale, void* out, int bf16) {
  for (int64_t i = 0; i < num_ids; ++i)
    if (block_ids[i] < 0 || block_ids[i] >= num_blocks) return 1;
  const auto* src = static_cast<const uint8_t*>(cache);
  const int64_t block_elems = block_size * head_dim;
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t i = 0; i < num_ids; ++i) {
      const uint8_t* b = src + (h * num_blocks + block_ids[i]) * block_elems;
      const int64_t o = (h * num_ids + i) * block_elems;
      int64_t e = 0;
#if CF_HAVE_FP8_VEC
      const __m512 s = _mm512_set1_ps(scale);
      for (; e + 16 <= block_elems; e += 16) {
        const __m512 x = _mm512_mul_ps(load16(b + e), s);
        if (bf16) cf_bf16::store16(static_cast<uint16_t*>(out) + o + e, x);
        else _mm512_storeu_ps(static_cast<float*>(out) + o + e, x);
      }
#endif
      for (; e < block_elems; ++e) {
        const float x = fp8_to_float(b[e]) * scale;
        if (bf16) static_cast<uint16_t*>(out)[o + e] = cf_bf16::from_float(x);
        else static_cast<float*>(out)[o + e] = x;
      }
    }
  }
  return 0;
}

}  // extern "C"

extern "C" {

namespace {

// Whether every one of the step's slots lies in the cache (the stores write nothing otherwise).
inline bool slots_in_range(const int64_t* slots, int64_t tokens, int64_t slots_per_head) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= slots_per_head) return false;
  return true;
}

}  // namespace

// The FP8 store divides exactly as torch does: -ffast-math (this file's flag) would let the
// compiler multiply by a reciprocal instead, which rounds differently.
#if defined(__clang__)
#pragma float_control(precise, on, push)
#elif defined(__GNUC__)
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
#endif

namespace {

// x / scale as the FP8 cache stores it (kv_cache.quantize_fp8): divided in float32, clamped to
// +-448, magnitudes under 2^-6 snapped to 0 (under 2^-7) or +-2^-6 (no subnormal codes), the rest
// rounded to the nearest e4m3 (ties to even); NaN stays NaN (0x7f with its sign).
inline uint8_t to_e4m3_cache(float x, float scale) {
  float y = x / scale;
  uint32_t bits = 0;
  std::memcpy(&bits, &y, sizeof bits);
  const uint8_t sign = static_cast<uint8_t>(bits >> 24) & 0x80u;
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return sign | 0x7fu;  // NaN
  if (mag >= 0x43e00000u) return sign | 0x7eu;  // >= 448 (clamped)
  if (mag < 0x3c000000u) return 0;  // under 2^-7: +0
  if (mag < 0x3c800000u) return sign | 0x08u;  // [2^-7, 2^-6): +-2^-6
  const uint32_t rounded = mag + 0x7ffffu + ((mag >> 20) & 1u);  // to 3 mantissa bits, ties to even
  return sign | static_cast<uint8_t>((rounded >> 20) - (120u << 3));
}

}  // namespace

// cf_store_kv for an FP8 cache: rows of bf16 (bf16 = 1) or float32 values stored as
// to_e4m3_cache(x, k_scale) / (x, v_scale) codes. Returns 0, or 1 for a slot out of range.
int cf_store_kv_fp8(const void* k, int64_t k_row, int64_t k_head, const void* v, int64_t v_row, int64_t v_head,
                    void* key_cache, void* value_cache, const int64_t* slots, int64_t tokens, int64_t heads,
                    int64_t head_dim, int64_t slots_per_head, int bf16, float k_scale, float v_scale) {
  if (!slots_in_range(slots, tokens, slots_per_head)) return 1;
  auto* kc = static_cast<uint8_t*>(key_cache);
  auto* vc = static_cast<uint8_t*>(value_cache);
  auto value_at = [bf16](const void* base, int64_t i) {
    return bf16 ? cf_bf16::to_float(static_cast<const uint16_t*>(base)[i]) : static_cast<const float*>(base)[i];
  };
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t dst = (h * slots_per_head + slots[t]) * head_dim;
      const int64_t ks = t * k_row + h * k_head, vs = t * v_row + h * v_head;
      for (int64_t i = 0; i < head_dim; ++i) {
        kc[dst + i] = to_e4m3_cache(value_at(k, ks + i), k_scale);
        vc[dst + i] = to_e4m3_cache(value_at(v, vs + i), v_scale);
      }
    }
  }
  return 0;
}

#if defined(__clang__)
#pragma float_control(pop)
#elif defined(__GNUC__)
#pragma GCC pop_options
#endif

// Stores a step's new keys and values into the paged cache: row t of head h of k (at
// k + t * k_row + h * k_head, head_dim contiguous elements of elem_bytes) goes to slot slots[t]
// of head h of key_cache ([heads, slots_per_head, head_dim] contiguous), and the same for v. The
// torch equivalent (two index_copy_ over transposed views) costs ~25-60 us a layer on one thread.
// Returns 0, or 1 for a slot out of range (nothing is written then).
int cf_store_kv(const void* k, int64_t k_row, int64_t k_head, const void* v, int64_t v_row, int64_t v_head,
                void* key_cache, void* value_cache, const int64_t* slots, int64_t tokens, int64_t heads,
                int64_t head_dim, int64_t slots_per_head, int64_t elem_bytes) {
  if (!slots_in_range(slots, tokens, slots_per_head)) return 1;
  const int64_t row_bytes = head_dim * elem_bytes;
  const char* kb = static_cast<const char*>(k);
  const char* vb = static_cast<const char*>(v);
  char* kc = static_cast<char*>(key_cache);
  char* vc = static_cast<char*>(value_cache);
  for (int64_t h = 0; h < heads; ++h) {
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t dst = (h * slots_per_head + slots[t]) * row_bytes;
      std::memcpy(kc + dst, kb + (t * k_row + h * k_head) * elem_bytes, row_bytes);
      std::memcpy(vc + dst, vb + (t * v_row + h * v_head) * elem_bytes, row_bytes);
    }
  }
  return 0;
}

}  // extern "C"
