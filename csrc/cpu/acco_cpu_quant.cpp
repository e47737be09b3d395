// Block-quantised communication on CPU: quantise with error feedback, quantise a parameter delta,
// dequantise-and-sum (the owner's side of a reduce-scatter) and apply a dequantised delta.
//
// One pass over memory: OpenMP splits the (chunk, block) pairs into one contiguous range per
// thread, and each quantisation block (32..512 values) is handled in L1: a first `omp simd` loop
// forms v and its absolute maximum, a second one rounds, writes the codes and the new residual.
// The format and its rounding rules are in acco_quant.h and docs/kernels.md; the torch reference
// (deepspeed_acco/ops/reference.py) defines the results, which these kernels reproduce bitwise:
// the builder compiles with -ffp-contract=off, so v * inv, q * scale and v - q * scale are each
// rounded once, as torch's separate operations are, and division is IEEE.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

#include "acco_cpu_quant.h"

// With -march=native on an AVX-512 machine GCC may still prefer 256-bit vectors (its tuning for
// recent Intel cores does). These kernels are compute-bound per block (two divisions and a
// horizontal max per 128 values), and 512-bit vectors make them about 1.5x faster: quantise with
// error feedback, block 128, one thread, 64K values in L1: 0.30 -> 0.19 ns per value; 1M values:
// 0.50 -> 0.39 ns per value (torch is built with AVX-512 kernels on such machines too).
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && defined(__AVX512F__)
#pragma GCC target("prefer-vector-width=512")
#endif

