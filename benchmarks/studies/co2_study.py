"""Single-process study of CO2's outer update (DESIGN 3.5) and its variants on the bench's setting.

W replicas (one GPT-Neo preset + ``torch.optim.AdamW`` each) train in one process on exactly the
batches, learning-rate schedule, clipping and initial weights the bench's ranks use
(``deepspeed_acco/bench``), and the outer averaging is done in plain torch on flat vectors. No
distributed code and nothing from ``deepspeed_acco.runtime`` or ``ops`` is used, so the study is
an independent check of the engine as well as a fast way to compare outer rules.

Methods (``--method``):

* ``zero1``: synchronous data-parallel AdamW, the gradient averaged over all W x accumulation
  micro-batches (what DeepSpeed ZeRO-1 computes);
* ``lone``: rank 0's replica training alone, no communication (the bench's compute-only run);
* ``outer``: W replicas with ``--local-steps`` tau inner steps per round and an outer rule:

  ``--delay 1`` (CO2, DESIGN 3.5): boundary k averages y_k, d_k = x_k - ybar_k and moves the
  anchor *one round late*: x_{k+2} = x_{k+1} - alpha * step, replicas restart from x_{k+1};
  ``--delay 0`` (synchronous Local SGD / DiLoCo): x_{k+1} = x_k - alpha * step, replicas restart
  from x_{k+1};
  ``--eager`` (with delay 1): replica i restarts round k+1 from the committed anchor X_k (every
  average that has arrived: rounds < k) moved by a share w (``--eager-weight``) of its *own*
  pseudo-gradient, s^i_{k+1} = X_k - alpha * step(w d^i_k) with the committed momentum left
  unchanged (d^i_k = s^i_k - y^i_k, from where the replica began); the average of round k moves
  the committed anchor, X_{k+1} = X_k - alpha * step(mean_i d^i_k), when it arrives at
  boundary k+1. w = 1/W is the rule of "Eager Updates for Overlapped Communication and
  Computation in DiLoCo" (arXiv 2502.12996) for an SGD outer optimizer.

  with step = m_{k+1} (heavy ball) or d/lambda + beta * m_{k+1} (``--nesterov``), where
  m_{k+1} = clamp(beta * m_k + d / lambda, -c, c); ``--gap-penalty`` lambda is a number or
  ``adaptive`` (DESIGN 3.5); ``--lr-normalize`` divides d by the mean inner lr of its round
  and multiplies the step by it again (SlowMo).

Logged per outer round: ||d||, lambda, ||m||, ||anchor step||, the largest inner displacement,
the replicas' spread, and the mean train loss; at ``--eval-points`` updates the validation loss
of the committed parameters (CO2: the newest anchor, as ``engine.committed_parameters()`` gives
it), of the replicas' average ybar and of replica 0. Writes one JSON file (``--out``).

    python benchmarks/studies/co2_study.py --method outer --delay 1 --updates 240 --out co2.json
    python benchmarks/studies/co2_study.py --method zero1 --updates 240 --out zero1.json
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

# torch.nn.utils.clip_grad_norm_ and the engine add this to the norm before dividing.
CLIP_EPSILON = 1e-6
# Added to the largest inner displacement so the adaptive penalty is defined for a still model.
DISPLACEMENT_EPSILON = 1e-12


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", choices=["zero1", "lone", "outer"], required=True)
    p.add_argument("--model", default="3m")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--updates", type=int, default=240)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-points", type=int, default=24)
    p.add_argument("--val-windows", type=int, default=40, help="the bench's default")
    p.add_argument("--round-val-windows", type=int, default=0,
                   help="also evaluate anchor and ybar after every round on this many windows (0: off)")
    g = p.add_argument_group("outer rule (--method outer)")
    g.add_argument("--local-steps", type=int, default=12)
    g.add_argument("--outer-lr", type=float, default=1.0)
    g.add_argument("--outer-momentum", type=float, default=0.5)
    g.add_argument("--gap-penalty", default="adaptive")
    g.add_argument("--clip-threshold", type=float, default=None)
    g.add_argument("--nesterov", action="store_true")
    g.add_argument("--lr-normalize", action="store_true")
    g.add_argument("--delay", type=int, choices=[0, 1], default=1)
    g.add_argument("--eager", action="store_true")
    g.add_argument("--merge-after", type=int, default=0,
                   help="(delay 1) do not restart the replicas at the boundary: J_k's anchor x_{k+1} arrives H "
                        "inner steps into round k+1, and each replica then moves to x_{k+1} plus its own progress "
                        "since the boundary (H = local steps is --eager with share 1)")
    g.add_argument("--eager-weight", type=float, default=1.0,
                   help="--eager: the share w of its own pseudo-gradient a replica applies at once (1: all of it; "
                        "1/W: the Eager Updates paper's rule, the other replicas' shares arriving a round later)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.gap_penalty != "adaptive":
        args.gap_penalty = float(args.gap_penalty)
    if args.eager and args.delay != 1:
        p.error("--eager applies to the one-round delay (--delay 1)")
    if args.merge_after and (args.eager or args.delay != 1 or args.merge_after > args.local_steps):
        p.error("--merge-after H takes --delay 1, no --eager, and 1 <= H <= --local-steps")
    if args.merge_after and args.gap_penalty == "adaptive":
        p.error("--merge-after takes a constant --gap-penalty")
    if args.eager and args.gap_penalty == "adaptive":
        p.error("--eager takes a constant --gap-penalty")
    return args


def copy_into(vector, params) -> None:
    """Copy a flat vector into parameters (``vector_to_parameters`` would make them views of it)."""
    import torch
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(vector[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    assert offset == vector.numel()


class Replica:
    """One model + AdamW fed by the micro-batch streams of ``ranks`` (a CO2 replica, or ZeRO-1)."""

    def __init__(self, args, ranks, corpus, initial_state):
        import torch
        from deepspeed_acco.bench.workload.data import WindowSampler
        from deepspeed_acco.bench.workload.models import build_model
        self.torch = torch
        self.args = args
        self.model = build_model(args.model, args.ctx, args.seed)
        self.model.load_state_dict(initial_state)
        self.model.train()
        self.params = list(self.model.parameters())
        self.optimizer = torch.optim.AdamW(self.params, lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                                           weight_decay=args.weight_decay, foreach=False)
        self.samplers = {r: WindowSampler(corpus.train, args.ctx, args.micro_batch, seed=args.seed, rank=r)
                         for r in ranks}
        self.cursor = {r: 0 for r in ranks}

    def inner_step(self, lr: float) -> float:
        """One AdamW step on the mean gradient of the next accumulation micro-batches of every rank.

        As the engine does it: sum the micro-batch gradients, divide by their number, clip by the
        norm of that mean (torch's epsilon), then AdamW. Returns the mean micro-batch loss."""
        torch = self.torch
        for p in self.params:
            p.grad = None
        losses = []
        for rank, sampler in self.samplers.items():
            for _ in range(self.args.grad_accum):
                x = torch.from_numpy(sampler.micro_batch_at(self.cursor[rank]))
                self.cursor[rank] += 1
                loss = self.model(input_ids=x, labels=x).loss
                loss.backward()
                losses.append(float(loss.detach()))
        count = len(losses)
        grads = [p.grad for p in self.params]
        sumsq = sum(float(torch.linalg.vector_norm(g))**2 for g in grads)
        norm = math.sqrt(sumsq) / count
        scale = 1.0 / count
        if self.args.clip > 0 and norm > self.args.clip:
            scale *= self.args.clip / (norm + CLIP_EPSILON)
        for g in grads:
            g.mul_(scale)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        return sum(losses) / count

    def flat(self):
        return self.torch.nn.utils.parameters_to_vector(self.params).detach().clone()

    def load(self, vector):
        copy_into(vector, self.params)


class Evaluator:
    def __init__(self, args, corpus):
        from deepspeed_acco.bench.workload.data import validation_windows
        from deepspeed_acco.bench.workload.models import build_model
        import torch
        self.torch = torch
        self.model = build_model(args.model, args.ctx, args.seed)
        self.params = list(self.model.parameters())
        self.windows = validation_windows(corpus.val, args.ctx, args.val_windows)
        self.batch_size = max(1, 2 * args.micro_batch)

    def __call__(self, vector, windows: Optional[int] = None) -> float:
        from deepspeed_acco.bench.running.train import evaluate
        copy_into(vector, self.params)
        data = self.windows if windows is None else self.windows[:: max(1, len(self.windows) // windows)][:windows]
        return evaluate(self.model, data, self.batch_size)


class OuterRule:
    """The outer optimizer on flat fp32 vectors: x <- x - alpha * step(m, d), m = clamp(beta m + d/lambda)."""

    def __init__(self, args, start):
        import torch
        self.args = args
        self.momentum = torch.zeros_like(start)

    def step(self, d, penalty: float, lr_scale: float, commit: bool = True):
        """The anchor step alpha * (...) for pseudo-gradient d; updates the momentum when ``commit``."""
        a = self.args
        g = d / (penalty * lr_scale) if a.lr_normalize else d / penalty
        m = self.momentum.mul(a.outer_momentum).add_(g)
        if a.clip_threshold is not None:
            m.clamp_(-a.clip_threshold, a.clip_threshold)
        direction = g + a.outer_momentum * m if a.nesterov else m
        if commit:
            self.momentum = m
        return direction.mul(a.outer_lr * (lr_scale if a.lr_normalize else 1.0))


def norm(t) -> float:
    return float(t.norm())


def run(args) -> Dict:
    import torch
    from deepspeed_acco.bench.workload.data import load_corpus
    from deepspeed_acco.bench.workload.methods import warmup_decay_lr
    from deepspeed_acco.bench.workload.models import build_model

    torch.set_num_threads(args.threads)
    corpus = load_corpus(None)
    initial_state = build_model(args.model, args.ctx, args.seed).state_dict()
    evaluator = Evaluator(args, corpus)
    points = max(1, int(args.eval_points))  # evenly spaced, 0 (the initial weights) included
    to_eval = {round(i * args.updates / points) for i in range(points + 1)}
    W = args.world_size
    if args.method == "zero1":
        replicas = [Replica(args, list(range(W)), corpus, initial_state)]
    elif args.method == "lone":
        replicas = [Replica(args, [0], corpus, initial_state)]
    else:
        replicas = [Replica(args, [r], corpus, initial_state) for r in range(W)]
    x0 = replicas[0].flat()
    outer = args.method == "outer"

    # Outer state. delay 1: anchors[k] is x_k (x_0 = x_1 = theta_0); delay 0: anchors[k] is x_k.
    anchors = {0: x0.clone(), 1: x0.clone()} if outer and args.delay == 1 else {0: x0.clone()}
    rule = OuterRule(args, x0) if outer else None
    starts = [x0.clone() for _ in replicas]  # where each replica began the current round
    committed = x0.clone()  # what engine.committed_parameters() would give
    eager_anchor = x0.clone()  # --eager: X_k, the anchor with every average that has arrived
    merge_anchor = x0.clone()  # --merge-after: x_k, the newest anchor computed
    pending = None  # --merge-after: (x_{k+1}, the replicas' y_k) until the merge
    rounds: List[Dict] = []
    evals: Dict[int, Dict] = {}
    round_lrs: List[float] = []
    round_losses: List[float] = []
    t0 = time.perf_counter()

    def record_eval(update, ys=None):
        """Validation of the committed parameters, and (outer) of ybar and replica 0: at a round
        boundary those of the round that just ended (``ys``, before the replicas restart)."""
        ys = ys if ys is not None else [r.flat() for r in replicas]
        ybar = torch.stack(ys).mean(0)
        row = {"committed": evaluator(committed if outer else ys[0])}
        if outer:
            row["ybar"] = evaluator(ybar)
            row["replica0"] = evaluator(ys[0])
        evals[update] = row
        if not args.quiet:
            print(f"eval @{update}: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()) +
                  f"  ({time.perf_counter() - t0:.0f} s)", flush=True)

    if 0 in to_eval:
        record_eval(0)
    for update in range(args.updates):
        lr = warmup_decay_lr(update, args.lr, args.warmup, args.updates)
        losses = [r.inner_step(lr) for r in replicas]
        round_lrs.append(lr)
        round_losses.append(sum(losses) / len(losses))
        if pending is not None and (update + 1) % args.local_steps == args.merge_after % args.local_steps:
            # J_{k}'s anchor arrives: keep the progress made since boundary k on top of it.
            x_next, ends = pending
            for r, y in zip(replicas, ends):
                r.load(x_next + (r.flat() - y))
            pending = None
        if outer and (update + 1) % args.local_steps == 0:
            k = len(rounds)
            ys = [r.flat() for r in replicas]
            ybar = torch.stack(ys).mean(0)
            lr_scale = sum(round_lrs) / len(round_lrs)
            displacements = [norm(y - s) for y, s in zip(ys, starts)]
            spread = norm(ys[0] - ys[1]) if len(ys) > 1 else 0.0
            info = dict(round=k, update=update + 1, lr=lr_scale, train_loss=sum(round_losses) / len(round_losses),
                        max_displacement=max(displacements), spread=spread)
            if args.merge_after:
                # d_k = x_k - ybar_k: every replica's round is tau steps of its own progress on top of x_k.
                x_k = merge_anchor
                d = x_k - ybar
                penalty = args.gap_penalty
                step = rule.step(d, penalty, lr_scale)
                merge_anchor = x_k - step
                pending = (merge_anchor, ys)
                new_starts = None
                committed = merge_anchor
            elif args.delay == 1 and not args.eager:
                x_k, x_next = anchors[k], anchors[k + 1]
                d = x_k - ybar
                if args.gap_penalty == "adaptive":
                    penalty = 1.0 + norm(x_next - x_k) / (max(displacements) + DISPLACEMENT_EPSILON)
                else:
                    penalty = args.gap_penalty
                step = rule.step(d, penalty, lr_scale)
                anchors[k + 2] = x_next - step
                new_starts = [x_next] * len(replicas)
                committed = anchors[k + 2]
                info.update(anchor_move=norm(x_next - x_k))
            elif args.delay == 1:  # eager
                # Replica i's own pseudo-gradient, from where it began this round.
                ds = [s - y for s, y in zip(starts, ys)]
                d = torch.stack(ds).mean(0)  # = X_k - ybar_k: the starts average to X_k
                penalty = args.gap_penalty
                # X_k, the anchor with the averages of rounds < k (J_{k-1} has just finished), and
                # the momentum M_k: each replica moves it by its own d^i_k at once ...
                new_starts = [eager_anchor - rule.step(args.eager_weight * di, penalty, lr_scale, commit=False)
                              for di in ds]
                # ... while J_k averages round k: X_{k+1}, M_{k+1}, installed at boundary k+1.
                step = rule.step(d, penalty, lr_scale)
                eager_anchor = eager_anchor - step
                committed = eager_anchor
                info.update(eager_offset=max(norm(s - committed) for s in new_starts))
            else:
                x_k = anchors[k]
                d = x_k - ybar
                penalty = args.gap_penalty if args.gap_penalty != "adaptive" else 1.0
                step = rule.step(d, penalty, lr_scale)
                anchors[k + 1] = x_k - step
                new_starts = [anchors[k + 1]] * len(replicas)
                committed = anchors[k + 1]
            info.update(d_norm=norm(d), penalty=penalty, m_norm=norm(rule.momentum), step_norm=norm(step),
                        ybar_minus_committed=norm(ybar - committed))
            if args.round_val_windows:
                info["val_committed"] = evaluator(committed, args.round_val_windows)
                info["val_ybar"] = evaluator(ybar, args.round_val_windows)
            if update + 1 in to_eval:
                record_eval(update + 1, ys)
            if new_starts is not None:
                for r, s in zip(replicas, new_starts):
                    r.load(s)
                starts = [s.clone() for s in new_starts]
            else:
                starts = ys
            # Keep only the anchors still needed (x_{k+1}, x_{k+2}).
            for key in [key for key in anchors if key < max(anchors) - 1]:
                del anchors[key]
            rounds.append(info)
            round_lrs, round_losses = [], []
            if not args.quiet:
                print("round {round:3d} @{update:4d}: lr {lr:.2e} loss {train_loss:.4f} |d| {d_norm:.4f} "
                      "lambda {penalty:.3f} |m| {m_norm:.4f} |step| {step_norm:.4f} maxdisp {max_displacement:.4f} "
                      "spread {spread:.4f} |ybar-x| {ybar_minus_committed:.4f}".format(**info) +
                      (" val x {val_committed:.4f} ybar {val_ybar:.4f}".format(**info) if args.round_val_windows
                       else ""), flush=True)
        if update + 1 in to_eval and str(update + 1) not in evals and update + 1 not in evals:
            record_eval(update + 1)
    return dict(args=vars(args), rounds=rounds, evals={str(k): v for k, v in sorted(evals.items())},
                wall_s=time.perf_counter() - t0)


def run_and_write(args, run_fn) -> int:
    """Run one study (``run_fn(args)`` returns a JSON-able dict) and write it to ``args.out``."""
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    result = run_fn(args)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def main(argv=None):
    return run_and_write(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
