"""Block-quantisation kernels of compressed communication (docs/kernels.md, "Compressed communication")
and their torch reference.

Layer 1 of docs/design.md, section 4: the reference against hand-computed codes and its error bounds, then
the fused CPU kernels (and CUDA, when a GPU is visible) bitwise against the reference over awkward
sizes, every block size and bit width, several chunks per call, exaggerated magnitudes, zero and
tiny blocks, inf/NaN, and every fp16 bit pattern for the held copies.
"""
import math
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import deepspeed_acco.ops as ops
from deepspeed_acco.ops import _backend, reference
from deepspeed_acco.ops.quantization import BITS, QUANT_MAX_CODE

CSRC = Path(__file__).resolve().parent.parent / "csrc"
BLOCK_SIZES = [32, 64, 128, 256, 512]
# (values per chunk, block size): every block size on the small sizes, two on 1M + 3 (the large
# size exercises the thread split; the block loops are the same at every size).
SIZE_CASES = ([(numel, block) for numel in (1, 7, 127, 129, 4097) for block in BLOCK_SIZES] +
              [((1 << 20) + 3, block) for block in (128, 512)])
HELD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")),
]
FLOAT_MAX = torch.finfo(torch.float32).max


@pytest.fixture
def kernels(request, monkeypatch):
    """Forces the fused backend of ``request.param``'s device, so a build failure fails the test."""
    device = request.param
    monkeypatch.setenv(_backend.ENV_VAR, device)
    _backend.reset()
    assert ops.backend(device) == device
    yield device
    _backend.reset()


def bits_view(tensor):
    return tensor.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[tensor.element_size()])


def assert_bitwise(actual, expected, what=""):
    """Bitwise equal, except that any NaN matches any NaN (casts differ in the NaN they produce)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.is_floating_point():
        nan = torch.isnan(actual)
        assert torch.equal(nan, torch.isnan(expected)), f"{what}: NaNs in different places"
        actual, expected = actual[~nan], expected[~nan]
    mismatch = (bits_view(actual) != bits_view(expected)).nonzero()
    assert mismatch.numel() == 0, (f"{what}: {mismatch.numel()} elements differ, first at {mismatch[0].item()}: "
                                   f"{actual[mismatch[0]].item()} vs {expected[mismatch[0]].item()}")


def awkward_values(numel, seed, device="cpu"):
    """Magnitudes over many decades (so blocks differ wildly in scale), some exact zeros and ties."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 4.0)
    values[torch.rand(numel, generator=gen) < 0.05] = 0.0
    values[torch.rand(numel, generator=gen) < 0.05] = 2.5  # exact ties once a block's scale is 1 or 0.5
    return values.to(device)


def special_values(device="cpu"):
    """Blocks of 32 with zeros, tiny, huge, signed zeros, denormals, inf and NaN, plus normal data."""
    blocks = [
        torch.zeros(32),
        torch.full((32, ), -0.0),
        torch.full((32, ), 1e-39),  # denormal: max_code / absmax overflows, the block is sent as zeros
        torch.linspace(-3e-37, 3e-37, 32),  # just above/below the int8 threshold 127 / FLT_MAX
        torch.full((32, ), FLOAT_MAX) * torch.tensor([1.0, -1.0]).repeat(16),  # sent as NaN (>= 2^127)
        torch.linspace(-1.7e38, 1.7e38, 32),  # just below 2^127: still quantised
        torch.linspace(-1e38, 1e38, 32),
        torch.tensor([math.inf] + [1.0] * 31),
        torch.tensor([2.0] * 31 + [-math.inf]),
        torch.tensor([math.nan] + [1.0] * 31),
        torch.tensor([127.0, -63.5, 0.5, 1.5, 2.5, -2.5, -0.0, 0.0] * 4),
        torch.randn(32),
    ]
    return torch.cat(blocks).to(device)


def new_packed(numel, rows, bits, block_size, device="cpu"):
    """A packed buffer full of garbage, so a kernel that skips a byte shows."""
    width = ops.packed_bytes(numel, bits=bits, block_size=block_size)
    return torch.full((rows, width), 0xA5, dtype=torch.uint8, device=device)


# ---------------------------------------------------------------------------------------------
# Reference semantics
# ---------------------------------------------------------------------------------------------


