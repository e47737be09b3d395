// Fused CUDA kernels of deepspeed-acco: AdamW step, AdamW peek and the CO2 outer step.
//
// Memory-bound elementwise kernels: grid-stride loops over float4 (16-byte) loads and stores
// when every buffer is suitably aligned (the usual case for flat shards), a scalar variant
// otherwise, one block wave sized to fill the device, and an optional fp32/bf16 copy of the
// result written in the same pass. Launches go to the stream the caller passes (torch's current
// stream, so the engine can run them on a side stream).
//
// Numerics mirror the torch CUDA kernels the reference dispatches to: each torch op is one
// rounding, so the arithmetic between ops uses the explicit _rn intrinsics (nvcc would otherwise
// contract across op boundaries), and the FMAs torch's own kernels get from contraction inside
// one op (lerp, addcmul, addcdiv) are explicit fmaf calls. Division by a Python scalar is a
// multiplication by its float reciprocal, as in torch. No --use_fast_math: sqrt and division
// must be IEEE-rounded.
//
// Controlled launches pass a device pointer to two floats (acco_coeffs.h, kControlValue/kControlSkip)
// that the engine's job computed on the device: the gradient multiplier (AdamW) or the gap penalty
// (CO2), and a skip flag. Every thread reads them itself, so the host never does; a skip makes the
// kernel write the current parameters to `out` and leave the state alone. The plain launches pass
// nullptr (multiplier 1, which is exact, and the host's reciprocal of the penalty).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>

#include "acco_cuda_kernels.h"

namespace acco {
namespace cuda {
namespace {

constexpr int kBlockThreads = 256;
constexpr int kMaxDevices = 64;

// Grid of one full wave: as many blocks as can be resident on every SM at once (from the
// kernel's occupancy), the grid-stride loop covering the rest. SM counts and occupancies are
// looked up once and cached, since the launchers run once per param group per update.
int sm_count_of_current_device() {
    static std::atomic<int> sm_counts[kMaxDevices];
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= kMaxDevices) device = 0;
    int sm_count = sm_counts[device].load(std::memory_order_relaxed);
    if (sm_count == 0) {
        if (cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) sm_count = 1;
        sm_counts[device].store(sm_count, std::memory_order_relaxed);
    }
    return sm_count;
}

template <typename Kernel>
int grid_blocks(Kernel kernel, std::atomic<int>& blocks_per_sm_cache, int64_t work_items) {
    int blocks_per_sm = blocks_per_sm_cache.load(std::memory_order_relaxed);
    if (blocks_per_sm == 0) {
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kBlockThreads, 0) != cudaSuccess ||
            blocks_per_sm < 1) {
            blocks_per_sm = 1;
        }
        blocks_per_sm_cache.store(blocks_per_sm, std::memory_order_relaxed);
    }
    const int64_t wave = static_cast<int64_t>(sm_count_of_current_device()) * blocks_per_sm;
    const int64_t needed = (work_items + kBlockThreads - 1) / kBlockThreads;
    return static_cast<int>(needed < wave ? (needed > 0 ? needed : 1) : wave);
}

bool aligned(const void* ptr, uintptr_t bytes) { return (reinterpret_cast<uintptr_t>(ptr) % bytes) == 0; }

struct AdamwResult {
    float theta;
    float m;
    float v;
};

__device__ __forceinline__ AdamwResult adamw_element(float theta_old, float g_raw, float m_old, float v_old,
                                                     const AdamwCoeffs& c, float grad_scale) {
    AdamwResult r;
    const float g = __fmul_rn(g_raw, grad_scale);
    const float theta = __fmul_rn(theta_old, c.decay);
    r.m = fmaf(c.lerp_coeff, __fsub_rn(g, m_old), c.lerp_from_grad ? g : m_old);
    r.v = fmaf(__fmul_rn(c.one_minus_beta2, g), g, __fmul_rn(v_old, c.beta2));
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(r.v), c.inv_bias_correction2_sqrt), c.eps);
    r.theta = fmaf(c.step_size, __fdiv_rn(r.m, denom), theta);
    return r;
}

