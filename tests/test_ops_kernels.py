"""Fused kernels (csrc/) against the torch reference (builders and dispatcher: tests/test_op_builders.py).

The CPU kernels are JIT-built on first use by the op builder (about 15 s from a clean cache on two
cores); the CUDA kernels are tested when a GPU is visible. Hyperparameters are exaggerated
(betas 0.1/0.2, eps 0.25, large weight decay) so that a wrong coefficient shows as a large error.
"""
import math

import pytest
import torch

import deepspeed_acco.ops as ops
from deepspeed_acco.ops import _backend, reference

SIZES = [1, 7, 4097, (1 << 20) + 3]
OUT_DTYPES = [None, torch.float32, torch.bfloat16]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
EXAGGERATED = dict(lr=0.1, beta1=0.1, beta2=0.2, eps=0.25, weight_decay=4.0)
STANDARD = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
RTOL = 1e-6


@pytest.fixture
def kernels(request, monkeypatch):
    """Forces the fused backend of ``request.param``'s device, so a build failure fails the test."""
    device = request.param
    monkeypatch.setenv(_backend.ENV_VAR, device)
    _backend.reset()
    assert ops.backend(device) == device
    yield device
    _backend.reset()


def assert_close_rel(actual, expected, rtol=RTOL):
    """Elementwise within ``rtol`` of the tensor's magnitude.

    Where theta nearly cancels (theta * decay ~ -update), one ulp of the operands is many ulps of
    the result, so a pure per-element rtol would flag correct code. torch's own CPU sqrt (MKL)
    is not correctly rounded, which is where such last-bit differences come from.
    """
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(actual, expected, rtol=rtol, atol=rtol * scale)


def assert_bitwise(actual, expected):
    assert actual.dtype == expected.dtype
    bits = torch.int16 if actual.element_size() == 2 else torch.int32
    mismatch = (actual.view(bits) != expected.view(bits)).nonzero()
    assert mismatch.numel() == 0, (f"{mismatch.numel()} elements differ, first at {mismatch[0].item()}: "
                                   f"{actual[mismatch[0]].item()} vs {expected[mismatch[0]].item()}")


def adamw_state(numel, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=gen)
    exp_avg = torch.randn(numel, generator=gen) * 0.1
    exp_avg_sq = torch.rand(numel, generator=gen) * 0.1
    return [t.to(device) for t in (param, exp_avg, exp_avg_sq)]


def random_grad(numel, device, seed):
    return torch.randn(numel, generator=torch.Generator().manual_seed(1000 + seed)).to(device)


# ---------------------------------------------------------------------------------------------
# AdamW step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
def test_adamw_step_matches_reference(kernels, numel, out_dtype):
    device = kernels
    param, exp_avg, exp_avg_sq = adamw_state(numel, device)
    ref_param, ref_exp_avg, ref_exp_avg_sq = (t.clone() for t in (param, exp_avg, exp_avg_sq))
    out = None if out_dtype is None else torch.full((numel, ), float("nan"), dtype=out_dtype, device=device)
    for step in range(1, 4):
        grad = random_grad(numel, device, step)
        ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, out=out, **EXAGGERATED)
        reference.adamw_step(ref_param, grad, ref_exp_avg, ref_exp_avg_sq, step=step, **EXAGGERATED)
        assert_close_rel(exp_avg, ref_exp_avg)
        assert_close_rel(exp_avg_sq, ref_exp_avg_sq)
        assert_close_rel(param, ref_param)
        if out is not None:
            # The output is the new parameters, cast exactly as torch casts them.
            assert_bitwise(out, param.to(out_dtype))


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("hyper", [EXAGGERATED, STANDARD], ids=["exaggerated", "standard"])
def test_adamw_step_matches_torch_adamw(kernels, hyper):
    device = kernels
    numel = 4097
    param, exp_avg, exp_avg_sq = adamw_state(numel, device)
    exp_avg.zero_()
    exp_avg_sq.zero_()
    torch_param = torch.nn.Parameter(param.clone())
    opt = torch.optim.AdamW([torch_param], lr=hyper["lr"], betas=(hyper["beta1"], hyper["beta2"]), eps=hyper["eps"],
                            weight_decay=hyper["weight_decay"], foreach=False)
    for step in range(1, 6):
        grad = random_grad(numel, device, step)
        torch_param.grad = grad.clone()
        opt.step()
        ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, **hyper)
        state = opt.state[torch_param]
        assert_close_rel(exp_avg, state["exp_avg"])
        assert_close_rel(exp_avg_sq, state["exp_avg_sq"])
        assert_close_rel(param, torch_param.detach())


