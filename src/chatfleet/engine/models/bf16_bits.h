// bfloat16 <-> float32 as torch converts, one value or 16 at a time: the CPU kernels' shared
// rounding (included by their .cpp files; cpu_kernel_build.py hashes it with each of them).
//
// float -> bf16 rounds to nearest even and quiets NaNs (sign and payload's top bits kept);
// subnormals are kept, not flushed. On a CPU with AVX512_BF16, 16 values with no zero or
// subnormal among them take vcvtneps2bf16 (one instruction; it rounds the same way, checked on
// all 2^32 floats, except that it flushes subnormal inputs to zero), the rest the integer path.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#endif

namespace cf_bf16 {

inline float to_float(uint16_t x) {
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t from_float(float f) {  // branch-free: loops over it vectorize
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (bits >> 16) | 0x40u;
  return static_cast<uint16_t>((bits & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

inline float round(float f) { return to_float(from_float(f)); }  // f as the nearest bf16, in a float

#if defined(__AVX512F__) && defined(__AVX512BW__)

inline __m512 load16(const uint16_t* p) {  // 16 bf16 -> 16 floats (exact)
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

inline __m256i from_floats(__m512 x) {  // 16 floats -> 16 bf16, as from_float
  const __m512i bits = _mm512_castps_si512(x);
#if defined(__AVX512BF16__)
  if (!_mm512_testn_epi32_mask(bits, _mm512_set1_epi32(0x7f800000))) return (__m256i)_mm512_cvtneps_pbh(x);
#endif
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(bits, _mm512_set1_epi32(0x7fffffff)),
                                                _mm512_set1_epi32(0x7f800000));
  const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
  return _mm512_cvtepi32_epi16(_mm512_mask_mov_epi32(rounded, nan, quiet));
}

inline void store16(uint16_t* p, __m512 x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), from_floats(x)); }

inline __m512 round16(__m512 x) {  // 16 floats as the nearest bf16s, in floats
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(from_floats(x)), 16));
}

#endif

}  // namespace cf_bf16
