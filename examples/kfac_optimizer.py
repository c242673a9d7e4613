"""A KFAC-preconditioned optimizer on gradhooks' factors, against SGD and Adam, on real digits.

    python examples/kfac_optimizer.py [--steps 300] [--out kfac_optimizer.png] [--sweep]

Trains the CNN of PyTorch's per-sample-gradients tutorial (``gradhooks.tools.workloads.DigitsCNN``) on
scikit-learn's 1797 handwritten digits upsampled to 28x28 (``gradhooks.tools.workloads.load_digits_batch``;
1500 for training, 297 held out), with the same minibatches for every optimizer, and saves a PNG
of the training loss and test accuracy against steps and against wall time (evaluation not
counted). Needs scikit-learn, tqdm and matplotlib (``pip install 'gradhooks[examples]'``).

KFAC (Martens & Grosse 2015, arXiv:1503.05671; KFC for the convolutions, Grosse & Martens 2016):

* every ``--factor-every`` steps, one extra backward pass with targets sampled from the model's
  predictive distribution (Monte-Carlo Fisher, their sec. 5; ``--fisher empirical`` uses the
  loss's own backward instead) gives ``gh.kfac_factors()``; the factors are kept as exponential
  moving averages (decay ``--ema``, their sec. 5);
* every ``--inv-every`` steps the averaged factors are eigendecomposed, ``A = Q_A a Q_A^T``,
  ``G = Q_G g Q_G^T``; in between the step uses the last decomposition;
* the step for a layer with gradient matrix ``V = [dW db]`` is the damped natural gradient
  ``(A ⊗ G + damping I)^-1 vec V = Q_G [(Q_G^T V Q_A) / (g a^T + damping)] Q_A^T`` (damping
  added to the exact eigenvalues of the Kronecker product rather than factored Tikhonov);
* the update is applied with momentum 0.9; optionally (``--kl-clip``) it is first rescaled so
  that the predicted KL change ``lr^2 <update, grad>`` stays below a bound (Ba, Grosse & Martens,
  ICLR 2017; kfac-pytorch's ``kl_clip``). With this problem's defaults the damping alone keeps
  the steps stable; clipping at 1e-2 / 1e-3 left the loss after 100 steps 1.2x / 2.2x higher;
* ``fc1`` has 9216 inputs: a dense ``9217 x 9217`` factor (340 MB; a Cholesky inverse alone took
  27 s on 2 cores, an eigendecomposition longer) is avoided with ``max_dense``: factors larger
  than ``--max-dense`` are kept diagonal (a diagonal ``A`` with the full ``G`` for ``fc1``).

The learning rates in ``LR`` are the best of a sweep (``--sweep``: every value of ``SWEEP`` for
``--sweep-steps`` steps, lowest final smoothed training loss wins), run with this script's
defaults (``--sweep --threads 1``): SGD (momentum 0.9) 0.03, Adam 3e-3, KFAC 0.01. On 2 shared
CPU cores a KFAC step (factors every 5 steps, eigendecompositions every 5) costs about twice
an SGD step; per step it reaches the lowest training loss.
"""
import argparse
import math
import sys
import time

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402

import gradhooks  # noqa: E402
from gradhooks import DiagonalFactors  # noqa: E402
from gradhooks.tools.workloads import DigitsCNN, load_digits_batch  # noqa: E402

# chosen by --sweep (see the module docstring); smoothed training loss after 100 steps:
# SGD   lr 0.01: 0.171, 0.03: 0.103, 0.1: diverged, 0.3: diverged
# Adam  lr 3e-4: 0.107, 1e-3: 0.052, 3e-3: 0.015, 1e-2: 0.074
# KFAC  lr 3e-3: 0.092, 0.01: 0.053, 0.03: diverged, 0.1: diverged
LR = {"SGD": 0.03, "Adam": 3e-3, "KFAC": 0.01}
SWEEP = {"SGD": [0.01, 0.03, 0.1, 0.3], "Adam": [3e-4, 1e-3, 3e-3, 1e-2],
         "KFAC": [0.003, 0.01, 0.03, 0.1]}