def _adamw_reference_ieee_sqrt(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay):
    """reference.adamw_step with a correctly rounded sqrt (via float64), the one op it differs in."""
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(grad, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1.0 - beta2)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2_sqrt = math.sqrt(1.0 - beta2**step)
    denom = (exp_avg_sq.double().sqrt().float() / bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-(lr / bias_correction1))


@pytest.mark.skipif(torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
                    reason="torch's FMA-based CPU kernels (lerp, addcmul) need AVX2 or AVX-512")
@pytest.mark.parametrize("kernels", ["cpu"], indirect=True)
@pytest.mark.parametrize("hyper", [EXAGGERATED, STANDARD], ids=["exaggerated", "standard"])
def test_cpu_adamw_step_is_bitwise_torch_with_ieee_sqrt(kernels, hyper):
    # Evidence that the CPU kernel reproduces torch's operation order exactly; the only difference
    # from the reference is torch's (MKL) sqrt, which is not correctly rounded.
    numel = (1 << 16) + 5
    param, exp_avg, exp_avg_sq = adamw_state(numel, "cpu")
    expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    for step in range(1, 4):
        grad = random_grad(numel, "cpu", step)
        ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, **hyper)
        _adamw_reference_ieee_sqrt(expected[0], grad, expected[1], expected[2], step=step, **hyper)
        for actual, want in zip((param, exp_avg, exp_avg_sq), expected):
            assert_bitwise(actual, want)


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
def test_adamw_step_on_unaligned_views(kernels):
    # Shards that start one float into a buffer: the CUDA kernel must take its scalar path.
    device = kernels
    numel = 4099
    backing = [torch.randn(numel + 1, device=device) for _ in range(4)]
    param, grad, exp_avg, exp_avg_sq = (t[1:] for t in backing)
    exp_avg_sq.abs_()
    expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    out_backing = torch.empty(numel + 1, dtype=torch.bfloat16, device=device)
    out = out_backing[1:]
    ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=3, out=out, **EXAGGERATED)
    reference.adamw_step(expected[0], grad, expected[1], expected[2], step=3, **EXAGGERATED)
    for actual, want in zip((param, exp_avg, exp_avg_sq), expected):
        assert_close_rel(actual, want)
    assert_bitwise(out, param.to(torch.bfloat16))


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
def test_large_shard_output_on_unaligned_buffer(kernels, out_dtype):
    # Above 32 MB per call the CPU kernels stream the output with non-temporal stores; an output
    # view one element into its buffer exercises the unaligned head before the streamed blocks.
    device = kernels
    numel = (1 << 21) + 37
    param, exp_avg, exp_avg_sq = adamw_state(numel, device)
    grad = random_grad(numel, device, 1)
    expected = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    peeked = torch.empty(numel + 1, dtype=out_dtype, device=device)[1:]
    out = torch.empty(numel + 1, dtype=out_dtype, device=device)[1:]
    ops.adamw_peek(param, grad, exp_avg, exp_avg_sq, step=2, out=peeked, **EXAGGERATED)
    ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=2, out=out, **EXAGGERATED)
    reference.adamw_step(expected[0], grad, expected[1], expected[2], step=2, **EXAGGERATED)
    for actual, want in zip((param, exp_avg, exp_avg_sq), expected):
        assert_close_rel(actual, want)
    assert_bitwise(out, param.to(out_dtype))
    assert_bitwise(peeked, out)

    prev_anchor, anchor, momentum, mean_params = co2_state(numel, device)
    expected = [t.clone() for t in (prev_anchor, anchor, momentum)]
    ops.co2_outer_step(prev_anchor, anchor, momentum, mean_params, clip_threshold=0.2, out=out, **CO2_HYPER)
    reference.co2_outer_step(*expected, mean_params, clip_threshold=0.2, **CO2_HYPER)
    for actual, want in zip((prev_anchor, anchor, momentum), expected):
        assert_close_rel(actual, want)
    assert_bitwise(out, anchor.to(out_dtype))


