// Linears of a few rows (decode steps) read straight from oneDNN's prepacked weight: see
// packed_gemv.py for why and for the layout, which the Python side checks against the plain
// weight before it lets a weight in here.
//
// The packed weight of an [N, K] linear is ceil(N / BN) blocks of BN outputs; block b holds, for
// each k step of P (P = 2 in bf16, 1 in float32) up to the padded K, the BN outputs' P weights:
// w[b][kp][n][p] = W[b * BN + n][kp * P + p], zeros in the padding. One block is one sequential
// stream: every row's BN sums are kept in registers while it is read (bf16 pairs through
// vdpbf16ps where the CPU has AVX512_BF16, else widened and fused-multiply-added), four rows at a
// time; with more rows the block goes by in chunks of CHUNK_BYTES that each group of four rows
// reads in turn, so it is read from memory once. Sums are float32 in k order; the output is
// rounded once, after the bias is added, oneDNN's swish applied if asked (SwiGLU's gate) and, if
// given, the product with a same-shaped factor taken (SwiGLU's up half times the activated gate,
// as oneDNN's binary mul post-op does).
//
// Where the CPU has AMX (and the OS grants its tile state: cf_packed_amx_init), bf16 sums are
// taken on AMX tiles instead, at any row count: a packed bf16 block is already AMX's B operand
// (16 k pairs of 16 outputs are one tile, rows 4 * BN bytes apart), rows go 16 to a tile, each
// 32-value k step is one tile product per 16 outputs, the block streamed once for up to 32 rows.
// TDPBF16PS rounds a k pair's two products as oneDNN's own AMX kernels do, which VDPBF16PS does
// not: on an AMX Xeon oneDNN's bf16 product of these weights uses AMX, and these sums are its bits.
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "amx_tiles.h"
#include "bf16_bits.h"

namespace {

constexpr int MAX_ROWS_AT_ONCE = 4;  // rows whose sums share a pass over a chunk, in registers
constexpr int64_t MAX_ROWS = 128;  // rows a call takes
constexpr int64_t CHUNK_BYTES = 8192;  // of a block, streamed once and read from L1 by every group of rows
constexpr int64_t AHEAD_BYTES = 8192;  // software prefetch distance: one thread streams ~1.6x faster with it

// Keeps a loaded vector in a register: without it the compiler folds the load into every row's
// multiply-add, reading each weight vector once per row, and the loads (not the multiplies) bound
// the loop on Zen 4 (~2/3 of the multiply-add rate).
template <typename Vec>
inline Vec in_register(Vec v) {
  asm("" : "+v"(v));
  return v;
}

// Row r's values 2kp and 2kp+1 as one 32-bit lane; the odd K's last pair (LAST) is x[2kp] and the
// padding's zero.
template <bool LAST>
inline int32_t pair_at(const uint16_t* x, int64_t kp) {
  int32_t both = x[2 * kp];
  if constexpr (!LAST) std::memcpy(&both, x + 2 * kp, sizeof both);
  return both;
}

// acc[r][v] += the block's k pair kp times row r's pair, for V vectors of 16 outputs.
template <int R, int V, bool LAST>
inline void bf16_step(__m512 (&acc)[R][V], const uint16_t* wk, const uint16_t* const* xs, int64_t kp) {
  __m512i w[V];
  for (int v = 0; v < V; ++v) {
    w[v] = in_register(_mm512_loadu_si512(wk + 32 * v));
  }
  for (int r = 0; r < R; ++r) {
    const __m512i xp = _mm512_set1_epi32(pair_at<LAST>(xs[r], kp));
#if defined(__AVX512BF16__)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], (__m512bh)w[v], (__m512bh)xp);
#else
    const __m512 x0 = _mm512_castsi512_ps(_mm512_slli_epi32(xp, 16));
    const __m512 x1 = _mm512_castsi512_ps(_mm512_and_si512(xp, _mm512_set1_epi32(0xffff0000)));
    for (int v = 0; v < V; ++v) {
      const __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(w[v], 16));
      const __m512 hi = _mm512_castsi512_ps(_mm512_and_si512(w[v], _mm512_set1_epi32(0xffff0000)));
      acc[r][v] = _mm512_fmadd_ps(hi, x1, _mm512_fmadd_ps(lo, x0, acc[r][v]));
    }
#endif
  }
}

