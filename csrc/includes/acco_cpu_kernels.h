// CPU kernels of deepspeed-acco: fused, one pass over flat fp32 shards.
//
// Raw pointers and sizes only (no torch types) so that the kernels can be compiled and their
// vectorisation inspected on their own (tests/test_ops_kernels.py does this with -fopt-info-vec).
// `out` is either nullptr (kind == kNone), a float* (kFloat32) or the raw uint16_t bits of a bf16
// buffer (kBFloat16). `num_threads` is the size of the OpenMP team to use; callers pass
// at::get_num_threads() so torch.set_num_threads() is honoured.
#pragma once

#include <cstdint>

#include "acco_coeffs.h"

namespace acco {
namespace cpu {

void adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, OutKind out_kind,
                int64_t numel, const AdamwCoeffs& coeffs, int num_threads);

void adamw_peek(const float* param, const float* grad, const float* exp_avg, const float* exp_avg_sq, void* out,
                OutKind out_kind, int64_t numel, const AdamwCoeffs& coeffs, int num_threads);

void co2_outer_step(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                    OutKind out_kind, int64_t numel, const Co2Coeffs& coeffs, int num_threads);

}  // namespace cpu
}  // namespace acco
