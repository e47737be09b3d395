"""The wire chosen from the link (docs/wire.md, "The wire"): the rule on a fake clock (each wire the choice
in turn, the memory rule), the config keys that select or fix it (layer 1), and on real gloo processes
(layer 3) ranks with different measurements agreeing, the buffers allocated only at the choice, replicas
staying identical on the chosen wire, a resumed run keeping the choice, and a run that cannot afford the
compressed buffers staying on its dtype.
"""
import os

import pytest
import torch

from deepspeed_acco.runtime import wire as wires
from deepspeed_acco.runtime.config import parse_config
from deepspeed_acco.runtime.regime import predict, round_bytes
from distributed_utils import run_distributed
from reference_sim import TinyNet, batch, loss_fn, param_groups


def _own(type_name, t_compute, t_comm, *, measured_bytes=4.0, quantization=None, **co2):
    predicted = predict(t_compute, t_comm, measured_bytes=measured_bytes, model_dtype="bf16",
                        quantization_s=quantization or {}, **co2)
    candidates = ("fp32", "int8", "int4") if type_name == "CO2" else ("bf16", "int8", "int4")
    return {w: predicted[f"{type_name} ({w})"] for w in candidates}, candidates


@pytest.mark.parametrize("t_comm, expected", [(0.15, "bf16"), (0.30, "int8"), (1.00, "int4")])
def test_acco_takes_each_wire_in_turn_as_the_link_slows(t_comm, expected):
    # 400 ms of compute per update; one bf16 job (2 + 2 bytes per value) takes t_comm.
    own, candidates = _own("ACCO", 0.4, t_comm, quantization={"int8": 0.005, "int4": 0.006})
    wire, reason, refused = wires.choose(own, candidates)
    assert wire == expected and not refused
    if expected == "bf16":
        assert reason == "its jobs hide behind the compute"
    else:
        assert reason.startswith("bf16's jobs do not hide behind the compute") and f"{expected} is the least" in reason


def test_dpu_and_co2_decide_by_their_own_bounds():
    own, candidates = _own("DPU", 0.4, 0.35)  # one job per update hides where ACCO's two do not
    assert wires.choose(own, candidates)[0] == "bf16"
    own, candidates = _own("DPU", 0.4, 0.5)
    assert wires.choose(own, candidates)[0] == "int8"
    # CO2 measured on its fp32 averaging (8 bytes per value), once every 4 inner steps, 1 step to hide in.
    own, candidates = _own("CO2", 0.4, 0.41, measured_bytes=8.0)  # 0.4 + 0.01 / 4: within 5% of hidden
    assert wires.choose(own, candidates)[0] == "fp32"
    own, candidates = _own("CO2", 0.4, 1.5, measured_bytes=8.0)
    assert wires.choose(own, candidates)[0] == "int8"
    own, candidates = _own("CO2", 0.4, 6.0, measured_bytes=8.0)
    assert wires.choose(own, candidates)[0] == "int4"


def test_only_a_clear_call_is_made_before_the_window_ends():
    candidates = ("bf16", "int8", "int4")
    assert wires.clear_early({"bf16": 2.0, "int8": 1.0, "int4": 0.9}, candidates)  # 2.2x: decide now
    assert not wires.clear_early({"bf16": 1.1, "int8": 1.0, "int4": 1.0}, candidates)  # a close call waits
    assert not wires.clear_early({"bf16": 1.0, "int8": 1.0, "int4": 1.0}, candidates)  # keeping it costs nothing
    # Only wires that fit count: with int4 out of memory, bf16 is 1.1x the fastest usable one.
    assert not wires.clear_early({"bf16": 1.1, "int8": 1.0, "int4": 0.5}, candidates, fits={"int4": False})
    assert not wires.clear_early({"bf16": 9.0, "int8": 1.0, "int4": 1.0}, candidates,
                                fits={"int8": False, "int4": False})


