"""Memory accounting (docs/precision.md, "Memory: bytes per parameter per rank").

One multi-process (gloo) job per world size (2 and 4) builds every optimizer type in several
precisions and checks, on every rank:
- ``engine.memory_breakdown()`` equals ``predicted_breakdown`` (the formula) in every category;
- every tensor reachable from the schedule of 1 KiB or more is one the breakdown names (nothing
  allocated is missed), no two named buffers share a storage, and ``other`` is a few bytes;
- at W = 2, DeepSpeed's own ZeRO-1 (fp32 and bf16) walked the same way equals its formula, and
  ACCO's and DPU's extra over it is what docs/design.md states.
"""
import pytest
import torch

from distributed_utils import run_distributed

IN_FEATURES, HIDDEN, OUT_FEATURES, MICRO_BATCH = 16, 96, 8, 4

# (type, precision, communication_data_type or None, extra optimizer params, extra config)
RUNS = [
    ("ShardedAdamW", "fp32", None, {}, {}),
    ("DPU", "fp16", None, {}, {}),
    ("DPU", "bf16", None, {}, {}),
    ("ACCO", "bf16", None, {}, {}),
    ("ACCO", "bf16", None, {}, {"data_types": {"grad_accum_dtype": "bf16"}}),
    ("ACCO", "bf16", "fp32", {}, {}),
    ("ACCO", "bf16", None, {}, {"zero_optimization": {"zero_quantized_gradients": True,
                                                       "zero_quantized_weights": True}}),
    ("CO2", "fp32", None, {"local_steps": 2, "anchor_merge_steps": 1}, {}),
    ("CO2", "bf16", None, {"local_steps": 2, "anchor_merge_steps": None}, {}),
]
RUNS_W4 = [
    ("ShardedAdamW", "bf16", None, {}, {}),
    ("DPU", "bf16", None, {}, {}),
    ("ACCO", "fp32", None, {}, {}),
    ("CO2", "bf16", None, {"local_steps": 2, "anchor_merge_steps": 1, "group_size": 2}, {}),
]


class Net(torch.nn.Module):
    """11,720 trainable parameters in two param groups (11,520 weights, 200 biases)."""

    def __init__(self):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.inner = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.hidden = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT_FEATURES)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.1)

    def forward(self, x):
        return self.head(torch.tanh(self.hidden(torch.tanh(self.inner(x)))))


def _groups(model):
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _batch(rank, index, dtype):
    generator = torch.Generator().manual_seed(1000 * rank + index)
    x = torch.randn(MICRO_BATCH, IN_FEATURES, generator=generator)
    return x.to(dtype), torch.randn(MICRO_BATCH, OUT_FEATURES, generator=generator)


def _config(kind, precision, communication, params, extra, world_size):
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
              "train_batch_size": MICRO_BATCH * 2 * world_size, "steps_per_print": 10 ** 6,
              "optimizer": {"type": kind, "params": dict(lr=1e-3, **params)}}
    if precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif precision == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale": 256}
    if communication is not None:
        config["communication_data_type"] = communication
    config.update(extra)
    return config


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _train(engine, rank, dtype, micro_batches):
    for index in range(micro_batches):
        x, y = _batch(rank, index, dtype)
        loss = torch.nn.functional.mse_loss(engine(x).float(), y)
        engine.backward(loss)
        engine.step()


def _extra_key(extra):
    """The extra config sections of a run, as part of its key ("" for none)."""
    import json
    return json.dumps(extra, sort_keys=True) if extra else ""