template <int R, int V>
inline void f32_step(__m512 (&acc)[R][V], const float* wk, const float* const* xs, int64_t kk) {
  __m512 w[V];
  for (int v = 0; v < V; ++v) {
    w[v] = in_register(_mm512_loadu_ps(wk + 16 * v));
  }
  for (int r = 0; r < R; ++r) {
    const __m512 x = _mm512_set1_ps(xs[r][kk]);
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w[v], x, acc[r][v]);
  }
}

template <int64_t BYTES, typename T>
inline void prefetch_step(const T* p) {  // every cache line of one k step
  for (int64_t b = 0; b < BYTES; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

// Values of a block per step (one k value of 16 * V outputs in float32, one k pair in bf16).
template <int V, typename T>
constexpr int64_t kStepValues = 16 * V * (sizeof(T) == 2 ? 2 : 1);

// Prefetches one group's share of the next chunk: lines first, first + stride, ... below `end`
// (in cache lines from `base`), `per_step` of them a step.
struct ChunkPrefetch {
  const char* base = nullptr;
  int64_t line = 0, stride = 1, end = 0;
  int per_step = 0;
  inline void step() {
    for (int i = 0; i < per_step && line < end; ++i, line += stride) _mm_prefetch(base + line * 64, _MM_HINT_T1);
  }
};

// Steps s0 .. s1 - 1 of one block (a step: one k value in float32, one k pair in bf16, LINE values
// of the block) into R rows' sums. PF: also prefetch the lines AHEAD steps on (one group of rows);
// else `pf`'s share of the next chunk. LAST: the odd K's final bf16 pair.
template <int R, int V, typename T, bool PF, bool LAST = false>
inline void run_steps(__m512 (&acc)[R][V], const T* w, const T* const* xs, int64_t s0, int64_t s1,
                      ChunkPrefetch& pf) {
  constexpr int64_t LINE = kStepValues<V, T>;
  constexpr int64_t AHEAD = AHEAD_BYTES / sizeof(T) / LINE + 1;  // steps ahead of the loads
  for (int64_t s = s0; s < s1; ++s) {
    if constexpr (PF) prefetch_step<LINE * sizeof(T)>(w + (s + AHEAD) * LINE);
    else pf.step();
    if constexpr (sizeof(T) == 2)
      bf16_step<R, V, LAST>(acc, reinterpret_cast<const uint16_t*>(w) + s * LINE,
                            reinterpret_cast<const uint16_t* const*>(xs), s);
    else
      f32_step<R, V>(acc, reinterpret_cast<const float*>(w) + s * LINE, reinterpret_cast<const float* const*>(xs), s);
  }
}

// One group of R (<= 4) rows over steps s0 .. s1 - 1: its sums start at zero (s0 = 0, also the odd
// K's last pair where K is 1) or where the previous chunk left them in `sums`, and go back there.
template <int R, int V, typename T, bool LAST = false>
inline void group_steps(__m512 (*sums)[V], const T* w, const T* const* xs, int64_t s0, int64_t s1, bool one_group,
                        ChunkPrefetch& pf) {
  __m512 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = s0 == 0 ? _mm512_setzero_ps() : sums[r][v];
  if (one_group) run_steps<R, V, T, true, LAST>(acc, w, xs, s0, s1, pf);
  else run_steps<R, V, T, false, LAST>(acc, w, xs, s0, s1, pf);
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) sums[r][v] = acc[r][v];
}

template <int V, typename T, bool LAST = false>
inline void group_dispatch(int rr, __m512 (*sums)[V], const T* w, const T* const* xs, int64_t s0, int64_t s1,
                           bool one_group, ChunkPrefetch& pf) {
  switch (rr) {  // R is a template argument so that the sums stay in registers
    case 1: group_steps<1, V, T, LAST>(sums, w, xs, s0, s1, one_group, pf); break;
    case 2: group_steps<2, V, T, LAST>(sums, w, xs, s0, s1, one_group, pf); break;
    case 3: group_steps<3, V, T, LAST>(sums, w, xs, s0, s1, one_group, pf); break;
    default: group_steps<4, V, T, LAST>(sums, w, xs, s0, s1, one_group, pf); break;
  }
}

// The sums of `rows` rows over one block (V * 16 outputs) of weight w (k values, k_padded steps
// of P values), in chunks of CHUNK_BYTES of the block: each chunk is streamed from memory once, by
// the first group of 4 rows, and read again from L1 by the others, so any number of rows costs
// one pass over the weight. Every sum runs in k order, as with one group.
template <int V, typename T>
inline void block_sums(__m512 (*sums)[V], const T* w, const T* const* xs, int rows, int64_t k) {
  constexpr int64_t LINE = kStepValues<V, T>;
  constexpr int64_t CHUNK = CHUNK_BYTES / sizeof(T) / LINE;  // steps a chunk
  constexpr int64_t LINES_A_STEP = LINE * sizeof(T) / 64;
  const int64_t steps = sizeof(T) == 2 ? k / 2 : k;  // whole steps (bf16: pairs whose both values are x's)
  const int groups = (rows + MAX_ROWS_AT_ONCE - 1) / MAX_ROWS_AT_ONCE;
  const bool one_group = groups <= 1;
  const int64_t chunk = one_group ? steps : CHUNK;
  ChunkPrefetch pf;
  for (int64_t c0 = 0; c0 < steps; c0 += chunk) {
    const int64_t c1 = std::min(steps, c0 + chunk);
    for (int g = 0; g < groups; ++g) {
      const int r0 = g * MAX_ROWS_AT_ONCE;
      if (!one_group)  // group g fetches every groups-th line of the next chunk (the bytes after this one's start)
        pf = ChunkPrefetch{reinterpret_cast<const char*>(w + (c0 + CHUNK) * LINE), g, groups, CHUNK_BYTES / 64,
                           static_cast<int>((LINES_A_STEP + groups - 1) / groups)};
      group_dispatch<V, T>(std::min(MAX_ROWS_AT_ONCE, rows - r0), sums + r0, w, xs + r0, c0, c1, one_group, pf);
    }
  }
  if (sizeof(T) == 2 && k % 2)  // the last value pairs with the padding's zero
    for (int r0 = 0; r0 < rows; r0 += MAX_ROWS_AT_ONCE)
      group_dispatch<V, T, true>(std::min(MAX_ROWS_AT_ONCE, rows - r0), sums + r0, w, xs + r0, steps, steps + 1,
                                 false, pf);
}

// x * sigmoid(x) with oneDNN's eltwise swish (alpha 1), operation for operation, so that the bits
// are the ones its post-op gives the same sums (the gate of a bf16 MLP takes the kernel at decode
// rows and oneDNN's post-op above them, and a row's activation must not depend on which):
// sigmoid(x) from e = exp(-|x|) as e / (e + 1), or 1 minus that for x >= 0; exp(v) = 2 * 2^(n-1)
// * p(r), n = floor(v log2(e) + 1/2), r = v - n ln 2 (fused), p oneDNN's degree-5 polynomial
// (fused multiply-adds), 2^(n-1) zero below ln(FLT_MIN). The tests compare it with the post-op.
inline __m512 onednn_swish(__m512 x) {
  auto c = [](uint32_t bits) { return _mm512_castsi512_ps(_mm512_set1_epi32(static_cast<int>(bits))); };
  const __m512 one = c(0x3f800000), ln_flt_min = c(0xc2aeac50);
  const __m512i sign_mask = _mm512_set1_epi32(static_cast<int>(0x80000000u));
  const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), sign_mask);
  __m512 v = _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(x), sign_mask));  // -|x|
  const __mmask16 underflow = _mm512_cmp_ps_mask(v, ln_flt_min, _CMP_LT_OS);
  v = _mm512_max_ps(_mm512_min_ps(v, c(0x42b17218)), ln_flt_min);
  __m512 n = _mm512_add_ps(_mm512_mul_ps(v, c(0x3fb8aa3b)), c(0x3f000000));
  n = _mm512_roundscale_ps(n, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, c(0x3f317218), v);
  __m512i two_n1 = _mm512_cvtps_epi32(_mm512_sub_ps(n, one));  // n - 1, exact
  two_n1 = _mm512_slli_epi32(_mm512_add_epi32(two_n1, _mm512_set1_epi32(127)), 23);
  two_n1 = _mm512_mask_blend_epi32(underflow, two_n1, _mm512_setzero_si512());
  __m512 p = c(0x3c07cfce);
  p = _mm512_fmadd_ps(p, r, c(0x3d2b9d0d));
  p = _mm512_fmadd_ps(p, r, c(0x3e2aad40));
  p = _mm512_fmadd_ps(p, r, c(0x3efffee3));
  p = _mm512_fmadd_ps(p, r, c(0x3f7ffffb));
  p = _mm512_fmadd_ps(p, r, one);
  const __m512 e = _mm512_mul_ps(_mm512_mul_ps(p, _mm512_castsi512_ps(two_n1)), c(0x40000000));
  const __m512 below = _mm512_div_ps(e, _mm512_add_ps(e, one));  // sigmoid(-|x|)
  const __m512 sigmoid = _mm512_mask_blend_ps(_mm512_test_epi32_mask(sign, sign), _mm512_sub_ps(one, below), below);
  return _mm512_mul_ps(sigmoid, x);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define CF_HAVE_AMX 1
