"""The bench's new modes end to end, on the tiny model with few updates: emulated nodes (network
namespaces, needs root and iproute2), time to a target loss, seeds, bf16 communication, and the
clean-up after a bench killed with SIGKILL. Each test runs one bench and checks several things, to
keep the multi-process cost low."""
import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from deepspeed_acco.bench.network import netns
from link_checks import assert_full_duplex

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

needs_netns = pytest.mark.skipif(not netns.supported()[0],
                                 reason=f"emulated nodes need network namespaces: {netns.supported()[1]}")
pytestmark = pytest.mark.slow


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = "1"
    return env


def _bench(out, *extra, timeout=600):
    cmd = [sys.executable, "-m", "deepspeed_acco.bench", "--model", "tiny", "--ctx", "64", "--val-windows", "8",
           "--out", str(out), "--no-progress", *extra]
    return subprocess.run(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)


def _namespaces():
    out = subprocess.run(["ip", "netns", "list"], stdout=subprocess.PIPE, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split()]


def _summary(path):
    return {r["method"]: r for r in csv.DictReader(open(path))}


@needs_netns
def test_two_nodes_two_ranks_each_time_to_target_and_bf16comm(tmp_path):
    """2 nodes x 2 ranks with the deepspeed launcher (hostfile, --no_ssh --node_rank): intra-node
    traffic on each node's loopback, inter-node on its NIC; CO2 averages inside each node
    (group_size 2); ACCO with bf16 gradient communication; the time-to-target table against
    ZeRO-1's loss (auto); the measured per-node rate and the bound lines."""
    res = _bench(tmp_path, "--nodes", "2", "--ranks-per-node", "2", "--bandwidth", "300mbit", "--updates", "4",
                 "--eval-every", "2", "--local-steps", "2", "--methods", "zero1,co2,acco+bf16comm", "--no-plots")
    out = res.stdout
    assert res.returncode == 0, out[-5000:]
    meta = json.load(open(tmp_path / "results.json"))
    link = meta["link"]["300 Mbit/s"]
    assert link["topology"] == "cluster" and link["nodes"] == 2 and link["ranks_per_node"] == 2
    assert_full_duplex(300e6, link["measured_bps"], link["duplex_bps"], link)
    assert "full-duplex link shaped with tc tbf to 300 Mbit/s per direction" in out

    for method in ("zero1", "co2", "acco+bf16comm"):
        run = tmp_path / "runs" / method
        commands = (run / "command.txt").read_text().splitlines()
        assert len(commands) == 2  # one launcher per node, each inside its node's namespace
        for k, line in enumerate(commands):
            assert re.match(rf"ip netns exec acco-\d+-\d+-n{k} ", line), line
            assert f"--hostfile {run}/hostfile --no_ssh --node_rank {k} --master_addr 198.18.0.1" in line
        assert (run / "hostfile").read_text() == "node0 slots=2\nnode1 slots=2\n"
        job = json.load(open(run / "job.json"))
        for node in job["traffic"]:  # ranks of a node talk over its loopback; nodes over their NICs
            assert node["lo_tx_bytes"] > 100_000 and node["nic_tx_bytes"] > 100_000, job["traffic"]
        nodes = {json.load(open(run / f"rank{r}.summary.json"))["node"] for r in range(4)}
        assert nodes == {0, 1}
        assert [json.load(open(run / f"rank{r}.summary.json"))["node"] for r in range(4)] == [0, 0, 1, 1]
    co2 = json.load(open(tmp_path / "runs" / "co2" / "ds_config.json"))["optimizer"]["params"]
    assert co2["group_size"] == 2
    acco = json.load(open(tmp_path / "runs" / "acco+bf16comm" / "ds_config.json"))
    assert acco["communication_data_type"] == "bf16" and acco["bf16"] == {"enabled": True}

    summary = _summary(tmp_path / "summary.csv")
    assert set(summary) == {"compute", "zero1", "co2", "acco+bf16comm"}
    assert summary["acco+bf16comm"]["label"] == "ACCO + bf16 comm" and summary["acco+bf16comm"]["comm"] == "bf16/bf16"
    for name, row in summary.items():
        assert int(row["updates"]) == 4 and int(row["samples"]) == 4 * 32, (name, row)
    target = meta["targets"]["300 Mbit/s"]["0"]
    zero1 = summary["zero1"]
    assert math.isclose(float(zero1["val_loss"]), target) and int(zero1["updates_to_target"]) == 4
    assert f"Time to target: validation loss <= {target:.4f}" in out
    for name in ("co2", "acco+bf16comm"):
        row = summary[name]
        assert float(row["target_loss"]) == pytest.approx(target)
        if row["updates_to_target"]:  # reached at an evaluation (every 2 updates; every update near the target)
            steps = [r for r in csv.DictReader(open(tmp_path / "steps.csv"))
                     if r["method"] == name and r["rank"] == "0" and r["val_loss"]]
            at = {int(r["update"]): float(r["val_loss"]) for r in steps}
            u = int(row["updates_to_target"])
            assert u in at and at[u] <= target and all(v > target for k, v in at.items() if k < u)
            assert int(row["final_update"]) == max(u, 4)
        else:
            assert int(row["final_update"]) == 12  # --max-updates default: 3 x --updates
    # Bound lines use the per-node link rate and each method's bytes.
    assert "over each node's link at the measured" in out and "x the bound" in out
    assert not [n for n in _namespaces() if n.startswith("acco-") and not os.path.exists(f"/proc/{n.split('-')[1]}")]