def _ours(rank, world_size, runs):
    import deepspeed_acco
    from deepspeed_acco.runtime.memory import predicted_breakdown, unaccounted
    results = []
    for kind, precision, communication, params, extra in runs:
        model = Net().to(_DTYPES[precision])
        config = _config(kind, precision, communication, params, extra, world_size)
        engine, _, _, _ = deepspeed_acco.initialize(model=model, model_parameters=_groups(model), config=config)
        schedule = engine.schedule
        # Two updates (CO2: one outer round; eager mode's boundary masters are alive until the next step).
        _train(engine, rank, _DTYPES[precision], 2 * (schedule.params.local_steps if kind == "CO2" else 2))
        schedule.drain()  # the running job has made its ring buffers
        measured = engine.memory_breakdown()
        zero = config.get("zero_optimization", {})
        options = {"num_parameters": measured["num_parameters"], "backend": "gloo",
                   "group_size": getattr(schedule.params, "group_size", 1),
                   "anchor_merge_steps": getattr(schedule.params, "anchor_merge_steps", None),
                   "outer_communication_dtype": communication or "fp32",
                   "accumulation_dtype": measured["accumulation_dtype"],
                   "compression": {"gradients": zero.get("zero_quantized_gradients", False),
                                   "weights": zero.get("zero_quantized_weights", False)}}
        predicted = predicted_breakdown(kind, measured["padded_numels"], world_size, measured["model_dtype"],
                                        engine.communication_data_type, options)
        results.append({"run": (kind, precision, communication, tuple(params.items()), _extra_key(extra)),
                        "measured": measured, "predicted": predicted, "unaccounted": unaccounted(engine, 1024),
                        "weights": [flat.model_flat.clone() for flat in schedule.flats]})
        engine.destroy()
    return results


def _deepspeed(rank, world_size):
    import deepspeed
    from deepspeed_acco.runtime.memory import deepspeed_breakdown, deepspeed_zero1_formula
    results = {}
    for precision in ("fp32", "bf16"):
        model = Net().to(_DTYPES[precision])
        config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 2,
                  "steps_per_print": 10 ** 6, "zero_optimization": {"stage": 1},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        if precision == "bf16":
            config["bf16"] = {"enabled": True}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=_groups(model), config=config)
        _train(engine, rank, _DTYPES[precision], 5)  # two updates, then a backward that does not end one
        measured = deepspeed_breakdown(engine)
        predicted = deepspeed_zero1_formula(measured["padded_numels"], world_size, measured["model_dtype"],
                                            num_parameters=measured["num_parameters"])
        _train(engine, rank, _DTYPES[precision], 1)  # ends the update: DeepSpeed releases the gradients
        from deepspeed_acco.bench.reporting.memory import engine_memory
        results[precision] = {"measured": measured, "predicted": predicted, "bench": engine_memory(engine)}
    return results


def _worker(rank, world_size, runs, with_deepspeed):
    return {"ours": _ours(rank, world_size, runs), "deepspeed": _deepspeed(rank, world_size) if with_deepspeed else None}


def _check_ours(results):
    for rank_results in results:
        for item in rank_results["ours"]:
            measured, predicted, run = item["measured"], item["predicted"], item["run"]
            assert not item["unaccounted"], f"{run}: buffers the breakdown does not name: {item['unaccounted']}"
            assert not measured["shared"], f"{run}: buffers counted twice: {measured['shared']}"
            assert measured["categories"]["other"] < 1024, f"{run}: other = {measured['categories']['other']}"
            for name, value in predicted["categories"].items():
                if name == "other":
                    continue
                assert measured["categories"][name] == value, \
                    f"{run}: {name}: measured {measured['categories'][name]} bytes, formula {value}"


