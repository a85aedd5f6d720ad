// Per-head RMSNorm then RoPE of the q and k heads of a fused qkv projection, on the CPU, in one
// pass (see qk_norm_rope.py for why and how it is built).
//
// qkv: [tokens, row_stride] (float32 or bfloat16 bits); the first heads * head_dim values of a
// row are its q heads then its k heads. weight: [heads, head_dim]; cos, sin: [tokens, head_dim]
// (sin sign-folded: -sin on the first half); out: [tokens, heads, head_dim]. Rounds where the
// torch ops round (each op's result in the model's dtype):
//   y = round(x * rsqrt(mean(x^2) + eps));  y = round(y * w);
//   out = round(round(y * cos) + roll(y, D/2) * sin)
#include <cmath>
#include <cstdint>
#include <cstring>

#include "bf16_bits.h"

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define CF_HAVE_AVX512 1
#else
#define CF_HAVE_AVX512 0
#endif

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return cf_bf16::to_float(p[i]); }
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const uint16_t*) { return cf_bf16::round(f); }
inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(uint16_t* p, int64_t i, float f) { p[i] = cf_bf16::from_float(f); }

constexpr int kMaxHeadDim = 512;

// D: the head dim as a compile-time constant (64, 128: the loops unroll), or 0 to read it from dd.
template <typename T, int D>
void run(const T* qkv, int64_t row_stride, int64_t tokens, int64_t heads, int64_t dd, const T* weight,
         const T* cos, const T* sin, float eps, T* out, int threads) {
  const int64_t d = D ? D : dd;
  const int64_t half = d / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && tokens > 1) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    float y[kMaxHeadDim];
    const T* c = cos + t * d;
    const T* s = sin + t * d;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = qkv + t * row_stride + h * d;
      const T* w = weight + h * d;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < d; ++i) {
        const float v = load(x, i);
        y[i] = v;
        ss += v * v;
      }
      const float r = 1.0f / std::sqrt(ss / static_cast<float>(d) + eps);
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) y[i] = round_to(round_to(y[i] * r, x) * load(w, i), x);
      T* o = out + (t * heads + h) * d;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {  // first half: rotated by the second
        const float a = round_to(y[i] * load(c, i), x);
        store(o, i, a + y[i + half] * load(s, i));
      }
#pragma omp simd
      for (int64_t i = half; i < d; ++i) {
        const float a = round_to(y[i] * load(c, i), x);
        store(o, i, a + y[i - half] * load(s, i));
      }
    }
  }
}

#if CF_HAVE_AVX512
// The same arithmetic 16 lanes at a time, for head dims whose halves are whole vectors (32, 64,
// 128, 256). A token's heads go in two passes: every head's sum of squares and 1 / rms first (the
// heads' reductions, square roots and divisions are independent chains the core overlaps), then
// each head's scale and rotation. Rounding to bfloat16 as in bf16_bits.h (vcvtneps2bf16 mostly).
// 500 tokens x 10 heads of 64 in bfloat16, one thread of an AMX Xeon: 306 us as the scalar loops
// below (each head's chain latency-bound), 148 us here. The sum of squares
// adds 16 lanes then reduces them, another order than torch's (the tests bound the difference).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return cf_bf16::load16(p); }
inline __m512 round16(__m512 x, const float*) { return x; }
inline __m512 round16(__m512 x, const uint16_t*) { return cf_bf16::round16(x); }
inline void store16(float* p, __m512 x) { _mm512_storeu_ps(p, x); }
inline void store16(uint16_t* p, __m512 x) { cf_bf16::store16(p, x); }

constexpr int64_t kMaxHeads = 1024;