def test_the_probe_is_a_sixteenth_of_the_job_within_its_limits():
    # A 13.2 MB job per rank (CO2's fp32 averaging of 3.3M values on 2 ranks): 1/16 of it, sent as the
    # (W - 1) / W of a reduce-scatter and an all-gather of fp32 values.
    values = wires.probe_values(13.2e6, 2)
    assert values % 2 == 0 and values * 8 * 0.5 == pytest.approx(13.2e6 / 16, abs=8)
    assert wires.probe_values(1e3, 4) * 8 * 0.75 == pytest.approx(wires.PROBE_MIN_BYTES, abs=32)
    assert wires.probe_values(1e12, 8) * 8 * 7 / 8 == pytest.approx(wires.PROBE_MAX_BYTES, abs=64)


def test_a_wire_that_does_not_fit_in_memory_is_not_taken():
    own, candidates = _own("ACCO", 0.4, 1.0)
    wire, reason, refused = wires.choose(own, candidates, fits={"int8": False, "int4": False})
    assert wire == "bf16" and refused == ["int8", "int4"] and "do not fit in memory" in reason
    wire, _, refused = wires.choose(own, candidates, fits={"int8": True, "int4": False})
    assert wire == "int8" and refused == ["int4"]
    assert wires.fits_in_memory(100, 1000) and not wires.fits_in_memory(950, 1000)
    assert wires.fits_in_memory(10**12, None)  # unknown free memory: no refusal


def test_the_choice_and_its_figures_round_trip_as_plain_data():
    choice = wires.WireChoice(wire="int8", reason="r", decided_at_update=5, measured_wire="bf16", t_compute_s=0.4,
                              t_comm_s=0.3, predicted_s={"bf16": 0.6, "int8": 0.4}, quantization_s={"int8": 0.01},
                              extra_bytes={"int8": 2**20}, type_name="ACCO", num_parameters=2**18)
    values = choice.as_dict()
    assert all(isinstance(v, (str, int, float, dict, list)) for v in values.values())
    assert wires.WireChoice.from_dict(values) == choice
    assert "the wire is int8 for the rest of the run (decided at update 5" in values["message"]
    assert "1.0 MiB more per rank (4.00 bytes per parameter)" in values["message"]


def test_quantization_kernels_are_timed_per_job():
    assert wires.quantization_job_s(8, 128, [1 << 16], 2, torch.device("cpu"), sample=1 << 14) > 0.0
    # Per group of P values on W ranks: 2 (W - 1) P / W quantised and summed, P / W deltas, P applied.
    assert wires.quantized_values_per_job([1 << 16], 2) == 2 * (1 << 15) + (1 << 15) + (1 << 16)
    assert wires.quantized_values_per_job([800, 800], 8) == 2 * (2 * 7 * 100 + 100 + 800)


def _config(kind, **top):
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "bf16": {"enabled": True},
            "optimizer": {"type": kind, "params": {"lr": 1e-3}}, **top}


def test_config_selects_or_fixes_the_wire():
    assert parse_config(_config("ACCO"), 2).wire == "auto"
    assert parse_config(_config("DPU"), 2).wire == "auto"
    assert parse_config(_config("CO2"), 2).wire == "auto"
    assert parse_config(_config("ShardedAdamW"), 2).wire == "bf16"  # never compresses on its own
    assert parse_config(_config("ACCO", communication_data_type="auto"), 2).wire == "auto"
    fixed = parse_config(_config("ACCO", communication_data_type="fp32"), 2)
    assert fixed.wire == "fp32" and fixed.communication_dtype == "fp32" and not fixed.compression.enabled
    int4 = parse_config(_config("ACCO", communication_data_type="int4"), 2)
    assert int4.wire == "int4" and int4.compression.gradients and int4.compression.weights
    assert int4.compression.format.bits == 4 and int4.communication_dtype == "fp32"
    zero_pp = parse_config(_config("ACCO", zero_optimization={"zero_quantized_gradients": True,
                                                              "zero_quantized_weights": True}), 2)
    assert zero_pp.wire == "int8"
    one_sided = parse_config(_config("ACCO", zero_optimization={"zero_quantized_weights": True}), 2)
    assert one_sided.wire == "custom"
    block = _config("ACCO")
    block["optimizer"]["params"]["quantization_block_size"] = 64  # applies if "auto" compresses
    assert parse_config(block, 2).params.quantization_block_size == 64