@pytest.mark.slow
def test_breakdown_matches_formula_at_two_ranks_and_deepspeed_zero1():
    results = run_distributed(_worker, 2, RUNS, True, timeout_s=600)
    _check_ours(results)
    for precision in ("fp32", "bf16"):
        for rank_results in results:
            deepspeed = rank_results["deepspeed"][precision]
            measured, predicted = deepspeed["measured"], deepspeed["predicted"]
            assert measured["shared"] == [], measured["shared"]
            for name, value in predicted["categories"].items():
                if name != "other":
                    assert measured["categories"][name] == value, \
                        f"DeepSpeed {precision}: {name}: measured {measured['categories'][name]}, formula {value}"
            assert measured["categories"]["other"] <= 0.02 * measured["total_bytes"], measured["categories"]
            bench = deepspeed["bench"]  # at the end of an update, as the bench measures it
            assert bench["gradients_from_sizes"]
            assert bench["total_bytes"] - bench["categories"]["other"] == predicted["total_bytes"]
    # ACCO in bf16 (default: bf16 communication) against DeepSpeed ZeRO-1 in bf16: 4 bytes per padded
    # parameter (the fp32 accumulator's 2 more than DeepSpeed's bf16 gradients, and the bf16 gradient
    # snapshot, which also receives the gathered estimate) plus, per shard element, 14 (reduced bf16 2,
    # fp32 shard gradient 4, kept first half 4, gloo's two bf16 ring chunks 4).
    acco = next(item["measured"] for item in results[0]["ours"] if item["run"] == ("ACCO", "bf16", None, (), ""))
    dpu = next(item["measured"] for item in results[0]["ours"] if item["run"][:2] == ("DPU", "bf16"))
    zero1 = results[0]["deepspeed"]["bf16"]["measured"]
    # Both have ZeRO-1's 4 bytes per parameter (bf16 model and gradients) and 12 per shard element
    # (master, moments); our flats pad to 32 W elements, DeepSpeed's to 2 W.
    padded, deepspeed_padded = sum(acco["padded_numels"]), sum(zero1["padded_numels"])
    held = {name: breakdown["total_bytes"] - breakdown["categories"]["other"] for name, breakdown in
            (("acco", acco), ("dpu", dpu), ("zero1", zero1))}
    assert held["zero1"] == 4 * deepspeed_padded + 12 * deepspeed_padded // 2
    assert held["acco"] == (4 + 4) * padded + (12 + 14) * padded // 2
    # The all-gather output is the snapshot's storage when the dtypes match, its own buffer otherwise.
    assert acco["categories"]["gathered"] == 0 and dpu["categories"]["gathered"] == 0
    acco_fp32_comm = next(item["measured"] for item in results[0]["ours"]
                          if item["run"] == ("ACCO", "bf16", "fp32", (), ""))
    assert acco_fp32_comm["categories"]["gathered"] == 2 * padded
    # data_types.grad_accum_dtype bf16 (DeepSpeed's bf16 default): the accumulator is 2 bytes per
    # parameter, and ACCO's extra over DeepSpeed ZeRO-1 is the bf16 snapshot plus O(P/W). With
    # one micro-batch per round (accumulation 2, ACCO's two halves) a bf16 sum is exact, so the
    # weights equal the fp32 accumulator's bitwise.
    by_run = {item["run"]: item for item in results[0]["ours"]}
    bf16_accumulation = by_run[("ACCO", "bf16", None, (), _extra_key({"data_types": {"grad_accum_dtype": "bf16"}}))]
    assert bf16_accumulation["measured"]["accumulation_dtype"] == "bfloat16"
    held_bf16 = bf16_accumulation["measured"]["total_bytes"] - bf16_accumulation["measured"]["categories"]["other"]
    assert held_bf16 == (4 + 2) * padded + (12 + 14) * padded // 2
    for ours, theirs in zip(bf16_accumulation["weights"], by_run[("ACCO", "bf16", None, (), "")]["weights"]):
        assert torch.equal(ours, theirs)
    assert held["acco"] - held["dpu"] == 4 * padded // 2  # DPU: no kept first half


@pytest.mark.slow
def test_breakdown_matches_formula_at_four_ranks():
    _check_ours(run_distributed(_worker, 4, RUNS_W4, False, timeout_s=900))