namespace acco {
namespace cpu {
namespace {

// Below this many values per thread a team costs more than it saves.
constexpr int64_t kMinValuesPerThread = 1 << 15;
// Software prefetch distance in values (2 KB of fp32), as in acco_cpu_kernels.cpp.
constexpr int64_t kPrefetchValues = 512;
// Blocks with a magnitude this large (or inf, or NaN) are sent as NaN: 127 * (absmax / 127) may
// round past FLT_MAX above it, which would turn a finite value into inf and poison the residual.
constexpr float kOverflowMagnitude = 0x1p127f;
constexpr float kInfinity = std::numeric_limits<float>::infinity();

enum class Source { kPlain, kFeedback, kDelta };

// ---- element conversions (integer-only where possible, so that they vectorise) ----

inline float bits_to_float(uint32_t bits) {
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
}

inline uint32_t float_to_bits(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof(bits));
    return bits;
}

inline float bf16_to_float(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

// Round to nearest even; every NaN becomes 0xFFFF, as torch's vectorised CPU cast does.
inline uint16_t float_to_bf16(float value) {
    const uint32_t bits = float_to_bits(value);
    const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
    return value != value ? static_cast<uint16_t>(0xFFFFu) : static_cast<uint16_t>(rounded);
}

inline float fp16_to_float(uint16_t half) {
    const uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
    const uint32_t exponent = half & 0x7C00u;
    const uint32_t magnitude = half & 0x7FFFu;
    uint32_t bits;
    if (exponent == 0x7C00u) {
        bits = (magnitude << 13) + ((255u - 31u) << 23);  // inf / NaN (payload kept)
    } else if (exponent != 0) {
        bits = (magnitude << 13) + ((127u - 15u) << 23);  // normal: rebias the exponent
    } else {
        // Zero or subnormal: magnitude units of 2^-24, exact in fp32.
        bits = float_to_bits(static_cast<float>(magnitude) * 0x1p-24f);
    }
    return bits_to_float(bits | sign);
}

// Round to nearest even, overflow to inf, subnormals kept; a NaN stays a (quiet) NaN.
inline uint16_t float_to_fp16(float value) {
    const uint32_t bits = float_to_bits(value);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const uint32_t magnitude = bits & 0x7FFFFFFFu;
    uint32_t half;
    if (magnitude > 0x7F800000u) {
        half = 0x7E00u | ((magnitude >> 13) & 0x3FFu);
    } else if (magnitude >= 0x477FF000u) {  // 65520 and above round to inf
        half = 0x7C00u;
    } else if (magnitude >= 0x38800000u) {  // fp16 normal range, |value| >= 2^-14
        half = (magnitude - ((127u - 15u) << 23) + 0x0FFFu + ((magnitude >> 13) & 1u)) >> 13;
    } else {
        // Adding 0.5 puts the fp16 subnormal unit (2^-24) at the last mantissa bit of the sum,
        // so the fp32 addition itself rounds to nearest even.
        half = float_to_bits(bits_to_float(magnitude) + 0.5f) - float_to_bits(0.5f);
    }
    return static_cast<uint16_t>(sign | half);
}

template <HeldKind kHeld>
struct HeldTraits {
    using type = float;
    static float load(float x) { return x; }
    static float store(float x) { return x; }
};
template <>
struct HeldTraits<HeldKind::kBFloat16> {
    using type = uint16_t;
    static float load(uint16_t x) { return bf16_to_float(x); }
    static uint16_t store(float x) { return float_to_bf16(x); }
};
template <>
struct HeldTraits<HeldKind::kFloat16> {
    using type = uint16_t;
    static float load(uint16_t x) { return fp16_to_float(x); }
    static uint16_t store(float x) { return float_to_fp16(x); }
};

inline float load_scale(const uint8_t* row, int64_t block) {
    float scale;
    std::memcpy(&scale, row + 4 * block, sizeof(scale));
    return scale;
}

inline void store_scale(uint8_t* row, int64_t block, float scale) { std::memcpy(row + 4 * block, &scale, sizeof(scale)); }

inline void prefetch_values(const void* base, int64_t element_bytes, int64_t index, bool for_write) {
    const char* address = static_cast<const char*>(base) + (index + kPrefetchValues) * element_bytes;
    if (for_write) {
        __builtin_prefetch(address, 1, 0);
    } else {
        __builtin_prefetch(address, 0, 0);
    }
}

// Runs fn(item_begin, item_end) over [0, num_items) in one contiguous range per thread.
template <typename Fn>
void parallel_items(int64_t num_items, int64_t values_per_item, int num_threads, const Fn& fn) {
    if (num_items <= 0) return;
    const int64_t useful_threads = std::max<int64_t>(1, num_items * values_per_item / kMinValuesPerThread);
    const int team_size = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), useful_threads));
    if (team_size == 1 || omp_in_parallel()) {
        fn(int64_t{0}, num_items);
        return;
    }
#pragma omp parallel num_threads(team_size)
    {
        const int64_t team = omp_get_num_threads();  // the runtime may grant fewer threads
        const int64_t rank = omp_get_thread_num();
        const int64_t per_thread = (num_items + team - 1) / team;
        const int64_t begin = std::min(num_items, rank * per_thread);
        const int64_t end = std::min(num_items, begin + per_thread);
        if (begin < end) fn(begin, end);
    }
}

// Calls fn(std::integral_constant<int, block_size>{}) for the supported block sizes, so that
// full blocks are loops of a compile-time length (fully vectorised, no remainder handling).
template <typename Fn>
void with_block_size(int64_t block_size, const Fn& fn) {
    switch (block_size) {
        case 32:
            return fn(std::integral_constant<int, 32>{});
        case 64:
            return fn(std::integral_constant<int, 64>{});
        case 128:
            return fn(std::integral_constant<int, 128>{});
        case 256:
            return fn(std::integral_constant<int, 256>{});
        default:
            return fn(std::integral_constant<int, kMaxBlockSize>{});
    }
}