@pytest.mark.parametrize("kernels", ["cpu"], indirect=True)
def test_cpu_result_does_not_depend_on_thread_count(kernels):
    numel = (1 << 20) + 3
    results = []
    threads_before = torch.get_num_threads()
    try:
        for threads in (1, max(2, threads_before)):
            torch.set_num_threads(threads)
            param, exp_avg, exp_avg_sq = adamw_state(numel, "cpu")
            out = torch.empty(numel, dtype=torch.bfloat16)
            ops.adamw_step(param, random_grad(numel, "cpu", 1), exp_avg, exp_avg_sq, step=1, out=out, **EXAGGERATED)
            results.append((param, exp_avg, exp_avg_sq, out))
    finally:
        torch.set_num_threads(threads_before)
    for one, many in zip(*results):
        assert_bitwise(many, one)


# ---------------------------------------------------------------------------------------------
# AdamW peek
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", SIZES)
def test_adamw_peek_leaves_state_and_equals_a_real_step(kernels, numel, out_dtype):
    device = kernels
    param, exp_avg, exp_avg_sq = adamw_state(numel, device)
    for step in range(1, 4):
        grad = random_grad(numel, device, step)
        before = [t.clone() for t in (param, grad, exp_avg, exp_avg_sq)]
        peeked = torch.empty(numel, dtype=out_dtype, device=device)
        ops.adamw_peek(param, grad, exp_avg, exp_avg_sq, step=step, out=peeked, **EXAGGERATED)
        for actual, want in zip((param, grad, exp_avg, exp_avg_sq), before):
            assert_bitwise(actual, want)
        # Peeking again at the same step gives the same estimate: nothing advanced.
        again = torch.empty_like(peeked)
        ops.adamw_peek(param, grad, exp_avg, exp_avg_sq, step=step, out=again, **EXAGGERATED)
        assert_bitwise(again, peeked)

        ref_out = torch.empty(numel, dtype=out_dtype, device=device)
        reference.adamw_peek(param, grad, exp_avg, exp_avg_sq, step=step, out=ref_out, **EXAGGERATED)
        if out_dtype == torch.float32:
            assert_close_rel(peeked, ref_out)

        ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=step, **EXAGGERATED)
        assert_bitwise(peeked, param.to(out_dtype))


# ---------------------------------------------------------------------------------------------
# CO2 outer step
# ---------------------------------------------------------------------------------------------

CO2_HYPER = dict(outer_lr=0.7, outer_momentum=0.5, penalty=3.0)


