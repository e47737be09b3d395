"""The deepspeed-acco benchmark: ``python -m deepspeed_acco.bench`` (console script ``deepspeed-acco-bench``).

Trains the same GPT-Neo on real text with DeepSpeed's ZeRO-1 / data parallel and deepspeed_acco's
ShardedAdamW, DPU, ACCO and CO2, each as a real multi-rank job, over a rate-limited network, and
reports wall-clock, communication wait and validation loss. Heavy imports happen only when run.
"""


def main(argv=None):
    """Entry point of ``python -m deepspeed_acco.bench`` and ``deepspeed-acco-bench``."""
    from .__main__ import main as _main
    return _main(argv)


__all__ = ["main"]
