// Scalar coefficients shared by the CPU and CUDA kernels of deepspeed-acco.
//
// The torch reference (deepspeed_acco/ops/reference.py) computes its scalars in Python (IEEE
// double) and torch casts each one to float when it meets an fp32 tensor. To reproduce its
// results we do the same: every coefficient below is derived in double, in the reference's
// order, and rounded to float once. This header is plain C++ (no torch, no CUDA headers) so the
// .cu files and the CPU kernels can include it without pulling in torch.
#pragma once

#include <cmath>
#include <cstdint>

namespace acco {

// Layout of the optional control tensor (2 fp32 values on the tensors' device; see
// deepspeed_acco/ops/reference.py): the gradient multiplier (AdamW) or the gap penalty (CO2), and
// a skip flag (non-zero: no update, the output gets the current parameters).
constexpr int kControlValue = 0;
constexpr int kControlSkip = 1;

// Element type of the optional output buffer (the all-gather buffer).
enum class OutKind : int { kNone = 0, kFloat32 = 1, kBFloat16 = 2 };

struct AdamwCoeffs {
    float decay;  // 1 - lr * weight_decay, applied to theta first (decoupled weight decay)
    // torch's lerp(m, g, w) picks one of two formulas depending on |w| < 0.5; both are an FMA:
    //   small w: m + w * (g - m)        large w: g + (w - 1) * (g - m)
    // lerp_coeff holds w or w - 1 and lerp_from_grad says which base (m or g) to add to.
    float lerp_coeff;
    int lerp_from_grad;
    float beta2;
    float one_minus_beta2;
    float bias_correction2_sqrt;
    // CUDA torch divides by a CPU scalar as a multiplication by its float reciprocal.
    float inv_bias_correction2_sqrt;
    float eps;
    float step_size;  // -(lr / bias_correction1), the addcdiv value
    // Multiplier applied to each gradient element as it is read (one rounding, like a separate
    // grad.mul_(s) would do): 1 (exact) for the plain entry points; the controlled CPU entry points
    // set it from the control tensor. The CUDA kernels read it from the control tensor on the device.
    float grad_scale;
};

inline AdamwCoeffs make_adamw_coeffs(int64_t step, double lr, double beta1, double beta2, double eps,
                                     double weight_decay) {
    AdamwCoeffs c;
    c.decay = static_cast<float>(1.0 - lr * weight_decay);
    const float weight = static_cast<float>(1.0 - beta1);
    c.lerp_from_grad = std::fabs(weight) < 0.5f ? 0 : 1;
    c.lerp_coeff = c.lerp_from_grad ? weight - 1.0f : weight;
    c.beta2 = static_cast<float>(beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    const double bias_correction1 = 1.0 - std::pow(beta1, static_cast<double>(step));
    const double bias_correction2_sqrt = std::sqrt(1.0 - std::pow(beta2, static_cast<double>(step)));
    c.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
    c.inv_bias_correction2_sqrt = 1.0f / c.bias_correction2_sqrt;
    c.eps = static_cast<float>(eps);
    c.step_size = static_cast<float>(-(lr / bias_correction1));
    c.grad_scale = 1.0f;
    return c;
}

struct Co2Coeffs {
    float outer_momentum;
    float penalty;
    float inv_penalty;  // CUDA torch divides by a CPU scalar via its float reciprocal
    float outer_lr;
    float clip_threshold;  // only read when has_clip
    int has_clip;
};

inline Co2Coeffs make_co2_coeffs(double outer_lr, double outer_momentum, double penalty, bool has_clip,
                                 double clip_threshold) {
    Co2Coeffs c;
    c.outer_momentum = static_cast<float>(outer_momentum);
    c.penalty = static_cast<float>(penalty);
    c.inv_penalty = 1.0f / c.penalty;
    c.outer_lr = static_cast<float>(outer_lr);
    c.clip_threshold = static_cast<float>(clip_threshold);
    c.has_clip = has_clip ? 1 : 0;
    return c;
}

}  // namespace acco
