// Python bindings of the CPU kernels (op `acco_cpu_ops`): tensor checks, the thread count torch
// is configured with, and the pybind declarations. The kernels live in acco_cpu_kernels.cpp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>

#include "acco_coeffs.h"
#include "acco_cpu_kernels.h"

namespace acco {
// The quantisation kernels' bindings (acco_cpu_quant_frontend.cpp).
void register_quant_bindings(pybind11::module_& m);
}  // namespace acco

namespace {

// The Python dispatcher validates arguments with helpful errors; these checks only guard the raw
// pointer arithmetic below against a caller that bypasses it.
void check_state(const at::Tensor& t, const char* name, int64_t numel) {
    TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
    TORCH_CHECK(t.scalar_type() == at::kFloat, name, " must be float32");
    TORCH_CHECK(t.is_contiguous() && t.dim() == 1, name, " must be 1-D and contiguous");
    TORCH_CHECK(t.numel() == numel, name, " must have ", numel, " elements");
}

acco::OutKind check_out(const std::optional<at::Tensor>& out, int64_t numel, void** out_ptr) {
    *out_ptr = nullptr;
    if (!out.has_value()) return acco::OutKind::kNone;
    const at::Tensor& t = *out;
    TORCH_CHECK(t.device().is_cpu(), "out must be a CPU tensor");
    TORCH_CHECK(t.is_contiguous() && t.dim() == 1 && t.numel() == numel, "out must be 1-D, contiguous, ", numel,
                " elements");
    *out_ptr = t.data_ptr();
    if (t.scalar_type() == at::kFloat) return acco::OutKind::kFloat32;
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, "out must be float32 or bfloat16");
    return acco::OutKind::kBFloat16;
}

void adamw_step(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                std::optional<at::Tensor> out, int64_t step, double lr, double beta1, double beta2, double eps,
                double weight_decay) {
    const int64_t numel = param.numel();
    check_state(param, "param", numel);
    check_state(grad, "grad", numel);
    check_state(exp_avg, "exp_avg", numel);
    check_state(exp_avg_sq, "exp_avg_sq", numel);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, numel, &out_ptr);
    const acco::AdamwCoeffs coeffs = acco::make_adamw_coeffs(step, lr, beta1, beta2, eps, weight_decay);
    acco::cpu::adamw_step(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                          exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, numel, coeffs, at::get_num_threads());
}

void adamw_peek(at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq, at::Tensor out,
                int64_t step, double lr, double beta1, double beta2, double eps, double weight_decay) {
    const int64_t numel = param.numel();
    check_state(param, "param", numel);
    check_state(grad, "grad", numel);
    check_state(exp_avg, "exp_avg", numel);
    check_state(exp_avg_sq, "exp_avg_sq", numel);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, numel, &out_ptr);
    const acco::AdamwCoeffs coeffs = acco::make_adamw_coeffs(step, lr, beta1, beta2, eps, weight_decay);
    acco::cpu::adamw_peek(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                          exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, numel, coeffs, at::get_num_threads());
}

void co2_outer_step(at::Tensor prev_anchor, at::Tensor anchor, at::Tensor momentum, at::Tensor mean_params,
                    std::optional<at::Tensor> out, double outer_lr, double outer_momentum, double penalty,
                    std::optional<double> clip_threshold) {
    const int64_t numel = anchor.numel();
    check_state(prev_anchor, "prev_anchor", numel);
    check_state(anchor, "anchor", numel);
    check_state(momentum, "momentum", numel);
    check_state(mean_params, "mean_params", numel);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, numel, &out_ptr);
    const acco::Co2Coeffs coeffs = acco::make_co2_coeffs(outer_lr, outer_momentum, penalty,
                                                         clip_threshold.has_value(), clip_threshold.value_or(0.0));
    acco::cpu::co2_outer_step(prev_anchor.data_ptr<float>(), anchor.data_ptr<float>(), momentum.data_ptr<float>(),
                              mean_params.data_ptr<float>(), out_ptr, out_kind, numel, coeffs,
                              at::get_num_threads());
}

// ---- Controlled entry points: the control tensor (gradient multiplier or gap penalty, skip flag)
// ---- decides on the device what the update does. On the CPU "the device" is host memory, so the
// ---- frontend reads the two values and branches; a skip copies the current parameters to out.