def test_packed_bytes_formula():
    # int8: 1 byte per value + 4 per block; int4: half a byte per value + 4 per block; 16-byte rows.
    assert ops.packed_bytes(128, bits=8, block_size=128) == 4 + 128 + 12
    assert ops.packed_bytes(1 << 20, bits=8, block_size=128) == (1 << 20) + 4 * 8192
    assert ops.packed_bytes(1 << 20, bits=4, block_size=128) == (1 << 19) + 4 * 8192
    assert ops.packed_bytes(7, bits=4, block_size=32) == 16  # 4 + 4 bytes, padded
    assert ops.packed_bytes(0, bits=8, block_size=64) == 0


def test_int8_codes_by_hand():
    # Block 0: absmax 127, so scale 1 and codes are v rounded half to even; block 1: all zeros.
    values = torch.tensor([127.0, -63.5, 0.5, 1.5, 2.5, -2.5, -0.0, 3.25] + [0.0] * 24 + [0.0] * 32)
    residual = torch.zeros(64)
    packed = new_packed(64, 1, 8, 32)
    reference.quantize(values, packed, bits=8, block_size=32, residual=residual)
    scales = packed[0, :8].view(torch.float32)
    assert scales.tolist() == [1.0, 0.0]
    codes = packed[0, 8:8 + 64].view(torch.int8)
    assert codes[:8].tolist() == [127, -64, 0, 2, 2, -2, 0, 3]
    assert codes[8:].eq(0).all()
    assert packed[0, 72:].eq(0).all()  # padding to 80 bytes
    assert residual[:8].tolist() == [0.0, 0.5, 0.5, -0.5, 0.5, -0.5, 0.0, 0.25]
    assert residual[8:].eq(0).all()


def test_int4_nibbles_by_hand():
    values = torch.tensor([7.0, -7.0, 3.0, -1.0, -3.5, 5.0, 1.0])  # odd length: the last high nibble is 0
    packed = new_packed(7, 1, 4, 32)
    reference.quantize(values, packed, bits=4, block_size=32)
    assert packed[0, :4].view(torch.float32).item() == 1.0
    # code & 0xF in the low nibble, the next element's code << 4 in the high one; -3.5 rounds to -4.
    assert packed[0, 4:8].tolist() == [0x97, 0xF3, 0x5C, 0x01]
    assert packed[0, 8:].eq(0).all()
    codes, scales = reference.read_packed(packed, 7, bits=4, block_size=32)
    assert codes[0].tolist() == [7, -7, 3, -1, -4, 5, 1] and scales.tolist() == [[1.0]]


def test_nonfinite_block_is_sent_as_nan_and_keeps_its_residual():
    values = torch.ones(96)
    values[40] = math.nan
    values[70] = -math.inf
    residual = torch.full((96, ), 0.25)
    packed = new_packed(96, 1, 8, 32)
    reference.quantize(values, packed, bits=8, block_size=32, residual=residual)
    scales = packed[0, :12].view(torch.float32)
    assert scales[0].item() == pytest.approx(1.25 / 127) and math.isnan(scales[1]) and math.isnan(scales[2])
    assert packed[0, 12 + 32:12 + 96].eq(0).all()  # codes of the bad blocks
    assert residual[32:].eq(0.25).all()  # untouched, so later steps are not poisoned
    dequantised = reference.dequantize_rows(packed, 96, bits=8, block_size=32)[0]
    assert torch.isfinite(dequantised[:32]).all() and torch.isnan(dequantised[32:]).all()


def test_magnitudes_from_two_to_the_127_are_sent_as_nan():
    # Above 2^127, code * scale could round past FLT_MAX: a finite value would arrive as inf and
    # leave -inf in the residual. Such blocks count as overflow, like inf.
    largest_quantised = torch.nextafter(torch.tensor(2.0**127), torch.tensor(0.0)).item()
    values = torch.tensor([largest_quantised, -largest_quantised] * 16 + [2.0**127] + [1.0] * 31)
    residual = torch.zeros(64)
    packed = new_packed(64, 1, 8, 32)
    reference.quantize(values, packed, bits=8, block_size=32, residual=residual)
    dequantised = reference.dequantize_rows(packed, 64, bits=8, block_size=32)[0]
    assert torch.isfinite(dequantised[:32]).all() and torch.isfinite(residual).all()
    assert torch.isnan(dequantised[32:]).all() and residual[32:].eq(0).all()


def test_overflowing_sum_counts_as_nonfinite():
    values = torch.full((32, ), 3e38)
    residual = torch.full((32, ), 3e38)  # v = inf
    packed = new_packed(32, 1, 8, 32)
    reference.quantize(values, packed, bits=8, block_size=32, residual=residual)
    assert math.isnan(packed[0, :4].view(torch.float32).item())
    assert residual.eq(3e38).all()


