"""The bench's memory columns: each method's held buffers in bytes per parameter, per rank.

Our engines answer ``engine.memory_breakdown()``; DeepSpeed's ZeRO-1 is walked the same way
(:func:`deepspeed_acco.runtime.memory.deepspeed_breakdown`). DeepSpeed releases the gradients its
parameters hold at the end of each update, which is where a run's summary is written, so for it
the gradients (the trainable parameters' sizes in their dtype, which it holds between backward
passes, as tests/test_memory.py measures) are added and marked ``gradients_from_sizes``. Methods
without either (the compute-only run, DeepSpeed stage 0) report None. The peak memory per rank is
the summary's ``peak_rss_mib`` (CPU) or ``peak_gpu_mib`` (``torch.cuda.max_memory_allocated``).
"""
from typing import Any, Dict, Mapping, Optional, Sequence

from ...runtime.memory import CATEGORIES, deepspeed_breakdown


def engine_memory(engine) -> Optional[Dict[str, Any]]:
    """A JSON-ready breakdown of what ``engine`` holds on this rank, or None if it cannot say."""
    breakdown = None
    gradients_from_sizes = False
    from ...runtime.engine import AccoEngine
    if isinstance(engine, AccoEngine):  # DeepSpeedEngine.memory_breakdown() is a config flag
        breakdown = engine.memory_breakdown()
    elif hasattr(getattr(engine, "optimizer", None), "bit16_groups_flat"):
        breakdown = deepspeed_breakdown(engine)
        if not breakdown["categories"]["gradient_accumulator"]:
            gradients = sum(p.numel() * p.element_size() for p in engine.module.parameters() if p.requires_grad)
            breakdown["categories"]["gradient_accumulator"] = gradients
            breakdown["total_bytes"] += gradients
            count = breakdown["num_parameters"]
            breakdown["bytes_per_parameter"]["gradient_accumulator"] = gradients / count
            breakdown["bytes_per_parameter"]["total"] = breakdown["total_bytes"] / count
            gradients_from_sizes = True
    if breakdown is None:
        return None
    return {"num_parameters": breakdown["num_parameters"], "world_size": breakdown["world_size"],
            "total_bytes": breakdown["total_bytes"], "categories": breakdown["categories"],
            "bytes_per_parameter": breakdown["bytes_per_parameter"], "padded_numels": breakdown.get("padded_numels"),
            "communication_dtype": breakdown.get("communication_dtype"),
            "gradients_from_sizes": gradients_from_sizes}


def memory_table(columns: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    """A markdown table: bytes per parameter per rank by category, one column per method, and the
    peak memory per rank (max over ranks). ``columns``: method label -> its ranks' summaries."""
    held = {label: next((s.get("memory") for s in summaries if s.get("memory")), None)
            for label, summaries in columns.items()}
    labels = [label for label in columns if held[label] is not None]
    if not labels:
        return ""
    rows = [name for name in CATEGORIES if any(held[label]["categories"].get(name) for label in labels)]
    lines = ["| bytes/param/rank | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for name in rows + ["total"]:
        cells = [f"{held[label]['bytes_per_parameter'].get(name, 0.0):.2f}" for label in labels]
        lines.append(f"| {'**total**' if name == 'total' else name} | " + " | ".join(cells) + " |")

    def peak(summaries):
        gpu = [s.get("peak_gpu_mib") for s in summaries if s.get("peak_gpu_mib") is not None]
        values = gpu or [s.get("peak_rss_mib") for s in summaries if s.get("peak_rss_mib") is not None]
        return (f"{max(values):.0f}" + (" (GPU)" if gpu else " (RSS)")) if values else "n/a"

    lines.append("| peak MiB per rank | " + " | ".join(peak(columns[label]) for label in labels) + " |")
    notes = [label for label in labels if held[label].get("gradients_from_sizes")]
    if notes:
        lines.append("")
        lines.append(f"{', '.join(notes)}: the gradients DeepSpeed holds between backward passes are counted from "
                     f"the parameters' sizes (it releases them at the end of each update, where this is measured).")
    return "\n".join(lines)
