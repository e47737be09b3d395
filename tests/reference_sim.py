"""An independent single-process simulation of docs/design.md, 3.1-3.5 for the tests.

W simulated workers feed the same micro-batches as the real ranks (``batch(rank, j)``). The
optimizer is plain ``torch.optim.AdamW`` on one model; ACCO's Peek is done the slow, obviously
correct way (deep-copy model and optimizer, step, read, discard), so the simulation shares no
code with the engine's fused path.

Precision (docs/precision.md, "Precision"): the simulated model may compute in bf16 or fp16
(``model_dtype``) while every master, anchor, CO2 y_k and optimizer state stays fp32; the model
holds the round-to-nearest cast of the fp32 values. With fp16 a static ``loss_scale`` S scales
each micro-batch loss before backward and the summed gradients are divided by S afterwards; for a
power of two S this is exactly what an engine that unscales each round by its own scale computes.

Gradients are summed per worker first and the workers' sums are then added in rank order, the
order of an engine that accumulates locally and reduces across ranks (for two ranks the final
addition is commutative, so the sums match the engine's bit for bit).
"""
import copy
import math

import torch

IN_FEATURES, HIDDEN, OUT_FEATURES = 5, 7, 3


class TinyNet(torch.nn.Module):
    """122 trainable parameters (not divisible by 3, padded for 2 and 3 ranks) plus a frozen layer."""

    def __init__(self, seed=0):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Linear(IN_FEATURES, HIDDEN)
        self.hidden = torch.nn.Linear(HIDDEN, HIDDEN)
        self.frozen = torch.nn.Linear(HIDDEN, HIDDEN)
        self.head = torch.nn.Linear(HIDDEN, OUT_FEATURES)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=generator) * 0.5)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        x = torch.tanh(self.embed(x))
        x = torch.tanh(self.hidden(x)) + self.frozen(x)
        return self.head(x)


def param_groups(model, two_groups=True, weight_decay=0.1):
    """Two groups: weight matrices with decay, biases without (the usual split)."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not two_groups:
        return [{"params": [p for _, p in trainable]}]
    return [{"params": [p for n, p in trainable if n.endswith("weight")], "weight_decay": weight_decay},
            {"params": [p for n, p in trainable if n.endswith("bias")], "weight_decay": 0.0}]


_TEACHER = torch.randn(IN_FEATURES, OUT_FEATURES, generator=torch.Generator().manual_seed(99))


def batch(rank, index, micro_batch_size=4, seed=1234):
    """Micro-batch ``index`` of worker ``rank``: a learnable target (a fixed teacher) plus noise."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + index)
    x = torch.randn(micro_batch_size, IN_FEATURES, generator=generator)
    y = torch.tanh(x @ _TEACHER) + 0.1 * torch.randn(micro_batch_size, OUT_FEATURES, generator=generator)
    return x, y


def loss_fn(output, target):
    return torch.nn.functional.mse_loss(output, target)


