"""GPT-Neo presets built from a config (no downloads), byte-level vocabulary.

Every preset uses a 256-token vocabulary (one token per byte), so the same corpus works for all
of them. ``build_model`` seeds the initialisation, so every method starts from identical weights
(DeepSpeed broadcasts rank 0's weights anyway; the compute-only baseline relies on the seed).
"""
from typing import Dict

# name -> GPTNeoConfig keyword arguments (vocab 256 and the token ids are added by gpt_neo_config)
PRESETS: Dict[str, dict] = {
    # For tests: 120,192 parameters, a few ms per micro-batch.
    "tiny": dict(max_position_embeddings=64, hidden_size=64, num_layers=2, num_heads=2,
                 attention_types=[[["global", "local"], 1]], window_size=32, intermediate_size=256),
    # The bench default: 3,287,552 parameters, ~0.3-0.4 s forward+backward per micro-batch of 4 x 256
    # tokens on one CPU thread.
    "3m": dict(max_position_embeddings=256, hidden_size=256, num_layers=4, num_heads=4,
               attention_types=[[["global", "local"], 2]], window_size=128, intermediate_size=1024),
    # 19,299,328 parameters: for machines with a few more cores per rank.
    "20m": dict(max_position_embeddings=512, hidden_size=512, num_layers=6, num_heads=8,
                attention_types=[[["global", "local"], 3]], window_size=256, intermediate_size=2048),
    # The GPT-Neo-125M shape (12 layers, hidden 768) with the byte vocabulary: 86,797,824 parameters, for GPUs.
    "125m": dict(max_position_embeddings=2048, hidden_size=768, num_layers=12, num_heads=12,
                 attention_types=[[["global", "local"], 6]], window_size=256, intermediate_size=3072),
}
DEFAULT_PRESET = "3m"


def gpt_neo_config(preset: str = DEFAULT_PRESET, ctx: int = 0):
    """A ``GPTNeoConfig`` for ``preset``; ``ctx`` > 0 overrides the context length (positions)."""
    from transformers import GPTNeoConfig
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; choose one of {sorted(PRESETS)}")
    kwargs = dict(PRESETS[preset])
    if ctx:
        kwargs["max_position_embeddings"] = max(int(ctx), 1)
    # bos/eos default to GPT-2's 50256, outside the byte vocabulary; use byte 0 (never in text).
    return GPTNeoConfig(vocab_size=256, bos_token_id=0, eos_token_id=0, **kwargs)


def build_model(preset: str = DEFAULT_PRESET, ctx: int = 0, seed: int = 0):
    """A freshly initialised ``GPTNeoForCausalLM`` with weights fixed by ``seed``."""
    import torch
    from transformers import GPTNeoForCausalLM
    config = gpt_neo_config(preset, ctx)
    devices = []  # fork_rng needs an explicit (empty) device list to stay on the CPU generator only
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        model = GPTNeoForCausalLM(config)
    return model


def count_parameters(model) -> int:
    """Unique parameters (GPT-Neo ties the input embedding and the output head)."""
    return sum(p.numel() for p in model.parameters())