// One quantisation block: kBlock values, or n (<= block size) when kBlock is 0 (a chunk's last,
// shorter block). `held` is only read for kDelta, `residual` only for kFeedback.
template <int kBits, Source kSource, HeldKind kHeld, int kBlock>
inline void quantize_block(const float* __restrict input, float* __restrict residual,
                           const typename HeldTraits<kHeld>::type* __restrict held, int64_t runtime_n,
                           uint8_t* __restrict codes, uint8_t* row, int64_t block) {
    const int64_t n = kBlock > 0 ? kBlock : runtime_n;
    constexpr float kMaxCode = kBits == 8 ? 127.0f : 7.0f;
    alignas(64) float values[kMaxBlockSize];
    // The largest |v| as its bit pattern: for non-negative floats the integer order is the
    // numeric order, and inf and NaN patterns are above every finite one, so one integer max
    // finds both the absmax and any non-finite value.
    uint32_t absmax_bits = 0;
#pragma omp simd reduction(max : absmax_bits)
    for (int64_t i = 0; i < n; ++i) {
        float v;
        if constexpr (kSource == Source::kFeedback) {
            v = input[i] + residual[i];
        } else if constexpr (kSource == Source::kDelta) {
            v = input[i] - HeldTraits<kHeld>::load(held[i]);
        } else {
            v = input[i];
        }
        values[i] = v;
        const uint32_t magnitude_bits = float_to_bits(v) & 0x7FFFFFFFu;
        absmax_bits = absmax_bits > magnitude_bits ? absmax_bits : magnitude_bits;
    }
    const bool nonfinite = absmax_bits >= float_to_bits(kOverflowMagnitude);  // also inf and NaN
    const float absmax = bits_to_float(absmax_bits);
    const int64_t code_bytes = kBits == 8 ? n : (n + 1) / 2;
    if (nonfinite) {
        // Sent as NaN, so the owner's sum is NaN and the job's non-finite check skips the update;
        // the residual is left as it was, so error feedback is not poisoned for later steps.
        store_scale(row, block, std::numeric_limits<float>::quiet_NaN());
        std::memset(codes, 0, static_cast<size_t>(code_bytes));
        return;
    }
    float inv = kMaxCode / absmax;
    float scale;
    if (inv == kInfinity) {
        // All zeros, or so small that max_code / absmax overflows: send zeros, keep the values
        // in the residual.
        inv = 0.0f;
        scale = 0.0f;
    } else {
        scale = absmax / kMaxCode;
    }
    store_scale(row, block, scale);
    if constexpr (kBits == 8) {
        int8_t* codes8 = reinterpret_cast<int8_t*>(codes);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float v = values[i];
            // No clamp needed: |v| <= absmax, so |v * inv| <= max_code * (1 + 2^-24) before the
            // product's own rounding, which rounds to at most max_code (acco_quant.h).
            const float q = std::nearbyint(v * inv);
            codes8[i] = static_cast<int8_t>(static_cast<int>(q));
            if constexpr (kSource == Source::kFeedback) residual[i] = v - q * scale;
        }
    } else {
        alignas(64) int8_t quantized[kMaxBlockSize + 1];
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) {
            const float v = values[i];
            const float q = std::nearbyint(v * inv);
            quantized[i] = static_cast<int8_t>(static_cast<int>(q));
            if constexpr (kSource == Source::kFeedback) residual[i] = v - q * scale;
        }
        quantized[n] = 0;  // the high nibble of an odd-length block's last byte
#pragma omp simd
        for (int64_t j = 0; j < code_bytes; ++j) {
            codes[j] = static_cast<uint8_t>((quantized[2 * j] & 0x0F) | (quantized[2 * j + 1] << 4));
        }
    }
}

