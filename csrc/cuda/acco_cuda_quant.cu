// Block-quantised communication on CUDA: quantise with error feedback, quantise a parameter
// delta, dequantise-and-sum and apply a dequantised delta (format: acco_quant.h).
//
// Quantisation: one warp per block of values. Lane l handles values l, l + 32, l + 64, ... of
// the block (coalesced loads), kept in registers; the block's absolute maximum and its non-finite
// flag are warp reductions (shuffles, a vote), then every lane rounds its values and writes its
// codes (int4: a lane pairs its code with its right neighbour's through a shuffle, and the even
// lanes store the bytes) and, with error feedback, the new residual. Dequantisation: one thread
// per value, grid-stride.
//
// Numerics are those of the torch reference (deepspeed_acco/ops/reference.py): each product,
// sum and difference is an explicit round-to-nearest intrinsic (nvcc would otherwise contract
// v - q * scale into an FMA), divisions are IEEE (__fdiv_rn), rounding to a code is rintf (half
// to even), so results match the reference and the CPU kernels bitwise.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "acco_cuda_quant.h"

namespace acco {
namespace cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kBlockThreads = 256;
constexpr int kMaxValuesPerLane = kMaxBlockSize / kWarpSize;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
// Blocks with a magnitude this large (or inf, or NaN) are sent as NaN (see acco_quant.h).
constexpr float kOverflowMagnitude = 0x1p127f;
constexpr int kMaxDevices = 64;

enum class Source { kPlain, kFeedback, kDelta };

template <HeldKind kHeld>
struct HeldTraits {
    using type = float;
    __device__ static float load(float x) { return x; }
    __device__ static float store(float x) { return x; }
};
template <>
struct HeldTraits<HeldKind::kBFloat16> {
    using type = __nv_bfloat16;
    __device__ static float load(__nv_bfloat16 x) { return __bfloat162float(x); }
    __device__ static __nv_bfloat16 store(float x) { return __float2bfloat16_rn(x); }
};
template <>
struct HeldTraits<HeldKind::kFloat16> {
    using type = __half;
    __device__ static float load(__half x) { return __half2float(x); }
    __device__ static __half store(float x) { return __float2half_rn(x); }
};

// Grid of at most one full wave of resident blocks; grid-stride loops cover the rest.
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
int grid_blocks(Kernel kernel, std::atomic<int>& blocks_per_sm_cache, int64_t threads_needed) {
    int blocks_per_sm = blocks_per_sm_cache.load(std::memory_order_relaxed);
    if (blocks_per_sm == 0) {
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, kBlockThreads, 0) != cudaSuccess ||
            blocks_per_sm < 1) {
            blocks_per_sm = 1;
        }
        blocks_per_sm_cache.store(blocks_per_sm, std::memory_order_relaxed);
    }
    const int64_t wave = static_cast<int64_t>(sm_count_of_current_device()) * blocks_per_sm;
    const int64_t needed = (threads_needed + kBlockThreads - 1) / kBlockThreads;
    return static_cast<int>(needed < wave ? (needed > 0 ? needed : 1) : wave);
}

int log2_of(int64_t power_of_two) {
    int shift = 0;
    while ((int64_t{1} << shift) < power_of_two) ++shift;
    return shift;
}