def test_seeds_fp32_and_a_target_not_reached(tmp_path):
    """Two seeds on one (unshaped) loopback in fp32 with an explicit target that nobody reaches: every
    run stops at --max-updates, the equal-samples numbers stay at --updates, and the seeds table
    gives the gap to ZeRO-1 of the same seed as mean and range."""
    res = _bench(tmp_path, "--nodes", "1", "--ranks-per-node", "2", "--bandwidth", "none", "--updates", "3",
                 "--max-updates", "4", "--eval-every", "2", "--methods", "zero1,acco", "--seeds", "0,1",
                 "--target-loss", "0.5", "--precision", "fp32", "--launcher", "torchrun")
    out = res.stdout
    assert res.returncode == 0, out[-5000:]
    meta = json.load(open(tmp_path / "results.json"))
    assert meta["args"]["precision"] == "fp32"
    assert "bf16" not in json.load(open(tmp_path / "runs" / "acco" / "seed1" / "ds_config.json"))
    runs = {(r["method"], r["seed"]): r for r in meta["runs"]}
    assert set(runs) == {("compute", 0), ("zero1", 0), ("zero1", 1), ("acco", 0), ("acco", 1)}
    val = {}
    for (method, seed), run in runs.items():
        s0 = json.load(open(tmp_path / run["dir"] / "rank0.summary.json"))
        assert s0["updates"] == 3
        if method != "compute":
            assert s0["final_update"] == 4 and s0["reached_update"] is None and s0["target_loss"] == 0.5
            assert sorted(map(int, s0["val"])) == [0, 2, 3, 4]
            val[(method, seed)] = s0["val"]
    # Different seeds: different initial weights (and data order), same weights for every method of a seed.
    assert val[("zero1", 0)]["0"] != val[("zero1", 1)]["0"] and val[("zero1", 1)]["0"] == val[("acco", 1)]["0"]
    assert out.count("not reached in 4") == 2  # seed 0's time-to-target table
    gaps = [val[("acco", s)]["3"] / val[("zero1", s)]["3"] - 1 for s in (0, 1)]
    seeds = {r["method"]: r for r in meta["seeds_table"]["unshaped"]}
    assert math.isclose(seeds["acco"]["gap_mean"], sum(gaps) / 2, rel_tol=1e-9)
    assert math.isclose(seeds["acco"]["gap_min"], min(gaps)) and math.isclose(seeds["acco"]["gap_max"], max(gaps))
    assert seeds["acco"]["reached"] == 0 and seeds["zero1"]["seeds"] == 2
    assert f"{100 * min(gaps):+.2f}% .. {100 * max(gaps):+.2f}%" in out
    assert "| ACCO | 2 |" in out and "0/2" in out
    # --replot rebuilds the same report from the run list in results.json.
    before = (tmp_path / "results.md").read_text()
    rep = subprocess.run([sys.executable, "-m", "deepspeed_acco.bench", "--replot", str(tmp_path)], env=_env(),
                         cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120)
    assert rep.returncode == 0, rep.stdout[-3000:]
    assert (tmp_path / "results.md").read_text() == before


def _processes_in(namespaces):
    return sorted({pid for name in namespaces for pid in netns.namespace_pids(name)})


@needs_netns
def test_killed_two_node_run_leaves_nothing_once_cleaned(tmp_path):
    """SIGKILL a bench during a two-node job: its namespaces, their veths and bridge, and the ranks
    that outlived it are all gone after the clean-up the next bench starts with."""
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "deepspeed_acco.bench", "--model", "tiny", "--ctx", "64", "--updates", "100000",
           "--methods", "zero1", "--no-compute-only", "--no-comm-probe", "--bandwidth", "1gbit",
           "--out", str(out), "--no-progress"]
    proc = subprocess.Popen(cmd, env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    rows = out / "runs" / "zero1" / "rank0.jsonl"
    deadline = time.time() + 180
    while time.time() < deadline and not (rows.exists() and rows.stat().st_size > 0):
        assert proc.poll() is None, proc.stdout.read()[-3000:]
        time.sleep(0.5)
    assert rows.exists(), "training never started"
    mine = [n for n in _namespaces() if n.startswith(f"acco-{proc.pid}-")]
    assert len(mine) == 3, mine  # switch and two nodes
    pids = _processes_in(mine)
    assert pids, "no launcher or rank runs inside the node namespaces"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert set(mine) <= set(_namespaces())  # a killed bench cannot clean up
    survivors = [p for p in pids if os.path.exists(f"/proc/{p}")]
    assert survivors, "expected the job's processes to outlive the killed bench"

    removed = netns.remove_orphans()  # what every bench does first
    assert set(mine) <= set(removed)
    assert not [n for n in _namespaces() if n.startswith(f"acco-{proc.pid}-")]
    deadline = time.time() + 10
    while time.time() < deadline and any(os.path.exists(f"/proc/{p}") for p in survivors):
        time.sleep(0.1)
    assert not [p for p in survivors if os.path.exists(f"/proc/{p}") and
                open(f"/proc/{p}/stat").read().split()[2] != "Z"], "a rank of the killed run is still alive"
    host_links = subprocess.run(["ip", "-o", "link"], stdout=subprocess.PIPE, text=True).stdout
    assert f"a{proc.pid}" not in host_links  # no veth or bridge of it anywhere in the host's network
