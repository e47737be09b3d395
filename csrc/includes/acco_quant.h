// Wire format of deepspeed-acco's block-quantised communication, shared by the CPU and CUDA
// kernels (plain C++: no torch, no CUDA headers). deepspeed_acco/ops/quantize.py mirrors it.
//
// A chunk of `numel` fp32 values is cut into blocks of `block_size` consecutive values (the last
// block may be shorter); each block gets one fp32 scale and one signed code per value, symmetric
// around zero: int8 codes in [-127, 127], or int4 codes in [-7, 7] stored two per byte (element 2j
// in the low nibble of byte j, element 2j + 1 in the high nibble, two's complement). A packed
// chunk is one byte buffer:
//
//     [ scales: num_blocks fp32 | codes: numel bytes (int8) or ceil(numel / 2) (int4) | zeros ]
//
// padded with zero bytes to a multiple of kPackedAlignBytes, so that chunks packed back to back
// keep their scales aligned. Several chunks of equal length are packed as rows of one buffer.
//
// Rounding: scale = absmax / max_code and inv = max_code / absmax (IEEE fp32 divisions); code =
// round_half_to_even(v * inv); a code stands for code * scale. No clamp is needed: |v| <= absmax
// and inv = (max_code / absmax)(1 + d) with |d| <= 2^-24, so |v * inv| <= max_code (1 + 2^-24),
// which the fp32 product rounds to at most max_code + ulp(max_code) and the rounding to an
// integer brings back to max_code (inv is a normal number for every absmax in (0, 2^127)). A block
// whose absmax is 0, or so small that inv overflows, gets scale 0 and zero codes. A block holding
// an inf, a NaN or a magnitude >= 2^127 (where code * scale could round past FLT_MAX) gets scale
// NaN and zero codes: it dequantises to NaN, so a non-finite gradient is never silently sent as
// finite numbers.
#pragma once

#include <cstdint>

namespace acco {

constexpr int64_t kPackedAlignBytes = 16;
constexpr int kMinBlockSize = 32;
constexpr int kMaxBlockSize = 512;

// Dtype of a tensor the quantisation kernels read or write besides the fp32 buffers.
enum class HeldKind : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2 };

inline int quant_max_code(int bits) { return bits == 8 ? 127 : 7; }

inline int64_t quant_num_blocks(int64_t numel, int64_t block_size) { return (numel + block_size - 1) / block_size; }

inline int64_t quant_code_bytes(int64_t numel, int bits) { return bits == 8 ? numel : (numel + 1) / 2; }

// Bytes of one packed chunk of `numel` values, padding included.
inline int64_t quant_packed_bytes(int64_t numel, int bits, int64_t block_size) {
    const int64_t raw = 4 * quant_num_blocks(numel, block_size) + quant_code_bytes(numel, bits);
    return (raw + kPackedAlignBytes - 1) / kPackedAlignBytes * kPackedAlignBytes;
}

// Where the pieces of one chunk of a packed buffer start.
struct QuantChunkLayout {
    int64_t numel;        // values per chunk
    int64_t block_size;   // values per block
    int64_t num_blocks;   // blocks per chunk
    int64_t code_bytes;   // bytes of codes per chunk
    int64_t codes_offset; // byte offset of the codes inside a chunk (after the scales)
    int64_t chunk_bytes;  // row stride of the packed buffer
    int bits;
    int max_code;
};

inline QuantChunkLayout make_quant_layout(int64_t numel, int bits, int64_t block_size) {
    QuantChunkLayout layout;
    layout.numel = numel;
    layout.block_size = block_size;
    layout.num_blocks = quant_num_blocks(numel, block_size);
    layout.code_bytes = quant_code_bytes(numel, bits);
    layout.codes_offset = 4 * layout.num_blocks;
    layout.chunk_bytes = quant_packed_bytes(numel, bits, block_size);
    layout.bits = bits;
    layout.max_code = quant_max_code(bits);
    return layout;
}

}  // namespace acco