def co2_state(numel, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(numel, generator=gen).to(device) for _ in range(4)]


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("clip_threshold", [None, 0.2], ids=["noclip", "clip"])
@pytest.mark.parametrize("numel", SIZES)
def test_co2_outer_step_matches_reference(kernels, numel, clip_threshold, out_dtype):
    device = kernels
    prev_anchor, anchor, momentum, mean_params = co2_state(numel, device)
    expected = [t.clone() for t in (prev_anchor, anchor, momentum)]
    out = None if out_dtype is None else torch.empty(numel, dtype=out_dtype, device=device)
    for _ in range(3):
        mean_params.add_(0.3)
        ops.co2_outer_step(prev_anchor, anchor, momentum, mean_params, clip_threshold=clip_threshold, out=out,
                           **CO2_HYPER)
        reference.co2_outer_step(*expected, mean_params, clip_threshold=clip_threshold, **CO2_HYPER)
        for actual, want in zip((prev_anchor, anchor, momentum), expected):
            assert_close_rel(actual, want)
        if out is not None:
            assert_bitwise(out, anchor.to(out_dtype))


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
def test_co2_clip_actually_clips(kernels):
    # An out-of-place clamp (momentum.clamp(...) with the result dropped) leaves |momentum| ~ 30.
    device = kernels
    numel = 4097
    clip = 0.01
    prev_anchor = torch.zeros(numel, device=device)
    anchor = torch.ones(numel, device=device)
    momentum = torch.zeros(numel, device=device)
    mean_params = torch.full((numel, ), -90.0, device=device)
    mean_params[::2] = 90.0
    mean_params[5] = 0.0  # pseudo-gradient 0: stays 0, inside the clip range
    ops.co2_outer_step(prev_anchor, anchor, momentum, mean_params, outer_lr=1.0, outer_momentum=0.9, penalty=3.0,
                       clip_threshold=clip)
    assert momentum.abs().max().item() <= clip
    expected = torch.where(mean_params > 0, -clip, clip)
    expected[5] = 0.0
    assert_bitwise(momentum, expected)
    assert_bitwise(anchor, 1.0 - expected)
    assert_bitwise(prev_anchor, torch.ones(numel, device=device))


# ---------------------------------------------------------------------------------------------
# bf16 conversion
# ---------------------------------------------------------------------------------------------


def special_floats(device):
    bits = [
        0x3F808000,  # tie between two bf16 values, even neighbour below
        0x3F818000,  # tie, even neighbour above
        0x3F808001,  # just above a tie
        0x3F807FFF,  # just below a tie
        0x7F7FFFFF,  # largest float: rounds to inf
        0x00000001,  # smallest denormal
        0x807FFFFF,  # largest negative denormal
        0x80000000,  # -0.0
        0x7F800000,  # inf
        0xFF800000,  # -inf
        0x7FC00000,  # quiet NaN
        0x7F800001,  # signalling NaN payload
        0xFFC12345,  # negative NaN with payload
    ]
    values = torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    return torch.cat([values, torch.randn(50)]).to(device)


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
def test_bf16_output_rounds_like_torch(kernels):
    device = kernels
    param = special_floats(device)
    numel = param.numel()
    grad = torch.ones(numel, device=device)
    exp_avg = torch.zeros(numel, device=device)
    exp_avg_sq = torch.zeros(numel, device=device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    # lr = 0 leaves every finite theta as is, so the special values reach the cast unchanged.
    ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=1, out=out, lr=0.0, beta1=0.9, beta2=0.99, eps=1e-8,
                   weight_decay=0.0)
    expected = param.to(torch.bfloat16)
    nan = torch.isnan(param)
    assert torch.isnan(out[nan].float()).all()
    assert_bitwise(out[~nan], expected[~nan])
    if device == "cuda" or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        # torch's vectorised casts map every NaN to one pattern (0xFFFF on CPU, 0x7FFF on CUDA).
        assert_bitwise(out, expected)


# ---------------------------------------------------------------------------------------------
# Control tensor: the gradient multiplier / gap penalty and the skip flag decided on the device
# ---------------------------------------------------------------------------------------------

# "kernels": the fused kernel of the device; "reference": the torch reference on that device.
IMPLEMENTATIONS = [("kernels", "cpu"), ("reference", "cpu"),
                   pytest.param(("kernels", "cuda"), marks=DEVICES[1].marks),
                   pytest.param(("reference", "cuda"), marks=DEVICES[1].marks)]


@pytest.fixture
def impl(request, monkeypatch):
    """(module with adamw_step/adamw_peek/co2_outer_step, device): the dispatcher with the device's fused
    kernels forced, or the torch reference called directly."""
    kind, device = request.param
    if kind == "reference":
        yield reference, device
        return
    monkeypatch.setenv(_backend.ENV_VAR, device)
    _backend.reset()
    assert ops.backend(device) == device
    yield ops, device
    _backend.reset()