template <int kBits, Source kSource, HeldKind kHeld>
__global__ void __launch_bounds__(kBlockThreads)
    quantize_kernel(const float* __restrict__ input, float* __restrict__ residual,
                    const typename HeldTraits<kHeld>::type* __restrict__ held, uint8_t* __restrict__ packed,
                    QuantChunkLayout layout, int64_t num_items) {
    const float max_code = kBits == 8 ? 127.0f : 7.0f;
    const int lane = threadIdx.x % kWarpSize;
    const int values_per_lane = static_cast<int>(layout.block_size / kWarpSize);
    const int64_t num_warps = static_cast<int64_t>(gridDim.x) * (blockDim.x / kWarpSize);
    const int64_t first_item = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / kWarpSize;
    // The loop bounds are the same for every lane of a warp, so the warp stays converged.
    for (int64_t item = first_item; item < num_items; item += num_warps) {
        const int64_t chunk = item / layout.num_blocks;
        const int64_t block = item - chunk * layout.num_blocks;
        const int64_t offset_in_chunk = block * layout.block_size;
        const int64_t start = chunk * layout.numel + offset_in_chunk;
        const int64_t remaining = layout.numel - offset_in_chunk;
        const int n = static_cast<int>(remaining < layout.block_size ? remaining : layout.block_size);

        float values[kMaxValuesPerLane];
        float absmax = 0.0f;
        int nonfinite = 0;
#pragma unroll
        for (int k = 0; k < kMaxValuesPerLane; ++k) {
            values[k] = 0.0f;
            const int index = k * kWarpSize + lane;
            if (k < values_per_lane && index < n) {
                float v;
                if constexpr (kSource == Source::kFeedback) {
                    v = __fadd_rn(input[start + index], residual[start + index]);
                } else if constexpr (kSource == Source::kDelta) {
                    v = __fsub_rn(input[start + index], HeldTraits<kHeld>::load(held[start + index]));
                } else {
                    v = input[start + index];
                }
                values[k] = v;
                const float magnitude = fabsf(v);
                nonfinite |= !(magnitude < kOverflowMagnitude);
                absmax = fmaxf(absmax, magnitude);
            }
        }
#pragma unroll
        for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
            absmax = fmaxf(absmax, __shfl_xor_sync(kFullMask, absmax, offset));
        }
        nonfinite = __any_sync(kFullMask, nonfinite);

        float inv = 0.0f;
        float scale = 0.0f;
        if (nonfinite) {
            // Dequantises to NaN, so the owner's non-finite check fires; the residual is kept.
            scale = __int_as_float(0x7FC00000);
        } else {
            inv = __fdiv_rn(max_code, absmax);
            if (isinf(inv)) {
                inv = 0.0f;  // zero or tiny block: zero codes, the values stay in the residual
            } else {
                scale = __fdiv_rn(absmax, max_code);
            }
        }
        uint8_t* row = packed + chunk * layout.chunk_bytes;
        if (lane == 0) reinterpret_cast<float*>(row)[block] = scale;
        uint8_t* codes = row + layout.codes_offset + (kBits == 8 ? offset_in_chunk : offset_in_chunk / 2);
#pragma unroll
        for (int k = 0; k < kMaxValuesPerLane; ++k) {
            if (k < values_per_lane) {
                const int index = k * kWarpSize + lane;
                int code = 0;
                if (!nonfinite && index < n) {
                    // |v * inv| rounds to at most max_code (acco_quant.h): no clamp needed.
                    const float q = rintf(__fmul_rn(values[k], inv));
                    code = static_cast<int>(q);
                    if constexpr (kSource == Source::kFeedback) {
                        residual[start + index] = __fsub_rn(values[k], __fmul_rn(q, scale));
                    }
                }
                if constexpr (kBits == 8) {
                    if (index < n) codes[index] = static_cast<uint8_t>(code);
                } else {
                    // Past the end of the block the neighbour's code is 0: the odd-length padding nibble.
                    const int next_code = __shfl_down_sync(kFullMask, code, 1);
                    if ((lane & 1) == 0 && index < n) {
                        codes[index / 2] = static_cast<uint8_t>((code & 0x0F) | ((next_code & 0x0F) << 4));
                    }
                }
            }
        }
        if (block == layout.num_blocks - 1) {
            // Zero padding, so packed buffers (and what goes on the wire) are deterministic.
            for (int64_t byte = layout.codes_offset + layout.code_bytes + lane; byte < layout.chunk_bytes;
                 byte += kWarpSize) {
                row[byte] = 0;
            }
        }
    }
}

template <int kBits>
__device__ __forceinline__ float dequantize_value(const uint8_t* __restrict__ row, const QuantChunkLayout& layout,
                                                  int64_t index, int block_shift) {
    const float scale = reinterpret_cast<const float*>(row)[index >> block_shift];
    int code;
    if constexpr (kBits == 8) {
        code = static_cast<int8_t>(row[layout.codes_offset + index]);
    } else {
        const int byte = row[layout.codes_offset + index / 2];
        const int nibble = (index & 1) ? (byte >> 4) : (byte & 0x0F);
        code = (nibble ^ 8) - 8;  // sign-extends the 4-bit two's complement value
    }
    return __fmul_rn(static_cast<float>(code), scale);
}

