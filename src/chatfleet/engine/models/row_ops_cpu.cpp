// The decoder layer's row-wise hidden-state kernels on the CPU: RMSNorm of each row, and SwiGLU's
// silu(gate) * up (see row_ops.py for why and how it is built).
//
// Each reproduces the torch ops it replaces to the last bit, rounding where they round:
//   add_rms_norm: a = round(a + res) in place (torch's add_), then rms_norm(a)
//   rms_norm:     r = 1 / sqrt(sum(x^2) / n + eps), the sum in the order of torch's CPU sum
//                 kernel (cascade_sum: 8 float lanes, 4 accumulators, 4 cascade levels);
//                 out = round(round(x * r) * w)  (float32: the same, every rounding a no-op)
//   silu_and_mul: s = round(g / (1 + exp(-g))), out = round(s * u), exp as torch computes it:
//                 Sleef_expf_u10's algorithm over each row's whole chunks of `chunk` elements
//                 (torch's vectorized loop: two vectors of the dtype a step; AVX-512 on this
//                 kernel), libm's expf on the rest.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "bf16_bits.h"

namespace {

inline float load(const float* p, int64_t i) { return p[i]; }
inline float load(const uint16_t* p, int64_t i) { return cf_bf16::to_float(p[i]); }
inline float round_to(float f, const float*) { return f; }
inline float round_to(float f, const uint16_t*) { return cf_bf16::round(f); }
inline void store(float* p, int64_t i, float f) { p[i] = f; }
inline void store(uint16_t* p, int64_t i, float f) { p[i] = cf_bf16::from_float(f); }

inline float square(float v) { return v * v; }

// torch's sum kernel is registered without its AVX-512 build (REGISTER_DISPATCH, not
// ALSO_REGISTER_AVX512_DISPATCH): it adds in AVX2 vectors of 8 floats on AVX-512 CPUs too.
constexpr int kSumLanes = 8;

int64_t ceil_log2(int64_t x) {  // ATen's utils::CeilLog2
  if (x <= 2) return 1;
  int64_t bits = 0;
  for (uint64_t v = static_cast<uint64_t>(x) - 1; v; v >>= 1) ++bits;
  return bits;
}

// ATen's multi_row_sum with nrows = 4 over W-lane vectors: `size` groups of 4 vectors (4 * W
// squares each, from x), accumulator k takes vector k of each group, in 4 cascade levels (the
// levels written out, so that every index is a constant and the accumulators stay in registers).
template <int W>
struct Acc {
  float v[4][W];
};

template <int W>
inline void zero(Acc<W>& a) {
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < W; ++l) a.v[k][l] = 0.f;
}

template <int W>
inline void add_into(Acc<W>& to, const Acc<W>& from) {
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < W; ++l) to.v[k][l] += from.v[k][l];
}

template <int W, typename T>
void multi_row_sum(const T* x, int64_t size, float out[4][W]) {
  const int64_t level_power = ceil_log2(size) / 4 > 4 ? ceil_log2(size) / 4 : 4;
  const int64_t level_step = int64_t{1} << level_power;
  const int64_t level_mask = level_step - 1;
  Acc<W> acc0, acc1, acc2, acc3;
  zero(acc0);
  zero(acc1);
  zero(acc2);
  zero(acc3);
  auto add_group = [&](int64_t i) {
    const T* g = x + i * 4 * W;
    for (int k = 0; k < 4; ++k)
      for (int l = 0; l < W; ++l) acc0.v[k][l] += square(load(g, k * W + l));
  };
  int64_t i = 0;
  while (i + level_step <= size) {
    for (int64_t j = 0; j < level_step; ++j, ++i) add_group(i);
    add_into(acc1, acc0);
    zero(acc0);
    if ((i & (level_mask << level_power)) != 0) continue;
    add_into(acc2, acc1);
    zero(acc1);
    if ((i & (level_mask << (2 * level_power))) != 0) continue;
    add_into(acc3, acc2);
    zero(acc2);
  }
  for (; i < size; ++i) add_group(i);
  add_into(acc0, acc1);
  add_into(acc0, acc2);
  add_into(acc0, acc3);
  for (int k = 0; k < 4; ++k)
    for (int l = 0; l < W; ++l) out[k][l] = acc0.v[k][l];
}

// ATen's row_sum (ilp 4) over `size` W-lane vectors: the vector of lane sums.
template <int W, typename T>
void row_sum(const T* x, int64_t size, float lanes[W]) {
  const int64_t size_ilp = size / 4;
  float partial[4][W];
  multi_row_sum<W>(x, size_ilp, partial);
  for (int64_t v = size_ilp * 4; v < size; ++v)
    for (int l = 0; l < W; ++l) partial[0][l] += square(load(x, v * W + l));
  for (int k = 1; k < 4; ++k)
    for (int l = 0; l < W; ++l) partial[0][l] += partial[k][l];
  for (int l = 0; l < W; ++l) lanes[l] = partial[0][l];
}

