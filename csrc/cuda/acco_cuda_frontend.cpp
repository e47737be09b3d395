// Python bindings of the CUDA kernels (op `acco_cuda_ops`): tensor checks, device guard, torch's
// current stream (c10::cuda::getCurrentCUDAStream, which at::cuda::getCurrentCUDAStream aliases;
// its header avoids pulling in the cuBLAS/cuSPARSE headers), and the pybind declarations. The
// kernels live in acco_cuda_kernels.cu.
#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "acco_coeffs.h"
#include "acco_cuda_kernels.h"

namespace acco {
// The quantisation kernels' bindings (acco_cuda_quant_frontend.cpp).
void register_quant_bindings(pybind11::module_& m);
}  // namespace acco

namespace {

// The Python dispatcher validates arguments with helpful errors; these checks only guard the raw
// pointers below against a caller that bypasses it.
void check_state(const at::Tensor& t, const char* name, const at::Tensor& like) {
    TORCH_CHECK(t.is_cuda() && t.device() == like.device(), name, " must be on ", like.device());
    TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
    TORCH_CHECK(t.is_contiguous() && t.dim() == 1, name, " must be 1-D and contiguous");
    TORCH_CHECK(t.numel() == like.numel(), name, " must have ", like.numel(), " elements");
}

acco::OutKind check_out(const std::optional<at::Tensor>& out, const at::Tensor& like, void** out_ptr) {
    *out_ptr = nullptr;
    if (!out.has_value()) return acco::OutKind::kNone;
    const at::Tensor& t = *out;
    TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "out must be on ", like.device());
    TORCH_CHECK(t.is_contiguous() && t.dim() == 1 && t.numel() == like.numel(), "out must be 1-D, contiguous, ",
                like.numel(), " elements");
    *out_ptr = t.data_ptr();
    if (t.scalar_type() == at::kFloat) return acco::OutKind::kFloat32;
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, "out must be float32 or bfloat16");
    return acco::OutKind::kBFloat16;
}

void check_launch(cudaError_t err, const char* what) {
    TORCH_CHECK(err == cudaSuccess, what, " kernel launch failed: ", cudaGetErrorString(err));
}

void adamw_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                std::optional<at::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay) {
    check_state(param, "param", param);
    check_state(grad, "grad", param);
    check_state(exp_avg, "exp_avg", param);
    check_state(exp_avg_sq, "exp_avg_sq", param);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, param, &out_ptr);
    const c10::cuda::CUDAGuard device_guard(param.device());
    const acco::AdamwCoeffs coeffs = acco::make_adamw_coeffs(step, lr, beta1, beta2, eps, weight_decay);
    check_launch(acco::cuda::adamw_step(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                                        exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, param.numel(), coeffs,
                                        c10::cuda::getCurrentCUDAStream()),
                 "adamw_step");
}

void adamw_peek(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor out,
                int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay) {
    check_state(param, "param", param);
    check_state(grad, "grad", param);
    check_state(exp_avg, "exp_avg", param);
    check_state(exp_avg_sq, "exp_avg_sq", param);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, param, &out_ptr);
    const c10::cuda::CUDAGuard device_guard(param.device());
    const acco::AdamwCoeffs coeffs = acco::make_adamw_coeffs(step, lr, beta1, beta2, eps, weight_decay);
    check_launch(acco::cuda::adamw_peek(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                                        exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, param.numel(), coeffs,
                                        c10::cuda::getCurrentCUDAStream()),
                 "adamw_peek");
}

void co2_outer_step(at::Tensor prev_anchor, at::Tensor anchor, at::Tensor momentum, at::Tensor mean_params,
                    std::optional<at::Tensor> out, double outer_lr, double outer_momentum, double penalty,
                    std::optional<double> clip_threshold) {
    check_state(prev_anchor, "prev_anchor", anchor);
    check_state(anchor, "anchor", anchor);
    check_state(momentum, "momentum", anchor);
    check_state(mean_params, "mean_params", anchor);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, anchor, &out_ptr);
    const c10::cuda::CUDAGuard device_guard(anchor.device());
    const acco::Co2Coeffs coeffs = acco::make_co2_coeffs(outer_lr, outer_momentum, penalty,
                                                         clip_threshold.has_value(), clip_threshold.value_or(0.0));
    check_launch(acco::cuda::co2_outer_step(prev_anchor.data_ptr<float>(), anchor.data_ptr<float>(),
                                            momentum.data_ptr<float>(), mean_params.data_ptr<float>(), out_ptr,
                                            out_kind, anchor.numel(), coeffs, c10::cuda::getCurrentCUDAStream()),
                 "co2_outer_step");
}

// ---- Controlled entry points: the control tensor (gradient multiplier or gap penalty, skip flag)
// ---- stays on the device; the kernels read it, so nothing here waits for the GPU.

const float* check_control(const at::Tensor& control, const at::Tensor& like) {
    TORCH_CHECK(control.is_cuda() && control.device() == like.device(), "control must be on ", like.device());
    TORCH_CHECK(control.scalar_type() == at::kFloat && control.is_contiguous() && control.dim() == 1 &&
                    control.numel() == 2,
                "control must be a float32 tensor of 2 elements");
    return control.data_ptr<float>();
}