def make_control(value, skip, device):
    return torch.tensor([value, 1.0 if skip else 0.0], dtype=torch.float32, device=device)


def adamw_out(numel, out_dtype, device):
    return None if out_dtype is None else torch.full((numel, ), float("nan"), dtype=out_dtype, device=device)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, indirect=True, ids=lambda p: "-".join(p))
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("numel", [7, 4097, (1 << 20) + 3])
def test_controlled_adamw_equals_a_plain_step_on_the_scaled_gradient(impl, numel, out_dtype):
    # Bitwise: the multiplier is one fp32 rounding of grad * value, exactly what the engine's jobs did
    # before with a separate grad.mul_(value); the gradient buffer itself is left alone.
    module, device = impl
    controlled = adamw_state(numel, device)
    plain = [t.clone() for t in controlled]
    for step in range(1, 4):
        grad = random_grad(numel, device, step)
        grad_before = grad.clone()
        control = make_control(0.37 / step, False, device)
        out_controlled, out_plain = adamw_out(numel, out_dtype, device), adamw_out(numel, out_dtype, device)
        module.adamw_step(*controlled[:1], grad, *controlled[1:], step=step, out=out_controlled, control=control,
                          **EXAGGERATED)
        module.adamw_step(*plain[:1], grad * control[0], *plain[1:], step=step, out=out_plain, **EXAGGERATED)
        assert_bitwise(grad, grad_before)
        for actual, want in zip(controlled, plain):
            assert_bitwise(actual, want)
        if out_dtype is not None:
            assert_bitwise(out_controlled, out_plain)
        peeked_controlled = torch.empty(numel, device=device)
        peeked_plain = torch.empty(numel, device=device)
        module.adamw_peek(*controlled[:1], grad, *controlled[1:], step=step + 1, out=peeked_controlled,
                          control=control, **EXAGGERATED)
        module.adamw_peek(*plain[:1], grad * control[0], *plain[1:], step=step + 1, out=peeked_plain, **EXAGGERATED)
        assert_bitwise(peeked_controlled, peeked_plain)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, indirect=True, ids=lambda p: "-".join(p))