@pytest.mark.parametrize("top, params, key, words", [
    ({"communication_data_type": "auto"}, {}, "communication_data_type", "ShardedAdamW, the synchronous baseline"),
    ({"communication_data_type": "int2"}, {}, "communication_data_type", "\"int8\" or \"int4\""),
])
def test_sharded_adamw_and_unknown_wires_are_refused(top, params, key, words):
    with pytest.raises(ValueError, match=key) as error:
        parse_config(_config("ShardedAdamW", **top), 2)
    assert words in str(error.value)


def test_contradictory_wire_keys_are_refused_naming_the_fix():
    both = _config("ACCO", communication_data_type="auto",
                   zero_optimization={"zero_quantized_gradients": True, "zero_quantized_weights": True})
    with pytest.raises(ValueError, match="remove one of the two"):
        parse_config(both, 2)
    bits = _config("ACCO")
    bits["optimizer"]["params"]["quantization_bits"] = 4
    with pytest.raises(ValueError, match="communication_data_type\": \"int8\" or \"int4\""):
        parse_config(bits, 2)
    clash = _config("ACCO", communication_data_type="int4")
    clash["optimizer"]["params"]["quantization_bits"] = 8
    with pytest.raises(ValueError, match="contradicts communication_data_type"):
        parse_config(clash, 2)


def test_the_environment_fixes_the_automatic_wire(monkeypatch):
    monkeypatch.setenv(wires.ENVIRONMENT, "int4")
    assert wires.environment_wire() == "int4"
    monkeypatch.setenv(wires.ENVIRONMENT, "")
    assert wires.environment_wire() is None
    monkeypatch.setenv(wires.ENVIRONMENT, "zip")
    with pytest.raises(ValueError, match="DEEPSPEED_ACCO_WIRE"):
        wires.environment_wire()


def test_extra_bytes_of_a_compressed_wire_follow_the_memory_formula():
    # ACCO in bf16 at W = 2, one group of 1024 values: the bf16 snapshot (shared with the gather) becomes fp32,
    # so +2 bytes x P for it, +2 x S for the reduced shard, + 2 x P for a gather of its own, plus the
    # compressed collectives' buffers (runtime/memory.py).
    from deepspeed_acco.runtime.memory import _compression_bytes
    extra = wires.compression_extra_bytes([1024], 2, 8, 128, model_bytes=2, communication_bytes=2, gather_shared=True)
    compressed = _compression_bytes(1024, 2, {"gradients": True, "weights": True, "bits": 8, "block_size": 128})
    assert extra == compressed + 2 * 1024 + 2 * 512 + 2 * 1024
    assert wires.compression_extra_bytes([1024], 2, 8, 128, model_bytes=0, communication_bytes=4, gather_shared=False,
                                         snapshot=False) == compressed
    assert round_bytes("ACCO", "int8", model_dtype="bf16") == pytest.approx(2 * (1 + 4 / 128))


# ---- layer 3: real gloo ranks ----------------------------------------------------------------------
MICRO_BATCH = 4


def _engine(kind, **params):
    import deepspeed_acco
    params = dict(lr=1e-2, weight_decay=0.1, **params)
    if kind in ("DPU", "ACCO"):
        params.setdefault("warmup_sync_updates", 3)
    if kind == "CO2":
        params.setdefault("local_steps", 2)
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
              "gradient_clipping": 1.0, "steps_per_print": 10_000, "optimizer": {"type": kind, "params": params}}
    torch.manual_seed(0)
    model = TinyNet()
    engine, *_ = deepspeed_acco.initialize(model=model, model_parameters=param_groups(model), config=config)
    return engine


def _train(engine, updates, rank, world_size, start=0):
    for index in range(start, start + updates * 2):
        x, y = batch(rank, index, MICRO_BATCH)
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()


