"""NCCL's implicit launch order: the engine sets it before its first NCCL use and detects when it was too late.

docs/gpu.md ("The ordered lane"): NCCL reads ``NCCL_LAUNCH_ORDER_IMPLICIT`` once per process. If a
torch NCCL group already had a communicator when the engine set the variable (a barrier of
Accelerate's before ``initialize``), the engine warns once with the fix and falls back to one
shared side stream. torch here has no NCCL, so the process groups' table is replaced by one whose
groups answer like torch's NCCL backends (``ProcessGroupNCCL._is_initialized``).
"""
import datetime
import logging
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d

from deepspeed_acco.runtime import comm
from deepspeed_acco.runtime import initialize as initialize_module


class FakeBackend:
    def __init__(self, communicator_exists):
        self.communicator_exists = communicator_exists

    def _is_initialized(self):
        return self.communicator_exists


class FakeGroup:
    """A process group with an NCCL backend on CUDA (``backend`` None: no CUDA backend, as a gloo group)."""

    def __init__(self, backend):
        self.backend = backend

    def _get_backend(self, device):
        assert device.type == "cuda"
        if self.backend is None:
            raise RuntimeError("No backend type associated with device type cuda")
        return self.backend


@pytest.fixture
def fresh_process(monkeypatch, caplog):
    """No variable in the environment, NCCL 2.27, no group yet; returns a function that installs groups."""
    monkeypatch.delenv(comm.NCCL_LAUNCH_ORDER_ENV, raising=False)
    monkeypatch.setattr(comm, "_launch_order_set_after", [])
    monkeypatch.setattr(comm, "nccl_version", lambda: (2, 27, 3))
    caplog.set_level(logging.WARNING, logger=comm.logger.name)

    def install(groups):
        world = SimpleNamespace(pg_map={group: (backend_name, None) for group, (backend_name, _) in groups.items()},
                                pg_names={group: name for group, (_, name) in groups.items()})
        monkeypatch.setattr(distributed_c10d, "_world", world)
    install({})
    return install


def _warnings(caplog):
    return [r.getMessage() for r in caplog.records if comm.NCCL_LAUNCH_ORDER_ENV in r.getMessage()]


def test_set_before_any_nccl_use_orders_by_host_without_warning(fresh_process, caplog):
    # Groups exist but none has created its communicator yet (torch creates it lazily).
    fresh_process({FakeGroup(FakeBackend(False)): ("nccl", "default_pg"),
                   FakeGroup(None): ("gloo", "control")})
    comm.prepare_nccl_environment()
    assert os.environ[comm.NCCL_LAUNCH_ORDER_ENV] == "1"
    assert comm.nccl_orders_by_host()
    assert not _warnings(caplog)


def test_communicator_before_the_variable_warns_once_and_falls_back_to_one_stream(fresh_process, caplog):
    fresh_process({FakeGroup(FakeBackend(True)): ("cpu:gloo,cuda:nccl", "default_pg"),
                   FakeGroup(FakeBackend(False)): ("nccl", "later")})
    comm.prepare_nccl_environment()
    assert os.environ[comm.NCCL_LAUNCH_ORDER_ENV] == "1"
    assert not comm.nccl_orders_by_host(), "the variable came after NCCL's first use: the ordering is not assured"
    messages = _warnings(caplog)
    assert len(messages) == 1
    assert "default_pg" in messages[0] and "later" not in messages[0]
    assert f"{comm.NCCL_LAUNCH_ORDER_ENV}=1" in messages[0] and "before launching" in messages[0]
    comm.prepare_nccl_environment()  # a second engine in the same process
    assert len(_warnings(caplog)) == 1
    # The lane takes the shared stream without repeating a warning that would blame the NCCL version.
    caplog.clear()
    lane = comm.Lane(0, torch.device("cuda", 0), timeout_s=10.0)
    assert lane.inline and lane.shared_stream
    assert not caplog.records


def test_a_value_the_user_set_is_kept_and_trusted(fresh_process, caplog, monkeypatch):
    fresh_process({FakeGroup(FakeBackend(True)): ("nccl", "default_pg")})
    monkeypatch.setenv(comm.NCCL_LAUNCH_ORDER_ENV, "1")  # exported in the launch environment
    comm.prepare_nccl_environment()
    assert comm.nccl_orders_by_host() and not _warnings(caplog)
    monkeypatch.setenv(comm.NCCL_LAUNCH_ORDER_ENV, "0")
    comm.prepare_nccl_environment()
    assert os.environ[comm.NCCL_LAUNCH_ORDER_ENV] == "0" and not comm.nccl_orders_by_host()
    assert not _warnings(caplog)


def test_real_gloo_group_has_no_nccl_communicator(tmp_path):
    """Against torch's own table: a gloo group is not mistaken for an NCCL one."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
    try:
        dist.new_group(backend="gloo")
        assert comm.nccl_communicators_in_use() == []
    finally:
        dist.destroy_process_group()


def test_initialize_prepares_nccl_before_it_creates_the_default_group(monkeypatch):
    calls = []

    class Stop(Exception):
        pass

    def init_distributed(timeout_s):
        calls.append("init_distributed")
        raise Stop

    monkeypatch.setattr(initialize_module, "_uses_nccl", lambda: True)
    monkeypatch.setattr(initialize_module, "prepare_nccl_environment", lambda: calls.append("prepare"))
    monkeypatch.setattr(initialize_module, "init_distributed", init_distributed)
    model = torch.nn.Linear(2, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "ShardedAdamW", "params": {"lr": 1e-3}}}
    with pytest.raises(Stop):
        initialize_module.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert calls == ["prepare", "init_distributed"]


def test_uses_nccl_follows_the_default_group_or_cuda(monkeypatch):
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert initialize_module._uses_nccl()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not initialize_module._uses_nccl()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "cpu:gloo,cuda:nccl")
    assert initialize_module._uses_nccl()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    assert not initialize_module._uses_nccl()
