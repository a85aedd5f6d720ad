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

namespace {

inline float bf16_to_float(uint16_t x) {
  uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {  // round to nearest even, like torch (branch-free: vectorizes)
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return bf16_to_float(p[i]); }
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const uint16_t*) { return bf16_to_float(float_to_bf16(f)); }
inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(uint16_t* p, int64_t i, float f) { p[i] = float_to_bf16(f); }

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

template <typename T>
void dispatch(const T* qkv, int64_t row_stride, int64_t tokens, int64_t heads, int64_t d, const T* weight,
              const T* cos, const T* sin, float eps, T* out, int threads) {
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
