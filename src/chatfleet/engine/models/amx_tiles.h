// AMX tile state, shared by the AMX kernels (chunk_attention_amx.cpp, packed_gemv_cpu.cpp,
// paged_decode_amx.h): asking Linux for it once per process, and loading a tile configuration in
// a thread.
#pragma once

#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>

namespace cf_amx {

// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA: true where the OS grants this process AMX tile data.
inline bool request_tile_state() {
  constexpr long kArchReqXcompPerm = 0x1023;
  constexpr long kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
}

// Whether a kernel library's AMX path runs: granted (the OS gave this process tile state: init) and
// on (switched off and on again for paired A/B runs and tests: use). One per library.
struct Switch {
  bool granted = false;
  bool on = true;
  int init() {  // 0: granted; 2: the OS refused
    granted = request_tile_state();
    return granted ? 0 : 2;
  }
  int use(int want) {  // 1: on, 0: off, -1: as it is; returns whether the AMX path runs now
    if (want >= 0) on = want != 0;
    return active() ? 1 : 0;
  }
  bool active() const { return granted && on; }
};

#if defined(__AMX_TILE__)
struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

// Palette 1, tiles 0-7 each rows[t] rows of colsb[t] bytes (a row count of 0 is taken as 1: the
// tile is configured but not meant to be used).
inline void configure(const uint8_t (&rows)[8], const uint16_t (&colsb)[8]) {
  TileConfig cfg;
  std::memset(&cfg, 0, sizeof cfg);
  cfg.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = colsb[t];
    cfg.rows[t] = rows[t] ? rows[t] : 1;
  }
  // GCC does not count ldtilecfg as reading all 64 bytes: with constant rows and widths it dropped
  // the stores of colsb and rows as dead (ldtilecfg then faults on the stale bytes); the empty asm
  // makes them visible.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// Every tile rows[t] rows of 64 bytes.
inline void configure(const uint8_t (&rows)[8]) { configure(rows, {64, 64, 64, 64, 64, 64, 64, 64}); }
#endif

}  // namespace cf_amx