// `penalty` > 0: divide by this device value (controlled launch, like torch dividing by a tensor);
// otherwise multiply by the host's reciprocal (like torch dividing by a Python number).
__device__ __forceinline__ float co2_element(float* prev_anchor_io, float anchor_old, float mean_param,
                                             float* momentum_io, const Co2Coeffs& c, bool clip, float penalty) {
    const float difference = __fsub_rn(*prev_anchor_io, mean_param);
    const float pseudo_grad = penalty > 0.0f ? __fdiv_rn(difference, penalty) : __fmul_rn(difference, c.inv_penalty);
    float mom = __fadd_rn(__fmul_rn(*momentum_io, c.outer_momentum), pseudo_grad);
    // NaN passes through, like torch.clamp.
    if (clip) mom = mom < -c.clip_threshold ? -c.clip_threshold : (mom > c.clip_threshold ? c.clip_threshold : mom);
    *momentum_io = mom;
    *prev_anchor_io = anchor_old;
    return __fsub_rn(anchor_old, __fmul_rn(mom, c.outer_lr));
}

template <OutKind kOut>
__device__ __forceinline__ void store_out(void* out, int64_t i, float x) {
    if constexpr (kOut == OutKind::kFloat32) static_cast<float*>(out)[i] = x;
    if constexpr (kOut == OutKind::kBFloat16) static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
}

// Stores elements [4 * vec_index, 4 * vec_index + 4) with one 16-byte (fp32) or 8-byte (bf16) store.
template <OutKind kOut>
__device__ __forceinline__ void store_out4(void* out, int64_t vec_index, float4 x) {
    if constexpr (kOut == OutKind::kFloat32) reinterpret_cast<float4*>(out)[vec_index] = x;
    if constexpr (kOut == OutKind::kBFloat16) {
        const __nv_bfloat162 lo = __floats2bfloat162_rn(x.x, x.y);
        const __nv_bfloat162 hi = __floats2bfloat162_rn(x.z, x.w);
        uint2 packed;
        packed.x = *reinterpret_cast<const unsigned int*>(&lo);
        packed.y = *reinterpret_cast<const unsigned int*>(&hi);
        reinterpret_cast<uint2*>(out)[vec_index] = packed;
    }
}

// kWriteState=false is the peek: param, exp_avg and exp_avg_sq are only read.
template <OutKind kOut, bool kWriteState, bool kVec>
__global__ void __launch_bounds__(kBlockThreads)
    adamw_kernel(float* __restrict__ param, const float* __restrict__ grad, float* __restrict__ exp_avg,
                 float* __restrict__ exp_avg_sq, void* __restrict__ out, int64_t numel, AdamwCoeffs coeffs,
                 const float* __restrict__ control) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    float grad_scale = 1.0f;
    if (control != nullptr) {
        if (control[kControlSkip] != 0.0f) {  // skipped update: out = theta, state untouched
            if constexpr (kOut != OutKind::kNone) {
                for (int64_t i = tid; i < numel; i += stride) store_out<kOut>(out, i, param[i]);
            }
            return;
        }
        grad_scale = control[kControlValue];
    }
    int64_t scalar_begin = 0;
    if constexpr (kVec) {
        const int64_t numel_vec = numel / 4;
        for (int64_t j = tid; j < numel_vec; j += stride) {
            const float4 p = reinterpret_cast<const float4*>(param)[j];
            const float4 g = reinterpret_cast<const float4*>(grad)[j];
            const float4 m = reinterpret_cast<const float4*>(exp_avg)[j];
            const float4 v = reinterpret_cast<const float4*>(exp_avg_sq)[j];
            const AdamwResult r0 = adamw_element(p.x, g.x, m.x, v.x, coeffs, grad_scale);
            const AdamwResult r1 = adamw_element(p.y, g.y, m.y, v.y, coeffs, grad_scale);
            const AdamwResult r2 = adamw_element(p.z, g.z, m.z, v.z, coeffs, grad_scale);
            const AdamwResult r3 = adamw_element(p.w, g.w, m.w, v.w, coeffs, grad_scale);
            const float4 theta = make_float4(r0.theta, r1.theta, r2.theta, r3.theta);
            if constexpr (kWriteState) {
                reinterpret_cast<float4*>(param)[j] = theta;
                reinterpret_cast<float4*>(exp_avg)[j] = make_float4(r0.m, r1.m, r2.m, r3.m);
                reinterpret_cast<float4*>(exp_avg_sq)[j] = make_float4(r0.v, r1.v, r2.v, r3.v);
            }
            store_out4<kOut>(out, j, theta);
        }
        scalar_begin = numel_vec * 4;
    }
    for (int64_t i = scalar_begin + tid; i < numel; i += stride) {
        const AdamwResult r = adamw_element(param[i], grad[i], exp_avg[i], exp_avg_sq[i], coeffs, grad_scale);
        if constexpr (kWriteState) {
            param[i] = r.theta;
            exp_avg[i] = r.m;
            exp_avg_sq[i] = r.v;
        }
        store_out<kOut>(out, i, r.theta);
    }
}

