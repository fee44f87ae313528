// The extension's one op namespace, ``torch.ops.declattn``: every source registers its ops
// into it with DECLATTN_FRAGMENT, and library.cpp defines it (one library per build).
//
// DECLATTN_OP_NAMESPACE is a macro so that a test can build a source into a namespace of
// its own and load it beside the extension (e.g. a portable build of one kernel).

#pragma once

#include <torch/library.h>

#ifndef DECLATTN_OP_NAMESPACE
#define DECLATTN_OP_NAMESPACE declattn
#endif

#define DECLATTN_STRINGIFY_(x) #x
#define DECLATTN_STRINGIFY(x) DECLATTN_STRINGIFY_(x)
// "declattn::name": an op of this build, as the dispatcher names it.
#define DECLATTN_OP(name) DECLATTN_STRINGIFY(DECLATTN_OP_NAMESPACE) "::" name
// TORCH_LIBRARY_FRAGMENT expands its namespace argument (TORCH_LIBRARY does not).
#define DECLATTN_FRAGMENT(m) TORCH_LIBRARY_FRAGMENT(DECLATTN_OP_NAMESPACE, m)