def _flat(engine):
    return torch.cat([p.detach().float().flatten() for p in engine.module.parameters()])


_ORIGINAL = {}


def _with_figures(figures):
    """Every rank's measurement window replaced by (updates, T_compute, T_comm) of ``figures[rank]``, and
    so are the compute so far and the probe's job time (CO2 before its first averaging)."""
    import torch.distributed as dist
    from deepspeed_acco.runtime import regime, schedule

    original = _ORIGINAL.setdefault("window", regime.RegimeMonitor.window)
    compute = _ORIGINAL.setdefault("compute_so_far", regime.RegimeMonitor.compute_so_far)
    _ORIGINAL.setdefault("probe", schedule.Schedule._probe_job_seconds)

    def window(self, steps, breakdown):
        measured = original(self, steps, breakdown)
        return None if measured is None else (measured[0], *figures[dist.get_rank()])

    def compute_so_far(self, steps, breakdown):
        measured = compute(self, steps, breakdown)
        return None if measured is None else (measured[0], figures[dist.get_rank()][0])

    def probe(self, communicator):
        seconds, sent = _ORIGINAL["probe"](self, communicator)  # the real probe runs; its figure is replaced
        return figures[dist.get_rank()][1], sent
    regime.RegimeMonitor.window = window
    regime.RegimeMonitor.compute_so_far = compute_so_far
    schedule.Schedule._probe_job_seconds = probe


def _wire_ranks(rank, world_size, directory):
    from deepspeed_acco.runtime import memory, wire
    out = {}
    # ACCO: rank 1's link is twice as slow; both ranks take the slowest figures: int8, a close call
    # (bf16 predicted 1.1x int8's update) decided at the window's end.
    _with_figures({0: (0.4, 0.10), 1: (0.4, 0.22)})
    engine = _engine("ACCO")
    _train(engine, 2, rank, world_size)
    before = memory.engine_breakdown(engine)
    out["before"] = (engine.wire, engine.regime() is None or engine.regime().wire is None,
                     before["categories"]["compression"])
    _train(engine, 4, rank, world_size, start=4)
    after = memory.engine_breakdown(engine)
    choice = engine.regime().wire
    out["acco"] = (engine.wire, choice["wire"], choice["t_comm_s"], choice["decided_at_update"],
                   after["categories"]["compression"], after["total_bytes"] - before["total_bytes"],
                   choice["extra_bytes"]["int8"])
    engine.save_checkpoint(directory, tag="chosen")
    _train(engine, 3, rank, world_size, start=12)
    out["continued"] = _flat(engine)
    engine.destroy()
    # A new "auto" engine resumes on the chosen wire without deciding again (its own figures would say bf16).
    _with_figures({0: (0.4, 0.01), 1: (0.4, 0.01)})
    resumed = _engine("ACCO")
    resumed.load_checkpoint(directory, tag="chosen")
    out["resumed_wire"] = resumed.wire
    _train(resumed, 3, rank, world_size, start=12)
    out["resumed"] = _flat(resumed)
    out["resumed_choice"] = resumed.regime().wire["decided_at_update"]
    resumed.destroy()
    # int4 where even int8's two jobs do not hide; DPU on one job; CO2 on its averaging.
    for kind, figures, key in (("ACCO", (0.4, 3.0), "acco_slow"), ("DPU", (0.4, 0.5), "dpu"),
                               ("CO2", (0.4, 1.5), "co2")):
        _with_figures({0: figures, 1: figures})
        engine = _engine(kind)
        _train(engine, 12, rank, world_size)
        out[key] = (engine.wire, _flat(engine), engine.regime().wire["decided_at_update"],
                    engine.regime().wire["probe_bytes"], engine.regime().wire["reason"])
        engine.destroy()
    # CO2 on this loopback: the real probe's time, scaled to its fp32 averaging, is what it would decide by.
    from deepspeed_acco.runtime import regime, schedule
    regime.RegimeMonitor.window = _ORIGINAL["window"]
    regime.RegimeMonitor.compute_so_far = _ORIGINAL["compute_so_far"]
    schedule.Schedule._probe_job_seconds = _ORIGINAL["probe"]
    engine = _engine("CO2")
    _train(engine, 1, rank, world_size)
    schedule_ = engine.schedule
    members = schedule_.network_communicator().world_size
    job_bytes = sum(f.padded_numel for f in schedule_.flats) * 8.0 * (members - 1) / members
    values = wires.probe_values(job_bytes, members)
    probe_s = wires.probe_link(schedule_.network_communicator(), values, torch.device("cpu"))
    t_job, sent = schedule_._probe_job_seconds(schedule_.network_communicator())
    out["probe"] = (probe_s, t_job, sent, values, job_bytes)
    _train(engine, 11, rank, world_size, start=2)
    out["probe_decision"] = engine.regime().wire
    engine.destroy()
    # Memory: rank 0 cannot afford the compressed buffers, so neither rank takes them.
    _with_figures({0: (0.4, 1.0), 1: (0.4, 1.0)})
    if rank == 0:
        wire.free_memory_bytes = lambda device: 1
    engine = _engine("ACCO")
    _train(engine, 6, rank, world_size)
    choice = engine.regime().wire
    out["memory"] = (engine.wire, choice["refused_for_memory"], choice["reason"],
                     memory.engine_breakdown(engine)["categories"]["compression"])
    engine.destroy()
    return out