void adamw_controlled(bool write_state, at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                      std::optional<at::Tensor> out, const at::Tensor& control, int64_t step, double lr, double beta1,
                      double beta2, double eps, double weight_decay) {
    check_state(param, "param", param);
    check_state(grad, "grad", param);
    check_state(exp_avg, "exp_avg", param);
    check_state(exp_avg_sq, "exp_avg_sq", param);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, param, &out_ptr);
    const float* control_ptr = check_control(control, param);
    const c10::cuda::CUDAGuard device_guard(param.device());
    const acco::AdamwCoeffs coeffs = acco::make_adamw_coeffs(step, lr, beta1, beta2, eps, weight_decay);
    const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
    if (write_state) {
        check_launch(acco::cuda::adamw_step(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                                            exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, param.numel(), coeffs,
                                            stream, control_ptr),
                     "adamw_step (controlled)");
    } else {
        check_launch(acco::cuda::adamw_peek(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                                            exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, param.numel(), coeffs,
                                            stream, control_ptr),
                     "adamw_peek (controlled)");
    }
}

void adamw_step_controlled(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                           std::optional<at::Tensor> out, at::Tensor control, int64_t step, double lr, double beta1,
                           double beta2, double eps, double weight_decay) {
    adamw_controlled(true, param, grad, exp_avg, exp_avg_sq, out, control, step, lr, beta1, beta2, eps, weight_decay);
}

void adamw_peek_controlled(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                           at::Tensor out, at::Tensor control, int64_t step, double lr, double beta1, double beta2,
                           double eps, double weight_decay) {
    adamw_controlled(false, param, grad, exp_avg, exp_avg_sq, out, control, step, lr, beta1, beta2, eps, weight_decay);
}

void co2_outer_step_controlled(at::Tensor prev_anchor, at::Tensor anchor, at::Tensor momentum, at::Tensor mean_params,
                               std::optional<at::Tensor> out, at::Tensor control, double outer_lr,
                               double outer_momentum, std::optional<double> clip_threshold) {
    check_state(prev_anchor, "prev_anchor", anchor);
    check_state(anchor, "anchor", anchor);
    check_state(momentum, "momentum", anchor);
    check_state(mean_params, "mean_params", anchor);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, anchor, &out_ptr);
    const float* control_ptr = check_control(control, anchor);
    const c10::cuda::CUDAGuard device_guard(anchor.device());
    // The penalty comes from the control tensor; 1.0 only fills the unused host fields.
    const acco::Co2Coeffs coeffs = acco::make_co2_coeffs(outer_lr, outer_momentum, 1.0, clip_threshold.has_value(),
                                                         clip_threshold.value_or(0.0));
    check_launch(acco::cuda::co2_outer_step(prev_anchor.data_ptr<float>(), anchor.data_ptr<float>(),
                                            momentum.data_ptr<float>(), mean_params.data_ptr<float>(), out_ptr,
                                            out_kind, anchor.numel(), coeffs, c10::cuda::getCurrentCUDAStream(),
                                            control_ptr),
                 "co2_outer_step (controlled)");
}

}  // namespace

#define ACCO_STRINGIFY_IMPL(x) #x
#define ACCO_STRINGIFY(x) ACCO_STRINGIFY_IMPL(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "deepspeed-acco fused CUDA kernels";
#ifdef ACCO_OPS_SOURCE_DIGEST
    // Lets the loader tell a stale ahead-of-time build from one of the current sources.
    m.attr("source_digest") = ACCO_STRINGIFY(ACCO_OPS_SOURCE_DIGEST);
#endif
    // The GIL is released so the engine's worker thread can enqueue while Python keeps running.
    m.def("adamw_step", &adamw_step, "Fused in-place AdamW step, optional fp32/bf16 copy of the new params",
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
          py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::call_guard<py::gil_scoped_release>());
    m.def("adamw_peek", &adamw_peek, "Parameters an AdamW step would produce, written to out only", py::arg("param"),
          py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"), py::arg("step"), py::arg("lr"),
          py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::call_guard<py::gil_scoped_release>());
    m.def("co2_outer_step", &co2_outer_step, "CO2 outer momentum/anchor update on a shard", py::arg("prev_anchor"),
          py::arg("anchor"), py::arg("momentum"), py::arg("mean_params"), py::arg("out"), py::arg("outer_lr"),
          py::arg("outer_momentum"), py::arg("penalty"), py::arg("clip_threshold"),
          py::call_guard<py::gil_scoped_release>());
    acco::register_quant_bindings(m);

    // ---- controlled entry points (device-side gradient multiplier / penalty and skip flag) ----
    m.def("adamw_step_controlled", &adamw_step_controlled,
          "adamw_step with the gradient multiplier and skip flag read on the device from a control tensor",
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
          py::arg("control"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::call_guard<py::gil_scoped_release>());
    m.def("adamw_peek_controlled", &adamw_peek_controlled,
          "adamw_peek with the gradient multiplier and skip flag read on the device from a control tensor",
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"),
          py::arg("control"), py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::call_guard<py::gil_scoped_release>());
    m.def("co2_outer_step_controlled", &co2_outer_step_controlled,
          "co2_outer_step with the gap penalty and skip flag read on the device from a control tensor",
          py::arg("prev_anchor"), py::arg("anchor"), py::arg("momentum"), py::arg("mean_params"), py::arg("out"),
          py::arg("control"), py::arg("outer_lr"), py::arg("outer_momentum"), py::arg("clip_threshold"),
          py::call_guard<py::gil_scoped_release>());
}
