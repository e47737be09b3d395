"""Single-process study of ACCO's rule (docs/design.md, 3.3) against data-parallel AdamW on the bench's setting.

One GPT-Neo preset trained on exactly the micro-batches, learning-rate schedule, clipping and
initial weights of the bench's W ranks (``deepspeed_acco/bench``), with AdamW written out on one
flat fp32 vector (torch.optim.AdamW semantics), so that the only difference between the methods
is where each half of the batch's gradient is computed. Nothing from ``deepspeed_acco.runtime``
or ``ops`` is used: an independent check of the engine's long-run behaviour, and a fast way to
test a hypothesis about ACCO's gap on long schedules.

Methods (``--method``), each update t taking every rank's next ``--grad-accum`` micro-batches,
split into the first half A_t and the second half B_t:

* ``zero1``: theta_{t+1} = AdamW(theta_t, mean g(theta_t; A_t + B_t));
* ``acco``: A_t at the estimate theta~_t, B_t at theta_t,
  theta~_{t+1} = Peek(theta_t, m_t, v_t, mean g(theta~_t; A_t)) (AdamW on copies),
  theta_{t+1} = AdamW(theta_t, mean of both halves) (docs/design.md, 3.3);
* ``stale-half``: A_t at theta_{t-1} instead of an estimate (what ACCO's Peek improves on: half
  the batch one update stale, as DPU makes all of it).

``--wire int8|int4`` reduces each half's gradients as the engine's compressed jobs do (docs/wire.md,
"Compressed communication"): every rank sends the other ranks' chunks of its own gradient sum
block-quantised (symmetric codes, one fp32 scale per ``--block-size`` values, round half to even)
with error feedback, and each owner adds them to its own exact chunk (each half its own job and residual, for ``zero1``
too). ``--residual bf16`` keeps
each rank's error-feedback residual in bf16 (rounded after every call) instead of fp32: what a
bf16 residual would cost in loss. The parameters' all-gather stays exact here.

Prints the validation loss at ``--eval-points`` updates and, per update, the distance of the
estimate from the parameters it estimates (``acco``). Writes one JSON file (``--out``).

    python benchmarks/studies/acco_study.py --method acco --ctx 64 --updates 720 --out acco.json
"""
import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root
sys.path.insert(0, str(Path(__file__).resolve().parent))

from co2_study import CLIP_EPSILON, Evaluator, copy_into, run_and_write  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", choices=["zero1", "acco", "stale-half"], required=True)
    p.add_argument("--model", default="3m")
    p.add_argument("--ctx", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--grad-accum", type=int, default=2, help="micro-batches per rank per update (even)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--updates", type=int, default=720)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--betas", type=float, nargs=2, default=(0.9, 0.95))
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--clip", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true",
                   help="compute the gradients with the model in bf16 (the masters, moments and sums stay fp32)")
    p.add_argument("--eval-points", type=int, default=12)
    p.add_argument("--val-windows", type=int, default=40, help="the bench's default")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="")
    p.add_argument("--save-final", default="",
                   help="also write the final fp32 parameter vector here (torch.save), "
                        "for benchmarks/studies/position_loss.py")
    p.add_argument("--probe-every", type=int, default=0,
                   help="acco: every N updates also compute the first half's gradient at the committed "
                        "parameters (same micro-batches) and record how far the estimate moves it, against the "
                        "half-batch noise (gradient_probe in the JSON; 0: off)")
    p.add_argument("--wire", choices=["exact", "int8", "int4"], default="exact",
                   help="the gradients' reduce-scatter: exact, or block-quantised with error feedback")
    p.add_argument("--residual", choices=["fp32", "bf16"], default="fp32",
                   help="the dtype the error-feedback residual is kept in (with --wire int8/int4)")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    if args.grad_accum % 2:
        p.error("--grad-accum must be even (ACCO's two halves)")
    return args


