// The extension's op namespace, defined once (the other sources add fragments to it), and
// what this build is: its CPU variant and the instruction sets it was compiled for.
//
// Why: the package ships one build per CPU variant and loads the best one the CPU runs
// (engine/native/variants.py); ``build_info`` lets the loader, ``declattn doctor`` and the
// tests ask the library itself which one they got, rather than trust a file name.

#include <torch/library.h>

#include <string>
#include <vector>

#include "declattn_ops.h"

#ifndef DECLATTN_VARIANT
#define DECLATTN_VARIANT unnamed
#endif

namespace {

// The variant's name, then each instruction set the compiler targeted for it.
std::vector<std::string> build_info() {
  std::vector<std::string> info{DECLATTN_STRINGIFY(DECLATTN_VARIANT)};
#if defined(__AVX2__)
  info.push_back("avx2");
#endif
#if defined(__FMA__)
  info.push_back("fma");
#endif
#if defined(__F16C__)
  info.push_back("f16c");
#endif
#if defined(__AVX512F__)
  info.push_back("avx512f");
#endif
#if defined(__AVX512BW__)
  info.push_back("avx512bw");
#endif
#if defined(__AVX512VNNI__)
  info.push_back("avx512_vnni");
#endif
#if defined(__AVX512BF16__)
  info.push_back("avx512_bf16");
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
  info.push_back("amx_bf16");
#endif
#if defined(__ARM_NEON)
  info.push_back("neon");
#endif
#if defined(_OPENMP)
  info.push_back("openmp");
#endif
  return info;
}

}  // namespace

#define DECLATTN_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)

DECLATTN_LIBRARY(DECLATTN_OP_NAMESPACE, m) { m.def("build_info() -> str[]", &build_info); }