class KFAC:
    """KFAC preconditioner with momentum on the factors of ``gradhooks.kfac_factors``.

    Args:
        model: the model (hooked here with ``gradhooks.attach``; ``detach()`` when done).
        lr: learning rate.
        damping: added to the eigenvalues of ``A ⊗ G``.
        ema: decay of the factors' moving averages.
        factor_every / inv_every: steps between factor updates / eigendecompositions.
        kl_clip: bound on the predicted KL change ``lr^2 sum <update, grad>`` of one step
            (0: no clipping).
        max_dense: factors larger than this are kept as their diagonal.
        generator: for the sampled targets of the Monte-Carlo Fisher.
    """

    def __init__(self, model, lr, damping=0.1, ema=0.95, factor_every=5, inv_every=5, momentum=0.9,
                 kl_clip=0.0, max_dense=4096, kfac_approx="expand", fisher="mc", generator=None):
        self.model, self.lr, self.damping, self.ema, self.fisher = model, lr, damping, ema, fisher
        self.factor_every, self.inv_every, self.momentum = factor_every, inv_every, momentum
        self.kl_clip, self.max_dense, self.kfac_approx = kl_clip, max_dense, kfac_approx
        self.generator = generator
        self.gh = gradhooks.attach(model, check=False)
        self.params = dict(model.named_parameters())
        self.factors, self.eig, self.buf, self.steps = {}, {}, {}, 0
        self.diagonal: set = set()  # names of the entries that are diagonal blocks

    def step(self, x, y):
        """One training step on the batch ``(x, y)``; returns the batch loss."""
        out = self.model(x)
        loss = F.cross_entropy(out, y)
        if not torch.isfinite(loss):  # diverged: leave it to the caller
            return loss.detach()
        refresh = self.steps % self.factor_every == 0
        if refresh and self.fisher == "mc":  # one backward with sampled targets, before the loss's
            probs = out.detach().softmax(1)
            sampled = torch.multinomial(probs, 1, generator=self.generator).squeeze(1)
            torch.autograd.grad(F.cross_entropy(out, sampled), list(self.params.values()),
                                retain_graph=True)
            self._update_factors(self.gh.kfac_factors(self.kfac_approx, max_dense=self.max_dense))
        for p in self.params.values():
            p.grad = None
        loss.backward()
        if refresh and self.fisher == "empirical":  # the loss's own backward pass
            self._update_factors(self.gh.kfac_factors(self.kfac_approx, max_dense=self.max_dense))
        if self.steps % self.inv_every == 0:
            self.eig = {name: (_eig(f.A, f.diagonal_A), _eig(f.G, f.diagonal_G))
                        for name, f in self.factors.items() if name not in self.diagonal}
        grads = {n: p.grad for n, p in self.params.items()}
        update = dict(grads)  # parameters without factors keep their gradient
        for name, f in self.factors.items():
            if name in self.diagonal:  # (norm layers and the like: their exact diagonal block)
                update.update(f.precondition(grads, self.damping))
                continue
            (qa, la), (qg, lg) = self.eig[name]
            v = _rotate(f.grad_matrix(grads), qg, qa, transpose=True)
            v = v / (lg[..., :, None] * la[..., None, :] + self.damping)
            update.update(f.split(_rotate(v, qg, qa, transpose=False)))
        kl = sum((update[n] * grads[n]).sum() for n in grads) * self.lr ** 2 if self.kl_clip else 0
        nu = min(1.0, math.sqrt(self.kl_clip / kl.item())) if self.kl_clip and kl > 0 else 1.0
        with torch.no_grad():
            for n, p in self.params.items():
                buf = self.buf.get(n)
                if buf is None:
                    buf = self.buf[n] = update[n] * nu
                else:
                    buf.mul_(self.momentum).add_(update[n], alpha=nu)
                p.sub_(buf, alpha=self.lr)
        self.steps += 1
        return loss.detach()

    def _update_factors(self, new):
        for name, f in new.items():
            old = self.factors.get(name)
            if isinstance(f, DiagonalFactors):
                self.diagonal.add(name)
                if old is not None:
                    for n, d in f.diagonal.items():
                        f.diagonal[n] = old.diagonal[n].mul_(self.ema).add_(d, alpha=1 - self.ema)
            elif old is not None:
                f.A = old.A.mul_(self.ema).add_(f.A, alpha=1 - self.ema)
                f.G = old.G.mul_(self.ema).add_(f.G, alpha=1 - self.ema)
            self.factors[name] = f