def flat_trainable(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


class Simulator:
    """Holds the simulated model, its AdamW optimizer and each worker's micro-batch cursor.

    With ``model_dtype=torch.bfloat16`` (or float16) the model computes in that dtype while AdamW
    runs on fp32 master copies (``self.trainable``), the mixed-precision recipe of DeepSpeed's
    bf16/fp16 modes. ``loss_scale``: the static fp16 loss scale (see the module docstring).
    ``lr_scheduler``: a factory ``f(optimizer) -> scheduler``; the scheduler steps once per
    committed update (``adamw``), never for a Peek.
    """

    def __init__(self, world_size, lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1, clipping=0.0,
                 seed=0, two_groups=True, model_dtype=torch.float32, ranks=None, loss_scale=1.0, lr_scheduler=None):
        self.world_size = world_size
        self.ranks = list(range(world_size)) if ranks is None else list(ranks)
        """The workers whose micro-batches this model's gradients average (CO2: one group)."""
        self.model = TinyNet(seed).to(model_dtype)
        self.model_params = [p for p in self.model.parameters() if p.requires_grad]
        master = TinyNet(seed).to(model_dtype).float()  # the engine's masters start from the cast model
        self.optimizer = torch.optim.AdamW(param_groups(master, two_groups, weight_decay), lr=lr, betas=betas,
                                           eps=eps, weight_decay=weight_decay, foreach=False)
        self.clipping = clipping
        self.cursor = {rank: 0 for rank in range(world_size)}
        self.trainable = [p for p in master.parameters() if p.requires_grad]
        self.model_dtype = model_dtype
        self.loss_scale = float(loss_scale)
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        self.committed_updates = 0
        """AdamW steps taken (the bias-correction count of the next update is this + 1)."""

    def get(self):
        return [p.detach().clone() for p in self.trainable]

    def flat(self):
        """The committed (master) parameters as one flat fp32 vector."""
        return torch.cat([p.detach().reshape(-1) for p in self.trainable])

    def set(self, values):
        with torch.no_grad():
            for p, v in zip(self.trainable, values):
                p.copy_(v)

    def lr(self):
        return self.optimizer.param_groups[0]["lr"]

    def skip(self, micro_batches_per_worker):
        """Advance the workers' cursors without using the micro-batches (a dropped partial round)."""
        for rank, count in self._counts(micro_batches_per_worker).items():
            self.cursor[rank] += count

    def _counts(self, micro_batches_per_worker):
        if isinstance(micro_batches_per_worker, dict):
            return {rank: int(count) for rank, count in sorted(micro_batches_per_worker.items())}
        return {rank: micro_batches_per_worker for rank in self.ranks}

    def gradient_sum(self, at, micro_batches_per_worker):
        """Sum over workers of their next micro-batches' gradients at parameters ``at``; and the count.

        ``micro_batches_per_worker``: an int (every worker of ``self.ranks`` contributes that many)
        or a dict {rank: count} (unequal contributions, as with ACCO's dynamic accumulation, or a
        subset of the workers, as after an elastic restart).
        """
        with torch.no_grad():
            for p, v in zip(self.model_params, at):
                p.copy_(v)  # the cast of the fp32 values into the model dtype
        total = [torch.zeros_like(p) for p in self.trainable]
        count = 0
        for rank, num_micro_batches in self._counts(micro_batches_per_worker).items():
            rank_sum = [torch.zeros_like(p) for p in self.trainable]
            for _ in range(num_micro_batches):
                x, y = batch(rank, self.cursor[rank])
                self.cursor[rank] += 1
                self.model.zero_grad()
                loss = loss_fn(self.model(x.to(self.model_dtype)).float(), y)
                (loss * self.loss_scale if self.loss_scale != 1.0 else loss).backward()
                for t, p in zip(rank_sum, self.model_params):
                    t.add_(p.grad)
                count += 1
            for t, s in zip(total, rank_sum):
                t.add_(s)
        if self.loss_scale != 1.0:
            for t in total:
                t.div_(self.loss_scale)
        return total, count

    def _apply(self, mean_grad):
        for p, g in zip(self.trainable, mean_grad):
            p.grad = g.clone()
        if self.clipping > 0:
            torch.nn.utils.clip_grad_norm_(self.trainable, self.clipping)
        self.optimizer.step()

    def adamw(self, mean_grad):
        """theta, m, v <- AdamW(theta, m, v, g): a committed update of the simulated model."""
        self._apply(mean_grad)
        self.committed_updates += 1
        if self.scheduler is not None:
            self.scheduler.step()

    def peek(self, mean_grad):
        """The parameters AdamW would produce, computed on throw-away copies."""
        saved_params = self.get()
        saved_state = copy.deepcopy(self.optimizer.state_dict())
        self._apply(mean_grad)
        estimate = self.get()
        self.set(saved_params)
        self.optimizer.load_state_dict(saved_state)
        return estimate


def run_sharded(sim, accumulation, num_updates):
    """docs/design.md, 3.1 on an existing simulator: ``num_updates`` synchronous AdamW updates from its state."""
    for _ in range(num_updates):
        total, count = sim.gradient_sum(sim.get(), accumulation)
        sim.adamw([t / count for t in total])
    return sim


def simulate_sharded(world_size, accumulation, num_updates, **options):
    return run_sharded(Simulator(world_size, **options), accumulation, num_updates)


def simulate_dpu(world_size, accumulation, num_rounds, warmup=0, **options):
    """docs/design.md, 3.2: g_0 = g(theta_0; B_0), g_t = g(theta_{t-1}; B_t); theta_{t+1} = AdamW(theta_t, g_t).

    Returns the parameters the model holds after ``num_rounds`` rounds (theta_{rounds-1}).
    ``warmup``: that many synchronous updates first; the DPU rounds then start from their result.
    """
    sim = Simulator(world_size, **options)
    run_sharded(sim, accumulation, warmup)
    model_holds = sim.get()  # theta_0 (after the warm-up: theta_warmup)
    for _ in range(num_rounds):
        total, count = sim.gradient_sum(model_holds, accumulation)
        model_holds = sim.get()  # the boundary installs theta_t (committed so far) ...
        sim.adamw([t / count for t in total])  # ... and launches theta_{t+1}
    return model_holds, sim


def simulate_acco(world_size, accumulation, num_updates=None, counts=None, warmup=0, **options):
    """docs/design.md, 3.3, with the parameters the model holds after the step() ending round B_{num_updates-1}.

    The model then holds theta~_{num_updates}; the committed theta_{num_updates} is also returned.
    ``counts`` (docs/design.md, 3.4, dynamic accumulation, or an elastic restart): one pair
    (first_half, second_half) per update, each an int or a {rank: micro-batches} dict, replacing
    the fixed halves of ``accumulation // 2``; every mean divides by the global count.
    """
    if counts is None:
        counts = [(accumulation // 2, accumulation // 2)] * num_updates
    sim = Simulator(world_size, **options)
    run_sharded(sim, accumulation, warmup)  # ``warmup`` synchronous updates first
    estimate = sim.get()  # theta~_0 = theta_0 (after the warm-up: theta_warmup)
    for first_half, second_half in counts:
        first_sum, first_count = sim.gradient_sum(estimate, first_half)  # A_t at theta~_t
        second_sum, second_count = sim.gradient_sum(sim.get(), second_half)  # B_t at theta_t
        estimate = sim.peek([s / first_count for s in first_sum])  # theta~_{t+1}
        sim.adamw([(a + b) / (first_count + second_count) for a, b in zip(first_sum, second_sum)])
    return estimate, sim.get(), sim


def _norm(tensors):
    return math.sqrt(sum(float(t.pow(2).sum()) for t in tensors))


def simulate_co2(world_size, accumulation, num_rounds, *, local_steps, outer_lr, outer_momentum, gap_penalty,
                 clip_threshold=None, group_size=1, anchor_merge_steps=None, nesterov=False, normalize=False,
                 warmup=0, **options):
    """docs/design.md, 3.5 with one replica (model + AdamW) per group. Returns (holds, committed,
    replicas): the parameters replica 0 holds after the last boundary (the anchor x_R it was reset
    to; in eager mode its own parameters) and the newest anchor (the one the last job computes).

    ``model_dtype`` (in ``options``, like ``loss_scale``): the dtype the replicas' models compute
    in. Whatever it is, the inner AdamW masters, y_k (a replica's fp32 masters at the end of a
    round), the anchors, the outer momentum and the adaptive penalty's norms are fp32, and a
    replica restarts each round from the fp32 anchor (docs/precision.md, "Precision").

    Options (docs/design.md, 3.5): ``anchor_merge_steps`` H (eager: x_{k+1} = x_k - alpha_o m_{k+1}
    from round k's own pseudo-gradient, merged H inner steps into round k+1 as x_{k+1} + the
    replica's progress since boundary k); ``nesterov`` (step along d / lambda + beta_o m);
    ``normalize`` (SlowMo: d / (lambda gamma_k) into the momentum, the step times gamma_k, gamma_k
    the mean inner learning rate of round k); ``warmup`` synchronous steps over all workers first.
    """
    replicas = [Simulator(world_size, ranks=range(first, first + group_size), **options)
                for first in range(0, world_size, group_size)]
    for _ in range(warmup):  # every replica takes the step of the gradient averaged over all workers
        sums = [replica.gradient_sum(replica.get(), accumulation) for replica in replicas]
        total = [sum(parts) for parts in zip(*(part for part, _ in sums))]
        count = sum(count for _, count in sums)
        for replica in replicas:
            replica.adamw([t / count for t in total])
    anchors = {0: replicas[0].get(), 1: replicas[0].get()}
    momentum = [torch.zeros_like(t) for t in anchors[0]]
    eager = anchor_merge_steps is not None
    pending = None  # eager: (x_{k+1}, each replica's y_k) waiting to be merged
    anchor = anchors[0]  # eager: the anchor the replicas' round started from

    def merge():
        new_anchor, ys = pending
        for replica, y in zip(replicas, ys):
            replica.set([x + (p - b) for x, p, b in zip(new_anchor, replica.get(), y)])
        return new_anchor

    for k in range(num_rounds):
        lr_total = 0.0
        for step in range(1, local_steps + 1):
            lr_total += replicas[0].lr()
            for replica in replicas:
                total, count = replica.gradient_sum(replica.get(), accumulation)
                replica.adamw([t / count for t in total])
            if eager and pending is not None and step == anchor_merge_steps:
                anchor, pending = merge(), None
        gamma = lr_total / local_steps if normalize else 1.0
        ys = [replica.get() for replica in replicas]
        ybar = [sum(parts) / len(ys) for parts in zip(*ys)]
        x_k, x_next = (anchor, anchor) if eager else (anchors[k], anchors[k + 1])
        if gap_penalty == "adaptive":
            largest = max(float(_norm([a - b for a, b in zip(y, x_k)])) for y in ys)
            penalty = 1.0 + float(_norm([a - b for a, b in zip(x_next, x_k)])) / (largest + 1e-12)
        else:
            penalty = gap_penalty
        steps = []
        for m, x, mean in zip(momentum, x_k, ybar):
            d = (x - mean) / penalty / gamma
            m.mul_(outer_momentum).add_(d)
            if clip_threshold is not None:
                m.clamp_(-clip_threshold, clip_threshold)
            steps.append(d + outer_momentum * m if nesterov else m.clone())
        new_anchor = [x - outer_lr * gamma * step for x, step in zip(x_next, steps)]
        if eager:
            pending = (new_anchor, ys)
        else:
            anchors[k + 2] = new_anchor
            for replica in replicas:
                replica.set(x_next)  # inner AdamW moments are kept
    if eager:
        newest = pending[0] if pending is not None else anchor
        return replicas[0].get(), newest, replicas
    return anchors[num_rounds], anchors[num_rounds + 1], replicas