#else
#define CF_HAVE_AMX 0
#endif

cf_amx::Switch g_amx;  // bf16 sums on AMX tiles (cf_packed_amx_init grants, cf_packed_use_amx switches)

#if CF_HAVE_AMX

// Tiles 0-3: sums (row tile i of two, 16-output half j of a 32-output slice: tile 2i + j); 4-5:
// the rows' k step (row tile i); 6-7: the weight's k step (half j). Row tile 0 holds rows0 rows,
// row tile 1 rows1 (0: unused).
inline void configure_amx(int rows0, int rows1) {
  const auto r0 = static_cast<uint8_t>(rows0), r1 = static_cast<uint8_t>(rows1);
  cf_amx::configure({r0, r0, r1, r1, r0, r1, 16, 16});
}

// The float32 sums of up to 32 rows (xs[0] onwards, rows x_stride values apart, `tail` holding the
// same rows' last k step zero-padded, 32 values a row) over one packed bf16 block of BN outputs,
// into sums (rows of BN floats). Steps 16 k pairs at a time through the block; per 32-output slice
// of it (one pass over the slice's bytes, the B tiles of a step 4 * BN bytes a row), two weight
// tiles and two row tiles feed four sum tiles.
template <int BN>
inline void amx_block_sums(float* sums, const uint16_t* w, const uint16_t* x, int64_t x_stride, const uint16_t* tail,
                           int rows, int64_t k, int64_t k_padded) {
  constexpr int SLICE = BN < 32 ? BN : 32;  // outputs a pass takes: one or two B tiles
  constexpr int HALVES = SLICE / 16;
  const bool two = rows > 16;
  const int64_t full = k / 32 * 32;  // k steps read from the rows in place
  for (int s0 = 0; s0 < BN; s0 += SLICE) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k0 = 0; k0 < k_padded; k0 += 32) {
      const uint16_t* wk = w + k0 * BN + 2 * s0;  // pair k0 / 2's row of the block, at output s0
      _mm_prefetch(reinterpret_cast<const char*>(wk + 64 * BN), _MM_HINT_T0);  // a line of the step 2 on
      if (k0 < full) {
        _tile_loadd(4, x + k0, x_stride * 2);
        if (two) _tile_loadd(5, x + 16 * x_stride + k0, x_stride * 2);
      } else {  // the padded last step (zeros past k: the padding's weights are zero too)
        _tile_loadd(4, tail, 64);
        if (two) _tile_loadd(5, tail + 16 * 32, 64);
      }
      _tile_loadd(6, wk, BN * 4);
      _tile_dpbf16ps(0, 4, 6);
      if (two) _tile_dpbf16ps(2, 5, 6);
      if constexpr (HALVES == 2) {
        _tile_loadd(7, wk + 32, BN * 4);
        _tile_dpbf16ps(1, 4, 7);
        if (two) _tile_dpbf16ps(3, 5, 7);
      }
    }
    _tile_stored(0, sums + s0, BN * 4);
    if (HALVES == 2) _tile_stored(1, sums + s0 + 16, BN * 4);
    if (two) {
      _tile_stored(2, sums + 16 * BN + s0, BN * 4);
      if (HALVES == 2) _tile_stored(3, sums + 16 * BN + s0 + 16, BN * 4);
    }
  }
}