@pytest.mark.parametrize("bits", BITS)
def test_zero_and_tiny_blocks_are_sent_as_zeros(bits):
    threshold = QUANT_MAX_CODE[bits] / FLOAT_MAX  # below it, max_code / absmax overflows
    values = torch.cat([torch.zeros(32), torch.full((32, ), 1e-39), torch.full((32, ), threshold * 0.9),
                        torch.full((32, ), threshold * 1.5)])
    residual = torch.zeros(128)
    packed = new_packed(128, 1, bits, 32)
    reference.quantize(values, packed, bits=bits, block_size=32, residual=residual)
    scales = packed[0, :16].view(torch.float32)
    assert scales[:3].eq(0).all() and scales[3] > 0
    assert_bitwise(residual[:96], values[:96], "tiny values stay in the residual")
    dequantised = reference.dequantize_rows(packed, 128, bits=bits, block_size=32)[0]
    assert dequantised[:96].eq(0).all() and dequantised[96:].gt(0).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("block_size", [32, 128, 512])
def test_round_trip_error_is_half_a_step(bits, block_size):
    numel = 64 * 1024 + 3
    values = awkward_values(numel, seed=bits + block_size)
    packed = new_packed(numel, 1, bits, block_size)
    reference.quantize(values, packed, bits=bits, block_size=block_size)
    codes, scales = reference.read_packed(packed, numel, bits=bits, block_size=block_size)
    scale = scales[0].repeat_interleave(block_size)[:numel]
    dequantised = reference.dequantize_rows(packed, numel, bits=bits, block_size=block_size)[0]
    # scale = absmax / max_code, the largest magnitude of each block maps to +-max_code.
    absmax = torch.nn.functional.pad(values.abs(), (0, -numel % block_size)).view(-1, block_size).amax(dim=1)
    torch.testing.assert_close(scales[0], absmax / QUANT_MAX_CODE[bits], rtol=0, atol=0)
    assert codes.abs().max().item() == QUANT_MAX_CODE[bits]
    # |v - q * scale| <= scale / 2, up to fp32 rounding of the reciprocal and the product.
    error = (values - dequantised).abs()
    assert (error <= scale * 0.5 * (1 + 2**-12)).all(), (error / scale).max().item()
    # ... and the bound is tight (a scale too large by 2x would still pass the line above).
    assert (error / scale)[scale > 0].max().item() > 0.49


@pytest.mark.parametrize("bits", BITS)
def test_error_feedback_is_exact_bookkeeping(bits):
    # v = input + residual is split exactly into what is sent and the new residual (Sterbenz: the
    # dequantised value is within a factor 2 of v, or 0), so nothing is lost, only delayed.
    numel = 4097
    residual = awkward_values(numel, seed=1) * 1e-3
    for step in range(3):
        values = awkward_values(numel, seed=10 + step)
        v = values + residual
        packed = new_packed(numel, 1, bits, 64)
        reference.quantize(values, packed, bits=bits, block_size=64, residual=residual)
        sent = reference.dequantize_rows(packed, numel, bits=bits, block_size=64)[0]
        assert_bitwise(sent + residual, v, "sent + new residual")


def test_chunks_are_quantised_independently():
    # Rows of packed are separate chunks: blocks restart at every chunk boundary.
    values = awkward_values(3 * 100, seed=3)
    packed = new_packed(100, 3, 8, 64)
    reference.quantize(values, packed, bits=8, block_size=64)
    for row in range(3):
        alone = new_packed(100, 1, 8, 64)
        reference.quantize(values[row * 100:(row + 1) * 100].clone(), alone, bits=8, block_size=64)
        assert torch.equal(packed[row], alone[0])


def test_delta_applied_lands_within_half_a_step_of_the_target():
    numel = 4097
    target = awkward_values(numel, seed=4)
    held = target + torch.randn(numel) * 0.01
    packed = new_packed(numel, 1, 8, 128)
    reference.quantize_delta(target, held, packed, bits=8, block_size=128)
    _, scales = reference.read_packed(packed, numel, bits=8, block_size=128)
    reference.apply_delta(packed, held, bits=8, block_size=128)
    scale = scales[0].repeat_interleave(128)[:numel]
    slack = target.abs() * 2**-23  # the fp32 sum held + delta is rounded once more
    assert ((target - held).abs() <= scale * 0.5 * (1 + 2**-12) + slack).all()


