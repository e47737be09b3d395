// Python bindings of the CUDA quantisation kernels, registered into the `acco_cuda_ops` module by
// acco_cuda_frontend.cpp: tensor checks, device guard, torch's current stream, pybind
// declarations. The kernels live in acco_cuda_quant.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>

#include "acco_cuda_quant.h"
#include "acco_quant.h"

namespace {

// The Python dispatcher (deepspeed_acco/ops/quantize.py) validates arguments with helpful
// errors; these checks only guard the raw pointer arithmetic against a caller that bypasses it.
void check_flat(const at::Tensor& t, const char* name, const at::Tensor& like) {
    TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
    TORCH_CHECK(t.is_contiguous() && t.dim() == 1, name, " must be 1-D and contiguous");
}

void check_launch(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, what, " kernel launch failed: ", cudaGetErrorString(err));
}

// Values per chunk when `numel` values are split over the rows of `packed`.
int64_t chunk_numel_of(const at::Tensor& packed, int64_t numel) {
    TORCH_CHECK(packed.dim() == 2, "packed must be a 2-D uint8 tensor (one row per chunk)");
    const int64_t rows = packed.size(0);
    TORCH_CHECK(rows > 0 ? numel % rows == 0 : numel == 0, numel, " values do not split into ", rows,
                " equal chunks");
    return rows > 0 ? numel / rows : 0;
}

acco::QuantChunkLayout check_packed(const at::Tensor& packed, int64_t chunk_numel, int64_t bits, int64_t block_size) {
    TORCH_CHECK(bits == 8 || bits == 4, "bits must be 8 or 4");
    TORCH_CHECK(block_size >= acco::kMinBlockSize && block_size <= acco::kMaxBlockSize &&
                    (block_size & (block_size - 1)) == 0,
                "block_size must be a power of two in [", acco::kMinBlockSize, ", ", acco::kMaxBlockSize, "]");
    TORCH_CHECK(packed.is_cuda(), "packed must be a CUDA tensor");
    TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 2 && packed.is_contiguous(),
                "packed must be a contiguous 2-D uint8 tensor");
    TORCH_CHECK(reinterpret_cast<uintptr_t>(packed.data_ptr()) % 4 == 0, "packed must be 4-byte aligned");
    const acco::QuantChunkLayout layout = acco::make_quant_layout(chunk_numel, static_cast<int>(bits), block_size);
    TORCH_CHECK(packed.size(1) == layout.chunk_bytes, "packed rows must have ", layout.chunk_bytes, " bytes");
    return layout;
}

acco::HeldKind held_kind_of(const at::Tensor& t, const char* name) {
    switch (t.scalar_type()) {
        case at::kFloat:
            return acco::HeldKind::kFloat32;
        case at::kBFloat16:
            return acco::HeldKind::kBFloat16;
        case at::kHalf:
            return acco::HeldKind::kFloat16;
        default:
            TORCH_CHECK(false, name, " must be float32, bfloat16 or float16");
    }
}

void quantize(at::Tensor input, std::optional<at::Tensor> residual, at::Tensor packed, int64_t bits,
              int64_t block_size) {
    check_flat(input, "input", input);
    TORCH_CHECK(input.scalar_type() == at::kFloat, "input must be float32");
    float* residual_ptr = nullptr;
    if (residual.has_value()) {
        check_flat(*residual, "residual", input);
        TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->numel() == input.numel(),
                    "residual must be float32 with as many elements as input");
        residual_ptr = residual->data_ptr<float>();
    }
    TORCH_CHECK(packed.device() == input.device(), "packed must be on ", input.device());
    const acco::QuantChunkLayout layout = check_packed(packed, chunk_numel_of(packed, input.numel()), bits, block_size);
    const c10::cuda::CUDAGuard device_guard(input.device());
    check_launch(acco::cuda::quantize(input.data_ptr<float>(), residual_ptr, packed.data_ptr<uint8_t>(), packed.size(0),
                                      layout, c10::cuda::getCurrentCUDAStream()),
                 "quantize");
}

