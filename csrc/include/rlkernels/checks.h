// How the rlkernels_C ops refuse an argument (docs/design.md §8). Every check goes through TORCH_CHECK, whose
// c10::Error is thrown inside libc10: this library throws nothing itself (no __cxa_throw call site; a test counts
// them). Each test that crashed (SIGSEGV) on the first H200 run reached a throw of the library's own
// (TORCH_CHECK_VALUE / TORCH_CHECK_TYPE), while a TORCH_CHECK raised cleanly (benchmarks/RESULTS.md).
// The Python class is the message's first word; rlkernels/kernels/_extension.py raises it instead of the
// RuntimeError, with the rest of the message.
#pragma once

#include <c10/util/Exception.h>

// A wrong shape, device, layout or value: ValueError.
#define RLK_CHECK_VALUE(cond, ...) TORCH_CHECK(cond, "ValueError: ", __VA_ARGS__)
// A wrong dtype: TypeError.
#define RLK_CHECK_TYPE(cond, ...) TORCH_CHECK(cond, "TypeError: ", __VA_ARGS__)