def _eig(m, diagonal):
    """(Q, eigenvalues) of a symmetric factor (batched over groups); Q is None for a diagonal."""
    if diagonal:
        return None, m.clamp(min=0)
    lam, q = torch.linalg.eigh(m)
    return q, lam.clamp(min=0)


def _rotate(v, qg, qa, transpose):
    # Q_G^T V Q_A (transpose=True) or Q_G V Q_A^T; a None Q is the identity
    if qg is not None:
        v = (qg.mT if transpose else qg) @ v
    if qa is not None:
        v = v @ (qa if transpose else qa.mT)
    return v


class Torch:
    """A torch.optim optimizer behind the same ``step(x, y)`` interface."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def step(self, x, y):
        loss = F.cross_entropy(self.model(x), y)
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return loss.detach()


def make(name, model, lr, args):
    if name == "SGD":
        return Torch(model, torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9))
    if name == "Adam":
        return Torch(model, torch.optim.Adam(model.parameters(), lr=lr))
    return KFAC(model, lr, damping=args.damping, ema=args.ema, factor_every=args.factor_every,
                inv_every=args.inv_every, kl_clip=args.kl_clip, max_dense=args.max_dense,
                kfac_approx=args.kfac_approx, fisher=args.fisher,
                generator=torch.Generator().manual_seed(args.seed))


@torch.no_grad()
def evaluate(model, x, y, chunk=512):
    """(mean cross-entropy, accuracy) of ``model`` on ``(x, y)``."""
    loss, correct = 0.0, 0
    for i in range(0, len(x), chunk):
        out = model(x[i:i + chunk])
        loss += F.cross_entropy(out, y[i:i + chunk], reduction="sum").item()
        correct += (out.argmax(1) == y[i:i + chunk]).sum().item()
    return loss / len(x), correct / len(x)


def train(name, lr, steps, data, args, progress=True):
    """Train a fresh DigitsCNN; returns the curves and the final numbers."""
    x_tr, y_tr, x_te, y_te = data
    torch.manual_seed(args.seed)
    model = DigitsCNN()
    opt = make(name, model, lr, args)
    batches = torch.Generator().manual_seed(args.seed + 1)
    order, pos = torch.randperm(len(x_tr), generator=batches), 0
    curve = {"step": [], "time": [], "loss": [], "eval_step": [], "eval_time": [], "acc": []}
    smooth, elapsed = None, 0.0
    bar = tqdm(range(1, steps + 1), desc=f"{name} lr={lr:g}", file=sys.stderr, disable=not progress,
               dynamic_ncols=True)
    for step in bar:
        if pos + args.batch > len(order):
            order, pos = torch.randperm(len(x_tr), generator=batches), 0
        idx = order[pos:pos + args.batch]
        pos += args.batch
        t0 = time.perf_counter()
        loss = opt.step(x_tr[idx], y_tr[idx]).item()
        elapsed += time.perf_counter() - t0
        if not math.isfinite(loss):
            smooth = math.inf
            break
        smooth = loss if smooth is None else 0.9 * smooth + 0.1 * loss
        curve["step"].append(step)
        curve["time"].append(elapsed)
        curve["loss"].append(smooth)
        if step % args.eval_every == 0 or step == steps:
            _, acc = evaluate(model, x_te, y_te)
            curve["eval_step"].append(step)
            curve["eval_time"].append(elapsed)
            curve["acc"].append(acc)
            bar.set_postfix(loss=f"{smooth:.3f}", test_acc=f"{acc:.3f}")
    if isinstance(opt, KFAC):
        opt.gh.detach()
    train_loss, _ = evaluate(model, x_tr, y_tr)
    _, acc = evaluate(model, x_te, y_te)
    return {"name": name, "lr": lr, "steps": len(curve["step"]), "time": elapsed,
            "train_loss": train_loss if math.isfinite(smooth) else math.inf, "acc": acc,
            "smooth": smooth, "curve": curve}


def table(results):
    header = ("optimizer", "steps", "time (s)", "train loss", "test acc")
    rows = [(f"{r['name']} (lr {r['lr']:g})", str(r["steps"]), f"{r['time']:.1f}",
             f"{r['train_loss']:.2e}", f"{r['acc']:.3f}") for r in results]
    widths = [max(map(len, col)) for col in zip(header, *rows)]
    def line(cells):
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(header), rule, *map(line, rows)])


def plot(results, path):
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for r in results:
        c = r["curve"]
        axes[0, 0].plot(c["step"], c["loss"], label=r["name"])
        axes[0, 1].plot(c["time"], c["loss"], label=r["name"])
        axes[1, 0].plot(c["eval_step"], c["acc"], marker=".", label=r["name"])
        axes[1, 1].plot(c["eval_time"], c["acc"], marker=".", label=r["name"])
    for ax in axes[0]:
        ax.set_yscale("log")
        ax.set_ylabel("training loss (EMA of batch losses)")
    for ax in axes[1]:
        ax.set_ylabel("test accuracy")
    for ax in axes[:, 0]:
        ax.set_xlabel("step")
    for ax in axes[:, 1]:
        ax.set_xlabel("wall time (s), evaluation excluded")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("DigitsCNN on sklearn digits (28x28): SGD vs Adam vs KFAC (gradhooks factors)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--train-size", type=int, default=1500, help="training digits used (<= 1500)")
    parser.add_argument("--eval-every", type=int, default=20)
    parser.add_argument("--out", default="kfac_optimizer.png", help="path of the PNG plot")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--sweep", action="store_true", help="tune each learning rate first")
    parser.add_argument("--sweep-steps", type=int, default=100)
    parser.add_argument("--damping", type=float, default=0.1)
    parser.add_argument("--ema", type=float, default=0.95)
    parser.add_argument("--factor-every", type=int, default=5)
    parser.add_argument("--inv-every", type=int, default=5)
    parser.add_argument("--kl-clip", type=float, default=0.0, help="0: no KL clipping")
    parser.add_argument("--max-dense", type=int, default=4096)
    parser.add_argument("--kfac-approx", choices=["expand", "reduce"], default="expand")
    parser.add_argument("--fisher", choices=["mc", "empirical"], default="mc",
                        help="Monte-Carlo Fisher (one extra backward) or empirical Fisher (none)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    x, y = load_digits_batch(torch.float32, batch=1797)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(123))
    tr, te = perm[:args.train_size], perm[1500:]
    data = (x[tr], y[tr], x[te], y[te])
    print(f"digits: {len(tr)} train / {len(te)} test, batch {args.batch}, {args.steps} steps, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")

    lrs = dict(LR)
    if args.sweep:
        for name, grid in SWEEP.items():
            scores = {lr: train(name, lr, args.sweep_steps, data, args, progress=False)["smooth"]
                      for lr in grid}
            lrs[name] = min(scores, key=scores.get)
            print(f"sweep {name}: " + ", ".join(f"lr {lr:g}: {s:.4f}" for lr, s in scores.items())
                  + f" -> {lrs[name]:g}")
    results = [train(name, lrs[name], args.steps, data, args) for name in ("SGD", "Adam", "KFAC")]
    plot(results, args.out)
    print()
    print(table(results))
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
