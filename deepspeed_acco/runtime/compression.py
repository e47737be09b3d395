"""Compressed collectives of the communication jobs (docs/wire.md, "Compressed communication").

Two collectives on the process group a :class:`~.comm.Communicator` holds, with the block
quantisation of :mod:`deepspeed_acco.ops.quantization` (int8 or int4 codes, one fp32 scale per
block of 32..512 values; the format is in docs/kernels.md):

* :class:`QuantizedReduceScatter` (the gradients; ``zero_quantized_gradients``). Every rank adds
  its error-feedback residual to its input, quantises the chunk destined for each other rank and
  sends it straight to that owner in one all-to-all, so quantisation error never compounds hop by
  hop as it would in a ring; the owner sums what it receives, dequantised, onto its own chunk,
  which it never quantises, in fp32 and in rank order. The residual keeps what was not sent
  (v - dequantised(v)) and is added to the next call's input, so over many calls the summed
  output tracks the exact sum within one quantisation step per peer (error feedback: Seide et al.
  2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes SignSGD"). ZeRO++ (Wang et
  al. 2023) quantises the gradient reduce-scatter the same way, all-to-all, without error feedback.

* :class:`DeltaAllGather` (the parameters; ``zero_quantized_weights``). Every rank holds the same
  copy of the parameters (the model's flat buffer, in the model dtype). The owner of a shard
  quantises ``new - held`` (its exact fp32 master minus what every replica currently holds), the
  packed deltas are all-gathered, and every rank, the owner included, applies the same dequantised
  deltas with the same kernel, so all replicas stay bitwise identical. The owner's master stays
  exact; the held copy lands within half a quantisation step of it (plus the model dtype's own
  rounding). The quantisation error needs no residual of its own: it is exactly ``master - held``,
  and the next delta is taken against the held copy, so it is sent with the next delta and the
  held copy never drifts further than one step from the master. (SDP4Bit, Jia et al. 2024, sends
  quantised weight differences for the same reason: a difference has a smaller range than the
  weights, so the same bits buy a finer step.) For ACCO's commit the delta is theta_{t+1} minus
  the estimate every replica holds, which is small.

Memory per rank (P = values of the flat vector, W = ranks, S = P / W; int8, block 128):

* ``QuantizedReduceScatter``: the residual, (W - 1) * S fp32 (the part of the rank's own gradient
  that goes to other ranks; none for its own chunk), plus send and receive buffers of
  (W - 1) * packed_bytes(S) bytes each (about 1.03 bytes per value each).
* ``DeltaAllGather``: no state; a send buffer of packed_bytes(S) bytes and a gather buffer of
  W * packed_bytes(S) bytes.

Bytes each rank sends per call: (W - 1) * packed_bytes(S) for either collective, against
(W - 1) * S * 4 for fp32 (:func:`job_wire_bytes`): 3.88x fewer with int8, 7.53x with int4 at
block 128. Both collectives are device-agnostic (gloo on CPU, NCCL on CUDA, kernels on the
current stream) and make no host synchronisation.

The update jobs hold one :class:`GroupCompression` per flat group (docs/wire.md, "Compressed communication"): it
adapts the residual to the round's loss scale and owns the fp32 buffer the update rule writes the
new shard into; checkpoints store its :meth:`~GroupCompression.state_dict`.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import torch

from .. import ops
from ..ops import quantization


@dataclass(frozen=True)
class QuantizationFormat:
    """How values are quantised on the wire."""

    bits: int = 8
    """8: int8 codes in [-127, 127]; 4: int4 codes in [-7, 7], two per byte."""
    block_size: int = quantization.DEFAULT_BLOCK_SIZE
    """Values per fp32 scale: a power of two in [32, 512]."""

    def __post_init__(self):
        quantization.check_format(self.bits, self.block_size)

    def packed_bytes(self, numel: int) -> int:
        """Bytes of one packed chunk of ``numel`` values (scales, codes, padding)."""
        return ops.packed_bytes(numel, bits=self.bits, block_size=self.block_size)

    def kernel_args(self) -> Dict[str, int]:
        return {"bits": self.bits, "block_size": self.block_size}

    @property
    def bytes_per_value(self) -> float:
        """Bytes per value on the wire for long chunks: codes plus the scale's share (1.03125 for
        int8 at block 128, 0.53125 for int4); a chunk adds at most 15 bytes of padding."""
        return self.bits / 8 + 4 / self.block_size


def job_wire_bytes(numel: int, world_size: int, fmt: Optional[QuantizationFormat]) -> Dict[str, int]:
    """Bytes one rank sends per reduce-scatter and per all-gather of a flat vector of ``numel``
    values (a multiple of ``world_size``); ``fmt=None`` is the uncompressed fp32 case."""
    if numel % world_size:
        raise ValueError(f"numel ({numel}) must be a multiple of world_size ({world_size})")
    chunk_numel = numel // world_size
    per_chunk = 4 * chunk_numel if fmt is None else fmt.packed_bytes(chunk_numel)
    return {"reduce_scatter": (world_size - 1) * per_chunk, "all_gather": (world_size - 1) * per_chunk}


def _check_flat(name: str, tensor, numel: int, dtypes, device: torch.device) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != 1 or not tensor.is_contiguous() or tensor.numel() != numel:
        raise ValueError(f"{name} must be a 1-D contiguous tensor of {numel} values, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        raise ValueError(f"{name} must have dtype in {[str(d) for d in dtypes]}, got {tensor.dtype}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")


def _check_geometry(communicator, numel: int) -> int:
    world_size = communicator.world_size
    if not 0 <= communicator.rank < world_size:
        raise ValueError(f"this process is not a member of communicator {communicator.name!r} "
                         f"(rank {communicator.rank}); build compressed collectives only on its members")
    if numel <= 0 or numel % world_size:
        raise ValueError(f"numel must be a positive multiple of the world size {world_size} (one equal chunk per "
                         f"rank, as the flat groups pad it), got {numel}")
    return numel // world_size


class QuantizedReduceScatter:
    """Error-feedback quantised reduce-scatter of one flat fp32 vector of ``numel`` values.

    ``reduce_scatter(output, input)`` has :meth:`Communicator.reduce_scatter`'s meaning (sum over
    ranks, keep this rank's chunk), up to quantisation error: with error feedback, what one call
    does not send is sent by later calls. ``error_feedback=False`` drops it instead (for
    comparisons; not for training).
    """

    def __init__(self, communicator, numel: int, *, fmt: QuantizationFormat, device, error_feedback: bool = True):
        self.communicator = communicator
        self.fmt = fmt
        self.numel = numel
        self.device = torch.device(device)
        self.chunk_numel = _check_geometry(communicator, numel)
        world_size = communicator.world_size
        self.error_feedback = error_feedback
        # Chunks of the other ranks in rank order: chunks [0, rank) then (rank, W).
        self.residual: Optional[torch.Tensor] = (torch.zeros(
            (world_size - 1) * self.chunk_numel, dtype=torch.float32, device=self.device)
                                                 if error_feedback else None)
        packed = fmt.packed_bytes(self.chunk_numel)
        self._send = torch.zeros(world_size - 1, packed, dtype=torch.uint8, device=self.device)
        self._receive = torch.zeros(world_size - 1, packed, dtype=torch.uint8, device=self.device)
        self._split_bytes = [0 if peer == communicator.rank else packed for peer in range(world_size)]

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends per call (the other ranks' packed chunks)."""
        return self._send.numel()

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """output (fp32, S values) = own chunk of ``input`` + the other ranks' chunks, dequantised.

        ``input`` (fp32, ``numel`` values) is only read. Blocks holding an inf or NaN arrive as
        NaN, so the caller's non-finite check sees them; their residual is kept.
        """
        _check_flat("input", input, self.numel, (torch.float32, ), self.device)
        _check_flat("output", output, self.chunk_numel, (torch.float32, ), self.device)
        rank, world_size, chunk = self.communicator.rank, self.communicator.world_size, self.chunk_numel
        own = input[rank * chunk:(rank + 1) * chunk]
        if world_size == 1:
            output.copy_(own)
            return
        kernel_args = self.fmt.kernel_args()
        with torch.profiler.record_function("acco::quantize"):
            # Two calls, one for the chunks before ours and one for those after, into the rows of
            # the send buffer in rank order (the all-to-all's order).
            for rows, values, residual in self._peer_ranges(input):
                ops.quantize(values, self._send[rows], residual=residual, **kernel_args)
        self.communicator.all_to_all(self._receive.view(-1), self._send.view(-1), output_split_sizes=self._split_bytes,
                                     input_split_sizes=self._split_bytes, collective="quantized_reduce_scatter")
        with torch.profiler.record_function("acco::dequantize_sum"):
            ops.dequantize_sum(self._receive, output, base=own, **kernel_args)

    def _peer_ranges(self, input: torch.Tensor):
        rank, chunk = self.communicator.rank, self.chunk_numel
        before, after = slice(0, rank), slice(rank, self.communicator.world_size - 1)
        for rows, values in ((before, input[:rank * chunk]), (after, input[(rank + 1) * chunk:])):
            if values.numel() == 0:
                continue
            start = rows.start * chunk
            residual = None if self.residual is None else self.residual[start:start + values.numel()]
            yield rows, values, residual

    def state_dict(self) -> Dict[str, Any]:
        """The error-feedback residual and the geometry it belongs to (a checkpoint's per-rank part)."""
        return {
            "bits": self.fmt.bits,
            "block_size": self.fmt.block_size,
            "numel": self.numel,
            "rank": self.communicator.rank,
            "world_size": self.communicator.world_size,
            "residual": None if self.residual is None else self.residual.clone(),
        }

    def check_state_dict(self, state: Dict[str, Any]) -> None:
        """Raise ``ValueError`` if :meth:`load_state_dict` would refuse ``state`` (changes nothing)."""
        expected = {"numel": self.numel, "rank": self.communicator.rank, "world_size": self.communicator.world_size}
        found = {key: state.get(key) for key in expected}
        if found != expected:
            raise ValueError(f"quantized reduce-scatter state is for {found}, this one is {expected}: the residual "
                             "is per rank and per shard geometry, so resume with the same world size and layout")
        residual = state.get("residual")
        if (residual is None) != (self.residual is None):
            raise ValueError("quantized reduce-scatter state and this collective disagree on error feedback: "
                             f"state has {'no ' if residual is None else ''}residual, error_feedback="
                             f"{self.error_feedback}")
        if residual is not None and (not torch.is_tensor(residual) or residual.shape != self.residual.shape):
            shape = tuple(residual.shape) if torch.is_tensor(residual) else type(residual).__name__
            raise ValueError(f"residual has shape {shape}, expected {tuple(self.residual.shape)}")

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s residual; the geometry must match (same rank and world size)."""
        self.check_state_dict(state)
        residual = state.get("residual")
        if residual is not None:
            # The format may change across a resume: the residual is plain fp32 values either way.
            self.residual.copy_(residual)


class DeltaAllGather:
    """All-gather of new parameter shards as quantised deltas against the copy every rank holds.

    ``all_gather(output, new_shard, held)``: ``held`` (the full flat parameters, fp32, bf16 or
    fp16, bitwise identical on every rank) is what every replica holds now, ``new_shard`` (fp32)
    this rank's new values for its chunk; ``output`` (held's dtype and length, may be ``held``)
    receives held + dequantised deltas for every chunk, bitwise identical on every rank.
    """

    def __init__(self, communicator, numel: int, *, fmt: QuantizationFormat, device):
        self.communicator = communicator
        self.fmt = fmt
        self.numel = numel
        self.device = torch.device(device)
        self.chunk_numel = _check_geometry(communicator, numel)
        packed = fmt.packed_bytes(self.chunk_numel)
        self._send = torch.zeros(1, packed, dtype=torch.uint8, device=self.device)
        self._gathered = torch.zeros(communicator.world_size, packed, dtype=torch.uint8, device=self.device)

    @property
    def wire_bytes(self) -> int:
        """Bytes this rank sends per call in a ring all-gather: W - 1 packed chunks."""
        return (self.communicator.world_size - 1) * self._send.numel()

    @property
    def last_sent(self) -> torch.Tensor:
        """This rank's packed delta of the last call ([1, packed_bytes(S)] uint8; for tests and stats)."""
        return self._send

    def all_gather(self, output: torch.Tensor, new_shard: torch.Tensor, held: torch.Tensor) -> None:
        _check_flat("held", held, self.numel, quantization.HELD_DTYPES, self.device)
        _check_flat("output", output, self.numel, (held.dtype, ), self.device)
        _check_flat("new_shard", new_shard, self.chunk_numel, (torch.float32, ), self.device)
        rank, chunk = self.communicator.rank, self.chunk_numel
        if self.communicator.world_size == 1:
            # Nothing goes on a wire: the single replica takes the master values exactly.
            output.copy_(new_shard)
            return
        kernel_args = self.fmt.kernel_args()
        with torch.profiler.record_function("acco::quantize_delta"):
            ops.quantize_delta(new_shard, held[rank * chunk:(rank + 1) * chunk], self._send, **kernel_args)
        self.communicator.all_gather(self._gathered.view(-1), self._send.view(-1))
        with torch.profiler.record_function("acco::apply_delta"):
            ops.apply_delta(self._gathered, held, out=output, **kernel_args)