class FlatAdamW:
    """torch.optim.AdamW on one flat fp32 vector (decoupled decay, bias correction)."""

    def __init__(self, args, theta):
        import torch
        self.args = args
        self.theta = theta
        self.m = torch.zeros_like(theta)
        self.v = torch.zeros_like(theta)
        self.step_count = 0

    def _apply(self, theta, m, v, grad, step, lr):
        b1, b2 = self.args.betas
        theta.mul_(1 - lr * self.args.weight_decay)
        m.mul_(b1).add_(grad, alpha=1 - b1)
        v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
        denom = (v / (1 - b2 ** step)).sqrt_().add_(self.args.eps)
        theta.addcdiv_(m, denom, value=-lr / (1 - b1 ** step))

    def step(self, grad, lr):
        self.step_count += 1
        self._apply(self.theta, self.m, self.v, grad, self.step_count, lr)

    def peek(self, grad, lr):
        theta = self.theta.clone()
        self._apply(theta, self.m.clone(), self.v.clone(), grad, self.step_count + 1, lr)
        return theta


class Model:
    """The bench's model and every rank's micro-batch stream; gradients at any flat vector."""

    def __init__(self, args, corpus):
        import torch
        from deepspeed_acco.bench.workload.data import WindowSampler
        from deepspeed_acco.bench.workload.models import build_model
        self.torch = torch
        self.args = args
        self.model = build_model(args.model, args.ctx, args.seed)
        self.fp32_params = [p.detach().clone() for p in self.model.parameters()]
        if args.bf16:
            self.model.to(torch.bfloat16)
        self.model.train()
        self.params = list(self.model.parameters())
        self.samplers = [WindowSampler(corpus.train, args.ctx, args.micro_batch, seed=args.seed, rank=r)
                         for r in range(args.world_size)]
        self.cursor = [0] * args.world_size

    def flat(self):
        """The fp32 master vector (with --bf16, of the seeded fp32 weights the bench starts from)."""
        return self.torch.nn.utils.parameters_to_vector(self.fp32_params).detach().clone()

    def gradient_sum(self, at, micro_batches_per_rank: int, reduce=None):
        """Sum of the gradients of every rank's next micro-batches at ``at``; count; mean loss.
        ``reduce`` (a :class:`CompressedReduce`) sums the ranks' own sums as its wire does."""
        torch = self.torch
        copy_into(at, self.params)
        losses = []
        numel = sum(p.numel() for p in self.params)
        grad = torch.zeros(numel, dtype=torch.float32)
        own = []
        for rank, sampler in enumerate(self.samplers):
            if reduce is not None:
                grad = torch.zeros(numel, dtype=torch.float32)
                own.append(grad)
            for _ in range(micro_batches_per_rank):
                x = torch.from_numpy(sampler.micro_batch_at(self.cursor[rank]))
                self.cursor[rank] += 1
                loss = self.model(input_ids=x, labels=x).loss
                loss.backward()
                losses.append(float(loss.detach()))
                # Each micro-batch's gradient (bf16 with --bf16) into an fp32 sum, as the engine does.
                grad += torch.nn.utils.parameters_to_vector([p.grad for p in self.params]).float()
                for p in self.params:
                    p.grad = None
        if reduce is not None:
            grad = reduce(own)
        return grad, len(losses), sum(losses) / len(losses)


def quantize_blocks(values, bits: int, block_size: int):
    """What the owner receives for ``values`` (fp32): per block, codes round_half_even(v * inv) with
    inv = max_code / absmax, each standing for code * (absmax / max_code); an all-zero block sends 0."""
    import torch
    max_code = 127.0 if bits == 8 else 7.0
    n = values.numel()
    padded = torch.nn.functional.pad(values, (0, (-n) % block_size)).view(-1, block_size)
    absmax = padded.abs().amax(dim=1, keepdim=True)
    safe = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    scale = torch.where(absmax > 0, safe / max_code, torch.zeros_like(absmax))
    codes = torch.round(padded * (max_code / safe))
    return (codes * scale).view(-1)[:n]


