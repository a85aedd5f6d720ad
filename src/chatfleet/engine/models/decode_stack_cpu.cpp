// A step's decoder layers (Qwen3 dense) in one call: the same C++ kernels the model's modules call
// one by one from Python (packed_gemv_cpu, row_ops_cpu, qk_norm_rope_cpu, paged_decode_cpu, a
// chunk attention kernel), called here in the same order on the same operands, through the
// function pointers Python hands over (each kernel stays in its own library, built with its own
// flags). So the results are the modules' bits; what goes is the Python between the calls
// (decode_stack.py). A step is its decode rows (one token of a sequence each) followed by its
// prompt chunks (returning turns' new tokens, say): the chunks' rows go through every row-wise call
// with the decodes', and each chunk attends over its sequence's keys, gathered block by block from
// the cache into the workspace, with the chunk kernel.
//
// Per layer, with X the hidden state coming in (layer 0: the embeddings, read only) and R the
// residual stream (layer 0: the embeddings):
//   H = X += R; rms_norm(X)              (layer 0: H = rms_norm(embeddings), R = embeddings)
//   QKV = H Wqkv^T (+ b)                 packed linear
//   QK = qk_norm_rope(QKV's q|k heads)   per-head RMSNorm, RoPE by the step's cos/sin rows
//   store k (QK's kv heads), v (QKV)     into the cache slots (FP8: quantized)
//   ATT = paged_decode(q)                over each sequence's cached context (decode rows);
//         chunk_attention(q)             the chunk's rows over its sequence's keys, causal
//   A = ATT Wo^T (+ b); H = A += X; rms_norm(A)    (A becomes the residual stream)
//   MID = silu(H Wg^T) * (H Wu^T)        bf16: both halves in the linear kernel (swish, mul);
//                                        float32: the fused gate_up product, then silu_and_mul
//   X = MID Wd^T
// then the final norm: OUT = rms_norm(X += A).
// Two buffers (X, A) trade the residual role as the modules' tensors do; every other buffer is
// reused by every layer. The workspace comes from the caller (cf_decode_stack_workspace).

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using PackedLinearFn = int (*)(const void*, int64_t, int64_t, const void*, int64_t, int64_t, int64_t, int64_t,
                               const void*, int, const void*, int64_t, void*, int64_t, int, int);
using RmsNormFn = int (*)(const void*, int64_t, int64_t, int64_t, const void*, float, void*, int64_t, int, int);
using AddRmsNormFn = int (*)(void*, const void*, int64_t, int64_t, const void*, float, void*, int, int);
using SiluAndMulFn = int (*)(const void*, int64_t, int64_t, int64_t, void*, int, int64_t, int);
using QkNormRopeFn = int (*)(const void*, int64_t, int64_t, int64_t, int64_t, const void*, const void*, const void*,
                             float, void*, int, int);
using PagedDecodeFn = int (*)(const void*, const void*, const void*, void*, const int64_t*, const int64_t*, int64_t,
                              int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, float, int, int, int, float,
                              float);
using StoreKvFn = int (*)(const void*, int64_t, int64_t, const void*, int64_t, int64_t, void*, void*,
                          const int64_t*, int64_t, int64_t, int64_t, int64_t, int64_t);
using StoreKvFp8Fn = int (*)(const void*, int64_t, int64_t, const void*, int64_t, int64_t, void*, void*,
                             const int64_t*, int64_t, int64_t, int64_t, int64_t, int, float, float);
using ChunkAttentionFn = int (*)(const void*, int64_t, int64_t, const void*, int64_t, int64_t, const void*, int64_t,
                                 int64_t, void*, int64_t, int64_t, int64_t, int64_t, int64_t, float, int);

}  // namespace