void quantize_delta(at::Tensor target, at::Tensor held, at::Tensor packed, int64_t bits, int64_t block_size) {
    check_flat(target, "target", target);
    check_flat(held, "held", target);
    TORCH_CHECK(target.scalar_type() == at::kFloat, "target must be float32");
    TORCH_CHECK(held.numel() == target.numel(), "held must have as many elements as target");
    const acco::HeldKind kind = held_kind_of(held, "held");
    TORCH_CHECK(packed.device() == target.device(), "packed must be on ", target.device());
    const acco::QuantChunkLayout layout = check_packed(packed, chunk_numel_of(packed, target.numel()), bits, block_size);
    const c10::cuda::CUDAGuard device_guard(target.device());
    check_launch(acco::cuda::quantize_delta(target.data_ptr<float>(), held.data_ptr(), kind, packed.data_ptr<uint8_t>(),
                                            packed.size(0), layout, c10::cuda::getCurrentCUDAStream()),
                 "quantize_delta");
}

void dequantize_sum(at::Tensor packed, at::Tensor out, std::optional<at::Tensor> base, int64_t bits,
                    int64_t block_size) {
    check_flat(out, "out", out);
    TORCH_CHECK(out.scalar_type() == at::kFloat, "out must be float32");
    const float* base_ptr = nullptr;
    if (base.has_value()) {
        check_flat(*base, "base", out);
        TORCH_CHECK(base->scalar_type() == at::kFloat && base->numel() == out.numel(),
                    "base must be float32 with as many elements as out");
        base_ptr = base->data_ptr<float>();
    }
    TORCH_CHECK(packed.dim() == 2, "packed must be a 2-D uint8 tensor");
    TORCH_CHECK(base_ptr != nullptr || packed.size(0) > 0, "dequantize_sum needs a base or at least one chunk");
    TORCH_CHECK(packed.device() == out.device(), "packed must be on ", out.device());
    // Every row is a whole chunk as long as out.
    const acco::QuantChunkLayout layout = check_packed(packed, out.numel(), bits, block_size);
    const c10::cuda::CUDAGuard device_guard(out.device());
    check_launch(acco::cuda::dequantize_sum(packed.data_ptr<uint8_t>(), packed.size(0), base_ptr, out.data_ptr<float>(),
                                            layout, c10::cuda::getCurrentCUDAStream()),
                 "dequantize_sum");
}

void apply_delta(at::Tensor packed, at::Tensor held, at::Tensor out, int64_t bits, int64_t block_size) {
    check_flat(held, "held", held);
    check_flat(out, "out", held);
    TORCH_CHECK(out.scalar_type() == held.scalar_type() && out.numel() == held.numel(),
                "out must have held's dtype and length");
    const acco::HeldKind kind = held_kind_of(held, "held");
    TORCH_CHECK(packed.device() == held.device(), "packed must be on ", held.device());
    const acco::QuantChunkLayout layout = check_packed(packed, chunk_numel_of(packed, held.numel()), bits, block_size);
    const c10::cuda::CUDAGuard device_guard(held.device());
    check_launch(acco::cuda::apply_delta(packed.data_ptr<uint8_t>(), packed.size(0), held.data_ptr(), out.data_ptr(),
                                         kind, layout, c10::cuda::getCurrentCUDAStream()),
                 "apply_delta");
}

}  // namespace

namespace acco {

void register_quant_bindings(pybind11::module_& m) {
    // The GIL is released so the engine's worker thread can quantise while Python keeps running.
    m.def("quantize", &quantize, "Block-quantise input (+ residual, updated by error feedback) into packed chunks",
          py::arg("input"), py::arg("residual"), py::arg("packed"), py::arg("bits"), py::arg("block_size"),
          py::call_guard<py::gil_scoped_release>());
    m.def("quantize_delta", &quantize_delta, "Block-quantise target - held into packed chunks", py::arg("target"),
          py::arg("held"), py::arg("packed"), py::arg("bits"), py::arg("block_size"),
          py::call_guard<py::gil_scoped_release>());
    m.def("dequantize_sum", &dequantize_sum, "out = base + sum of the dequantised packed chunks, in row order",
          py::arg("packed"), py::arg("out"), py::arg("base"), py::arg("bits"), py::arg("block_size"),
          py::call_guard<py::gil_scoped_release>());
    m.def("apply_delta", &apply_delta, "out = held + dequantised packed chunks, rounded to held's dtype",
          py::arg("packed"), py::arg("held"), py::arg("out"), py::arg("bits"), py::arg("block_size"),
          py::call_guard<py::gil_scoped_release>());
}

}  // namespace acco
