// Fused CPU kernels of deepspeed-acco: AdamW step, AdamW peek and the CO2 outer step.
//
// Each kernel makes one pass over its flat fp32 shard: OpenMP splits the shard into one
// contiguous range per thread and each range runs a `#pragma omp simd` loop, which GCC
// vectorises to the widest ISA the build targets (AVX-512 with -march=native on this project's
// machines; see docs/kernels.md for the -fopt-info-vec evidence). The vector loop handles the
// remainder with a masked or scalar epilogue, so any length works.
//
// Numerics follow the torch reference operation by operation (see acco_coeffs.h for how the
// scalars are rounded): the builder compiles this file with -ffp-contract=off so that a * b + c
// stays two roundings like torch's separate kernels, and the places where torch's vectorised CPU
// kernels themselves use an FMA (lerp, and addcmul as fma(value * t1, t2, self)) are explicit
// std::fma calls here.
#include "acco_cpu_kernels.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>

namespace acco {
namespace cpu {
namespace {

// Starting a thread team costs a few microseconds; below this many elements per thread it is
// cheaper to stay on the calling thread.
constexpr int64_t kMinNumelPerThread = 1 << 15;
// Range boundaries are multiples of 16 floats (one 64-byte cache line) so threads never share a
// line and every range but the last starts vector-aligned relative to the shard.
constexpr int64_t kRangeAlignNumel = 16;

// fp32 -> bf16 with round-to-nearest-even, bit-exact with torch's vectorised CPU cast (which also
// maps every NaN to 0xFFFF). Integer-only so that it vectorises.
inline uint16_t bf16_bits_rne(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return value != value ? static_cast<uint16_t>(0xFFFFu) : static_cast<uint16_t>(rounded);
}

template <typename RangeFn>
void run_parallel(int64_t numel, int num_threads, const RangeFn& fn) {
    const int64_t useful_threads = std::max<int64_t>(1, numel / kMinNumelPerThread);
    const int team_size = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), useful_threads));
    if (team_size == 1 || omp_in_parallel()) {
        fn(int64_t{0}, numel);
        return;
    }
#pragma omp parallel num_threads(team_size)
    {
        // The runtime may grant fewer threads than asked for; split by the team we actually got.
        const int64_t team = omp_get_num_threads();
        const int64_t rank = omp_get_thread_num();
        int64_t per_thread = (numel + team - 1) / team;
        per_thread = (per_thread + kRangeAlignNumel - 1) / kRangeAlignNumel * kRangeAlignNumel;
        const int64_t begin = std::min(numel, rank * per_thread);
        const int64_t end = std::min(numel, begin + per_thread);
        if (begin < end) fn(begin, end);
    }
}

// One AdamW update of elements [begin, end). kWriteState=false is the peek: theta, m and v are
// only read and the new theta goes to `out` alone.
template <OutKind kOut, bool kWriteState>
void adamw_range(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, int64_t begin,
                 int64_t end, const AdamwCoeffs& coeffs) {
    // Scalars in locals: the compiler cannot prove the struct is not aliased by the stores.
    const float decay = coeffs.decay;
    const float lerp_coeff = coeffs.lerp_coeff;
    const bool lerp_from_grad = coeffs.lerp_from_grad != 0;
    const float beta2 = coeffs.beta2;
    const float one_minus_beta2 = coeffs.one_minus_beta2;
    const float bias_correction2_sqrt = coeffs.bias_correction2_sqrt;
    const float eps = coeffs.eps;
    const float step_size = coeffs.step_size;
    float* out_f32 = static_cast<float*>(out);
    uint16_t* out_bf16 = static_cast<uint16_t*>(out);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
        const float g = grad[i];
        const float m_old = exp_avg[i];
        const float theta = param[i] * decay;
        const float m = std::fma(lerp_coeff, g - m_old, lerp_from_grad ? g : m_old);
        const float v = std::fma(one_minus_beta2 * g, g, exp_avg_sq[i] * beta2);
        const float denom = std::sqrt(v) / bias_correction2_sqrt + eps;
        const float theta_new = theta + step_size * m / denom;
        if constexpr (kWriteState) {
            param[i] = theta_new;
            exp_avg[i] = m;
            exp_avg_sq[i] = v;
        }
        if constexpr (kOut == OutKind::kFloat32) out_f32[i] = theta_new;
        if constexpr (kOut == OutKind::kBFloat16) out_bf16[i] = bf16_bits_rne(theta_new);
    }
}

