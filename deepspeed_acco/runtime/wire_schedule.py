"""The regime and the wire of a schedule: what it measures, predicts and chooses under "auto"
(runtime/regime.py, runtime/wire.py; docs/wire.md, "The wire"), and how the choice is kept in
checkpoints. :class:`WireChoosing` is a part of :class:`~deepspeed_acco.runtime.schedule.Schedule`:
it reads the schedule's flats, shards, communicators, clock (``time``), progress and control plane.
"""
from typing import Any, Dict, Optional

import torch

from . import wire as wires
from .comm import Communicator
from .compression import CompressionConfig, QuantizationFormat, group_compressions
from .regime import Regime, RegimeMonitor, predict, round_bytes, uncompressed_wire, wires_of


class WireChoosing:
    """The wire part of a schedule (its attributes are set by :meth:`_init_wire`)."""

    def _init_wire(self, wire: str, device: torch.device) -> None:
        self.wire_mode = wire
        """"auto" (chosen once from the measurements, runtime/wire.py) or the wire the config fixes."""
        self.wire_name = uncompressed_wire(self.type_name, self.precision) if wire == wires.AUTO else wire
        """The wire the jobs run on now."""
        self.block_size = int(getattr(self.params, "quantization_block_size", 128))
        self.wire_choice: Optional[wires.WireChoice] = None
        """What "auto" decided (None before the decision, or with a fixed wire)."""
        self.regime_monitor = RegimeMonitor(compute_key="device_compute" if device.type == "cuda" else "compute")
        self.regime_log: Optional[str] = None
        """The regime and wire message waiting for the engine to log it (once)."""
        self._wire_cost_cache: Optional[tuple] = None
        """What each compressed wire costs on this rank, measured once (:meth:`_wire_costs`)."""

    def network_communicator(self) -> Communicator:
        """The communicator whose jobs cross the network (CO2: the outer averaging's)."""
        return self.communicator

    def co2_steps(self) -> Dict[str, int]:
        """CO2's local_steps and averaging steps for the predictions (its defaults for other types)."""
        return {}

    def regime(self) -> Optional[Regime]:
        """The regime decided at the end of the measurement window, or before that the one so far."""
        monitor = self.regime_monitor
        if monitor.logged is not None:
            return monitor.logged
        window = monitor.window(self.progress.global_steps, self.time.snapshot())
        if window is None:
            return None
        updates, t_compute, t_comm = window
        return self._regime(updates, t_compute, t_comm, {})

    def measured_round_bytes(self) -> float:
        """Bytes per value one job of this schedule moves now (its wire; ZeRO++'s one-sided keys included)."""
        if self.wire_name in wires.WIRES:
            return round_bytes(self.type_name, self.wire_name, model_dtype=self.precision, block_size=self.block_size)
        flat, compression = self.flats[0], (self.compression or [None])[0]
        gradient = (compression.gradients.fmt.bytes_per_value if compression is not None and compression.gradients
                    is not None else flat.job_grad.dtype.itemsize)
        parameter = (compression.weights.fmt.bytes_per_value if compression is not None and compression.weights
                     is not None else flat.model_dtype.itemsize)
        return float(gradient + parameter)

    def _regime(self, updates: int, t_compute: float, t_comm: float, quantization_s: Dict[str, float]) -> Regime:
        measured = self.measured_round_bytes()
        if self.wire_name in wires.COMPRESSED:  # the measured collectives held this wire's kernels
            t_comm = max(0.0, t_comm - quantization_s.get(self.wire_name, 0.0))
        communication = self.wire_name if self.wire_name in wires.UNCOMPRESSED and self.type_name != "CO2" else None
        predicted = predict(t_compute, t_comm, measured_bytes=measured, model_dtype=self.precision,
                            communication_dtype=communication, quantization_s=quantization_s,
                            block_size=self.block_size, **self.co2_steps())
        return Regime(t_compute_s=t_compute, t_comm_s=t_comm, round_bytes=measured, updates=updates,
                      predicted_s=predicted, quantization_s=dict(quantization_s), type_name=self.type_name,
                      wire_name=self.wire_name)

    def decide_wire(self) -> None:
        """At the end of the measurement window, between jobs: agree on the figures with every rank,
        predict, choose the wire under "auto" (runtime/wire.py) and keep the message for the log.
        Every rank calls it at the same points with the same answer to whether the window is over."""
        monitor = self.regime_monitor
        if monitor.decided or self.running is not None or self.network_communicator().world_size == 1:
            return
        steps = self.progress.global_steps
        breakdown = self.time.snapshot()
        complete = monitor.complete(steps, breakdown)
        if not complete and not (self.wire_mode == wires.AUTO and monitor.early(steps, breakdown)):
            return
        updates, t_compute, t_comm = monitor.window(steps, self.time.snapshot(wait_for_device=True))
        self._decide(steps, updates, t_compute, t_comm, final=complete)

    def decide_wire_from_probe(self) -> None:
        """Under "auto", before the first job that crosses the network when no job could be measured
        yet (CO2's first averaging, which may be several seconds on a slow link): T_compute from the
        window's updates so far, T_comm from a timed reduce-scatter and all-gather of a sixteenth of the
        job's bytes (:func:`~deepspeed_acco.runtime.wire.probe_link`) scaled to the whole job. Only a
        clear call is made from it (:func:`~deepspeed_acco.runtime.wire.clear_early`); otherwise the
        first jobs decide as usual. Every rank calls it at the same point."""
        monitor = self.regime_monitor
        communicator = self.network_communicator()
        if (self.wire_mode != wires.AUTO or monitor.decided or self.running is not None
                or communicator.world_size == 1):
            return
        steps = self.progress.global_steps
        compute = monitor.compute_so_far(steps, self.time.snapshot(wait_for_device=True))
        if compute is None:
            return
        updates, t_compute = compute
        t_comm, sent = self._probe_job_seconds(communicator)
        self._decide(steps, updates, t_compute, t_comm, final=False, probe_bytes=sent)

    def _probe_job_seconds(self, communicator: Communicator) -> tuple:
        """(one job's collectives on this wire predicted from a probe of the link, bytes the probe sent
        per rank). The probe's time counts as this boundary's wait for the link."""
        members = communicator.world_size
        job_values = sum(flat.padded_numel for flat in self.flats)
        job_bytes = job_values * self.measured_round_bytes() * (members - 1) / members
        values = wires.probe_values(job_bytes, members)
        seconds = wires.probe_link(communicator, values, self.device)
        self._boundary_wait_s += seconds
        sent = values * 8.0 * (members - 1) / members
        return seconds * job_bytes / sent, int(sent)

    def _decide(self, steps: int, updates: int, t_compute: float, t_comm: float, *, final: bool,
                probe_bytes: int = 0) -> None:
        """Agree on the figures, predict, and under "auto" choose the wire (``final``: the window is
        over; otherwise only a clear call is made); log the regime once decided."""
        monitor = self.regime_monitor
        compressed = list(wires.COMPRESSED)
        quantization, extra, fits = self._wire_costs()
        agreed = wires.agree(self.control, wires.WireDecision(t_compute_s=t_compute, t_comm_s=t_comm,
                                                              quantization_s=quantization, extra_bytes=extra,
                                                              fits=fits), compressed)
        regime = self._regime(updates, agreed.t_compute_s, agreed.t_comm_s, agreed.quantization_s)
        if self.wire_mode == wires.AUTO:
            candidates = wires_of(self.type_name, self.precision)
            own = {name: regime.predicted_s[f"{self.type_name} ({name})"] for name in candidates}
            if not final and not wires.clear_early(own, candidates, fits=agreed.fits):
                return  # a closer call: measure the whole window (every rank has the same figures)
            name, reason, refused = wires.choose(own, candidates, fits=agreed.fits)
            if probe_bytes:
                reason += f" (T_comm from a {probe_bytes / 2**20:.2f} MiB probe of the link before the first job)"
            choice = wires.WireChoice(wire=name, reason=reason, decided_at_update=steps, measured_wire=self.wire_name,
                                      t_compute_s=agreed.t_compute_s, t_comm_s=agreed.t_comm_s, predicted_s=own,
                                      quantization_s=agreed.quantization_s, extra_bytes=agreed.extra_bytes,
                                      refused_for_memory=refused, type_name=self.type_name,
                                      num_parameters=sum(flat.numel for flat in self.flats), probe_bytes=probe_bytes)
            if name != self.wire_name:
                self.switch_wire(name)
            self.wire_choice = choice
            regime.wire = choice.as_dict()
        monitor.logged = regime
        self.regime_log = regime.describe(self.type_name)

    def _wire_costs(self) -> tuple:
        """(quantisation seconds, extra bytes, fits in memory) per compressed wire on this rank, measured
        once (the early checks of the measurement window reuse them)."""
        if self._wire_cost_cache is None:
            quantization, extra, fits = {}, {}, {}
            free = wires.free_memory_bytes(self.device)
            numels = [flat.padded_numel for flat in self.flats]
            members = self.network_communicator().world_size
            for name in wires.COMPRESSED:
                bits = wires.bits_of(name)
                quantization[name] = wires.quantization_job_s(bits, self.block_size, numels, members, self.device)
                extra[name] = self.wire_extra_bytes(bits)
                fits[name] = wires.fits_in_memory(extra[name], free)
            self._wire_cost_cache = (quantization, extra, fits)
        return self._wire_cost_cache

    def wire_extra_bytes(self, bits: int) -> int:
        """Bytes per rank the buffers of a ``bits`` wire would add to this schedule's."""
        flat = self.flats[0]
        return wires.compression_extra_bytes([f.padded_numel for f in self.flats], self.communicator.world_size, bits,
                                             self.block_size, model_bytes=flat.model_dtype.itemsize,
                                             communication_bytes=flat.job_grad.dtype.itemsize,
                                             gather_shared=flat.gather_shares_job_grad)

    def switch_wire(self, name: str) -> None:
        """Run the jobs on the compressed wire ``name`` from now on: its buffers are allocated here
        (fp32 gradient snapshot and reduced shard, residual, packed buffers). Between jobs only."""
        bits = wires.bits_of(name)
        assert bits is not None and self.running is None, "a wire is switched between jobs, to a compressed one"
        config = CompressionConfig(gradients=True, weights=True,
                                   format=QuantizationFormat(bits=bits, block_size=self.block_size))
        for flat, shard in zip(self.flats, self.shards):
            flat.set_communication_dtype(torch.float32)
            shard.reduced = torch.zeros(flat.shard_numel, dtype=torch.float32, device=flat.device)
        self.compression = group_compressions(config, self.communicator, [flat.padded_numel for flat in self.flats],
                                              self.device)
        self.wire_name = name

    @property
    def communication_torch_dtype(self) -> torch.dtype:
        """The dtype of the gradient snapshot the jobs reduce (fp32 on a compressed wire)."""
        return self.flats[0].job_grad.dtype

    def wire_state(self) -> Dict[str, Any]:
        """The wire in plain data, for checkpoints."""
        return {"mode": self.wire_mode, "wire": self.wire_name,
                "choice": None if self.wire_choice is None else self.wire_choice.as_dict()}

    def restore_wire(self, saved: Optional[Dict[str, Any]]) -> None:
        """A resumed "auto" run keeps the wire its checkpoint chose (before residuals are loaded); a
        checkpoint written before the choice leaves it to be made again. A fixed wire stays fixed."""
        if not saved or self.wire_mode != wires.AUTO or not saved.get("choice"):
            return
        choice = wires.WireChoice.from_dict(saved["choice"])
        if choice.wire != self.wire_name and self.running is None:
            self.switch_wire(choice.wire)
        self.wire_choice = choice
        self.regime_monitor.logged = Regime(t_compute_s=choice.t_compute_s, t_comm_s=choice.t_comm_s,
                                            round_bytes=0.0, updates=0, predicted_s=dict(choice.predicted_s),
                                            quantization_s=dict(choice.quantization_s), wire=choice.as_dict(),
                                            type_name=self.type_name, wire_name=choice.measured_wire)
        self.regime_log = (f"{self.type_name}: resumed on the {choice.wire} wire its checkpoint chose at update "
                           f"{choice.decided_at_update} ({choice.reason})")

    def fix_wire_from_environment(self) -> None:
        """Under "auto", :data:`~deepspeed_acco.runtime.wire.ENVIRONMENT` fixes the wire for the whole run
        (called by the builder once the schedule is complete)."""
        fixed = wires.environment_wire()
        if self.wire_mode != wires.AUTO or fixed is None:
            return
        if fixed != "uncompressed" and self.network_communicator().world_size > 1:
            self.switch_wire(fixed)
        self.wire_mode = self.wire_name

    def take_regime_log(self) -> Optional[str]:
        message, self.regime_log = self.regime_log, None
        return message