# ---------------------------------------------------------------------------------------------
# Kernels against the reference (bitwise)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel,block_size", SIZE_CASES)
def test_quantize_matches_reference(kernels, numel, block_size, bits):
    device = kernels
    rows = 1 if numel > 5000 else 3
    values = awkward_values(rows * numel, seed=numel + block_size, device=device)
    residual = awkward_values(rows * numel, seed=7, device=device) * 1e-3
    expected_residual = residual.clone()
    packed = new_packed(numel, rows, bits, block_size, device)
    expected = new_packed(numel, rows, bits, block_size, device)
    ops.quantize(values, packed, bits=bits, block_size=block_size, residual=residual)
    reference.quantize(values, expected, bits=bits, block_size=block_size, residual=expected_residual)
    assert_bitwise(packed, expected, "packed")
    assert_bitwise(residual, expected_residual, "residual")
    ops.quantize(values, packed, bits=bits, block_size=block_size)  # without error feedback
    reference.quantize(values, expected, bits=bits, block_size=block_size)
    assert_bitwise(packed, expected, "packed without residual")


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("held_dtype", HELD_DTYPES, ids=str)
@pytest.mark.parametrize("numel,block_size", [(7, 32), (129, 64), (4097, 128), ((1 << 20) + 3, 256)])
def test_delta_kernels_match_reference(kernels, numel, block_size, held_dtype, bits):
    device = kernels
    rows = 3
    target = awkward_values(rows * numel, seed=numel, device=device)
    held = (target + awkward_values(rows * numel, seed=5, device=device) * 1e-2).to(held_dtype)
    packed = new_packed(numel, rows, bits, block_size, device)
    expected = new_packed(numel, rows, bits, block_size, device)
    ops.quantize_delta(target, held, packed, bits=bits, block_size=block_size)
    reference.quantize_delta(target, held, expected, bits=bits, block_size=block_size)
    assert_bitwise(packed, expected, "packed delta")

    out = torch.empty_like(held)
    expected_out = torch.empty_like(held)
    ops.apply_delta(packed, held, bits=bits, block_size=block_size, out=out)
    reference.apply_delta(packed, held, bits=bits, block_size=block_size, out=expected_out)
    assert_bitwise(out, expected_out, "apply_delta")
    ops.apply_delta(packed, held, bits=bits, block_size=block_size)  # in place
    assert_bitwise(held, expected_out, "apply_delta in place")


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel,block_size,rows", [(numel, block, rows) for numel, block in ((1, 32), (127, 64),
                                                                                          (4097, 128))
                                                    for rows in (1, 2, 5)] + [((1 << 20) + 3, 128, 3)])
def test_dequantize_sum_matches_reference(kernels, numel, block_size, rows, bits):
    device = kernels
    values = awkward_values(rows * numel, seed=rows, device=device)
    packed = new_packed(numel, rows, bits, block_size, device)
    ops.quantize(values, packed, bits=bits, block_size=block_size)
    base = awkward_values(numel, seed=99, device=device)
    for with_base in ("none", "separate", "in place"):
        out = base.clone() if with_base == "in place" else torch.full((numel, ), math.nan, device=device)
        expected = torch.empty(numel, device=device)
        base_arg = {"none": None, "separate": base, "in place": out}[with_base]
        reference.dequantize_sum(packed, expected, bits=bits, block_size=block_size,
                                 base=None if base_arg is None else base)
        ops.dequantize_sum(packed, out, bits=bits, block_size=block_size, base=base_arg)
        assert_bitwise(out, expected, f"dequantize_sum, base {with_base}")


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("bits", BITS)
def test_special_values_match_reference(kernels, bits):
    device = kernels
    values = special_values(device)
    numel = values.numel()
    residual = torch.full_like(values, 0.125)
    residual[5:9] = 1e-39
    expected_residual = residual.clone()
    packed = new_packed(numel, 1, bits, 32, device)
    expected = new_packed(numel, 1, bits, 32, device)
    ops.quantize(values, packed, bits=bits, block_size=32, residual=residual)
    reference.quantize(values, expected, bits=bits, block_size=32, residual=expected_residual)
    assert_bitwise(packed, expected, "packed")
    assert_bitwise(residual, expected_residual, "residual")
    assert torch.isfinite(residual).all()

    out = torch.empty(numel, device=device)
    expected_out = torch.empty(numel, device=device)
    ops.dequantize_sum(packed.expand(2, -1).contiguous(), out, bits=bits, block_size=32, base=values)
    reference.dequantize_sum(packed.expand(2, -1).contiguous(), expected_out, bits=bits, block_size=32, base=values)
    assert_bitwise(out, expected_out, "dequantize_sum")

    for held_dtype in HELD_DTYPES:
        held = special_values(device).flip(0).to(held_dtype)
        ops.quantize_delta(values, held, packed, bits=bits, block_size=32)
        reference.quantize_delta(values, held, expected, bits=bits, block_size=32)
        assert_bitwise(packed, expected, f"delta against {held_dtype}")
        out = torch.empty_like(held)
        expected_out = torch.empty_like(held)
        ops.apply_delta(packed, held, bits=bits, block_size=32, out=out)
        reference.apply_delta(packed, held, bits=bits, block_size=32, out=expected_out)
        assert_bitwise(out, expected_out, f"apply_delta to {held_dtype}")


