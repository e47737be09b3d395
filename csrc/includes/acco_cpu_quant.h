// CPU kernels of deepspeed-acco's block-quantised communication (format: acco_quant.h).
//
// Raw pointers and sizes only (no torch types), like acco_cpu_kernels.h. Every function works on
// `num_chunks` chunks of `layout.numel` values laid out back to back (`num_chunks * layout.numel`
// values), whose packed forms are the rows of `packed` (`num_chunks * layout.chunk_bytes` bytes).
// `held` and `out` of the delta functions hold elements of `held_kind` (fp32, or the raw uint16_t
// bits of bf16 / fp16). `num_threads` is the OpenMP team to use (callers pass at::get_num_threads()).
// Results do not depend on the number of threads.
#pragma once

#include <cstdint>

#include "acco_quant.h"

namespace acco {
namespace cpu {

// Quantises v = input (+ residual, when residual is not null) block by block into `packed`; with
// a residual, also writes residual <- v - dequantised(v) (error feedback). A block holding a
// non-finite v (or |v| >= 2^127) gets scale NaN, zero codes, and keeps its residual.
void quantize(const float* input, float* residual, uint8_t* packed, int64_t num_chunks, const QuantChunkLayout& layout,
              int num_threads);

// Quantises v = target - held (the change that takes `held` to `target`) into `packed`.
void quantize_delta(const float* target, const void* held, HeldKind held_kind, uint8_t* packed, int64_t num_chunks,
                    const QuantChunkLayout& layout, int num_threads);

// out = ((base + d_0) + d_1) + ... + d_{num_chunks - 1}, where d_k dequantises row k of `packed`
// (each row a chunk of layout.numel values, as long as out); without base, the sum starts at d_0.
// `base` may be `out`.
void dequantize_sum(const uint8_t* packed, int64_t num_chunks, const float* base, float* out,
                    const QuantChunkLayout& layout, int num_threads);

// out = held + dequantised(packed), chunk by chunk, rounded to held_kind; `out` may be `held`.
void apply_delta(const uint8_t* packed, int64_t num_chunks, const void* held, void* out, HeldKind held_kind,
                 const QuantChunkLayout& layout, int num_threads);

}  // namespace cpu
}  // namespace acco