template <int kBits, Source kSource, HeldKind kHeld, int kBlock>
void quantize_items(const float* input, float* residual, const void* held, uint8_t* packed,
                    const QuantChunkLayout& layout, int64_t item_begin, int64_t item_end) {
    using HeldT = typename HeldTraits<kHeld>::type;
    const HeldT* held_values = static_cast<const HeldT*>(held);
    for (int64_t item = item_begin; item < item_end; ++item) {
        const int64_t chunk = item / layout.num_blocks;
        const int64_t block = item % layout.num_blocks;
        const int64_t offset_in_chunk = block * layout.block_size;
        const int64_t start = chunk * layout.numel + offset_in_chunk;
        const int64_t n = std::min(layout.block_size, layout.numel - offset_in_chunk);
        uint8_t* row = packed + chunk * layout.chunk_bytes;
        uint8_t* codes = row + layout.codes_offset + (kBits == 8 ? offset_in_chunk : offset_in_chunk / 2);
        prefetch_values(input, sizeof(float), start, false);
        if constexpr (kSource == Source::kFeedback) prefetch_values(residual, sizeof(float), start, true);
        if constexpr (kSource == Source::kDelta) prefetch_values(held, sizeof(HeldT), start, false);
        float* block_residual = kSource == Source::kFeedback ? residual + start : nullptr;
        const HeldT* block_held = kSource == Source::kDelta ? held_values + start : nullptr;
        if (n == kBlock) {
            quantize_block<kBits, kSource, kHeld, kBlock>(input + start, block_residual, block_held, n, codes, row,
                                                          block);
        } else {
            quantize_block<kBits, kSource, kHeld, 0>(input + start, block_residual, block_held, n, codes, row, block);
        }
        if (block == layout.num_blocks - 1) {
            // Zero padding, so that packed buffers (and what goes on the wire) are deterministic.
            const int64_t used = layout.codes_offset + layout.code_bytes;
            std::memset(row + used, 0, static_cast<size_t>(layout.chunk_bytes - used));
        }
    }
}

template <Source kSource, HeldKind kHeld>
void quantize_dispatch(const float* input, float* residual, const void* held, uint8_t* packed, int64_t num_chunks,
                       const QuantChunkLayout& layout, int num_threads) {
    parallel_items(num_chunks * layout.num_blocks, layout.block_size, num_threads, [&](int64_t begin, int64_t end) {
        with_block_size(layout.block_size, [&](auto block_size) {
            constexpr int kBlock = decltype(block_size)::value;
            if (layout.bits == 8) {
                quantize_items<8, kSource, kHeld, kBlock>(input, residual, held, packed, layout, begin, end);
            } else {
                quantize_items<4, kSource, kHeld, kBlock>(input, residual, held, packed, layout, begin, end);
            }
        });
    });
}

// Calls fn(i, code_i as float) for the n codes of one block, in a vectorised loop. int4 codes are
// walked a byte (two codes) at a time; an odd last code is handled on its own.
template <int kBits, typename Fn>
inline void for_each_code(const uint8_t* __restrict codes, int64_t n, const Fn& fn) {
    if constexpr (kBits == 8) {
        const int8_t* codes8 = reinterpret_cast<const int8_t*>(codes);
#pragma omp simd
        for (int64_t i = 0; i < n; ++i) fn(i, static_cast<float>(codes8[i]));
    } else {
        const int64_t num_pairs = n / 2;
#pragma omp simd
        for (int64_t j = 0; j < num_pairs; ++j) {
            const uint8_t byte = codes[j];
            fn(2 * j, static_cast<float>(static_cast<int8_t>(byte << 4) >> 4));  // sign-extended low nibble
            fn(2 * j + 1, static_cast<float>(static_cast<int8_t>(byte) >> 4));
        }
        if (n & 1) fn(n - 1, static_cast<float>(static_cast<int8_t>(codes[num_pairs] << 4) >> 4));
    }
}

