// CUDA launchers of deepspeed-acco's block-quantised communication (format: acco_quant.h).
//
// Same contracts as the CPU kernels in acco_cpu_quant.h, on device pointers; `held` / `out` are
// float*, __nv_bfloat16* or __half* according to `held_kind`. Kernels are enqueued on `stream`
// (the caller passes torch's current stream) and the launch error, if any, is returned. `packed`
// must be 4-byte aligned (the scales are read and written as fp32).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "acco_quant.h"

namespace acco {
namespace cuda {

cudaError_t quantize(const float* input, float* residual, uint8_t* packed, int64_t num_chunks,
                     const QuantChunkLayout& layout, cudaStream_t stream);

cudaError_t quantize_delta(const float* target, const void* held, HeldKind held_kind, uint8_t* packed,
                           int64_t num_chunks, const QuantChunkLayout& layout, cudaStream_t stream);

cudaError_t dequantize_sum(const uint8_t* packed, int64_t num_chunks, const float* base, float* out,
                           const QuantChunkLayout& layout, cudaStream_t stream);

cudaError_t apply_delta(const uint8_t* packed, int64_t num_chunks, const void* held, void* out, HeldKind held_kind,
                        const QuantChunkLayout& layout, cudaStream_t stream);

}  // namespace cuda
}  // namespace acco