template <OutKind kOut, bool kClip, bool kVec>
__global__ void __launch_bounds__(kBlockThreads)
    co2_kernel(float* __restrict__ prev_anchor, float* __restrict__ anchor, float* __restrict__ momentum,
               const float* __restrict__ mean_params, void* __restrict__ out, int64_t numel, Co2Coeffs coeffs,
               const float* __restrict__ control) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
    float penalty = 0.0f;  // 0: use the host's reciprocal in coeffs
    if (control != nullptr) {
        if (control[kControlSkip] != 0.0f) {  // skipped round: x_{k+2} = x_{k+1}, momentum untouched
            for (int64_t i = tid; i < numel; i += stride) {
                const float a = anchor[i];
                prev_anchor[i] = a;
                store_out<kOut>(out, i, a);
            }
            return;
        }
        penalty = control[kControlValue];
    }
    int64_t scalar_begin = 0;
    if constexpr (kVec) {
        const int64_t numel_vec = numel / 4;
        for (int64_t j = tid; j < numel_vec; j += stride) {
            float4 prev = reinterpret_cast<const float4*>(prev_anchor)[j];
            const float4 a = reinterpret_cast<const float4*>(anchor)[j];
            float4 mom = reinterpret_cast<const float4*>(momentum)[j];
            const float4 mean = reinterpret_cast<const float4*>(mean_params)[j];
            float4 a_new;
            a_new.x = co2_element(&prev.x, a.x, mean.x, &mom.x, coeffs, kClip, penalty);
            a_new.y = co2_element(&prev.y, a.y, mean.y, &mom.y, coeffs, kClip, penalty);
            a_new.z = co2_element(&prev.z, a.z, mean.z, &mom.z, coeffs, kClip, penalty);
            a_new.w = co2_element(&prev.w, a.w, mean.w, &mom.w, coeffs, kClip, penalty);
            reinterpret_cast<float4*>(momentum)[j] = mom;
            reinterpret_cast<float4*>(prev_anchor)[j] = prev;
            reinterpret_cast<float4*>(anchor)[j] = a_new;
            store_out4<kOut>(out, j, a_new);
        }
        scalar_begin = numel_vec * 4;
    }
    for (int64_t i = scalar_begin + tid; i < numel; i += stride) {
        float prev = prev_anchor[i];
        float mom = momentum[i];
        const float a_new = co2_element(&prev, anchor[i], mean_params[i], &mom, coeffs, kClip, penalty);
        momentum[i] = mom;
        prev_anchor[i] = prev;
        anchor[i] = a_new;
        store_out<kOut>(out, i, a_new);
    }
}

bool can_vectorize(const void* const* state, int num_state, const void* out, OutKind out_kind) {
    for (int k = 0; k < num_state; ++k) {
        if (!aligned(state[k], 16)) return false;
    }
    if (out_kind == OutKind::kFloat32) return aligned(out, 16);
    if (out_kind == OutKind::kBFloat16) return aligned(out, 8);
    return true;
}

template <bool kWriteState, OutKind kOut>
cudaError_t launch_adamw_out(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out,
                             int64_t numel, const AdamwCoeffs& coeffs, const float* control, cudaStream_t stream) {
    const void* state[4] = {param, grad, exp_avg, exp_avg_sq};
    static std::atomic<int> vec_blocks_per_sm{0};
    static std::atomic<int> scalar_blocks_per_sm{0};
    if (can_vectorize(state, 4, out, kOut)) {
        auto kernel = adamw_kernel<kOut, kWriteState, true>;
        kernel<<<grid_blocks(kernel, vec_blocks_per_sm, (numel + 3) / 4), kBlockThreads, 0, stream>>>(
            param, grad, exp_avg, exp_avg_sq, out, numel, coeffs, control);
    } else {
        auto kernel = adamw_kernel<kOut, kWriteState, false>;
        kernel<<<grid_blocks(kernel, scalar_blocks_per_sm, numel), kBlockThreads, 0, stream>>>(
            param, grad, exp_avg, exp_avg_sq, out, numel, coeffs, control);
    }
    return cudaGetLastError();
}