template <bool kWriteState>
void adamw_dispatch(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, OutKind out_kind,
                    int64_t numel, const AdamwCoeffs& coeffs, int num_threads) {
    run_parallel(numel, num_threads, [&](int64_t begin, int64_t end) {
        switch (out_kind) {
            case OutKind::kNone:
                adamw_range<OutKind::kNone, kWriteState>(param, grad, exp_avg, exp_avg_sq, out, begin, end, coeffs);
                break;
            case OutKind::kFloat32:
                adamw_range<OutKind::kFloat32, kWriteState>(param, grad, exp_avg, exp_avg_sq, out, begin, end, coeffs);
                break;
            case OutKind::kBFloat16:
                adamw_range<OutKind::kBFloat16, kWriteState>(param, grad, exp_avg, exp_avg_sq, out, begin, end, coeffs);
                break;
        }
    });
}

template <OutKind kOut, bool kClip>
void co2_range(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out, int64_t begin,
               int64_t end, const Co2Coeffs& coeffs) {
    const float outer_momentum = coeffs.outer_momentum;
    const float penalty = coeffs.penalty;
    const float outer_lr = coeffs.outer_lr;
    const float clip_hi = coeffs.clip_threshold;
    const float clip_lo = -coeffs.clip_threshold;
    float* out_f32 = static_cast<float*>(out);
    uint16_t* out_bf16 = static_cast<uint16_t*>(out);
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
        const float pseudo_grad = prev_anchor[i] - mean_params[i];
        float mom = momentum[i] * outer_momentum + pseudo_grad / penalty;
        // Written so that NaN passes through, like torch.clamp.
        if constexpr (kClip) mom = mom < clip_lo ? clip_lo : (mom > clip_hi ? clip_hi : mom);
        momentum[i] = mom;
        const float a = anchor[i];
        prev_anchor[i] = a;
        const float a_new = a - mom * outer_lr;
        anchor[i] = a_new;
        if constexpr (kOut == OutKind::kFloat32) out_f32[i] = a_new;
        if constexpr (kOut == OutKind::kBFloat16) out_bf16[i] = bf16_bits_rne(a_new);
    }
}

template <bool kClip>
void co2_dispatch(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                  OutKind out_kind, int64_t numel, const Co2Coeffs& coeffs, int num_threads) {
    run_parallel(numel, num_threads, [&](int64_t begin, int64_t end) {
        switch (out_kind) {
            case OutKind::kNone:
                co2_range<OutKind::kNone, kClip>(prev_anchor, anchor, momentum, mean_params, out, begin, end, coeffs);
                break;
            case OutKind::kFloat32:
                co2_range<OutKind::kFloat32, kClip>(prev_anchor, anchor, momentum, mean_params, out, begin, end, coeffs);
                break;
            case OutKind::kBFloat16:
                co2_range<OutKind::kBFloat16, kClip>(prev_anchor, anchor, momentum, mean_params, out, begin, end,
                                                     coeffs);
                break;
        }
    });
}

}  // namespace

void adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, OutKind out_kind,
                int64_t numel, const AdamwCoeffs& coeffs, int num_threads) {
    adamw_dispatch<true>(param, grad, exp_avg, exp_avg_sq, out, out_kind, numel, coeffs, num_threads);
}

void adamw_peek(const float* param, const float* grad, const float* exp_avg, const float* exp_avg_sq, void* out,
                OutKind out_kind, int64_t numel, const AdamwCoeffs& coeffs, int num_threads) {
    // The <false> instantiation never stores to param / exp_avg / exp_avg_sq.
    adamw_dispatch<false>(const_cast<float*>(param), grad, const_cast<float*>(exp_avg),
                          const_cast<float*>(exp_avg_sq), out, out_kind, numel, coeffs, num_threads);
}

void co2_outer_step(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                    OutKind out_kind, int64_t numel, const Co2Coeffs& coeffs, int num_threads) {
    if (coeffs.has_clip) {
        co2_dispatch<true>(prev_anchor, anchor, momentum, mean_params, out, out_kind, numel, coeffs, num_threads);
    } else {
        co2_dispatch<false>(prev_anchor, anchor, momentum, mean_params, out, out_kind, numel, coeffs, num_threads);
    }
}

}  // namespace cpu
}  // namespace acco
