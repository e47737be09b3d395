// Fused CPU kernels of deepspeed-acco: AdamW step, AdamW peek and the CO2 outer step.
//
// Each kernel makes one pass over its flat fp32 shard: OpenMP splits the shard into one
// contiguous range per thread; each range is walked in blocks of 64 elements, each block a
// `#pragma omp simd` loop that GCC vectorises to the widest ISA the build targets (AVX-512 with
// -march=native on this project's machines; docs/kernels.md has the -fopt-info-vec evidence),
// with a scalar epilogue so any length works. Two memory tricks, both measured (docs/kernels.md):
// software prefetch 2 KB ahead on every stream (two cores cannot keep enough misses in flight
// from the hardware prefetchers alone), and, for shards larger than a last-level cache, the
// output buffer written with non-temporal stores (no read-for-ownership of a buffer we only
// write and the all-gather reads later).
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
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX__)
#include <immintrin.h>
#define ACCO_HAVE_STREAMING_STORES 1
#else
#define ACCO_HAVE_STREAMING_STORES 0
#endif

namespace acco {
namespace cpu {
namespace {

// Starting a thread team costs a few microseconds; below this many elements per thread it is
// cheaper to stay on the calling thread.
constexpr int64_t kMinNumelPerThread = 1 << 15;
// Elements per block: 4 cache lines of each fp32 stream, a whole number of vectors.
constexpr int64_t kBlockNumel = 64;
// Prefetch distance: 2 KB per stream. Of 0.5, 1, 2, 4 and 16 KB, 2 KB was fastest on the
// project's machines; 0 (hardware prefetch only) was about 10% slower at 32M elements.
constexpr int64_t kPrefetchNumel = 512;
// Above this many bytes touched per call the shard cannot stay in a typical last-level cache,
// so the output buffer is streamed past the caches instead of being read for ownership first.
constexpr int64_t kStreamingMinBytes = int64_t{32} << 20;
constexpr uintptr_t kStreamAlignBytes = 64;

template <OutKind kOut>
struct OutType {
    using type = float;  // kNone: never written
};
template <>
struct OutType<OutKind::kBFloat16> {
    using type = uint16_t;
};

// fp32 -> bf16 with round-to-nearest-even, bit-exact with torch's vectorised CPU cast (which also
// maps every NaN to 0xFFFF). Integer-only so that it vectorises.
inline uint16_t bf16_bits_rne(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return value != value ? static_cast<uint16_t>(0xFFFFu) : static_cast<uint16_t>(rounded);
}

bool should_stream(OutKind out_kind, int64_t numel, int64_t state_bytes_per_element) {
    if (!ACCO_HAVE_STREAMING_STORES || out_kind == OutKind::kNone) return false;
    const int64_t out_bytes = out_kind == OutKind::kBFloat16 ? 2 : 4;
    return numel * (state_bytes_per_element + out_bytes) >= kStreamingMinBytes;
}

// Copies one block from the (aligned, L1-resident) staging buffer to `dst` (64-byte aligned) with
// non-temporal stores.
template <typename T>
inline void stream_block(T* dst, const T* staging) {
    constexpr int64_t kBytes = kBlockNumel * sizeof(T);
#if defined(__AVX512F__)
    for (int64_t offset = 0; offset < kBytes; offset += 64) {
        const auto* src = reinterpret_cast<const char*>(staging) + offset;
        _mm512_stream_si512(reinterpret_cast<__m512i*>(reinterpret_cast<char*>(dst) + offset),
                            _mm512_load_si512(reinterpret_cast<const void*>(src)));
    }
#elif defined(__AVX__)
    for (int64_t offset = 0; offset < kBytes; offset += 32) {
        const auto* src = reinterpret_cast<const char*>(staging) + offset;
        _mm256_stream_si256(reinterpret_cast<__m256i*>(reinterpret_cast<char*>(dst) + offset),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(src)));
    }
#else
    std::memcpy(dst, staging, kBytes);
#endif
}

inline void streaming_store_fence() {
#if ACCO_HAVE_STREAMING_STORES
    // Non-temporal stores are weakly ordered: make them visible before the caller (or the end of
    // the parallel region) publishes the buffer.
    _mm_sfence();
#endif
}

// Walks [begin, end) in blocks: prefetch(position) is called kPrefetchNumel ahead of each block,
// then block(out_block, out_base, block_begin, block_end) computes the block and writes element i
// of the output to out_block[i - out_base]. With `stream_out`, full blocks go through an aligned
// staging buffer and reach `out` as non-temporal stores; the head up to the first 64-byte
// boundary of `out`, and a short last block, are written directly.
template <OutKind kOut, typename Prefetch, typename Block>
void run_blocks(void* out, int64_t begin, int64_t end, bool stream_out, const Prefetch& prefetch,
                const Block& block) {
    using OutT = typename OutType<kOut>::type;
    int64_t pos = begin;
    if (stream_out) {
        const uintptr_t addr = reinterpret_cast<uintptr_t>(static_cast<OutT*>(out) + begin);
        const int64_t head_numel = static_cast<int64_t>((kStreamAlignBytes - addr % kStreamAlignBytes) %
                                                        kStreamAlignBytes / sizeof(OutT));
        pos = std::min(end, begin + head_numel);
        if (pos > begin) block(out, int64_t{0}, begin, pos);
    }
    alignas(kStreamAlignBytes) OutT staging[kBlockNumel];
    for (; pos < end; pos += kBlockNumel) {
        const int64_t block_end = std::min(end, pos + kBlockNumel);
        prefetch(pos + kPrefetchNumel);
        if (stream_out && block_end - pos == kBlockNumel) {
            block(static_cast<void*>(staging), pos, pos, block_end);
            stream_block(static_cast<OutT*>(out) + pos, staging);
        } else {
            block(out, int64_t{0}, pos, block_end);
        }
    }
    if (stream_out) streaming_store_fence();
}

// Prefetches one block's worth of each stream at element `pos` (prefetches never fault, so
// running past the end of a shard is harmless).
template <bool kForWrite>
inline void prefetch_block(const float* stream, int64_t pos) {
    for (int64_t offset = 0; offset < kBlockNumel; offset += 16) {
        __builtin_prefetch(stream + pos + offset, kForWrite ? 1 : 0, 0);
    }
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
        // Range boundaries are multiples of a block (whole cache lines: no line is shared).
        const int64_t team = omp_get_num_threads();
        const int64_t rank = omp_get_thread_num();
        int64_t per_thread = (numel + team - 1) / team;
        per_thread = (per_thread + kBlockNumel - 1) / kBlockNumel * kBlockNumel;
        const int64_t begin = std::min(numel, rank * per_thread);
        const int64_t end = std::min(numel, begin + per_thread);
        if (begin < end) fn(begin, end);
    }
}

// One AdamW update of elements [begin, end), the new theta going to out[i - out_base].
// kWriteState=false is the peek: theta, m and v are only read.
template <OutKind kOut, bool kWriteState>
void adamw_block(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, int64_t out_base,
                 int64_t begin, int64_t end, const AdamwCoeffs& coeffs) {
    // Scalars in locals: the compiler cannot prove the struct is not aliased by the stores.
    const float decay = coeffs.decay;
    const float lerp_coeff = coeffs.lerp_coeff;
    const bool lerp_from_grad = coeffs.lerp_from_grad != 0;
    const float beta2 = coeffs.beta2;
    const float one_minus_beta2 = coeffs.one_minus_beta2;
    const float bias_correction2_sqrt = coeffs.bias_correction2_sqrt;
    const float eps = coeffs.eps;
    const float step_size = coeffs.step_size;
    const float grad_scale = coeffs.grad_scale;
    float* out_f32 = static_cast<float*>(out) - out_base;
    uint16_t* out_bf16 = static_cast<uint16_t*>(out) - out_base;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
        const float g = grad[i] * grad_scale;  // exact when grad_scale == 1
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

template <OutKind kOut, bool kWriteState>
void adamw_range(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, int64_t begin,
                 int64_t end, bool stream_out, const AdamwCoeffs& coeffs) {
    run_blocks<kOut>(
        out, begin, end, stream_out,
        [&](int64_t pos) {
            prefetch_block<false>(grad, pos);
            prefetch_block<kWriteState>(param, pos);
            prefetch_block<kWriteState>(exp_avg, pos);
            prefetch_block<kWriteState>(exp_avg_sq, pos);
        },
        [&](void* out_block, int64_t out_base, int64_t block_begin, int64_t block_end) {
            adamw_block<kOut, kWriteState>(param, grad, exp_avg, exp_avg_sq, out_block, out_base, block_begin,
                                           block_end, coeffs);
        });
}

template <bool kWriteState>
void adamw_dispatch(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, void* out, OutKind out_kind,
                    int64_t numel, const AdamwCoeffs& coeffs, int num_threads) {
    const bool stream_out = should_stream(out_kind, numel, 16);
    run_parallel(numel, num_threads, [&](int64_t begin, int64_t end) {
        switch (out_kind) {
            case OutKind::kNone:
                adamw_range<OutKind::kNone, kWriteState>(param, grad, exp_avg, exp_avg_sq, out, begin, end, false,
                                                         coeffs);
                break;
            case OutKind::kFloat32:
                adamw_range<OutKind::kFloat32, kWriteState>(param, grad, exp_avg, exp_avg_sq, out, begin, end,
                                                            stream_out, coeffs);
                break;
            case OutKind::kBFloat16:
                adamw_range<OutKind::kBFloat16, kWriteState>(param, grad, exp_avg, exp_avg_sq, out, begin, end,
                                                             stream_out, coeffs);
                break;
        }
    });
}

template <OutKind kOut, bool kClip>
void co2_block(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
               int64_t out_base, int64_t begin, int64_t end, const Co2Coeffs& coeffs) {
    const float outer_momentum = coeffs.outer_momentum;
    const float penalty = coeffs.penalty;
    const float outer_lr = coeffs.outer_lr;
    const float clip_hi = coeffs.clip_threshold;
    const float clip_lo = -coeffs.clip_threshold;
    float* out_f32 = static_cast<float*>(out) - out_base;
    uint16_t* out_bf16 = static_cast<uint16_t*>(out) - out_base;
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

template <OutKind kOut, bool kClip>
void co2_range(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
               int64_t begin, int64_t end, bool stream_out, const Co2Coeffs& coeffs) {
    run_blocks<kOut>(
        out, begin, end, stream_out,
        [&](int64_t pos) {
            prefetch_block<true>(prev_anchor, pos);
            prefetch_block<true>(anchor, pos);
            prefetch_block<true>(momentum, pos);
            prefetch_block<false>(mean_params, pos);
        },
        [&](void* out_block, int64_t out_base, int64_t block_begin, int64_t block_end) {
            co2_block<kOut, kClip>(prev_anchor, anchor, momentum, mean_params, out_block, out_base, block_begin,
                                   block_end, coeffs);
        });
}

template <bool kClip>
void co2_dispatch(float* prev_anchor, float* anchor, float* momentum, const float* mean_params, void* out,
                  OutKind out_kind, int64_t numel, const Co2Coeffs& coeffs, int num_threads) {
    const bool stream_out = should_stream(out_kind, numel, 16);
    run_parallel(numel, num_threads, [&](int64_t begin, int64_t end) {
        switch (out_kind) {
            case OutKind::kNone:
                co2_range<OutKind::kNone, kClip>(prev_anchor, anchor, momentum, mean_params, out, begin, end, false,
                                                 coeffs);
                break;
            case OutKind::kFloat32:
                co2_range<OutKind::kFloat32, kClip>(prev_anchor, anchor, momentum, mean_params, out, begin, end,
                                                    stream_out, coeffs);
                break;
            case OutKind::kBFloat16:
                co2_range<OutKind::kBFloat16, kClip>(prev_anchor, anchor, momentum, mean_params, out, begin, end,
                                                     stream_out, coeffs);
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
