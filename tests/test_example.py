"""examples/train_gpt.py end to end under the real ``deepspeed`` launcher with 2 ranks."""
import os
import re
import shutil
import subprocess
import sys

import pytest


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_gpt.py")
CONFIGS = os.path.join(REPO, "examples", "configs")
# Validation-loss drop (nats) that 12 updates of the tiny model reach with every method here.
LEARNED_AT_LEAST = 0.2


def _deepspeed_launcher():
    """The ``deepspeed`` console script of this interpreter's environment (else on PATH)."""
    here = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    return [here] if os.path.exists(here) else ([shutil.which("deepspeed")] if shutil.which("deepspeed") else None)


pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(_deepspeed_launcher() is None, reason="the deepspeed launcher script is not installed"),
]


def _free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_example(tmp_path, config, override=None, *extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if not env.get("TORCH_EXTENSIONS_DIR"):  # DeepSpeed's CPU shm op: build once, not per flag change
        from deepspeed_acco.bench.workload.data import default_cache_dir
        env["TORCH_EXTENSIONS_DIR"] = os.path.join(default_cache_dir(), "torch_extensions")
    cmd = _deepspeed_launcher() + ["--num_gpus", "2", "--master_port", str(_free_port()), EXAMPLE,
                                   "--deepspeed_config", os.path.join(CONFIGS, config), "--model", "tiny",
                                   "--ctx", "64", "--steps", "12", "--log-every", "6", "--val-windows", "8", *extra]
    if override:
        cmd += ["--optimizer", override]
    res = subprocess.run(cmd, cwd=str(tmp_path), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-4000:]
    return res.stdout


@pytest.mark.parametrize("config,override", [("zero1.json", None), ("acco.json", None), ("co2.json", None),
                                             ("acco.json", "DPU"), ("acco.json", "ShardedAdamW")])
def test_example_under_deepspeed_launcher(tmp_path, config, override):
    out = _run_example(tmp_path, config, override)
    expected_type = override or {"zero1.json": "AdamW", "acco.json": "ACCO", "co2.json": "CO2"}[config]
    assert f"optimizer {expected_type}, 2 ranks" in out
    assert "standard library" in out
    losses = [float(x) for x in re.findall(r"update +\d+ +loss (\d+\.\d+)", out)]
    assert len(losses) == 2, out[-2000:]
    initial = float(re.search(r"initial validation loss (\d+\.\d+)", out).group(1))
    final = float(re.search(r"final validation loss (\d+\.\d+)", out).group(1))
    # It learned: 12 updates of the tiny model take the validation loss well below that of the
    # initial weights (about 5.4 nats per byte), and the second logged loss below the first.
    assert final < initial - LEARNED_AT_LEAST, (initial, final)
    assert losses[1] < losses[0], losses


@pytest.mark.parametrize("config", ["acco.json", "zero1.json"])
def test_example_saves_a_checkpoint(tmp_path, config):
    _run_example(tmp_path, config, None, "--save", str(tmp_path / "ckpt"))
    assert os.listdir(tmp_path / "ckpt")