struct Control {
    float value;
    bool skip;
};

Control read_control(const at::Tensor& control) {
    TORCH_CHECK(control.device().is_cpu() && control.scalar_type() == at::kFloat && control.is_contiguous() &&
                    control.dim() == 1 && control.numel() == 2,
                "control must be a CPU float32 tensor of 2 elements");
    const float* values = control.data_ptr<float>();
    return Control{values[acco::kControlValue], values[acco::kControlSkip] != 0.0f};
}

void adamw_controlled(bool write_state, at::Tensor param, at::Tensor grad, at::Tensor exp_avg, at::Tensor exp_avg_sq,
                      std::optional<at::Tensor> out, const at::Tensor& control, int64_t step, double lr, double beta1,
                      double beta2, double eps, double weight_decay) {
    const int64_t numel = param.numel();
    check_state(param, "param", numel);
    check_state(grad, "grad", numel);
    check_state(exp_avg, "exp_avg", numel);
    check_state(exp_avg_sq, "exp_avg_sq", numel);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, numel, &out_ptr);
    const Control c = read_control(control);
    if (c.skip) {
        if (out.has_value()) out->copy_(param);
        return;
    }
    acco::AdamwCoeffs coeffs = acco::make_adamw_coeffs(step, lr, beta1, beta2, eps, weight_decay);
    coeffs.grad_scale = c.value;
    if (write_state) {
        acco::cpu::adamw_step(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                              exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, numel, coeffs, at::get_num_threads());
    } else {
        acco::cpu::adamw_peek(param.data_ptr<float>(), grad.data_ptr<float>(), exp_avg.data_ptr<float>(),
                              exp_avg_sq.data_ptr<float>(), out_ptr, out_kind, numel, coeffs, at::get_num_threads());
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
    const int64_t numel = anchor.numel();
    check_state(prev_anchor, "prev_anchor", numel);
    check_state(anchor, "anchor", numel);
    check_state(momentum, "momentum", numel);
    check_state(mean_params, "mean_params", numel);
    void* out_ptr;
    const acco::OutKind out_kind = check_out(out, numel, &out_ptr);
    const Control c = read_control(control);
    if (c.skip) {  // x_{k+2} = x_{k+1}: the anchor stays, the momentum too
        prev_anchor.copy_(anchor);
        if (out.has_value()) out->copy_(anchor);
        return;
    }
    // The penalty is an fp32 value; widening it to double and back is exact.
    co2_outer_step(prev_anchor, anchor, momentum, mean_params, out, outer_lr, outer_momentum,
                   static_cast<double>(c.value), clip_threshold);
}

}  // namespace

#define ACCO_STRINGIFY_IMPL(x) #x
#define ACCO_STRINGIFY(x) ACCO_STRINGIFY_IMPL(x)

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "deepspeed-acco fused CPU kernels (OpenMP + SIMD)";
#ifdef ACCO_OPS_SOURCE_DIGEST
    // Lets the loader tell a stale ahead-of-time build from one of the current sources.
    m.attr("source_digest") = ACCO_STRINGIFY(ACCO_OPS_SOURCE_DIGEST);
#endif
    // The GIL is released so the engine's worker thread can update while Python keeps running.
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
          "adamw_step with the gradient multiplier and skip flag read from a control tensor", py::arg("param"),
          py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"), py::arg("control"),
          py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::call_guard<py::gil_scoped_release>());
    m.def("adamw_peek_controlled", &adamw_peek_controlled,
          "adamw_peek with the gradient multiplier and skip flag read from a control tensor", py::arg("param"),
          py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"), py::arg("out"), py::arg("control"),
          py::arg("step"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
          py::call_guard<py::gil_scoped_release>());
    m.def("co2_outer_step_controlled", &co2_outer_step_controlled,
          "co2_outer_step with the gap penalty and skip flag read from a control tensor", py::arg("prev_anchor"),
          py::arg("anchor"), py::arg("momentum"), py::arg("mean_params"), py::arg("out"), py::arg("control"),
          py::arg("outer_lr"), py::arg("outer_momentum"), py::arg("clip_threshold"),
          py::call_guard<py::gil_scoped_release>());
}