# ---- how the update jobs use the collectives (docs/wire.md, "Compressed communication") ---
@dataclass(frozen=True)
class CompressionConfig:
    """What an engine's jobs compress: ``zero_optimization.zero_quantized_gradients`` /
    ``zero_quantized_weights`` (DeepSpeed's ZeRO++ key names) with the format from
    ``optimizer.params.quantization_bits`` / ``quantization_block_size``."""

    gradients: bool = False
    """Gradient (CO2: displacement) reduce-scatters are quantised, with error feedback."""
    weights: bool = False
    """Parameter all-gathers send quantised deltas against what every rank holds."""
    format: QuantizationFormat = QuantizationFormat()

    @property
    def enabled(self) -> bool:
        return self.gradients or self.weights


class GroupCompression:
    """One flat group's compressed collectives in the jobs of one communicator, and their buffers.

    ``gradients`` (a :class:`QuantizedReduceScatter`, or None) replaces the job's reduce-scatter;
    its residual is kept in the units of the job's input, which for gradients carry the round's
    loss scale: when the scale changes (fp16), the residual is rescaled by the ratio (a power of two,
    so exactly). ``weights`` (a :class:`DeltaAllGather`, or None) replaces the all-gather: the
    update rule writes this rank's new fp32 shard into ``new_shard`` and the owner sends
    ``new_shard - held``, where ``held`` is what every rank holds at that moment and keeps holding
    until the job ends.
    """

    def __init__(self, communicator, numel: int, *, device, config: CompressionConfig):
        self.gradients = (QuantizedReduceScatter(communicator, numel, fmt=config.format, device=device)
                          if config.gradients else None)
        self.weights = DeltaAllGather(communicator, numel, fmt=config.format, device=device) if config.weights else None
        self.new_shard = (torch.zeros(numel // communicator.world_size, dtype=torch.float32, device=device)
                          if config.weights else None)
        self.residual_loss_scale = 1.0
        """The loss scale of the input the residual was left by."""

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, *, loss_scale: float = 1.0) -> None:
        if loss_scale != self.residual_loss_scale:
            self.gradients.residual.mul_(loss_scale / self.residual_loss_scale)
            self.residual_loss_scale = loss_scale
        self.gradients.reduce_scatter(output, input)

    def all_gather(self, output: torch.Tensor, held: torch.Tensor) -> None:
        """``output`` <- ``held`` plus every rank's quantised ``new_shard - held`` (bitwise equal on all ranks)."""
        self.weights.all_gather(output, self.new_shard, held)

    def reset(self) -> None:
        """Forget the residual (the schedule restarts from committed state that did not leave it)."""
        if self.gradients is not None:
            self.gradients.residual.zero_()
        self.residual_loss_scale = 1.0

    def state_dict(self) -> Dict[str, Any]:
        return {"gradients": self.gradients.state_dict() if self.gradients is not None else None,
                "residual_loss_scale": self.residual_loss_scale}

    def load_state_dict(self, state: Dict[str, Any]) -> bool:
        """Restore the residual where both the saved state and this group compress gradients (else it
        starts from zero); returns False if the saved state held a residual that had nowhere to go."""
        self.reset()
        saved = state.get("gradients")
        if saved is None or self.gradients is None:
            return saved is None
        self.gradients.load_state_dict(saved)
        self.residual_loss_scale = float(state["residual_loss_scale"])
        return True


