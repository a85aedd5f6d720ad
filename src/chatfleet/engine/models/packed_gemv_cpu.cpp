// Linears of a few rows (decode steps) read straight from oneDNN's prepacked weight: see
// packed_gemv.py for why and for the layout, which the Python side checks against the plain
// weight before it lets a weight in here.
//
// The packed weight of an [N, K] linear is ceil(N / BN) blocks of BN outputs; block b holds, for
// each k step of P (P = 2 in bf16, 1 in float32) up to the padded K, the BN outputs' P weights:
// w[b][kp][n][p] = W[b * BN + n][kp * P + p], zeros in the padding. One block is one sequential
// stream: every row's BN sums are kept in registers while it is read (bf16 pairs through
// vdpbf16ps where the CPU has AVX512_BF16, else widened and fused-multiply-added), four rows at a
// time; more rows re-read the block from cache. Sums are float32 in k order; the output is
// rounded once, after the bias is added and, if given, the product with a same-shaped factor
// (SwiGLU's up half times the activated gate, as oneDNN's binary mul post-op does).
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "bf16_bits.h"

namespace {

constexpr int MAX_ROWS_AT_ONCE = 4;
constexpr int64_t AHEAD_BYTES = 8192;  // software prefetch distance: one thread streams ~1.6x faster with it

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
  for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_si512(wk + 32 * v);
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
  for (int v = 0; v < V; ++v) w[v] = _mm512_loadu_ps(wk + 16 * v);
  for (int r = 0; r < R; ++r) {
    const __m512 x = _mm512_set1_ps(xs[r][kk]);
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(w[v], x, acc[r][v]);
  }
}

template <int64_t BYTES, typename T>
inline void prefetch_step(const T* p) {  // every cache line of one k step
  for (int64_t b = 0; b < BYTES; b += 64) _mm_prefetch(reinterpret_cast<const char*>(p) + b, _MM_HINT_T0);
}

// The sums of R rows over one block (V * 16 outputs) of weight w (k_padded steps of P values).
template <int R, int V, typename T>
inline void block_sums(__m512 (&acc)[R][V], const T* w, const T* const* xs, int64_t k) {
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  constexpr int64_t LINE = 16 * V * (sizeof(T) == 2 ? 2 : 1);  // values per k step
  constexpr int64_t AHEAD = AHEAD_BYTES / sizeof(T) / LINE + 1;  // k steps ahead of the loads
  if constexpr (sizeof(T) == 2) {
    const int64_t whole = k / 2;  // pairs whose both values are x's: broadcast from memory
    for (int64_t kp = 0; kp < whole; ++kp) {
      prefetch_step<LINE * sizeof(T)>(w + (kp + AHEAD) * LINE);
      bf16_step<R, V, false>(acc, reinterpret_cast<const uint16_t*>(w) + kp * LINE,
                             reinterpret_cast<const uint16_t* const*>(xs), kp);
    }
    if (k % 2)  // the last value pairs with the padding's zero
      bf16_step<R, V, true>(acc, reinterpret_cast<const uint16_t*>(w) + whole * LINE,
                            reinterpret_cast<const uint16_t* const*>(xs), whole);
  } else {
    for (int64_t kk = 0; kk < k; ++kk) {
      prefetch_step<LINE * sizeof(T)>(w + (kk + AHEAD) * LINE);
      f32_step<R, V>(acc, reinterpret_cast<const float*>(w) + kk * LINE, reinterpret_cast<const float* const*>(xs),
                     kk);
    }
  }
}

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
                   const T* bias, const T* mul, int64_t mul_stride, T* out, int64_t out_stride, int threads) {
  constexpr int64_t BN = 16 * V;
  const int64_t blocks = (n + BN - 1) / BN;
#pragma omp parallel for num_threads(threads) if (threads > 1 && blocks > 1) schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const T* wb = w + b * k_padded * BN;
    for (int64_t r0 = 0; r0 < rows; r0 += MAX_ROWS_AT_ONCE) {
      const T* xs[MAX_ROWS_AT_ONCE];
      const int rr = static_cast<int>(std::min<int64_t>(MAX_ROWS_AT_ONCE, rows - r0));
      for (int r = 0; r < MAX_ROWS_AT_ONCE; ++r) xs[r] = x + (r0 + std::min(r, rr - 1)) * x_stride;
      __m512 acc[MAX_ROWS_AT_ONCE][V];
      switch (rr) {  // R is a template argument so that the sums stay in registers
        case 1: block_sums<1, V>(reinterpret_cast<__m512(&)[1][V]>(acc), wb, xs, k); break;
        case 2: block_sums<2, V>(reinterpret_cast<__m512(&)[2][V]>(acc), wb, xs, k); break;
        case 3: block_sums<3, V>(reinterpret_cast<__m512(&)[3][V]>(acc), wb, xs, k); break;
        default: block_sums<4, V>(acc, wb, xs, k); break;
      }
      for (int r = 0; r < rr; ++r) {
        T* o = out + (r0 + r) * out_stride + b * BN;
        for (int v = 0; v < V; ++v) {
          const int64_t first = b * BN + 16 * v;
          const __mmask16 m = lanes_below(n - first);
          if (!m) break;
          __m512 y = acc[r][v];
          if (bias) y = _mm512_add_ps(y, load_row(bias + first, m));
          if (mul) y = _mm512_mul_ps(y, load_row(mul + (r0 + r) * mul_stride + first, m));
          store(o + 16 * v, y, m);
        }
      }
    }
  }
}