template <int kBits, bool kHasBase>
__global__ void __launch_bounds__(kBlockThreads)
    dequantize_sum_kernel(const uint8_t* __restrict__ packed, int64_t num_chunks, const float* base, float* out,
                          QuantChunkLayout layout, int block_shift) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < layout.numel; i += stride) {
        float sum;
        int64_t first_row = 0;
        if constexpr (kHasBase) {
            sum = base[i];
        } else {
            sum = dequantize_value<kBits>(packed, layout, i, block_shift);
            first_row = 1;
        }
        for (int64_t k = first_row; k < num_chunks; ++k) {
            sum = __fadd_rn(sum, dequantize_value<kBits>(packed + k * layout.chunk_bytes, layout, i, block_shift));
        }
        out[i] = sum;
    }
}

template <int kBits, HeldKind kHeld>
__global__ void __launch_bounds__(kBlockThreads)
    apply_delta_kernel(const uint8_t* __restrict__ packed, int64_t num_chunks,
                       const typename HeldTraits<kHeld>::type* held, typename HeldTraits<kHeld>::type* out,
                       QuantChunkLayout layout, int block_shift) {
    const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
    for (int64_t k = 0; k < num_chunks; ++k) {
        const uint8_t* row = packed + k * layout.chunk_bytes;
        const int64_t chunk_start = k * layout.numel;
        for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < layout.numel; i += stride) {
            const float delta = dequantize_value<kBits>(row, layout, i, block_shift);
            out[chunk_start + i] =
                HeldTraits<kHeld>::store(__fadd_rn(HeldTraits<kHeld>::load(held[chunk_start + i]), delta));
        }
    }
}

template <int kBits, Source kSource, HeldKind kHeld>
cudaError_t launch_quantize(const float* input, float* residual, const void* held, uint8_t* packed,
                            int64_t num_chunks, const QuantChunkLayout& layout, cudaStream_t stream) {
    const int64_t num_items = num_chunks * layout.num_blocks;
    if (num_items <= 0) return cudaSuccess;
    static std::atomic<int> blocks_per_sm{0};
    auto kernel = quantize_kernel<kBits, kSource, kHeld>;
    kernel<<<grid_blocks(kernel, blocks_per_sm, num_items * kWarpSize), kBlockThreads, 0, stream>>>(
        input, residual, static_cast<const typename HeldTraits<kHeld>::type*>(held), packed, layout, num_items);
    return cudaGetLastError();
}

template <Source kSource, HeldKind kHeld>
cudaError_t launch_quantize_bits(const float* input, float* residual, const void* held, uint8_t* packed,
                                 int64_t num_chunks, const QuantChunkLayout& layout, cudaStream_t stream) {
    if (layout.bits == 8) {
        return launch_quantize<8, kSource, kHeld>(input, residual, held, packed, num_chunks, layout, stream);
    }
    return launch_quantize<4, kSource, kHeld>(input, residual, held, packed, num_chunks, layout, stream);
}

template <int kBits, bool kHasBase>
cudaError_t launch_dequantize_sum(const uint8_t* packed, int64_t num_chunks, const float* base, float* out,
                                  const QuantChunkLayout& layout, cudaStream_t stream) {
    static std::atomic<int> blocks_per_sm{0};
    auto kernel = dequantize_sum_kernel<kBits, kHasBase>;
    kernel<<<grid_blocks(kernel, blocks_per_sm, layout.numel), kBlockThreads, 0, stream>>>(
        packed, num_chunks, base, out, layout, log2_of(layout.block_size));
    return cudaGetLastError();
}

