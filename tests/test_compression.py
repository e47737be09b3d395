"""Compressed collectives (docs/wire.md, "Compressed communication"): quantised reduce-scatter with error feedback and the
parameter-delta all-gather, on real gloo processes (W = 2 and 3; 3 catches shard-size assumptions).

One distributed run per world size computes everything (process start-up dominates the cost); the
ranks return raw results and the checks below recompute the expectations independently, from the
seeds, in float64. Bytes on the wire are measured from /proc/self/io (what gloo writes to its
sockets), not taken from our own accounting.
"""
import io
import math
import types

import pytest
import torch

from deepspeed_acco.runtime.compression import (DeltaAllGather, QuantizationFormat, QuantizedReduceScatter,
                                                job_wire_bytes)

from distributed_utils import run_distributed

BLOCK = 64
ONE_STEP_CHUNK = 4099  # odd: int4 rows end in half a byte
TRACK_CHUNK, TRACK_STEPS = 1000, 30
QUAD_CHUNK, QUAD_STEPS, QUAD_AVERAGED = 515, 160, 60
DELTA_CHUNK, DELTA_STEPS = 515, 12
WIRE_CHUNK = 1 << 17
HELD_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
MAX_CODE = {8: 127, 4: 7}


def awkward(numel, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * torch.exp(torch.randn(numel, generator=gen) * 2.0)


def tracking_input(numel, rank, step, bits):
    """A +-1 spike at the start of every block and, elsewhere, a bias too small to survive rounding
    on its own (0.3 to 0.45 of a step): without error feedback it is never sent."""
    gen = torch.Generator().manual_seed(10_000 + 100 * rank + step)
    values = (0.3 + 0.15 * torch.rand(numel, generator=gen)) / MAX_CODE[bits]
    values[::BLOCK] = torch.where(torch.rand(values[::BLOCK].shape, generator=gen) < 0.5, -1.0, 1.0)
    return values


def quadratic_problem(numel, world_size):
    """Curvatures a (shared) and per-rank optima c_r of f = sum_r 1/2 sum_i a_i (theta_i - c_r,i)^2."""
    gen = torch.Generator().manual_seed(77)
    curvature = 0.2 + 0.8 * torch.rand(numel, generator=gen)
    optima = [torch.randn(numel, generator=torch.Generator().manual_seed(500 + r)) * 3.0 for r in range(world_size)]
    return curvature, optima


def _wchar():
    with open("/proc/self/io") as handle:
        return int(next(line for line in handle if line.startswith("wchar:")).split(":")[1])


# ---------------------------------------------------------------------------------------------
# What every rank runs
# ---------------------------------------------------------------------------------------------


def _worker(rank, world_size):
    import torch.distributed as dist

    from deepspeed_acco.runtime.comm import new_communicator

    dist.init_process_group("gloo")
    communicator = new_communicator(list(range(world_size)), timeout_s=60, name="compression-test", backend="gloo")
    results = {"wire": _wire(communicator)}
    for bits in (8, 4):
        fmt = QuantizationFormat(bits=bits, block_size=BLOCK)
        results[bits] = {
            "one_step": _one_step(communicator, fmt),
            "tracking": _tracking(communicator, fmt),
            "quadratic": _quadratic(communicator, fmt),
            "deltas": {str(dtype): _deltas(communicator, fmt, dtype) for dtype in HELD_DTYPES},
            "resume": _resume(communicator, fmt),
        }
    return results


def _one_step(communicator, fmt):
    numel = ONE_STEP_CHUNK * communicator.world_size
    collective = QuantizedReduceScatter(communicator, numel, fmt=fmt, device="cpu")
    output = torch.empty(ONE_STEP_CHUNK)
    collective.reduce_scatter(output, awkward(numel, seed=100 + communicator.rank))
    return output


def _tracking(communicator, fmt):
    numel = TRACK_CHUNK * communicator.world_size
    with_feedback = QuantizedReduceScatter(communicator, numel, fmt=fmt, device="cpu")
    without = QuantizedReduceScatter(communicator, numel, fmt=fmt, device="cpu", error_feedback=False)
    sums = {"feedback": torch.zeros(TRACK_CHUNK, dtype=torch.float64),
            "none": torch.zeros(TRACK_CHUNK, dtype=torch.float64)}
    output = torch.empty(TRACK_CHUNK)
    for step in range(TRACK_STEPS):
        values = tracking_input(numel, communicator.rank, step, fmt.bits)
        for name, collective in (("feedback", with_feedback), ("none", without)):
            collective.reduce_scatter(output, values)
            sums[name] += output.double()
    return {"sums": sums, "residual": with_feedback.residual.clone()}


def _quadratic(communicator, fmt):
    # ZeRO-1 SGD on a quadratic whose ranks disagree (different optima c_r): gradients are taken at
    # the held copy, reduced with the quantised reduce-scatter, the owner updates its fp32 master
    # shard, and the delta all-gather brings every replica's held copy along.
    rank, world_size = communicator.rank, communicator.world_size
    numel = QUAD_CHUNK * world_size
    curvature, optima = quadratic_problem(numel, world_size)
    own = slice(rank * QUAD_CHUNK, (rank + 1) * QUAD_CHUNK)
    result = {}
    for name, error_feedback in (("feedback", True), ("none", False)):
        reduce = QuantizedReduceScatter(communicator, numel, fmt=fmt, device="cpu", error_feedback=error_feedback)
        gather = DeltaAllGather(communicator, numel, fmt=fmt, device="cpu")
        held = torch.zeros(numel)
        master = held[own].clone()
        gathered = torch.empty(numel)
        reduced = torch.empty(QUAD_CHUNK)
        averaged = torch.zeros(QUAD_CHUNK, dtype=torch.float64)
        for step in range(QUAD_STEPS):
            reduce.reduce_scatter(reduced, curvature * (held - optima[rank]))
            master -= reduced / world_size  # learning rate 1: the mean gradient's Newton-like step for a <= 1
            gather.all_gather(gathered, master, held)
            held, gathered = gathered, held
            if step >= QUAD_STEPS - QUAD_AVERAGED:
                averaged += master.double() / QUAD_AVERAGED
        result[name] = {"master": master.clone(), "averaged": averaged, "held": held.clone()}
    return result


def _deltas(communicator, fmt, held_dtype):
    # A sequence of updates of each owner's fp32 master shard of varying size, all-gathered as
    # quantised deltas; the held copies must stay bitwise equal on every rank and within half a
    # step (plus the held dtype's rounding) of the masters.
    rank, world_size = communicator.rank, communicator.world_size
    numel = DELTA_CHUNK * world_size
    own = slice(rank * DELTA_CHUNK, (rank + 1) * DELTA_CHUNK)
    gather = DeltaAllGather(communicator, numel, fmt=fmt, device="cpu")
    held = awkward(numel, seed=3).to(held_dtype)  # the same start on every rank
    master = held[own].to(torch.float32, copy=True)
    out = torch.empty_like(held)
    helds, worst = [], 0.0
    for step in range(DELTA_STEPS):
        gen = torch.Generator().manual_seed(1000 * rank + step)
        master += torch.randn(DELTA_CHUNK, generator=gen) * math.exp(torch.randn(1, generator=gen).item() * 2)
        gather.all_gather(out, master, held)
        held, out = out, held
        helds.append(held.clone())
        scales = gather.last_sent[0, :4 * math.ceil(DELTA_CHUNK / BLOCK)].view(torch.float32)
        scale = scales.repeat_interleave(BLOCK)[:DELTA_CHUNK]
        mine = held[own].float()
        half_ulp = (mine.abs() * torch.finfo(held_dtype).eps).clamp_min(torch.finfo(held_dtype).tiny)
        allowed = scale * 0.5 * (1 + 2**-12) + half_ulp + master.abs() * 2**-23
        worst = max(worst, ((master - mine).abs() / allowed).max().item())
    return {"helds": helds, "worst_ratio": worst}


def _resume(communicator, fmt):
    numel = 300 * communicator.world_size
    inputs = [awkward(numel, seed=7000 + 10 * communicator.rank + step) for step in range(6)]
    output = torch.empty(300)
    original = QuantizedReduceScatter(communicator, numel, fmt=fmt, device="cpu")
    for values in inputs[:3]:
        original.reduce_scatter(output, values)
    buffer = io.BytesIO()
    torch.save(original.state_dict(), buffer)  # as a checkpoint would
    continued = []
    for values in inputs[3:]:
        original.reduce_scatter(output, values)
        continued.append(output.clone())
    buffer.seek(0)
    resumed = QuantizedReduceScatter(communicator, numel, fmt=fmt, device="cpu")
    resumed.load_state_dict(torch.load(buffer))
    replayed = []
    for values in inputs[3:]:
        resumed.reduce_scatter(output, values)
        replayed.append(output.clone())
    return {"continued": continued, "replayed": replayed}


def _wire(communicator):
    import torch.distributed as dist

    world_size, rank = communicator.world_size, communicator.rank
    numel = WIRE_CHUNK * world_size
    values = awkward(numel, seed=rank)
    chunk = torch.empty(WIRE_CHUNK)
    held = awkward(numel, seed=1)
    gathered = torch.empty(numel)

    def measure(fn):
        fn()  # warm-up (buffers, connections)
        dist.barrier()
        before = _wchar()
        fn()
        sent = _wchar() - before
        dist.barrier()
        return sent

    measured = {
        "fp32 reduce_scatter": measure(lambda: communicator.reduce_scatter(chunk, values)),
        "fp32 all_gather": measure(lambda: communicator.all_gather(gathered, held[rank * WIRE_CHUNK:][:WIRE_CHUNK])),
    }
    expected = {}
    for bits in (8, 4):
        fmt = QuantizationFormat(bits=bits, block_size=128)
        reduce = QuantizedReduceScatter(communicator, numel, fmt=fmt, device="cpu")
        gather = DeltaAllGather(communicator, numel, fmt=fmt, device="cpu")
        new_shard = held[rank * WIRE_CHUNK:][:WIRE_CHUNK] + 1e-3
        measured[f"int{bits} reduce_scatter"] = measure(lambda: reduce.reduce_scatter(chunk, values))
        measured[f"int{bits} all_gather"] = measure(lambda: gather.all_gather(gathered, new_shard, held))
        expected[f"int{bits} reduce_scatter"] = reduce.wire_bytes
        expected[f"int{bits} all_gather"] = gather.wire_bytes
    return {"measured": measured, "expected": expected}


# ---------------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["W2", "W3"])
def run(request):
    world_size = request.param
    return world_size, run_distributed(_worker, world_size, timeout_s=300)


def _peer_residual(residual, owner_rank, sender_rank, chunk):
    """The part of ``sender_rank``'s (compact) residual that belongs to ``owner_rank``'s chunk."""
    row = owner_rank if owner_rank < sender_rank else owner_rank - 1
    return residual[row * chunk:(row + 1) * chunk].double()


def _block_absmax(values, block):
    padded = torch.nn.functional.pad(values.abs(), (0, -values.numel() % block))
    return padded.view(-1, block).amax(dim=1).repeat_interleave(block)[:values.numel()]


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_one_step_is_within_half_a_step_per_peer_of_the_exact_sum(run, bits):
    world_size, results = run
    chunk = ONE_STEP_CHUNK
    inputs = [awkward(chunk * world_size, seed=100 + r) for r in range(world_size)]
    for owner in range(world_size):
        part = slice(owner * chunk, (owner + 1) * chunk)
        exact = sum(inputs[r][part].double() for r in range(world_size))
        output = results[owner][bits]["one_step"].double()
        # Each peer's value is off by at most half its block's step; the owner's own is exact; the
        # fp32 additions round once each.
        allowed = sum(_block_absmax(inputs[r][part], BLOCK).double() / MAX_CODE[bits] * 0.5 * (1 + 2**-12)
                      for r in range(world_size) if r != owner)
        allowed += world_size * 2**-23 * sum(inputs[r][part].double().abs() for r in range(world_size))
        error = (output - exact).abs()
        assert (error <= allowed).all(), f"owner {owner}: worst error/allowed {(error / allowed).max().item():.3f}"
        # Not exact either: the peers' chunks really were quantised.
        assert error.max().item() > 0


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_error_feedback_tracks_the_accumulated_exact_sum(run, bits):
    world_size, results = run
    chunk = TRACK_CHUNK
    exact = torch.zeros(chunk * world_size, dtype=torch.float64)
    for step in range(TRACK_STEPS):
        for r in range(world_size):
            exact += tracking_input(chunk * world_size, r, step, bits).double()
    step_size = (1.45 / MAX_CODE[bits] + 1.0) / MAX_CODE[bits]  # the largest block absmax / max_code
    for owner in range(world_size):
        part = slice(owner * chunk, (owner + 1) * chunk)
        tracking = results[owner][bits]["tracking"]
        pending = sum(_peer_residual(results[r][bits]["tracking"]["residual"], owner, r, chunk)
                      for r in range(world_size) if r != owner)
        # Bookkeeping: what arrived plus what the peers still hold is the exact sum (up to the
        # owner's fp32 additions, TRACK_STEPS * world_size roundings of values below 1.5).
        bookkeeping = (tracking["sums"]["feedback"] + pending - exact[part]).abs().max().item()
        assert bookkeeping <= TRACK_STEPS * world_size * 2**-23 * 1.5
        # So the accumulated output never drifts further than half a step per peer from the exact
        # accumulated sum, however many steps ...
        drift = (tracking["sums"]["feedback"] - exact[part]).abs().max().item()
        assert drift <= (world_size - 1) * step_size * 0.5 * (1 + 2**-12) + bookkeeping
        # ... while without error feedback the small values are dropped at every step.
        dropped = (tracking["sums"]["none"] - exact[part]).abs().max().item()
        assert dropped >= TRACK_STEPS * (world_size - 1) * 0.3 / MAX_CODE[bits] * 0.9
        assert dropped > 10 * drift


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_sgd_on_a_quadratic_converges_to_the_exact_optimum_with_error_feedback(run, bits):
    world_size, results = run
    chunk = QUAD_CHUNK
    _, optima = quadratic_problem(chunk * world_size, world_size)
    optimum = sum(c.double() for c in optima) / world_size  # where the mean gradient vanishes
    for owner in range(world_size):
        part = slice(owner * chunk, (owner + 1) * chunk)
        quadratic = results[owner][bits]["quadratic"]
        # Per-rank gradients a (theta - c_r) do not vanish at the optimum, so every step keeps
        # quantising values of size |c_r - c| ~ 3: the iterates jitter by about a step, but with
        # error feedback nothing is lost, and their average sits on the exact optimum.
        step_size = 2 * 3.0 * 4 / MAX_CODE[bits]  # a generous bound on a block's step (|a (c_q - c_r)| <~ 24)
        feedback_error = (quadratic["feedback"]["averaged"] - optimum[part]).abs().max().item()
        assert feedback_error < 0.02 * step_size, feedback_error
        # Without error feedback the small components of the per-rank gradients are rounded away
        # the same way at every step, and SGD settles somewhere else.
        biased_error = (quadratic["none"]["averaged"] - optimum[part]).abs().max().item()
        assert biased_error > 10 * feedback_error, (biased_error, feedback_error)
    for name in ("feedback", "none"):
        first = results[0][bits]["quadratic"][name]["held"]
        for r in range(1, world_size):
            assert torch.equal(results[r][bits]["quadratic"][name]["held"].view(torch.int32), first.view(torch.int32))


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("held_dtype", HELD_DTYPES, ids=str)
def test_delta_all_gather_keeps_replicas_identical_and_near_the_masters(run, bits, held_dtype):
    world_size, results = run
    deltas = [results[r][bits]["deltas"][str(held_dtype)] for r in range(world_size)]
    int_view = torch.int32 if held_dtype == torch.float32 else torch.int16
    for step in range(DELTA_STEPS):
        first = deltas[0]["helds"][step].view(int_view)
        for r in range(1, world_size):
            assert torch.equal(deltas[r]["helds"][step].view(int_view), first), f"step {step}: rank {r} differs"
        if step:
            assert not torch.equal(deltas[0]["helds"][step - 1].view(int_view), first), "the held copy did not move"
    for r in range(world_size):
        assert deltas[r]["worst_ratio"] <= 1.0, deltas[r]["worst_ratio"]


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_resume_from_the_residual_state_is_bitwise(run, bits):
    world_size, results = run
    for r in range(world_size):
        resume = results[r][bits]["resume"]
        for continued, replayed in zip(resume["continued"], resume["replayed"]):
            assert torch.equal(continued.view(torch.int32), replayed.view(torch.int32))


@pytest.mark.slow
def test_bytes_on_the_wire(run):
    world_size, results = run
    for r in range(world_size):
        measured, expected = results[r]["wire"]["measured"], results[r]["wire"]["expected"]
        for name, payload in expected.items():
            # gloo adds a small header per message on top of our packed chunks.
            assert payload <= measured[name] <= payload * 1.01 + 4096, (name, measured[name], payload)
        fp32_job = measured["fp32 reduce_scatter"] + measured["fp32 all_gather"]
        assert fp32_job >= 2 * (world_size - 1) * WIRE_CHUNK * 4
        for bits, target in ((8, 3.5), (4, 6.5)):
            job = measured[f"int{bits} reduce_scatter"] + measured[f"int{bits} all_gather"]
            assert fp32_job / job >= target, (bits, fp32_job / job)
            assert measured["fp32 reduce_scatter"] / measured[f"int{bits} reduce_scatter"] >= target
            assert measured["fp32 all_gather"] / measured[f"int{bits} all_gather"] >= target


# ---------------------------------------------------------------------------------------------
# One process: the degenerate group, the arithmetic of the bytes, argument checks
# ---------------------------------------------------------------------------------------------


def _solo(world_size=1, rank=0):
    return types.SimpleNamespace(rank=rank, world_size=world_size, name="solo", group=None)


def test_one_rank_sends_nothing_and_is_exact():
    fmt = QuantizationFormat(bits=4, block_size=32)
    values = awkward(100, seed=1)
    reduce = QuantizedReduceScatter(_solo(), 100, fmt=fmt, device="cpu")
    output = torch.empty(100)
    reduce.reduce_scatter(output, values)
    assert torch.equal(output, values) and reduce.wire_bytes == 0
    gather = DeltaAllGather(_solo(), 100, fmt=fmt, device="cpu")
    held = torch.zeros(100, dtype=torch.bfloat16)
    gather.all_gather(held, values, held)
    assert torch.equal(held, values.to(torch.bfloat16)) and gather.wire_bytes == 0


def test_job_wire_bytes_and_compression_ratio():
    numel = 8 * (1 << 20)
    for world_size in (2, 3, 8):
        numel_w = numel - numel % world_size
        fp32 = job_wire_bytes(numel_w, world_size, None)
        int8 = job_wire_bytes(numel_w, world_size, QuantizationFormat(bits=8, block_size=128))
        int4 = job_wire_bytes(numel_w, world_size, QuantizationFormat(bits=4, block_size=128))
        assert fp32["reduce_scatter"] == (world_size - 1) * numel_w // world_size * 4
        ratio8 = sum(fp32.values()) / sum(int8.values())
        ratio4 = sum(fp32.values()) / sum(int4.values())
        assert 3.87 < ratio8 < 3.88 and 7.52 < ratio4 < 7.53  # 4 / (1 + 4/128), 4 / (0.5 + 4/128)


def test_bad_arguments_are_named():
    fmt = QuantizationFormat()
    with pytest.raises(ValueError, match="bits must be 8"):
        QuantizationFormat(bits=2)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        QuantizationFormat(block_size=96)
    with pytest.raises(ValueError, match="numel must be a positive multiple of the world size 2"):
        QuantizedReduceScatter(_solo(2), 101, fmt=fmt, device="cpu")
    with pytest.raises(ValueError, match="not a member"):
        DeltaAllGather(_solo(2, rank=-1), 100, fmt=fmt, device="cpu")
    reduce = QuantizedReduceScatter(_solo(2), 100, fmt=fmt, device="cpu")
    with pytest.raises(ValueError, match="output must be a 1-D contiguous tensor of 50 values"):
        reduce.reduce_scatter(torch.empty(100), torch.empty(100))
    with pytest.raises(ValueError, match="input must have dtype"):
        reduce.reduce_scatter(torch.empty(50), torch.empty(100, dtype=torch.bfloat16))
    state = reduce.state_dict()
    with pytest.raises(ValueError, match="same world size"):
        QuantizedReduceScatter(_solo(2, rank=1), 100, fmt=fmt, device="cpu").load_state_dict(state)
    with pytest.raises(ValueError, match="disagree on error feedback"):
        QuantizedReduceScatter(_solo(2), 100, fmt=fmt, device="cpu", error_feedback=False).load_state_dict(state)
    gather = DeltaAllGather(_solo(2), 100, fmt=fmt, device="cpu")
    with pytest.raises(ValueError, match="output must have dtype"):
        gather.all_gather(torch.empty(100), torch.empty(50), torch.empty(100, dtype=torch.float16))
    with pytest.raises(ValueError, match="new_shard must be a 1-D contiguous tensor of 50 values"):
        gather.all_gather(torch.empty(100), torch.empty(100), torch.empty(100))