#endif  // CF_HAVE_AMX

inline __mmask16 lanes_below(int64_t n_left) {
  return n_left >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << std::max<int64_t>(n_left, 0)) - 1);
}

inline void store(float* out, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(out, m, v); }
inline void store(uint16_t* out, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(out, m, cf_bf16::from_floats(v));
}
inline __m512 load_row(const float* b, __mmask16 m) { return _mm512_maskz_loadu_ps(m, b); }
inline __m512 load_row(const uint16_t* b, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, b)), 16));
}

template <int V, typename T>
void linear_blocks(const T* x, int64_t rows, int64_t x_stride, const T* w, int64_t n, int64_t k, int64_t k_padded,
                   const T* bias, bool swish, const T* mul, int64_t mul_stride, T* out, int64_t out_stride,
                   int threads) {
  constexpr int64_t BN = 16 * V;
  const int64_t blocks = (n + BN - 1) / BN;
  const T* xs[MAX_ROWS];
  for (int64_t r = 0; r < rows; ++r) xs[r] = x + r * x_stride;
#if CF_HAVE_AMX
  // AMX: bf16 only, and the k steps the packing pads to (32 values) must be the ones oneDNN's own
  // AMX product takes
  const bool amx = sizeof(T) == 2 && g_amx.active() && k_padded == (k + 31) / 32 * 32;
  alignas(64) uint16_t tail[MAX_ROWS * 32];  // the rows' last k step, zero-padded (AMX)
  if (amx && k % 32) {  // only then is the tail read, and only its first `rows` rows
    const int64_t full = k / 32 * 32;
    std::memset(tail, 0, sizeof(uint16_t) * 32 * rows);
    for (int64_t r = 0; r < rows; ++r)
      std::memcpy(tail + 32 * r, reinterpret_cast<const uint16_t*>(x + r * x_stride) + full, 2 * (k - full));
  }
  auto configure_pass = [rows](int64_t r0) {  // tiles for rows r0 .. r0 + 31
    const int64_t left = rows - r0;
    configure_amx(static_cast<int>(std::min<int64_t>(16, left)), static_cast<int>(std::clamp<int64_t>(left - 16, 0, 16)));
  };
#endif
#pragma omp parallel num_threads(threads) if (threads > 1 && blocks > 1)
  {
#if CF_HAVE_AMX
  if (amx) configure_pass(0);
#endif
#pragma omp for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    __m512 sums[MAX_ROWS][V];
#if CF_HAVE_AMX
    if (amx) {
      for (int64_t r0 = 0; r0 < rows; r0 += 32) {  // 32 rows a pass over the block (more: its bytes again)
        if (rows > 32) configure_pass(r0);
        amx_block_sums<BN>(reinterpret_cast<float*>(sums[r0]), reinterpret_cast<const uint16_t*>(w) + b * k_padded * BN,
                           reinterpret_cast<const uint16_t*>(x + r0 * x_stride), x_stride, tail + 32 * r0,
                           static_cast<int>(std::min<int64_t>(32, rows - r0)), k, k_padded);
      }
    } else
#endif
    block_sums<V>(sums, w + b * k_padded * BN, xs, static_cast<int>(rows), k);
    for (int64_t r = 0; r < rows; ++r) {
      T* o = out + r * out_stride + b * BN;
      for (int v = 0; v < V; ++v) {
        const int64_t first = b * BN + 16 * v;
        const __mmask16 m = lanes_below(n - first);
        if (!m) break;
        __m512 y = sums[r][v];
        if (bias) y = _mm512_add_ps(y, load_row(bias + first, m));
        if (swish) y = onednn_swish(y);
        if (mul) y = _mm512_mul_ps(y, load_row(mul + r * mul_stride + first, m));
        store(o + 16 * v, y, m);
      }
    }
  }
#if CF_HAVE_AMX
  if (amx) _tile_release();
#endif
  }
}