extern "C" {

// The kernels' entry points (their libraries' exported functions).
struct CfKernels {
  void* packed_linear;
  void* rms_norm;
  void* add_rms_norm;
  void* silu_and_mul;
  void* qk_norm_rope;
  void* paged_decode;
  void* store_kv;
  void* store_kv_fp8;
};

// A linear's oneDNN-packed weight as packed_gemv reads it (data null: absent).
struct CfPackedWeight {
  const void* data;
  int64_t n, k, k_padded, block_n;
  const void* bias;  // [n] of the model's dtype, or null
};

struct CfLayer {
  const void* input_norm;  // [hidden]
  const void* post_norm;   // [hidden]
  const void* qk_norm;     // [heads + kv_heads, head_dim]: q_norm's weight per q head, then k_norm's
  CfPackedWeight qkv, o, gate, up, down;  // bf16: gate and up halves; float32: gate = the fused gate_up
  void* key_cache;    // [kv_heads, num_blocks, block_size, head_dim]
  void* value_cache;
  float k_scale, v_scale;  // FP8 caches only
};

struct CfModel {
  int64_t hidden, heads, kv_heads, head_dim, intermediate, layers, num_blocks, block_size;
  float eps, scale;
  int bf16, fp8, halves;  // halves: the MLP's gate and up are separate packed halves (bf16)
  int64_t silu_chunk;     // silu_and_mul's vector step (row_ops.py)
  const void* final_norm;
  const CfLayer* layer;
  CfKernels kernels;
};

struct CfStep {
  int64_t batch;
  const void* embeddings;  // [batch, hidden]
  const void* cos;         // [batch, head_dim]
  const void* sin;         // [batch, head_dim] (sign-folded, qwen3.Rotary)
  const int64_t* slots;    // [batch]
  const int64_t* block_tables;  // [decodes, table_width]
  int64_t table_width;
  const int64_t* context_lens;  // [decodes]
  void* out;                    // [batch, hidden]
  void* workspace;              // cf_decode_stack_workspace(model, batch) bytes, 64-byte aligned
  int threads;
  // Rows 0 .. decodes - 1 are decodes (block_tables and context_lens: theirs); the rows after them
  // are `chunks` prompt chunks, one after another.
  int64_t decodes;
  int64_t chunks;
  const int64_t* chunk_info;    // [chunks][3]: its rows, its first position, where its blocks start in chunk_blocks
  const int64_t* chunk_blocks;  // each chunk's sequence's blocks from position 0, ceil((first + rows) / block_size)
  void* chunk_kv;               // [2][kv_heads][the most blocks of a chunk * block_size][head_dim], the model's dtype
  void* chunk_attention;        // cf_chunk_attention_* of the model's dtype (causal, k/v from position 0)
};

}  // extern "C"

namespace {

constexpr int64_t kAlign = 64;

int64_t aligned(int64_t bytes) { return (bytes + kAlign - 1) / kAlign * kAlign; }

struct Buffers {
  char* x;
  char* a;
  char* h;
  char* qkv;
  char* qk;
  char* q;
  char* att;
  char* act;  // bf16: the activated gate; float32: gate_up [batch, 2 * intermediate]
  char* mid;
};

// The buffers' offsets in the workspace; returns its size.
int64_t lay_out(const CfModel& m, int64_t batch, char* base, Buffers* b) {
  const int64_t e = m.bf16 ? 2 : 4;
  const int64_t qkv_n = (m.heads + 2 * m.kv_heads) * m.head_dim;
  const int64_t sizes[] = {
      batch * m.hidden * e, batch * m.hidden * e, batch * m.hidden * e, batch * qkv_n * e,
      batch * (m.heads + m.kv_heads) * m.head_dim * e, batch * m.heads * m.head_dim * e,
      batch * m.heads * m.head_dim * e, batch * 2 * m.intermediate * e, batch * m.intermediate * e};
  char** slots[] = {&b->x, &b->a, &b->h, &b->qkv, &b->qk, &b->q, &b->att, &b->act, &b->mid};
  int64_t off = 0;
  for (int i = 0; i < 9; ++i) {
    *slots[i] = base + off;
    off += aligned(sizes[i]);
  }
  return off;
}

int linear(const CfModel& m, const CfPackedWeight& w, const void* x, int64_t rows, int64_t x_stride, void* out,
           int threads, int swish = 0, const void* mul = nullptr) {
  auto fn = reinterpret_cast<PackedLinearFn>(m.kernels.packed_linear);
  return fn(x, rows, x_stride, w.data, w.n, w.k, w.k_padded, w.block_n, w.bias, swish, mul, mul ? w.n : 0, out, w.n,
            m.bf16, threads);
}

}  // namespace