@pytest.mark.parametrize("out_dtype", [None, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("numel", [7, 4097])
def test_controlled_skip_leaves_the_state_and_writes_the_current_parameters(impl, numel, out_dtype):
    module, device = impl
    param, exp_avg, exp_avg_sq = adamw_state(numel, device)
    grad = random_grad(numel, device, 1)
    grad[::3] = float("nan")  # what a skipped update usually sees
    before = [t.clone() for t in (param, exp_avg, exp_avg_sq)]
    control = make_control(float("nan"), True, device)
    out = adamw_out(numel, out_dtype, device)
    module.adamw_step(param, grad, exp_avg, exp_avg_sq, step=3, out=out, control=control, **EXAGGERATED)
    for actual, want in zip((param, exp_avg, exp_avg_sq), before):
        assert_bitwise(actual, want)
    if out is not None:
        assert_bitwise(out, param.to(out_dtype))
    peeked = adamw_out(numel, out_dtype or torch.float32, device)
    module.adamw_peek(param, grad, exp_avg, exp_avg_sq, step=3, out=peeked, control=control, **EXAGGERATED)
    assert_bitwise(peeked, param.to(peeked.dtype))
    for actual, want in zip((param, exp_avg, exp_avg_sq), before):
        assert_bitwise(actual, want)

    prev_anchor, anchor, momentum, mean_params = co2_state(numel, device)
    mean_params[::2] = float("inf")
    anchor_before, momentum_before = anchor.clone(), momentum.clone()
    out = adamw_out(numel, out_dtype, device)
    module.co2_outer_step(prev_anchor, anchor, momentum, mean_params, outer_lr=0.7, outer_momentum=0.5,
                          clip_threshold=0.2, out=out, control=make_control(float("nan"), True, device))
    # x_{k+2} = x_{k+1}: the anchor stays (and becomes the previous anchor), the momentum is kept.
    assert_bitwise(anchor, anchor_before)
    assert_bitwise(prev_anchor, anchor_before)
    assert_bitwise(momentum, momentum_before)
    if out is not None:
        assert_bitwise(out, anchor.to(out_dtype))


@pytest.mark.parametrize("impl", IMPLEMENTATIONS, indirect=True, ids=lambda p: "-".join(p))
@pytest.mark.parametrize("clip_threshold", [None, 0.2], ids=["noclip", "clip"])
def test_controlled_co2_outer_step_takes_the_penalty_from_the_device(impl, clip_threshold):
    module, device = impl
    numel = 4097
    controlled = co2_state(numel, device)
    plain = [t.clone() for t in controlled]
    penalty = 2.7  # not a power of two: a reciprocal and a division round differently
    control = make_control(penalty, False, device)
    out = torch.empty(numel, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        controlled[3].add_(0.3)
        plain[3].add_(0.3)
        module.co2_outer_step(*controlled, outer_lr=0.7, outer_momentum=0.5, clip_threshold=clip_threshold, out=out,
                              control=control)
        module.co2_outer_step(*plain, outer_lr=0.7, outer_momentum=0.5, penalty=float(control[0]),
                              clip_threshold=clip_threshold)
        for actual, want in zip(controlled[:3], plain[:3]):
            if device == "cpu":
                # On the CPU both divide by the fp32 penalty: bitwise what the engine computed before.
                assert_bitwise(actual, want)
            else:
                # CUDA divides by the device value but multiplies by the reciprocal of a host number
                # (as torch does): the two differ in the last bit.
                assert_close_rel(actual, want)
        assert_bitwise(out, controlled[1].to(torch.bfloat16))


def test_co2_outer_step_needs_exactly_one_penalty_source():
    prev_anchor, anchor, momentum, mean_params = co2_state(16, "cpu")
    with pytest.raises(ValueError, match="exactly one of penalty"):
        ops.co2_outer_step(prev_anchor, anchor, momentum, mean_params, outer_lr=1.0, outer_momentum=0.5)
    with pytest.raises(ValueError, match="exactly one of penalty"):
        ops.co2_outer_step(prev_anchor, anchor, momentum, mean_params, outer_lr=1.0, outer_momentum=0.5, penalty=2.0,
                           control=make_control(2.0, False, "cpu"))
    with pytest.raises(ValueError, match="control has 3 elements"):
        ops.adamw_step(anchor, mean_params, momentum, prev_anchor.abs(), step=1, control=torch.zeros(3),
                       **EXAGGERATED)


def test_make_control_rounds_the_value_to_fp32_once():
    value = torch.tensor(1.0 / 3.0, dtype=torch.float64)
    control = ops.make_control(value, torch.tensor(True))
    assert control.dtype == torch.float32 and control.tolist() == [float(torch.tensor(1.0 / 3.0).float()), 1.0]


# ---------------------------------------------------------------------------------------------
# CUDA: streams
# ---------------------------------------------------------------------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernels", ["cuda"], indirect=True)
def test_cuda_kernels_run_on_the_current_stream(kernels):
    numel = 1 << 20
    param, exp_avg, exp_avg_sq = adamw_state(numel, "cuda")
    grad = random_grad(numel, "cuda", 1)
    before = param.clone()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    done = torch.cuda.Event()
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # keeps the side stream busy for ~0.1 s
        ops.adamw_step(param, grad, exp_avg, exp_avg_sq, step=1, **EXAGGERATED)
        done.record()
    # Had the kernel gone to the default stream, it would have run already.
    snapshot = param.clone()
    torch.cuda.current_stream().synchronize()
    assert not done.query(), "the side stream finished too early for this test to tell"
    assert_bitwise(snapshot, before)
    side.synchronize()
    assert not torch.equal(param, before)