template <bool kWriteState>
cudaError_t launch_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out,
                         OutKind out_kind, int64_t numel, const AdamwCoeffs& coeffs, const float* control,
                         cudaStream_t stream) {
    if (numel <= 0) return cudaSuccess;
    switch (out_kind) {
        case OutKind::kFloat32:
            return launch_adamw_out<kWriteState, OutKind::kFloat32>(param, grad, exp_avg, exp_avg_sq, out, numel,
                                                                    coeffs, control, stream);
        case OutKind::kBFloat16:
            return launch_adamw_out<kWriteState, OutKind::kBFloat16>(param, grad, exp_avg, exp_avg_sq, out, numel,
                                                                     coeffs, control, stream);
        default:
            return launch_adamw_out<kWriteState, OutKind::kNone>(param, grad, exp_avg, exp_avg_sq, out, numel, coeffs,
                                                                 control, stream);
    }
}

template <bool kClip, OutKind kOut>
cudaError_t launch_co2_out(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                           int64_t numel, const Co2Coeffs& coeffs, const float* control, cudaStream_t stream) {
    const void* state[4] = {prev_anchor, anchor, momentum, mean_params};
    static std::atomic<int> vec_blocks_per_sm{0};
    static std::atomic<int> scalar_blocks_per_sm{0};
    if (can_vectorize(state, 4, out, kOut)) {
        auto kernel = co2_kernel<kOut, kClip, true>;
        kernel<<<grid_blocks(kernel, vec_blocks_per_sm, (numel + 3) / 4), kBlockThreads, 0, stream>>>(
            prev_anchor, anchor, momentum, mean_params, out, numel, coeffs, control);
    } else {
        auto kernel = co2_kernel<kOut, kClip, false>;
        kernel<<<grid_blocks(kernel, scalar_blocks_per_sm, numel), kBlockThreads, 0, stream>>>(
            prev_anchor, anchor, momentum, mean_params, out, numel, coeffs, control);
    }
    return cudaGetLastError();
}

template <bool kClip>
cudaError_t launch_co2(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                       OutKind out_kind, int64_t numel, const Co2Coeffs& coeffs, const float* control,
                       cudaStream_t stream) {
    switch (out_kind) {
        case OutKind::kFloat32:
            return launch_co2_out<kClip, OutKind::kFloat32>(prev_anchor, anchor, momentum, mean_params, out, numel,
                                                            coeffs, control, stream);
        case OutKind::kBFloat16:
            return launch_co2_out<kClip, OutKind::kBFloat16>(prev_anchor, anchor, momentum, mean_params, out, numel,
                                                             coeffs, control, stream);
        default:
            return launch_co2_out<kClip, OutKind::kNone>(prev_anchor, anchor, momentum, mean_params, out, numel,
                                                         coeffs, control, stream);
    }
}

}  // namespace

cudaError_t adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out,
                       OutKind out_kind, int64_t numel, const AdamwCoeffs& coeffs, cudaStream_t stream,
                       const float* control) {
    return launch_adamw<true>(param, grad, exp_avg, exp_avg_sq, out, out_kind, numel, coeffs, control, stream);
}

cudaError_t adamw_peek(const float* param, const float* grad, const float* exp_avg, const float* exp_avg_sq,
                       void* out, OutKind out_kind, int64_t numel, const AdamwCoeffs& coeffs, cudaStream_t stream,
                       const float* control) {
    // The <false> instantiation never stores to param / exp_avg / exp_avg_sq.
    return launch_adamw<false>(const_cast<float*>(param), grad, const_cast<float*>(exp_avg),
                               const_cast<float*>(exp_avg_sq), out, out_kind, numel, coeffs, control, stream);
}

cudaError_t co2_outer_step(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                           OutKind out_kind, int64_t numel, const Co2Coeffs& coeffs, cudaStream_t stream,
                           const float* control) {
    if (numel <= 0) return cudaSuccess;
    if (coeffs.has_clip) {
        return launch_co2<true>(prev_anchor, anchor, momentum, mean_params, out, out_kind, numel, coeffs, control,
                                stream);
    }
    return launch_co2<false>(prev_anchor, anchor, momentum, mean_params, out, out_kind, numel, coeffs, control, stream);
}

}  // namespace cuda
}  // namespace acco