template <int kBits, HeldKind kHeld>
cudaError_t launch_apply_delta(const uint8_t* packed, int64_t num_chunks, const void* held, void* out,
                               const QuantChunkLayout& layout, cudaStream_t stream) {
    using HeldT = typename HeldTraits<kHeld>::type;
    static std::atomic<int> blocks_per_sm{0};
    auto kernel = apply_delta_kernel<kBits, kHeld>;
    kernel<<<grid_blocks(kernel, blocks_per_sm, layout.numel), kBlockThreads, 0, stream>>>(
        packed, num_chunks, static_cast<const HeldT*>(held), static_cast<HeldT*>(out), layout,
        log2_of(layout.block_size));
    return cudaGetLastError();
}

template <HeldKind kHeld>
cudaError_t launch_apply_delta_bits(const uint8_t* packed, int64_t num_chunks, const void* held, void* out,
                                    const QuantChunkLayout& layout, cudaStream_t stream) {
    if (layout.bits == 8) return launch_apply_delta<8, kHeld>(packed, num_chunks, held, out, layout, stream);
    return launch_apply_delta<4, kHeld>(packed, num_chunks, held, out, layout, stream);
}

}  // namespace

cudaError_t quantize(const float* input, float* residual, uint8_t* packed, int64_t num_chunks,
                     const QuantChunkLayout& layout, cudaStream_t stream) {
    if (residual != nullptr) {
        return launch_quantize_bits<Source::kFeedback, HeldKind::kFloat32>(input, residual, nullptr, packed,
                                                                           num_chunks, layout, stream);
    }
    return launch_quantize_bits<Source::kPlain, HeldKind::kFloat32>(input, nullptr, nullptr, packed, num_chunks,
                                                                    layout, stream);
}

cudaError_t quantize_delta(const float* target, const void* held, HeldKind held_kind, uint8_t* packed,
                           int64_t num_chunks, const QuantChunkLayout& layout, cudaStream_t stream) {
    switch (held_kind) {
        case HeldKind::kBFloat16:
            return launch_quantize_bits<Source::kDelta, HeldKind::kBFloat16>(target, nullptr, held, packed,
                                                                             num_chunks, layout, stream);
        case HeldKind::kFloat16:
            return launch_quantize_bits<Source::kDelta, HeldKind::kFloat16>(target, nullptr, held, packed,
                                                                            num_chunks, layout, stream);
        default:
            return launch_quantize_bits<Source::kDelta, HeldKind::kFloat32>(target, nullptr, held, packed,
                                                                            num_chunks, layout, stream);
    }
}

cudaError_t dequantize_sum(const uint8_t* packed, int64_t num_chunks, const float* base, float* out,
                           const QuantChunkLayout& layout, cudaStream_t stream) {
    if (layout.numel <= 0) return cudaSuccess;
    if (num_chunks == 0) {
        if (base == nullptr || base == out) return cudaSuccess;
        return cudaMemcpyAsync(out, base, static_cast<size_t>(layout.numel) * sizeof(float), cudaMemcpyDeviceToDevice,
                               stream);
    }
    if (layout.bits == 8) {
        return base != nullptr ? launch_dequantize_sum<8, true>(packed, num_chunks, base, out, layout, stream)
                               : launch_dequantize_sum<8, false>(packed, num_chunks, base, out, layout, stream);
    }
    return base != nullptr ? launch_dequantize_sum<4, true>(packed, num_chunks, base, out, layout, stream)
                           : launch_dequantize_sum<4, false>(packed, num_chunks, base, out, layout, stream);
}

cudaError_t apply_delta(const uint8_t* packed, int64_t num_chunks, const void* held, void* out, HeldKind held_kind,
                        const QuantChunkLayout& layout, cudaStream_t stream) {
    if (layout.numel <= 0 || num_chunks <= 0) return cudaSuccess;
    switch (held_kind) {
        case HeldKind::kBFloat16:
            return launch_apply_delta_bits<HeldKind::kBFloat16>(packed, num_chunks, held, out, layout, stream);
        case HeldKind::kFloat16:
            return launch_apply_delta_bits<HeldKind::kFloat16>(packed, num_chunks, held, out, layout, stream);
        default:
            return launch_apply_delta_bits<HeldKind::kFloat32>(packed, num_chunks, held, out, layout, stream);
    }
}

}  // namespace cuda
}  // namespace acco