def group_compressions(config: CompressionConfig, communicator, numels: List[int],
                       device) -> Optional[List[GroupCompression]]:
    """Per flat group (``numels``: padded lengths), its :class:`GroupCompression` on ``communicator``;
    None when nothing is compressed, or when the communicator has one member (nothing goes on a wire,
    e.g. CO2's inner steps with ``group_size`` 1)."""
    if not config.enabled or communicator.world_size == 1:
        return None
    return [GroupCompression(communicator, numel, device=device, config=config) for numel in numels]


def compressing(compressions: Optional[List[GroupCompression]], index: int,
                collective: str) -> Optional[GroupCompression]:
    """Group ``index``'s compression if it compresses ``collective`` ("gradients" or "weights"), else None."""
    compression = compressions[index] if compressions is not None else None
    return compression if compression is not None and getattr(compression, collective) is not None else None


def compresses(compressions: Optional[List[GroupCompression]], collective: str) -> bool:
    """Whether any group compresses ``collective`` ("gradients" or "weights")."""
    return any(compressing(compressions, index, collective) is not None for index in range(len(compressions or ())))


def check_group_compressions(compressions: Optional[List[GroupCompression]], saved: Optional[List[Dict]]) -> None:
    """Raise ``ValueError`` if :func:`load_group_compressions` would refuse ``saved`` (changes nothing)."""
    if compressions is None or saved is None:
        return
    if len(saved) != len(compressions):
        raise ValueError(f"compression state for {len(saved)} parameter groups, the engine has {len(compressions)}")
    for compression, entry in zip(compressions, saved):
        gradients = entry.get("gradients")
        if gradients is not None and compression.gradients is not None:
            compression.gradients.check_state_dict(gradients)
            float(entry["residual_loss_scale"])