extern "C" {

int64_t cf_decode_stack_workspace(const CfModel* model, int64_t batch) {
  Buffers b;
  return lay_out(*model, batch, nullptr, &b);
}

// Returns 0, or 100 * (layer + 1) + the step that failed (1-9), or 1 for a bad model or step.
int cf_decode_stack(const CfModel* model, const CfStep* step) {
  const CfModel& m = *model;
  const int64_t B = step->batch;
  const int64_t decodes = step->decodes, chunks = step->chunks;
  if (B < 1 || m.layers < 1 || !step->workspace || decodes < 0 || decodes > B || chunks < 0) return 1;
  if (chunks && (m.fp8 || !step->chunk_info || !step->chunk_blocks || !step->chunk_kv || !step->chunk_attention))
    return 1;
  int64_t rows = decodes, most_blocks = 0;  // the chunks' rows after the decodes, their longest context
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t n = step->chunk_info[3 * c], first = step->chunk_info[3 * c + 1];
    if (n < 1 || first < 0 || step->chunk_info[3 * c + 2] < 0) return 1;
    rows += n;
    most_blocks = std::max(most_blocks, (first + n + m.block_size - 1) / m.block_size);
  }
  if (rows != B) return 1;
  auto chunk_attention = reinterpret_cast<ChunkAttentionFn>(step->chunk_attention);
  const CfKernels& k = m.kernels;
  auto rms_norm = reinterpret_cast<RmsNormFn>(k.rms_norm);
  auto add_rms_norm = reinterpret_cast<AddRmsNormFn>(k.add_rms_norm);
  auto silu_and_mul = reinterpret_cast<SiluAndMulFn>(k.silu_and_mul);
  auto qk_norm_rope = reinterpret_cast<QkNormRopeFn>(k.qk_norm_rope);
  auto paged_decode = reinterpret_cast<PagedDecodeFn>(k.paged_decode);
  auto store_kv = reinterpret_cast<StoreKvFn>(k.store_kv);
  auto store_kv_fp8 = reinterpret_cast<StoreKvFp8Fn>(k.store_kv_fp8);

  Buffers buf;
  lay_out(m, B, static_cast<char*>(step->workspace), &buf);
  const int64_t e = m.bf16 ? 2 : 4;
  const int64_t H = m.hidden, D = m.head_dim, heads_qk = m.heads + m.kv_heads;
  const int64_t q_size = m.heads * D, kv_size = m.kv_heads * D, qkv_n = q_size + 2 * kv_size;
  const int64_t I = m.intermediate;
  const int T = step->threads;
  const int64_t slots_per_head = m.num_blocks * m.block_size;
  // a chunk's keys and values, gathered from the cache: [kv_heads][its blocks * block_size][D] each
  const int64_t block_bytes = m.block_size * D * e;
  char* chunk_k = static_cast<char*>(step->chunk_kv);
  char* chunk_v = chunks ? chunk_k + m.kv_heads * most_blocks * m.block_size * D * e : nullptr;

  for (int64_t i = 0; i < m.layers; ++i) {
    const CfLayer& L = m.layer[i];
    const int fail = static_cast<int>(100 * (i + 1));
    const void* residual;
    if (i == 0) {
      if (rms_norm(step->embeddings, H, B, H, L.input_norm, m.eps, buf.h, H, m.bf16, T)) return fail + 1;
      residual = step->embeddings;
    } else {
      if (add_rms_norm(buf.x, buf.a, B, H, L.input_norm, m.eps, buf.h, m.bf16, T)) return fail + 1;
      residual = buf.x;
    }
    if (linear(m, L.qkv, buf.h, B, H, buf.qkv, T)) return fail + 2;
    if (qk_norm_rope(buf.qkv, qkv_n, B, heads_qk, D, L.qk_norm, step->cos, step->sin, m.eps, buf.qk, m.bf16, T))
      return fail + 3;
    const char* k_rows = buf.qk + q_size * e;       // row stride heads_qk * D, head stride D
    const char* v_rows = buf.qkv + (q_size + kv_size) * e;  // row stride qkv_n, head stride D
    const int stored = m.fp8 ? store_kv_fp8(k_rows, heads_qk * D, D, v_rows, qkv_n, D, L.key_cache, L.value_cache,
                                            step->slots, B, m.kv_heads, D, slots_per_head, m.bf16, L.k_scale,
                                            L.v_scale)
                             : store_kv(k_rows, heads_qk * D, D, v_rows, qkv_n, D, L.key_cache, L.value_cache,
                                        step->slots, B, m.kv_heads, D, slots_per_head, e);
    if (stored) return fail + 4;
    for (int64_t b = 0; b < B; ++b)  // q heads, contiguous (paged_decode.py's q.contiguous())
      std::memcpy(buf.q + b * q_size * e, buf.qk + b * heads_qk * D * e, q_size * e);
    if (decodes && paged_decode(buf.q, L.key_cache, L.value_cache, buf.att, step->block_tables, step->context_lens,
                                decodes, m.heads, m.kv_heads, m.num_blocks, m.block_size, step->table_width, D, m.scale,
                                m.bf16, T, m.fp8, L.k_scale, L.v_scale))
      return fail + 5;
    for (int64_t c = 0, row = decodes; c < chunks; ++c) {  // its keys and values (this step's included,
      const int64_t n = step->chunk_info[3 * c], first = step->chunk_info[3 * c + 1];  // just stored) in order
      const int64_t* blocks = step->chunk_blocks + step->chunk_info[3 * c + 2];
      const int64_t nblk = (first + n + m.block_size - 1) / m.block_size, len = nblk * m.block_size;
      for (int64_t h = 0; h < m.kv_heads; ++h)
        for (int64_t j = 0; j < nblk; ++j) {
          const int64_t from = (h * slots_per_head + blocks[j] * m.block_size) * D * e;
          const int64_t to = (h * len + j * m.block_size) * D * e;
          std::memcpy(chunk_k + to, static_cast<const char*>(L.key_cache) + from, block_bytes);
          std::memcpy(chunk_v + to, static_cast<const char*>(L.value_cache) + from, block_bytes);
        }
      if (chunk_attention(buf.q + row * q_size * e, q_size, D, chunk_k, len * D, D, chunk_v, len * D, D,
                          buf.att + row * q_size * e, n, m.heads, m.kv_heads, D, first, m.scale, T))
        return fail + 5;
      row += n;
    }
    if (linear(m, L.o, buf.att, B, q_size, buf.a, T)) return fail + 6;
    if (add_rms_norm(buf.a, residual, B, H, L.post_norm, m.eps, buf.h, m.bf16, T)) return fail + 7;
    if (m.halves) {
      if (linear(m, L.gate, buf.h, B, H, buf.act, T, 1)) return fail + 8;
      if (linear(m, L.up, buf.h, B, H, buf.mid, T, 0, buf.act)) return fail + 8;
    } else {
      if (linear(m, L.gate, buf.h, B, H, buf.act, T)) return fail + 8;
      if (silu_and_mul(buf.act, 2 * I, B, I, buf.mid, m.bf16, m.silu_chunk, T)) return fail + 8;
    }
    if (linear(m, L.down, buf.mid, B, I, buf.x, T)) return fail + 9;
  }
  if (add_rms_norm(buf.x, buf.a, B, H, m.final_norm, m.eps, step->out, m.bf16, T)) return 1;
  return 0;
}

}  // extern "C"