@pytest.mark.parametrize("kernels", DEVICES, indirect=True)
@pytest.mark.parametrize("held_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_every_half_precision_bit_pattern(kernels, held_dtype):
    # Widening: quantize_delta reads every 16-bit pattern as a held value. Narrowing: apply_delta
    # rounds held + delta back, with deltas of one code times scales that sit on and beside fp16 /
    # bf16 rounding ties, overflow thresholds and subnormals.
    device = kernels
    held = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(held_dtype).to(device)
    target = torch.zeros(held.numel(), device=device)
    packed = new_packed(held.numel(), 1, 8, 32, device)
    expected = new_packed(held.numel(), 1, 8, 32, device)
    ops.quantize_delta(target, held, packed, bits=8, block_size=32)
    reference.quantize_delta(target, held, expected, bits=8, block_size=32)
    assert_bitwise(packed, expected, "delta from every pattern")

    gen = torch.Generator().manual_seed(0)
    num_blocks = held.numel() // 32
    scales = (torch.rand(num_blocks, generator=gen) * 2 - 1) * torch.exp2(torch.randint(-30, 20, (num_blocks, ),
                                                                                        generator=gen).float())
    scales[:8] = torch.tensor([65504.0, 65519.99, 65520.0, 2**-24, 2**-25, 3 * 2**-26, 1.0 + 2**-11, 1.0 + 3 * 2**-11])
    crafted = torch.zeros(1, ops.packed_bytes(held.numel(), bits=8, block_size=32), dtype=torch.uint8)
    reference.write_packed(crafted, torch.ones(1, held.numel()), scales.view(1, -1), bits=8)
    crafted = crafted.to(device)
    for base in (torch.zeros_like(held), held):
        out = torch.empty_like(held)
        expected_out = torch.empty_like(held)
        ops.apply_delta(crafted, base, bits=8, block_size=32, out=out)
        reference.apply_delta(crafted, base, bits=8, block_size=32, out=expected_out)
        assert_bitwise(out, expected_out, "apply_delta rounding")


@pytest.mark.parametrize("kernels", ["cpu"], indirect=True)
def test_cpu_results_do_not_depend_on_thread_count(kernels):
    numel = (1 << 20) + 3
    values = awkward_values(2 * numel, seed=11)
    results = []
    threads_before = torch.get_num_threads()
    try:
        for threads in (1, max(2, threads_before)):
            torch.set_num_threads(threads)
            residual = torch.full((2 * numel, ), 1e-3)
            packed = new_packed(numel, 2, 4, 128)
            ops.quantize(values, packed, bits=4, block_size=128, residual=residual)
            out = torch.empty(numel)
            ops.dequantize_sum(packed, out, bits=4, block_size=128)
            held = values.to(torch.bfloat16)
            ops.apply_delta(packed, held, bits=4, block_size=128)
            results.append((packed, residual, out, held))
    finally:
        torch.set_num_threads(threads_before)
    for one, many in zip(*results):
        assert_bitwise(many, one)


# ---------------------------------------------------------------------------------------------
# Argument checks
# ---------------------------------------------------------------------------------------------


def test_bad_arguments_raise_errors_naming_the_argument():
    values = torch.zeros(100)
    packed = torch.zeros(1, ops.packed_bytes(100, bits=8, block_size=64), dtype=torch.uint8)
    with pytest.raises(ValueError, match="bits must be 8"):
        ops.quantize(values, packed, bits=6, block_size=64)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        ops.quantize(values, packed, bits=8, block_size=100)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        ops.quantize(values, packed, bits=8, block_size=1024)
    with pytest.raises(ValueError, match=r"packed rows have \d+ bytes, expected packed_bytes"):
        ops.quantize(values, packed, bits=4, block_size=64)
    with pytest.raises(ValueError, match="packed must be a contiguous 2-D uint8"):
        ops.quantize(values, packed.view(-1), bits=8, block_size=64)
    with pytest.raises(ValueError, match="input has 100 values, which do not split into 3 equal chunks"):
        ops.quantize(values, torch.zeros(3, 48, dtype=torch.uint8), bits=8, block_size=64)
    with pytest.raises(ValueError, match="input must have dtype"):
        ops.quantize(values.double(), packed, bits=8, block_size=64)
    with pytest.raises(ValueError, match="residual has 99 elements"):
        ops.quantize(values, packed, bits=8, block_size=64, residual=torch.zeros(99))
    with pytest.raises(ValueError, match="residual overlaps input"):
        ops.quantize(values, packed, bits=8, block_size=64, residual=values)
    with pytest.raises(ValueError, match="held must have dtype"):
        ops.quantize_delta(values, torch.zeros(100, dtype=torch.int32), packed, bits=8, block_size=64)
    with pytest.raises(ValueError, match="held has 50 elements"):
        ops.quantize_delta(values, torch.zeros(50), packed, bits=8, block_size=64)
    with pytest.raises(ValueError, match="out must have dtype"):
        ops.apply_delta(packed, values, bits=8, block_size=64, out=torch.zeros(100, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="out overlaps held"):
        backing = torch.zeros(101)
        ops.apply_delta(packed, backing[:100], bits=8, block_size=64, out=backing[1:])
    with pytest.raises(ValueError, match="needs a base or at least one packed row"):
        ops.dequantize_sum(packed[:0], values, bits=8, block_size=64)
    with pytest.raises(ValueError, match="base overlaps out"):
        backing = torch.zeros(101)
        ops.dequantize_sum(packed, backing[:100], bits=8, block_size=64, base=backing[1:])
    with pytest.raises(TypeError, match="input must be a torch.Tensor"):
        ops.quantize([0.0], packed, bits=8, block_size=64)


# ---------------------------------------------------------------------------------------------
# Build checks
# ---------------------------------------------------------------------------------------------


def test_quantisation_sources_are_in_the_builders():
    from deepspeed_acco.op_builder import AccoCPUOpsBuilder, AccoCUDAOpsBuilder

    assert str(CSRC / "cpu" / "acco_cpu_quant.cpp") in AccoCPUOpsBuilder().sources()
    assert str(CSRC / "cuda" / "acco_cuda_quant.cu") in AccoCUDAOpsBuilder().sources()


def test_cpu_quantisation_loops_are_vectorised(tmp_path):
    from deepspeed_acco.op_builder import AccoCPUOpsBuilder

    builder = AccoCPUOpsBuilder()
    compiler = builder._cxx_compiler()
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler})")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    if "Free Software Foundation" not in version:
        pytest.skip("the vectorisation report is read in GCC's -fopt-info format")
    source = CSRC / "cpu" / "acco_cpu_quant.cpp"
    simd_loops = _simd_loop_line_ranges(source.read_text().splitlines())
    assert len(simd_loops) == 6  # quantise (4), walking int8 and int4 codes (2)
    cmd = [compiler, *builder.strip_empty_entries(builder.cxx_args()), "-I", str(CSRC / "includes"),
           "-fopt-info-vec-optimized", "-c", str(source), "-o", str(tmp_path / "quant.o")]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    vectorised = [int(m.group(1)) for m in re.finditer(r"acco_cpu_quant\.cpp:(\d+):\d+: optimized: loop vectorized",
                                                       result.stderr)]
    for first, last in simd_loops:
        assert any(first <= line <= last for line in vectorised), \
            f"loop at lines {first}-{last} not vectorised:\n{result.stderr}"


def _simd_loop_line_ranges(lines):
    """1-based (first, last) line of every loop under a `#pragma omp simd` (with or without clauses)."""
    ranges = []
    for index, line in enumerate(lines):
        if not line.strip().startswith("#pragma omp simd"):
            continue
        first = index + 1  # the `for` line, 0-based
        if "{" not in lines[first]:
            ranges.append((first + 1, first + 1))  # a one-statement loop
            continue
        depth = 0
        for end in range(first, len(lines)):
            depth += lines[end].count("{") - lines[end].count("}")
            if depth == 0:
                break
        ranges.append((first + 1, end + 1))
    return ranges