def load_group_compressions(compressions: Optional[List[GroupCompression]], saved: Optional[List[Dict]]) -> bool:
    """Restore residuals from a checkpoint's per-rank entry; without one they start from zero.
    Returns False if a saved residual was dropped (this engine does not compress gradients)."""
    if compressions is None:
        return saved is None or all(entry.get("gradients") is None for entry in saved)
    if saved is None:
        for compression in compressions:
            compression.reset()
        return True
    return all([compression.load_state_dict(entry) for compression, entry in zip(compressions, saved)])


def wire_bytes(compressions: Optional[List[GroupCompression]], shard_numels: List[int], world_size: int,
               gradient_dtype: torch.dtype, parameter_dtype: torch.dtype) -> Dict[str, int]:
    """Bytes this rank sends per job on a communicator of ``world_size`` ranks: its reduce-scatter and
    its all-gather over every group (transport headers and the small statistics all-reduce left out)."""
    total = {"reduce_scatter": 0, "all_gather": 0}
    for index, shard_numel in enumerate(shard_numels):
        for name, collective, dtype in (("reduce_scatter", "gradients", gradient_dtype),
                                        ("all_gather", "weights", parameter_dtype)):
            compression = compressing(compressions, index, collective)
            total[name] += (getattr(compression, collective).wire_bytes if compression is not None
                            else (world_size - 1) * shard_numel * dtype.itemsize)
    return total


# ---- for tools that build configs (the bench's +q8 / +q4 methods) ------------------------------
def compression_config(bits: int = 8, block_size: int = quantization.DEFAULT_BLOCK_SIZE) -> Dict[str, Any]:
    """The DeepSpeed config fragment that turns on compressed gradients and weights with this format;
    merge it into a config section by section (``optimizer.params`` keeps its other keys)."""
    QuantizationFormat(bits=bits, block_size=block_size)  # validates
    return {"zero_optimization": {"zero_quantized_gradients": True, "zero_quantized_weights": True},
            "optimizer": {"params": {"quantization_bits": bits, "quantization_block_size": block_size}}}
