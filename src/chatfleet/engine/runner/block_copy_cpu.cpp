// Whole KV blocks between the engine's paged caches and the host tier's slabs in one pass over
// their bytes (CPU: both sides are host memory): see block_copy.py for why and for the layouts.
//
// host: [host blocks][tensors][heads][chunk bytes], a block's slab host_block_bytes long;
// tensor i (K0, V0, K1, V1, ...): [heads][device blocks][chunk bytes] from tensors[i], heads
// head_strides[i] bytes apart, blocks chunk_bytes apart. Block j of the call moves between host
// block host_ids[j] and device block device_ids[j], every tensor and head: tensors * heads
// copies of chunk_bytes each.
#include <cstdint>
#include <cstring>

extern "C" {

// to_host: 1 stores device -> host, 0 loads host -> device. 0 on success; 1: bad sizes.
int cf_copy_blocks(char* host, int64_t host_block_bytes, char* const* tensors, const int64_t* head_strides,
                   int64_t n_tensors, int64_t heads, int64_t chunk_bytes, const int64_t* host_ids,
                   const int64_t* device_ids, int64_t n, int to_host, int threads) {
  if (n < 0 || n_tensors <= 0 || heads <= 0 || chunk_bytes <= 0 || host_block_bytes < n_tensors * heads * chunk_bytes)
    return 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 1)
  for (int64_t j = 0; j < n; ++j) {
    char* slab = host + host_ids[j] * host_block_bytes;
    for (int64_t i = 0; i < n_tensors; ++i) {
      char* block = tensors[i] + device_ids[j] * chunk_bytes;
      for (int64_t h = 0; h < heads; ++h) {
        char* hp = slab + (i * heads + h) * chunk_bytes;
        char* dp = block + h * head_strides[i];
        if (to_host) std::memcpy(hp, dp, chunk_bytes);
        else std::memcpy(dp, hp, chunk_bytes);
      }
    }
  }
  return 0;
}

}  // extern "C"