class CompressedReduce:
    """The sum over ranks of their gradient sums as the owners of W equal chunks receive it: the own
    chunk exact, every other rank's chunk quantised from its sum plus that rank's residual, the
    residual keeping what was not sent (in ``residual_dtype``)."""

    def __init__(self, numel: int, world_size: int, bits: int, block_size: int, residual_dtype):
        import torch
        self.world_size, self.bits, self.block_size = world_size, bits, block_size
        self.chunk = -(-numel // world_size)
        self.numel = numel
        self.residuals = [torch.zeros(self.chunk * world_size, dtype=residual_dtype) for _ in range(world_size)]

    def __call__(self, own_sums):
        import torch
        total = torch.zeros(self.chunk * self.world_size, dtype=torch.float32)
        for rank, own in enumerate(own_sums):
            v = torch.nn.functional.pad(own, (0, self.chunk * self.world_size - self.numel))
            residual = self.residuals[rank]
            for owner in range(self.world_size):
                part = slice(owner * self.chunk, (owner + 1) * self.chunk)
                if owner == rank:
                    total[part] += v[part]
                    continue
                with_residual = v[part] + residual[part].float()
                sent = quantize_blocks(with_residual, self.bits, self.block_size)
                residual[part] = (with_residual - sent).to(residual.dtype)
                total[part] += sent
        return total[:self.numel]


def clipped_mean(args, total, count):
    """As the engine: divide by the count, clip by the norm of that mean (torch's epsilon)."""
    mean = total / count
    norm = float(mean.norm())
    if args.clip > 0 and norm > args.clip:
        mean.mul_(args.clip / (norm + CLIP_EPSILON))
    return mean


def run(args):
    import torch
    from deepspeed_acco.bench.workload.data import load_corpus
    from deepspeed_acco.bench.workload.methods import warmup_decay_lr

    torch.set_num_threads(args.threads)
    corpus = load_corpus(None)
    model = Model(args, corpus)
    evaluator = Evaluator(args, corpus)
    opt = FlatAdamW(args, model.flat())
    points = max(1, int(args.eval_points))
    to_eval = {round(i * args.updates / points) for i in range(points + 1)}
    half = args.grad_accum // 2
    reduces = [None, None]  # one wire per half: the estimate job's and the commit's own residuals
    if args.wire != "exact":
        dtype = torch.bfloat16 if args.residual == "bf16" else torch.float32
        reduces = [CompressedReduce(opt.theta.numel(), args.world_size, int(args.wire[3:]), args.block_size, dtype)
                   for _ in range(2)]
    estimate = opt.theta.clone()  # theta~_0 = theta_0
    previous = opt.theta.clone()  # theta_{t-1} (stale-half)
    evals, estimate_error, train_losses, probes = {}, [], [], []
    t0 = time.perf_counter()
    for update in range(args.updates + 1):
        if update in to_eval:
            evals[str(update)] = evaluator(opt.theta)
            if not args.quiet:
                print(f"eval @{update}: {evals[str(update)]:.4f}  ({time.perf_counter() - t0:.0f} s)", flush=True)
        if update == args.updates:
            break
        lr = warmup_decay_lr(update, args.lr, args.warmup, args.updates)
        at_first = {"zero1": opt.theta, "acco": estimate, "stale-half": previous}[args.method]
        probe = args.method == "acco" and args.probe_every > 0 and update > 0 and update % args.probe_every == 0
        cursor = list(model.cursor) if probe else None
        first, first_count, loss_a = model.gradient_sum(at_first, half, reduces[0])
        if probe:  # the same micro-batches again, at the committed parameters
            after_first, model.cursor = model.cursor, cursor
            at_theta, _, _ = model.gradient_sum(opt.theta, half)
            model.cursor = after_first
        second, second_count, loss_b = model.gradient_sum(opt.theta, half, reduces[1])
        if probe:
            displacement = float((estimate - opt.theta).norm())
            error = float((first - at_theta).norm()) / first_count
            noise = float((at_theta / first_count - second / second_count).norm()) / 2
            probes.append(dict(update=update, lr=lr, displacement=displacement, gradient_error=error,
                               half_noise=noise, error_over_noise=error / noise,
                               curvature=error / displacement if displacement else None))
        train_losses.append((loss_a + loss_b) / 2)
        if args.method == "acco":
            next_estimate = opt.peek(clipped_mean(args, first, first_count), lr)
        previous = opt.theta.clone()
        opt.step(clipped_mean(args, first + second, first_count + second_count), lr)
        if args.method == "acco":
            estimate = next_estimate
            estimate_error.append(dict(update=update + 1, lr=lr, error=float((estimate - opt.theta).norm()),
                                       step=float((opt.theta - previous).norm())))
    if args.save_final:
        torch.save(opt.theta, args.save_final)
    return dict(args=vars(args), evals=evals, train_losses=train_losses, estimate_error=estimate_error,
                gradient_probe=probes, wall_s=time.perf_counter() - t0)


def main(argv=None):
    return run_and_write(parse_args(argv), run)


if __name__ == "__main__":
    sys.exit(main())