// One block of the sum: ((base + d_0) + d_1) + ..., each row added straight from the codes, the
// running sum kept in an L1 buffer and the last row's addition written to out. `base` may be
// `out` (each element is read before it is written).
template <int kBits, bool kHasBase, int kBlock>
inline void dequantize_sum_block(const uint8_t* packed, int64_t num_chunks, const float* base, float* out,
                                 const QuantChunkLayout& layout, int64_t block, int64_t runtime_n) {
    const int64_t n = kBlock > 0 ? kBlock : runtime_n;
    alignas(64) float sum[kMaxBlockSize];
    const int64_t code_offset = layout.codes_offset + (kBits == 8 ? block * layout.block_size : block * layout.block_size / 2);
    const float* source = base;
    for (int64_t k = 0; k < num_chunks; ++k) {
        const uint8_t* row = packed + k * layout.chunk_bytes;
        const float scale = load_scale(row, block);
        float* target = k == num_chunks - 1 ? out : sum;
        if (!kHasBase && k == 0) {
            for_each_code<kBits>(row + code_offset, n, [&](int64_t i, float code) { target[i] = code * scale; });
        } else {
            for_each_code<kBits>(row + code_offset, n,
                                 [&](int64_t i, float code) { target[i] = source[i] + code * scale; });
        }
        source = target;
    }
}

template <int kBits, bool kHasBase, int kBlock>
void dequantize_sum_blocks(const uint8_t* packed, int64_t num_chunks, const float* base, float* out,
                           const QuantChunkLayout& layout, int64_t block_begin, int64_t block_end) {
    for (int64_t block = block_begin; block < block_end; ++block) {
        const int64_t start = block * layout.block_size;
        const int64_t n = std::min(layout.block_size, layout.numel - start);
        if constexpr (kHasBase) prefetch_values(base, sizeof(float), start, false);
        const float* block_base = kHasBase ? base + start : nullptr;
        if (n == kBlock) {
            dequantize_sum_block<kBits, kHasBase, kBlock>(packed, num_chunks, block_base, out + start, layout, block, n);
        } else {
            dequantize_sum_block<kBits, kHasBase, 0>(packed, num_chunks, block_base, out + start, layout, block, n);
        }
    }
}

template <int kBits, HeldKind kHeld, int kBlock>
inline void apply_delta_block(const uint8_t* __restrict codes, float scale,
                              const typename HeldTraits<kHeld>::type* held,
                              typename HeldTraits<kHeld>::type* out, int64_t runtime_n) {
    const int64_t n = kBlock > 0 ? kBlock : runtime_n;
    // `out` may be `held`: each element is read before it is written.
    for_each_code<kBits>(codes, n, [&](int64_t i, float code) {
        out[i] = HeldTraits<kHeld>::store(HeldTraits<kHeld>::load(held[i]) + code * scale);
    });
}

template <int kBits, HeldKind kHeld, int kBlock>
void apply_delta_items(const uint8_t* packed, const void* held, void* out, const QuantChunkLayout& layout,
                       int64_t item_begin, int64_t item_end) {
    using HeldT = typename HeldTraits<kHeld>::type;
    const HeldT* held_values = static_cast<const HeldT*>(held);
    HeldT* out_values = static_cast<HeldT*>(out);
    for (int64_t item = item_begin; item < item_end; ++item) {
        const int64_t chunk = item / layout.num_blocks;
        const int64_t block = item % layout.num_blocks;
        const int64_t offset_in_chunk = block * layout.block_size;
        const int64_t start = chunk * layout.numel + offset_in_chunk;
        const int64_t n = std::min(layout.block_size, layout.numel - offset_in_chunk);
        const uint8_t* row = packed + chunk * layout.chunk_bytes;
        const uint8_t* codes = row + layout.codes_offset + (kBits == 8 ? offset_in_chunk : offset_in_chunk / 2);
        const float scale = load_scale(row, block);
        prefetch_values(held, sizeof(HeldT), start, false);
        if (n == kBlock) {
            apply_delta_block<kBits, kHeld, kBlock>(codes, scale, held_values + start, out_values + start, n);
        } else {
            apply_delta_block<kBits, kHeld, 0>(codes, scale, held_values + start, out_values + start, n);
        }
    }
}