// The sum of a row's squares as torch's sum kernel adds them (vectorized_inner_sum where the row
// holds a whole vector, else scalar_inner_sum: the same with one lane).
template <int W, typename T>
float sum_of_squares(const T* x, int64_t n) {
  if (n < W) {
    float one[1];
    row_sum<1>(x, n, one);
    return one[0];
  }
  const int64_t vectors = n / W;
  float lanes[W];
  row_sum<W>(x, vectors, lanes);
  float total = 0.f;
  for (int64_t k = vectors * W; k < n; ++k) total += square(load(x, k));
  for (int l = 0; l < W; ++l) total += lanes[l];
  return total;
}

// o = round(round(x * r) * w) and a = round(a + b), element by element. In bfloat16 on AVX-512
// explicitly 16 at a time with bf16_bits.h's rounding (the same bits; the compiler's own
// vectorization of the scalar rounding took most of the norm's time: add + RMSNorm of 500 x 512
// in bf16 on an AMX Xeon, one thread, 144 -> 112 us), the tail and float32 by the scalar loops.
template <typename T>
inline void scale_tail(const T* xr, int64_t n, float r, const T* weight, T* o, int64_t from) {
#pragma omp simd
  for (int64_t i = from; i < n; ++i) store(o, i, round_to(load(xr, i) * r, xr) * load(weight, i));
}

template <typename T>
inline void add_tail(T* a, const T* b, int64_t n, int64_t from) {
#pragma omp simd
  for (int64_t i = from; i < n; ++i) store(a, i, load(a, i) + load(b, i));
}

template <typename T>
inline void scale_row(const T* xr, int64_t n, float r, const T* weight, T* o) { scale_tail(xr, n, r, weight, o, 0); }

template <typename T>
inline void add_row(T* a, const T* b, int64_t n) { add_tail(a, b, n, 0); }

#if defined(__AVX512F__) && defined(__AVX512BW__)
inline void scale_row(const uint16_t* xr, int64_t n, float r, const uint16_t* weight, uint16_t* o) {
  const __m512 rv = _mm512_set1_ps(r);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 y = cf_bf16::round16(_mm512_mul_ps(cf_bf16::load16(xr + i), rv));
    cf_bf16::store16(o + i, _mm512_mul_ps(y, cf_bf16::load16(weight + i)));
  }
  scale_tail(xr, n, r, weight, o, i);
}

inline void add_row(uint16_t* a, const uint16_t* b, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) cf_bf16::store16(a + i, _mm512_add_ps(cf_bf16::load16(a + i), cf_bf16::load16(b + i)));
  add_tail(a, b, n, i);
}
#endif

template <int W, typename T>
inline void norm_row(const T* xr, int64_t n, const T* weight, float eps, T* o) {
  const float mean = sum_of_squares<W>(xr, n) / static_cast<float>(n);
  const float r = 1.0f / std::sqrt(mean + eps);
  scale_row(xr, n, r, weight, o);
}

template <int W, typename T>
void rms_norm(const T* x, int64_t x_stride, int64_t rows, int64_t n, const T* weight, float eps, T* out,
              int64_t out_stride, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
  for (int64_t t = 0; t < rows; ++t) norm_row<W>(x + t * x_stride, n, weight, eps, out + t * out_stride);
}

// The residual add and the next RMSNorm in one pass per row: a += r (rounded to T, as torch's
// add_ rounds), then out = rms_norm(a).
template <int W, typename T>
void add_rms_norm(T* a, const T* res, int64_t rows, int64_t n, const T* weight, float eps, T* out, int threads) {
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
    T* ar = a + t * n;
    add_row(ar, res + t * n, n);
    norm_row<W>(static_cast<const T*>(ar), n, weight, eps, out + t * n);
  }
}