template <typename T>
int linear_dispatch(const T* x, int64_t rows, int64_t x_stride, const T* w, int64_t n, int64_t k, int64_t k_padded,
                    int64_t block_n, const T* bias, const T* mul, int64_t mul_stride, T* out, int64_t out_stride,
                    int threads) {
  switch (block_n) {
    case 16: linear_blocks<1>(x, rows, x_stride, w, n, k, k_padded, bias, mul, mul_stride, out, out_stride, threads);
      return 0;
    case 32: linear_blocks<2>(x, rows, x_stride, w, n, k, k_padded, bias, mul, mul_stride, out, out_stride, threads);
      return 0;
    case 64: linear_blocks<4>(x, rows, x_stride, w, n, k, k_padded, bias, mul, mul_stride, out, out_stride, threads);
      return 0;
    default: return 2;
  }
}

}  // namespace

extern "C" {

// out[rows, n] = (x[rows, k] W^T (+ bias)) (* mul[rows, n]), W as oneDNN packed it (blocks of
// block_n outputs, each k_padded k steps long); bias and mul may be null. 0 on success; 1: bad
// sizes; 2: a block width this file has no code for.
int cf_packed_linear(const void* x, int64_t rows, int64_t x_stride, const void* w, int64_t n, int64_t k,
                     int64_t k_padded, int64_t block_n, const void* bias, const void* mul, int64_t mul_stride,
                     void* out, int64_t out_stride, int is_bf16, int threads) {
  if (rows < 0 || n <= 0 || k <= 0 || k_padded < k || x_stride < k || out_stride < n || (mul && mul_stride < n))
    return 1;
  if (is_bf16)
    return linear_dispatch(static_cast<const uint16_t*>(x), rows, x_stride, static_cast<const uint16_t*>(w), n, k,
                           k_padded, block_n, static_cast<const uint16_t*>(bias), static_cast<const uint16_t*>(mul),
                           mul_stride, static_cast<uint16_t*>(out), out_stride, threads);
  return linear_dispatch(static_cast<const float*>(x), rows, x_stride, static_cast<const float*>(w), n, k, k_padded,
                         block_n, static_cast<const float*>(bias), static_cast<const float*>(mul), mul_stride,
                         static_cast<float*>(out), out_stride, threads);
}

}  // extern "C"