@pytest.mark.slow
def test_ranks_agree_on_the_wire_allocate_it_lazily_and_resume_on_it(tmp_path):
    results = run_distributed(_wire_ranks, 2, str(tmp_path), env={wires.ENVIRONMENT: ""}, timeout_s=400)
    for out in results:
        # Before the decision: the model's dtype and no compressed buffers.
        assert out["before"] == ("fp32", True, 0)
        wire_now, chosen, t_comm, decided_at, compression_bytes, grown, predicted_extra = out["acco"]
        assert (wire_now, chosen) == ("int8", "int8")
        assert t_comm == pytest.approx(0.22)  # the slowest rank's figure on both
        assert decided_at == 5  # a close call: the first update, then the window of DECISION_UPDATES
        assert compression_bytes > 0 and grown == predicted_extra  # allocated at the choice, as predicted
        assert out["resumed_wire"] == "int8" and out["resumed_choice"] == 5
        assert torch.equal(out["resumed"], out["continued"])  # the resumed run continues bitwise
        assert out["acco_slow"][0] == "int4" and out["dpu"][0] == "int8" and out["co2"][0] == "int8"
        # Clear calls (the starting wire predicted >= 1.25x the fastest) are made one update and one
        # network job into the window: ACCO and DPU at update 2; CO2, whose first job is its averaging
        # at update 2 (local_steps 2), before that job, from the compute so far and a probe of the link.
        assert out["acco_slow"][2] == 2 and out["dpu"][2] == 2 and out["co2"][2] == 2
        assert out["acco_slow"][3] == 0 and out["co2"][3] >= wires.PROBE_MIN_BYTES
        assert "probe of the link before the first job" in out["co2"][4]
        # The real probe: timed, scaled by the job's bytes over its own.
        probe_s, t_job, sent, values, job_bytes = out["probe"]
        assert 0 < probe_s < 5 and sent == int(values * 8 * 0.5) and 0 < t_job < 60
        # On this loopback the fp32 averaging hides (no clear call from the probe): the jobs decide, later.
        assert out["probe_decision"]["probe_bytes"] == 0 and out["probe_decision"]["decided_at_update"] > 2
        memory_wire, refused, reason, memory_bytes = out["memory"]
        assert memory_wire == "fp32" and refused == ["int8", "int4"] and "do not fit in memory" in reason
        assert memory_bytes == 0
    for key in ("continued", "resumed"):
        assert torch.equal(results[0][key], results[1][key])  # replicas identical on the chosen wire
    for key in ("acco_slow", "dpu", "co2"):
        if key != "co2":  # CO2's replicas differ between averagings by design
            assert torch.equal(results[0][key][1], results[1][key][1])