template <HeldKind kHeld>
void apply_delta_dispatch(const uint8_t* packed, int64_t num_chunks, const void* held, void* out,
                          const QuantChunkLayout& layout, int num_threads) {
    parallel_items(num_chunks * layout.num_blocks, layout.block_size, num_threads, [&](int64_t begin, int64_t end) {
        with_block_size(layout.block_size, [&](auto block_size) {
            constexpr int kBlock = decltype(block_size)::value;
            if (layout.bits == 8) {
                apply_delta_items<8, kHeld, kBlock>(packed, held, out, layout, begin, end);
            } else {
                apply_delta_items<4, kHeld, kBlock>(packed, held, out, layout, begin, end);
            }
        });
    });
}

}  // namespace

void quantize(const float* input, float* residual, uint8_t* packed, int64_t num_chunks, const QuantChunkLayout& layout,
              int num_threads) {
    if (residual != nullptr) {
        quantize_dispatch<Source::kFeedback, HeldKind::kFloat32>(input, residual, nullptr, packed, num_chunks, layout,
                                                                 num_threads);
    } else {
        quantize_dispatch<Source::kPlain, HeldKind::kFloat32>(input, nullptr, nullptr, packed, num_chunks, layout,
                                                              num_threads);
    }
}

void quantize_delta(const float* target, const void* held, HeldKind held_kind, uint8_t* packed, int64_t num_chunks,
                    const QuantChunkLayout& layout, int num_threads) {
    switch (held_kind) {
        case HeldKind::kFloat32:
            quantize_dispatch<Source::kDelta, HeldKind::kFloat32>(target, nullptr, held, packed, num_chunks, layout,
                                                                  num_threads);
            break;
        case HeldKind::kBFloat16:
            quantize_dispatch<Source::kDelta, HeldKind::kBFloat16>(target, nullptr, held, packed, num_chunks, layout,
                                                                   num_threads);
            break;
        case HeldKind::kFloat16:
            quantize_dispatch<Source::kDelta, HeldKind::kFloat16>(target, nullptr, held, packed, num_chunks, layout,
                                                                  num_threads);
            break;
    }
}

void dequantize_sum(const uint8_t* packed, int64_t num_chunks, const float* base, float* out,
                    const QuantChunkLayout& layout, int num_threads) {
    if (num_chunks == 0) {
        // Nothing to add: the sum is the base (the owner of a one-rank group).
        if (base != nullptr && base != out) std::memmove(out, base, static_cast<size_t>(layout.numel) * sizeof(float));
        return;
    }
    const int64_t values_per_block = layout.block_size * (num_chunks + 1);
    parallel_items(layout.num_blocks, values_per_block, num_threads, [&](int64_t begin, int64_t end) {
        with_block_size(layout.block_size, [&](auto block_size) {
            constexpr int kBlock = decltype(block_size)::value;
            if (layout.bits == 8) {
                if (base != nullptr) {
                    dequantize_sum_blocks<8, true, kBlock>(packed, num_chunks, base, out, layout, begin, end);
                } else {
                    dequantize_sum_blocks<8, false, kBlock>(packed, num_chunks, base, out, layout, begin, end);
                }
            } else {
                if (base != nullptr) {
                    dequantize_sum_blocks<4, true, kBlock>(packed, num_chunks, base, out, layout, begin, end);
                } else {
                    dequantize_sum_blocks<4, false, kBlock>(packed, num_chunks, base, out, layout, begin, end);
                }
            }
        });
    });
}

void apply_delta(const uint8_t* packed, int64_t num_chunks, const void* held, void* out, HeldKind held_kind,
                 const QuantChunkLayout& layout, int num_threads) {
    switch (held_kind) {
        case HeldKind::kFloat32:
            apply_delta_dispatch<HeldKind::kFloat32>(packed, num_chunks, held, out, layout, num_threads);
            break;
        case HeldKind::kBFloat16:
            apply_delta_dispatch<HeldKind::kBFloat16>(packed, num_chunks, held, out, layout, num_threads);
            break;
        case HeldKind::kFloat16:
            apply_delta_dispatch<HeldKind::kFloat16>(packed, num_chunks, held, out, layout, num_threads);
            break;
    }
}

}  // namespace cpu
}  // namespace acco