// Sleef_expf_u10 (sleefsimdsp.c xexpf, with FMA as torch's AVX2/AVX-512 builds have it), element
// by element so that it vectorizes. q is rounded by adding 1.5 * 2^23 (exact for |d| <= 104, the
// only inputs whose result is kept); the integer exponent comes from q clamped with min/max
// (a NaN becomes a bound, never an integer conversion of a NaN), and no input is clamped, so the
// compiler has no constant lanes to split the polynomial over.
inline float pow2i(int32_t e) {
  const uint32_t bits = static_cast<uint32_t>(e + 0x7f) << 23;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline float sleef_expf(float d) {
  const float qf = (d * 1.442695040888963407359924681001892137426645954152985934135449406931f + 12582912.f)
                   - 12582912.f;
  float s = std::fma(qf, -0.693145751953125f, d);
  s = std::fma(qf, -1.428606765330187045e-06f, s);
  float u = 0.000198527617612853646278381f;
  u = std::fma(u, s, 0.00139304355252534151077271f);
  u = std::fma(u, s, 0.00833336077630519866943359f);
  u = std::fma(u, s, 0.0416664853692054748535156f);
  u = std::fma(u, s, 0.166666671633720397949219f);
  u = std::fma(u, s, 0.5f);
  u = 1.0f + std::fma(s * s, u, s);
  float qc = qf < 160.f ? qf : 160.f;
  qc = qc > -160.f ? qc : -160.f;
  const int32_t q = static_cast<int32_t>(qc);
  const int32_t half = q >> 1;
  u = u * pow2i(half) * pow2i(q - half);
  u = d < -104.f ? 0.f : u;
  return 100.f < d ? std::numeric_limits<float>::infinity() : u;
}

// bf16 silu of every bf16 gate, rounded (the vector path's round_to(g / (1 + exp(-g)))), built once:
// a 16-bit gate has 65,536 values, so a 128 KiB table (it stays in L2) gives the same bits as
// computing it, without the exp polynomial and the division (vdivps alone bounded the loop).
const uint16_t* bf16_silu_table() {
  static const std::vector<uint16_t> table = [] {
    std::vector<uint16_t> t(65536);
    for (uint32_t b = 0; b < 65536; ++b) {
      const float x = cf_bf16::to_float(static_cast<uint16_t>(b));
      t[b] = cf_bf16::from_float(x / (1.0f + sleef_expf(-x)));
    }
    return t;
  }();
  return table.data();
}

template <typename T>
void silu_and_mul(const T* gate_up, int64_t stride, int64_t rows, int64_t n, T* out, int64_t chunk,
                  int threads) {
  const uint16_t* silu_table = nullptr;  // bf16 only
  if constexpr (std::is_same_v<T, uint16_t>) silu_table = bf16_silu_table();
  const int64_t whole = n / chunk * chunk;
#pragma omp parallel for num_threads(threads) if (threads > 1 && rows > 1) schedule(static)
  for (int64_t t = 0; t < rows; ++t) {
    const T* g = gate_up + t * stride;
    const T* u = g + n;
    T* o = out + t * n;
    if constexpr (std::is_same_v<T, uint16_t>) {
#pragma omp simd
      for (int64_t i = 0; i < whole; ++i) store(o, i, cf_bf16::to_float(silu_table[g[i]]) * load(u, i));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < whole; ++i) {
        const float x = load(g, i);
        store(o, i, round_to(x / (1.0f + sleef_expf(-x)), g) * load(u, i));
      }
    }
    for (int64_t i = whole; i < n; ++i) {  // torch's scalar tail: libm's expf
      const float x = load(g, i);
      store(o, i, round_to(x / (1.0f + std::exp(-x)), g) * load(u, i));
    }
  }
}

}  // namespace

extern "C" {

// Returns 0, or 1 when a size is not positive.
int cf_rms_norm(const void* x, int64_t x_stride, int64_t rows, int64_t n, const void* weight, float eps, void* out,
                int64_t out_stride, int is_bf16, int threads) {
  if (n < 1 || rows < 0) return 1;
  if (is_bf16) {
    rms_norm<kSumLanes>(static_cast<const uint16_t*>(x), x_stride, rows, n, static_cast<const uint16_t*>(weight), eps,
                        static_cast<uint16_t*>(out), out_stride, threads);
  } else {
    rms_norm<kSumLanes>(static_cast<const float*>(x), x_stride, rows, n, static_cast<const float*>(weight), eps,
                        static_cast<float*>(out), out_stride, threads);
  }
  return 0;
}

// a, res, out: [rows, n] contiguous; a += res, then out = RMSNorm(a). Returns 0, or 1 when a size
// is not positive.
int cf_add_rms_norm(void* a, const void* res, int64_t rows, int64_t n, const void* weight, float eps, void* out,
                    int is_bf16, int threads) {
  if (n < 1 || rows < 0) return 1;
  if (is_bf16) {
    add_rms_norm<kSumLanes>(static_cast<uint16_t*>(a), static_cast<const uint16_t*>(res), rows, n,
                            static_cast<const uint16_t*>(weight), eps, static_cast<uint16_t*>(out), threads);
  } else {
    add_rms_norm<kSumLanes>(static_cast<float*>(a), static_cast<const float*>(res), rows, n,
                            static_cast<const float*>(weight), eps, static_cast<float*>(out), threads);
  }
  return 0;
}

// gate_up: [rows, stride], gate in columns [0, n), up in [n, 2n); out: [rows, n] contiguous.
// Returns 0, or 1 when a size is not positive.
int cf_silu_and_mul(const void* gate_up, int64_t stride, int64_t rows, int64_t n, void* out, int is_bf16,
                    int64_t chunk, int threads) {
  if (n < 1 || rows < 0 || chunk < 1) return 1;
  if (is_bf16) {
    silu_and_mul(static_cast<const uint16_t*>(gate_up), stride, rows, n, static_cast<uint16_t*>(out), chunk,
                 threads);
  } else {
    silu_and_mul(static_cast<const float*>(gate_up), stride, rows, n, static_cast<float*>(out), chunk, threads);
  }
  return 0;
}

}  // extern "C"