template <typename T, int D>
void run_avx512(const T* qkv, int64_t row_stride, int64_t tokens, int64_t heads, const T* weight, const T* cos,
                const T* sin, float eps, T* out, int threads) {
  constexpr int kVectors = D / 16, kHalf = kVectors / 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && tokens > 1) schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    float inv_rms[kMaxHeads];
    const T* row = qkv + t * row_stride;
    for (int64_t h = 0; h < heads; ++h) {
      __m512 ss = _mm512_setzero_ps();
      for (int v = 0; v < kVectors; ++v) {
        const __m512 x = load16(row + h * D + v * 16);
        ss = _mm512_add_ps(ss, _mm512_mul_ps(x, x));
      }
      inv_rms[h] = 1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(D) + eps);
    }
    const T* c = cos + t * D;
    const T* s = sin + t * D;
    for (int64_t h = 0; h < heads; ++h) {
      const T* x = row + h * D;
      const T* w = weight + h * D;
      const __m512 r = _mm512_set1_ps(inv_rms[h]);
      __m512 y[kVectors];
      for (int v = 0; v < kVectors; ++v)
        y[v] = round16(_mm512_mul_ps(round16(_mm512_mul_ps(load16(x + v * 16), r), x), load16(w + v * 16)), x);
      T* o = out + (t * heads + h) * D;
      for (int v = 0; v < kVectors; ++v) {  // first half rotated by the second, second by the first
        const __m512 a = round16(_mm512_mul_ps(y[v], load16(c + v * 16)), x);
        const __m512 other = y[v < kHalf ? v + kHalf : v - kHalf];
        store16(o + v * 16, _mm512_add_ps(a, _mm512_mul_ps(other, load16(s + v * 16))));
      }
    }
  }
}
#endif

template <typename T>
void dispatch(const T* qkv, int64_t row_stride, int64_t tokens, int64_t heads, int64_t d, const T* weight,
              const T* cos, const T* sin, float eps, T* out, int threads) {
#if CF_HAVE_AVX512
  if (heads <= kMaxHeads) {
    switch (d) {
      case 32: run_avx512<T, 32>(qkv, row_stride, tokens, heads, weight, cos, sin, eps, out, threads); return;
      case 64: run_avx512<T, 64>(qkv, row_stride, tokens, heads, weight, cos, sin, eps, out, threads); return;
      case 128: run_avx512<T, 128>(qkv, row_stride, tokens, heads, weight, cos, sin, eps, out, threads); return;
      case 256: run_avx512<T, 256>(qkv, row_stride, tokens, heads, weight, cos, sin, eps, out, threads); return;
      default: break;
    }
  }
#endif
  switch (d) {
    case 64: run<T, 64>(qkv, row_stride, tokens, heads, d, weight, cos, sin, eps, out, threads); return;
    case 128: run<T, 128>(qkv, row_stride, tokens, heads, d, weight, cos, sin, eps, out, threads); return;
    default: run<T, 0>(qkv, row_stride, tokens, heads, d, weight, cos, sin, eps, out, threads);
  }
}

}  // namespace

extern "C" {

// Returns 0, or 1 when the head dim is odd or over kMaxHeadDim.
int cf_qk_norm_rope(const void* qkv, int64_t row_stride, int64_t tokens, int64_t heads, int64_t head_dim,
                    const void* weight, const void* cos, const void* sin, float eps, void* out, int is_bf16,
                    int threads) {
  if (head_dim % 2 || head_dim > kMaxHeadDim || head_dim < 2) return 1;
  if (is_bf16) {
    dispatch(static_cast<const uint16_t*>(qkv), row_stride, tokens, heads, head_dim,
             static_cast<const uint16_t*>(weight), static_cast<const uint16_t*>(cos),
             static_cast<const uint16_t*>(sin), eps, static_cast<uint16_t*>(out), threads);
  } else {
    dispatch(static_cast<const float*>(qkv), row_stride, tokens, heads, head_dim, static_cast<const float*>(weight),
             static_cast<const float*>(cos), static_cast<const float*>(sin), eps, static_cast<float*>(out), threads);
  }
  return 0;
}

}  // extern "C"