template <typename T>
int linear_dispatch(const T* x, int64_t rows, int64_t x_stride, const T* w, int64_t n, int64_t k, int64_t k_padded,
                    int64_t block_n, const T* bias, bool swish, const T* mul, int64_t mul_stride, T* out,
                    int64_t out_stride, int threads) {
  switch (block_n) {
    case 16:
      linear_blocks<1>(x, rows, x_stride, w, n, k, k_padded, bias, swish, mul, mul_stride, out, out_stride, threads);
      return 0;
    case 32:
      linear_blocks<2>(x, rows, x_stride, w, n, k, k_padded, bias, swish, mul, mul_stride, out, out_stride, threads);
      return 0;
    case 64:
      linear_blocks<4>(x, rows, x_stride, w, n, k, k_padded, bias, swish, mul, mul_stride, out, out_stride, threads);
      return 0;
    default: return 2;
  }
}

}  // namespace

extern "C" {

// Asks the OS for AMX tile state in this process; 0: bf16 sums run on AMX tiles from now on; 1: not
// built for AMX (no AMX here); 2: the OS refused.
int cf_packed_amx_init() {
#if CF_HAVE_AMX
  return g_amx.init();
#else
  return 1;
#endif
}

// Whether bf16 sums run on AMX tiles (1) or on AVX-512 (0, also where AMX is not granted); `on`:
// switch to AMX (1, only where cf_packed_amx_init granted it) or to AVX-512 (0), -1 leaves it.
// For paired A/B measurements and tests; not thread-safe against a running product.
int cf_packed_use_amx(int on) {
  return g_amx.use(on);  // never granted where not built for AMX: 0
}

// out[rows, n] = swish?(x[rows, k] W^T (+ bias)) (* mul[rows, n]), W as oneDNN packed it (blocks
// of block_n outputs, each k_padded k steps long); bias and mul may be null, swish (oneDNN's) is
// applied where nonzero. At most MAX_ROWS rows. 0 on success; 1: bad sizes; 2: a block width this
// file has no code for.
int cf_packed_linear(const void* x, int64_t rows, int64_t x_stride, const void* w, int64_t n, int64_t k,
                     int64_t k_padded, int64_t block_n, const void* bias, int swish, const void* mul,
                     int64_t mul_stride, void* out, int64_t out_stride, int is_bf16, int threads) {
  if (rows < 0 || rows > MAX_ROWS || n <= 0 || k <= 0 || k_padded < k || x_stride < k || out_stride < n ||
      (mul && mul_stride < n))
    return 1;
  if (is_bf16)
    return linear_dispatch(static_cast<const uint16_t*>(x), rows, x_stride, static_cast<const uint16_t*>(w), n, k,
                           k_padded, block_n, static_cast<const uint16_t*>(bias), swish != 0,
                           static_cast<const uint16_t*>(mul), mul_stride, static_cast<uint16_t*>(out), out_stride,
                           threads);
  return linear_dispatch(static_cast<const float*>(x), rows, x_stride, static_cast<const float*>(w), n, k, k_padded,
                         block_n, static_cast<const float*>(bias), swish != 0, static_cast<const float*>(mul),
                         mul_stride, static_cast<float*>(out), out_stride, threads);
}

}  // extern "C"
