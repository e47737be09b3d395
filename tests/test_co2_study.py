"""benchmarks/studies/co2_study.py: the outer rules' identities on the tiny preset (a few seconds each)."""
import importlib.util
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study():
    spec = importlib.util.spec_from_file_location("co2_study",
                                                  os.path.join(REPO, "benchmarks", "studies", "co2_study.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMMON = ["--model", "tiny", "--ctx", "32", "--updates", "12", "--local-steps", "3", "--eval-points", "2",
          "--val-windows", "4", "--outer-lr", "1", "--outer-momentum", "0", "--gap-penalty", "1", "--quiet"]


def _committed(extra):
    study = _study()
    result = study.run(study.parse_args(["--method", "outer"] + COMMON + extra))
    return [v["committed"] for _, v in sorted(result["evals"].items(), key=lambda kv: int(kv[0]))], result


def test_merge_after_a_whole_round_is_eager_with_the_whole_own_share():
    merged, _ = _committed(["--delay", "1", "--merge-after", "3"])
    eager, _ = _committed(["--delay", "1", "--eager", "--eager-weight", "1"])
    assert merged == pytest.approx(eager, abs=1e-5)


def test_delayed_local_sgd_anchor_is_ybar_plus_the_last_anchor_move():
    """DESIGN 3.5 with alpha 1, beta 0, lambda 1: x_{k+2} = ybar_k + (x_{k+1} - x_k), so the anchor
    lands ||x_{k+1} - x_k|| = ||d_{k-1}|| away from ybar_k."""
    _, result = _committed(["--delay", "1"])
    rounds = result["rounds"]
    for previous, current in zip(rounds, rounds[1:]):
        assert current["ybar_minus_committed"] == pytest.approx(previous["d_norm"], rel=1e-4)
        assert current["anchor_move"] == pytest.approx(previous["d_norm"], rel=1e-4)


def test_merge_after_one_step_differs_from_synchronous_and_eager():
    merged, _ = _committed(["--delay", "1", "--merge-after", "1"])
    synchronous, _ = _committed(["--delay", "0"])
    eager, _ = _committed(["--delay", "1", "--eager"])
    assert merged[0] == synchronous[0] == eager[0]
    assert merged[-1] != synchronous[-1] and merged[-1] != eager[-1]