def test_formula_bytes_per_parameter_at_eight_ranks():
    """The table of docs/design.md: bf16 model and communication, one group, P a multiple of 32 W."""
    from deepspeed_acco.runtime.memory import deepspeed_zero1_formula, predicted_breakdown
    P, W = 256 * 10 ** 6, 8

    def total(kind, **options):
        return predicted_breakdown(kind, P, W, "bf16", "bf16", options)["bytes_per_parameter"]["total"]

    # ShardedAdamW: model 2 + fp32 accumulator 4 + bf16 snapshot 2 = 8 per param; master, moments,
    # reduced (bf16) and fp32 shard gradient 4 + 8 + 2 + 4 = 18 per shard element = 2.25 per param.
    assert total("ShardedAdamW") == pytest.approx(10.25)
    # DPU: its all-gather output is the bf16 snapshot's storage (nothing more); with another
    # communication dtype it needs its own (+ 2).
    assert total("DPU") == pytest.approx(10.25)
    assert predicted_breakdown("DPU", P, W, "bf16", "fp32")["bytes_per_parameter"]["gathered"] == 2
    assert total("ACCO") == pytest.approx(10.75)  # + the kept first-half sum (fp32 shard)
    # data_types.grad_accum_dtype bf16: the accumulator is 2 bytes per parameter instead of 4.
    assert total("ACCO", accumulation_dtype="bf16") == pytest.approx(8.75)
    assert total("DPU", accumulation_dtype="bf16") == total("ShardedAdamW", accumulation_dtype="bf16") == \
        pytest.approx(8.25)
    # CO2 (group_size 1: the inner update is not sharded): 8 + 18 + 4 (fp32 displacement: the outer
    # job averages parameters in fp32) + 8 (fp32 replica state) + 12 / 8 (outer) + 4 / 8 (mean
    # displacement) + 4 (eager mode's boundary masters).
    assert total("CO2", anchor_merge_steps=1) == pytest.approx(8 + 18 + 4 + 8 + 16 / 8 + 4)
    # Not given, the formula takes the engine's default (the eager merge).
    from deepspeed_acco.runtime.memory import CO2_DEFAULT_ANCHOR_MERGE_STEPS
    from deepspeed_acco.runtime.optimizers.co2 import CO2Params
    assert CO2_DEFAULT_ANCHOR_MERGE_STEPS == CO2Params().anchor_merge_steps
    assert total("CO2") == total("CO2", anchor_merge_steps=1)
    assert total("CO2", group_size=8, anchor_merge_steps=0) == pytest.approx(8 + 18 / 8 + 4 + 8 + 16 / 8)
    assert total("CO2", anchor_merge_steps=1, outer_communication_dtype="bf16") == pytest.approx(
        8 + 18 + 2 + 8 + 14 / 8 + 4)
    zero1 = deepspeed_zero1_formula(P, W, "bf16")["bytes_per_parameter"]["total"]
    assert zero1 == pytest.approx(4 + 12 / 8)
    with pytest.raises(ValueError, match="no memory formula"):
        predicted_breakdown("SGD", P, W)


def test_bench_memory_table():
    """The bench report's table: bytes/param by category per method, and the peak per rank."""
    from deepspeed_acco.bench.reporting.memory import memory_table
    from deepspeed_acco.runtime.memory import predicted_breakdown
    acco = predicted_breakdown("ACCO", 256 * 8, 8, "bf16")
    dpu = predicted_breakdown("DPU", 256 * 8, 8, "bf16")
    table = memory_table({"ACCO": [{"memory": acco, "peak_rss_mib": 100.0}, {"memory": acco, "peak_rss_mib": 120.0}],
                          "DPU": [{"memory": dpu, "peak_rss_mib": 90.0, "peak_gpu_mib": 50.0}],
                          "compute-only": [{"memory": None, "peak_rss_mib": 10.0}]})
    lines = table.splitlines()
    assert lines[0] == "| bytes/param/rank | ACCO | DPU |"
    assert "| acco_first_half | 0.50 | 0.00 |" in lines
    assert "| **total** | 10.75 | 10.25 |" in lines
    assert lines[-1] == "| peak MiB per rank | 120 (RSS) | 50 (GPU) |"
    assert memory_table({"compute-only": [{"memory": None}]}) == ""
