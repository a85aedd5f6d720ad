// 2^x for x <= 0, 16 floats at a time (AVX-512): the CPU kernels' softmax numerators (included by
// their .cpp files; cpu_kernel_build.py hashes it with each of them).
//
// 2^floor(x) * 2^f with f = x - floor(x) in [0, 1) (vreduceps, exact) and 2^f by a degree-4
// polynomial fitted on [0, 1]: relative error < 3e-6 (checked on 2M inputs), under the bf16
// rounding (4e-3) the bf16 kernels' numerators or outputs get. vscalefps takes floor(x) itself.
// Inputs below -100 give ~2^-100 (a numerator next to the maximum's 1), never a subnormal:
// subnormal arithmetic takes microcode assists, several times slower.
#pragma once

#if defined(__AVX512F__) && defined(__AVX512DQ__)
#include <immintrin.h>

namespace cf_vec {

inline __m512 exp2_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-100.0f));
  const __m512 f = _mm512_reduce_ps(x, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(1.352060e-2f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.203743e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4142749e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9300662e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.00000252f));
  return _mm512_scalef_ps(p, x);
}

}  // namespace cf_vec
#endif
