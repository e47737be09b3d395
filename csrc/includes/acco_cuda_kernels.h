// CUDA launchers of deepspeed-acco: fused, one pass over flat fp32 shards.
//
// Plain CUDA (no torch headers) so every .cu compiles on its own with `nvcc -c` in CI. Pointers
// are device pointers; `out` is nullptr (kNone), float* (kFloat32) or __nv_bfloat16* (kBFloat16).
// Kernels are enqueued on `stream` (the caller passes torch's current stream) and the launch
// error, if any, is returned rather than thrown. `control`, if not nullptr, is a device pointer to
// the two floats of a control tensor (acco_coeffs.h: kControlValue, kControlSkip).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "acco_coeffs.h"

namespace acco {
namespace cuda {

cudaError_t adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out,
                       OutKind out_kind, int64_t numel, const AdamwCoeffs& coeffs, cudaStream_t stream,
                       const float* control = nullptr);

cudaError_t adamw_peek(const float* param, const float* grad, const float* exp_avg, const float* exp_avg_sq,
                       void* out, OutKind out_kind, int64_t numel, const AdamwCoeffs& coeffs, cudaStream_t stream,
                       const float* control = nullptr);

cudaError_t co2_outer_step(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                           OutKind out_kind, int64_t numel, const Co2Coeffs& coeffs, cudaStream_t stream,
                           const float* control = nullptr);

}  // namespace cuda
}  // namespace acco
