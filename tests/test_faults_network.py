"""Faults on the emulated network during training (bench/running/faults.py, docs/faults.md): a link that
flaps and one that goes down for good, injected on node 1 of two emulated nodes (network
namespaces; needs root and iproute2) while ACCO trains the tiny model. Each slow test runs one
bench and checks several things, to keep the multi-process cost low."""
import json
import os
import subprocess
import sys

import pytest

from deepspeed_acco.bench.running import faults
from deepspeed_acco.bench.network import netns

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TIMEOUT_S = 20

needs_netns = pytest.mark.skipif(not netns.supported()[0],
                                 reason=f"emulated nodes need network namespaces: {netns.supported()[1]}")


def _bench(out, fault, updates=5):
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    cmd = [sys.executable, "-m", "deepspeed_acco.bench", "--model", "tiny", "--ctx", "64", "--val-windows", "8",
           "--updates", str(updates), "--eval-every", str(updates), "--methods", "acco", "--bandwidth", "100mbit",
           "--fault", fault, "--communication-timeout-s", str(TIMEOUT_S), "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stdout, _ = proc.communicate(timeout=400)
    return proc, stdout


def _assert_nothing_left(bench_pid, out):
    """No namespace, veth or bridge of the bench, and no launcher or rank of its runs, is left."""
    names = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    assert f"acco-{bench_pid}-" not in names
    assert f"a{bench_pid}" not in subprocess.run(["ip", "-o", "link"], stdout=subprocess.PIPE, text=True).stdout
    assert faults.leftovers(str(out), pid=bench_pid) == dict(namespaces=[], interfaces=[], processes=[])


def test_parse_fault():
    assert faults.parse_fault("link-down@3") == faults.Fault("link-down", 3)
    assert faults.parse_fault("flap:2.5@4") == faults.Fault("flap", 4, 2.5)
    assert faults.parse_fault("node-kill@1").spec() == "node-kill@1"
    for bad in ("link-down", "flap@3", "flap:0@3", "node-kill@0", "reboot@2", "link-down@x"):
        with pytest.raises(ValueError, match="--fault"):
            faults.parse_fault(bad)


def test_fault_runs_refuse_what_they_cannot_do():
    from deepspeed_acco.bench.__main__ import build_parser

    def check(*argv, methods=("acco",)):
        args = build_parser().parse_args(["--updates", "5", *argv])
        with pytest.raises(SystemExit) as raised:
            faults.check_fault_args(args, list(methods))
        return str(raised.value)

    assert "--methods acco,dpu" in check("--fault", "link-down@2", methods=("zero1", "acco"))
    assert "--nodes 2" in check("--fault", "node-kill@2", "--nodes", "1")
    assert "before the last update" in check("--fault", "link-down@5")
    assert "shorter than --communication-timeout-s" in check("--fault", "flap:30@2", "--communication-timeout-s", "20")
    assert "--slow-rank" in check("--fault", "flap:3@2", "--slow-rank", "1:2")
    assert "expected link-down@U" in check("--fault", "unplug@2")
    # --recover: after a lost node only, never CO2, and only where the global batch can be kept.
    assert "node-kill@U" in check("--fault", "link-down@2", "--recover")
    assert "--methods sharded,dpu,acco" in check("--fault", "node-kill@2", "--recover", methods=("acco", "co2"))
    assert "must divide by 2" in check("--fault", "node-kill@2", "--recover", "--nodes", "3", "--grad-accum", "1",
                                       methods=("dpu",))
    assert "even" in check("--fault", "node-kill@2", "--recover", "--nodes", "3", "--grad-accum", "2")
    args = build_parser().parse_args(["--updates", "5", "--fault", "node-kill@2", "--recover", "--grad-accum", "2"])
    assert faults.recovery_accumulation(args, faults.parse_fault(args.fault), ["acco", "dpu"]) == 4


def test_checkpoint_record_names_what_a_killed_save_left(tmp_path):
    for tag in ("update1", "update2"):
        (tmp_path / tag).mkdir()
        (tmp_path / tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    (tmp_path / ".update3.staging").mkdir()  # a save the kill interrupted
    (tmp_path / "latest").write_text("update2")
    assert faults.checkpoint_record(str(tmp_path)) == dict(latest="update2", complete=["update1", "update2"],
                                                           other=[".update3.staging"])
    assert faults.checkpoint_record(str(tmp_path / "none")) == dict(latest=None, complete=[], other=[])


@pytest.mark.slow
@needs_netns
def test_flap_shorter_than_the_timeout_changes_nothing_but_the_time(tmp_path):
    """Node 1's link is down for 4 s after update 2: ACCO finishes without an error, later, with
    rank 0's training and validation losses bitwise equal to an undisturbed run's; nothing is left."""
    proc, out = _bench(tmp_path, "flap:4@2")
    assert proc.returncode == 0, out[-5000:]
    run = json.load(open(tmp_path / "faults.json"))["runs"][0]
    assert run["returncodes"] == [0, 0] and run["reference_ok"]
    assert run["injection"]["injected_after_update"] >= 2 and 4.0 <= run["injection"]["down_s"] < 6.0
    assert run["losses"] == dict(updates=[5, 5], bitwise_equal=True, first_difference=None)
    assert not run["failures"]
    # The flap really held the training up: rank 0's clock (compile and start-up excluded) grew by most of it.
    walls = [json.load(open(tmp_path / "runs" / "acco" / d / "rank0.summary.json"))["wall_s"]
             for d in ("undisturbed", "fault")]
    assert walls[1] - walls[0] > 3.0, walls
    _assert_nothing_left(proc.pid, tmp_path)


@pytest.mark.slow
@needs_netns
def test_link_down_every_rank_exits_non_zero_within_the_timeout(tmp_path):
    """Node 1's link goes down for good after update 2: both ranks raise CommunicationError naming
    the collective and the peer at about communication_timeout_s, and exit non-zero within it plus
    the grace; nothing hangs and nothing is left."""
    proc, out = _bench(tmp_path, "link-down@2", updates=6)
    assert proc.returncode == 0, out[-5000:]  # the bench's verdict: the fault ended as it must
    run = json.load(open(tmp_path / "faults.json"))["runs"][0]
    assert all(code not in (0, None) for code in run["returncodes"]), run["returncodes"]
    job = json.load(open(tmp_path / "runs" / "acco" / "fault" / "job.json"))
    assert job["fault_overdue"] is False
    injection = run["injection"]
    exits = injection["rank_exit_after_fault_s"]
    assert set(exits) == {"0", "1"}
    assert all(TIMEOUT_S - 2 <= s <= TIMEOUT_S + faults.EXIT_GRACE_S for s in exits.values()), exits
    assert set(run["failures"]) == {"0", "1"}
    for rank, failure in run["failures"].items():
        peer = 1 - int(rank)
        assert failure["error"].startswith("CommunicationError"), failure
        assert any(f"collective {c} " in failure["error"] for c in ("reduce_scatter", "all_gather", "all_reduce"))
        assert f"peer rank {peer}" in failure["error"], failure
        # At the timeout of a collective issued at the fault (or up to one injector poll before it).
        assert TIMEOUT_S - 2 <= failure["at"] - injection["fault_at"] <= TIMEOUT_S + faults.EXIT_GRACE_S
    assert "last rank exited" in out
    _assert_nothing_left(proc.pid, tmp_path)
