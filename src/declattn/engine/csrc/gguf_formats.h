// The GGUF block formats the kernels read, and the layouts regrouped at load: for each
// format its block size and bytes and the kernels that read it (``format_of``), for each
// regrouped layout the file's format it holds and how to move rows in and out of it
// (``kRegrouped``). Read by the matmul and the dequantisation alike (gguf_matmul.cpp,
// gguf_dequant.h), so both take a layout the same way.

#pragma once

#include <c10/util/Exception.h>

#include <cstdint>

#include "gguf_blocks.h"
#include "gguf_dot_avx2.h"
#include "gguf_dot_portable.h"
#include "gguf_k_rows16.h"
#include "gguf_q5_0_rows8.h"
#include "gguf_q8_0_rows8.h"
#include "gguf_rows16_vnni.h"

namespace gguf {

// One whole group of ``kRows`` weight rows . n activation rows -> out[n][kRows].
using GroupBatch = void (*)(const uint8_t*, const Q8Row*, int64_t, int64_t, float*);

struct Format {
  int64_t block;  // weights per block
  int64_t bytes;  // bytes per block
  RowsDot dot;
  GroupBatch batch = nullptr;  // several activation rows per pass over a tile, where written
};

inline Format format_of(int64_t type) {
  switch (type) {
#if defined(GGUF_ROWS16)
    case kQ5_0_R16: return {32, 22, dot_q5_0_r16, batch_q5_0_r16};
    case kQ8_0_R16: return {32, 34, dot_q8_0_r16, batch_q8_0_r16};
    case kQ4_K_R16: return {256, 144, dot_q4_k_r16, batch_q4_k_r16};
    case kQ6_K_R16: return {256, 210, dot_q6_k_r16, batch_q6_k_r16};
#else
    case kQ5_0_R16: case kQ8_0_R16:
    case kQ4_K_R16: case kQ6_K_R16:
      TORCH_CHECK(false, "gguf: the layouts regrouped by sixteen rows (", type,
                  ") are made and read by AVX-512 VNNI builds only");
#endif
#if defined(__AVX2__)
    case kQ4_0: return {32, 18, dot32<BQ4_0>};
    case kQ4_1: return {32, 20, dot32<BQ4_1>};
    case kQ5_0: return {32, 22, dot32<BQ5_0>};
    case kQ8_0: return {32, 34, dot32<BQ8_0>};
    case kQ5_0_R8: return {32, 22, dot_q5_0_r8};
    case kQ8_0_R8: return {32, 34, dot_q8_0_r8};
#else
    case kQ5_0_R8: TORCH_CHECK(false, "gguf: the regrouped Q5_0 layout (", kQ5_0_R8,
                               ") is made and read by AVX2 builds only");
    case kQ8_0_R8: TORCH_CHECK(false, "gguf: the regrouped Q8_0 layout (", kQ8_0_R8,
                               ") is made and read by AVX2 builds only");
    case kQ4_0: return {32, 18, each_row<dot_q4_0>};
    case kQ4_1: return {32, 20, each_row<dot_q4_1>};
    case kQ5_0: return {32, 22, each_row<dot_q5_0>};
    case kQ8_0: return {32, 34, each_row<dot_q8_0>};
#endif
    case kQ4_K: return {256, 144, each_row<dot_q4_k>};
    case kQ6_K: return {256, 210, each_row<dot_q6_k>};
    default: TORCH_CHECK(false, "gguf_linear: unsupported ggml type ", type);
  }
}

// A layout regrouped by eight rows (gguf_q5_0_rows8.h, gguf_q8_0_rows8.h) or sixteen
// (gguf_rows16_vnni.h): the file's type it holds (whose block bytes ``format_of`` gives),
// the rows of a group, and one group to and from that many of the file's rows.
using GroupFn = void (*)(const uint8_t*, int64_t, int64_t, uint8_t*);
// A whole group dequantised as it lies (row r at out + r * k), where written.
using GroupDequant = void (*)(const uint8_t*, int64_t, float*, int64_t);
struct Regrouped {
  int64_t type, file_type, rows;
  GroupFn regroup, ungroup;
  GroupDequant dequant = nullptr;
};
// Best first: ``gguf_repack`` takes the first one this build reads.
inline constexpr Regrouped kRegrouped[] = {
#if defined(GGUF_ROWS16)
    {kQ5_0_R16, kQ5_0, 16, regroup_q5_0_r16, ungroup_q5_0_r16, dequant_q5_0_r16},
    {kQ8_0_R16, kQ8_0, 16, regroup_q8_0_r16, ungroup_q8_0_r16, dequant_q8_0_r16},
#else
    {kQ5_0_R16, kQ5_0, 16, regroup_q5_0_r16, ungroup_q5_0_r16},
    {kQ8_0_R16, kQ8_0, 16, regroup_q8_0_r16, ungroup_q8_0_r16},
#endif
#if defined(GGUF_ROWS16)
    {kQ4_K_R16, kQ4_K, 16, regroup_q4_k_r16, ungroup_q4_k_r16},
    {kQ6_K_R16, kQ6_K, 16, regroup_q6_k_r16, ungroup_q6_k_r16},
#endif
    {kQ5_0_R8, kQ5_0, 8, regroup_q5_0, ungroup_q5_0},
    {kQ8_0_R8, kQ8_0, 8, regroup_q8_0, ungroup_q8_0}};

// Whether this build's kernel reads layout ``g`` (rows by sixteen: AVX-512 VNNI; by
// eight: AVX2).
inline bool readable(const Regrouped& g) {
#if defined(GGUF_ROWS16)
  if (g.rows == 16) return true;
#endif
#if defined(__AVX2__)
  if (g.rows == 8) return true;
#endif
  return false;
}

inline const Regrouped* regrouped(int64_t type) {  // by the regrouped id; nullptr: not one
  for (const Regrouped& g : kRegrouped)
    if (g.type == type) return &g;
  return nullptr;
}

}  // namespace gguf
