"""Per-sample Jacobians, NTK / Gram matrices and laplace-torch fits: gradhooks against torch.func
and laplace-torch's other backends (median of repeats, CPU, float32, one process; peak memory
in fresh processes).

    python benchmarks/jacobians_laplace.py [--repeats 5] [--no-memory]

Models: the digits MLP (64-32-10, tanh), the small digits CNN of examples/laplace_digits.py and
a small Transformer classifier (the 8 rows of a digit as tokens: Linear(8, 32), one
``nn.TransformerEncoderLayer`` with 4 heads, mean over tokens, Linear(32, 10)), batch 64 of
scikit-learn's digits.

* Jacobians ``(B, C, P)`` of the logits: gradhooks, torch.func ``vmap(jacrev)``, laplace-torch's
  ASDL and BackPACK backends' ``jacobians`` (ASDL's gradient per output dimension; BackPACK's
  ``BatchGrad`` per output dimension) and curvlinops' ``TransposedJacobianLinearOperator``
  applied to the identity (one vjp per row ``(n, c)``). Memory: peak RSS of one call above the
  warmed-up process, in a fresh process per method, beside the result's own size.
* The empirical NTK ``(B, B, C, C)``: gradhooks' ``ntk`` (no ``(B, C, P)`` Jacobian), torch.func
  (``vmap(jacrev)`` then ``einsum``) and ASDL's Jacobians then ``einsum`` (its
  ``empirical_direct_ntk`` fails in the installed asdl); the Gram matrix
  ``(B, B)`` of per-sample loss gradients: gradhooks' ``gram`` after a backward against
  torch.func ``vmap(grad)`` then ``G G^T``.
* Laplace: fit on 256 digits (batch 64) per Hessian structure, last layer (laplace's default)
  and all weights, gradhooks against laplace-torch's curvlinops, ASDL and BackPACK backends.
"""
import argparse
import os
import statistics
import sys
import time
import types

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))
from curvlinops import TransposedJacobianLinearOperator  # noqa: E402
from laplace import Laplace  # noqa: E402
from laplace.curvature import AsdlGGN, BackPackGGN, CurvlinopsGGN  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import gradhooks  # noqa: E402
from gradhooks.integrations.laplace_backend import GradHooksGGN  # noqa: E402


class MeanTokens(nn.Module):
    def forward(self, x):
        return x.mean(1)


def models():
    return {"mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)),
            "cnn": lambda: nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128, 10)),
            "transformer": lambda: nn.Sequential(
                nn.Flatten(1, 2), nn.Linear(8, 32),
                nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True),
                MeanTokens(), nn.Linear(32, 10))}


def jacobian_methods(model, xb, yb):
    """name -> a call computing the (B, C, P) Jacobians (or raising where a backend lacks a
    layer)."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def ours():
        with gradhooks.attach(model, check=False) as gh:
            return gh.per_sample_jacobians(model(xb), flat=True)

    def func():
        f = lambda p, xi: functional_call(model, p, (xi[None],))[0]  # noqa: E731
        jac = vmap(jacrev(f), in_dims=(None, 0))(params, xb)
        return torch.cat([j.flatten(2) for j in jac.values()], 2)

    def curvlinops():
        op = TransposedJacobianLinearOperator(model, list(model.parameters()), [(xb, yb)],
                                              check_deterministic=False)
        return (op @ torch.eye(op.shape[1])).T  # (B C, P), rows (n, c)

    methods = {"gradhooks": ours, "torch.func vmap(jacrev)": func}
    for name, backend in (("ASDL", AsdlGGN), ("BackPACK BatchGrad", BackPackGGN)):
        try:
            peer = backend(make_like(model), "classification")
            methods[name] = lambda peer=peer: peer.jacobians(xb)[0]
        except Exception as e:  # noqa: BLE001 (a backend without this layer)
            methods[name] = lambda e=e: (_ for _ in ()).throw(e)
    methods["curvlinops"] = curvlinops
    return methods


def ntk_methods(model, xb, yb):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def ours():
        with gradhooks.attach(model, check=False) as gh:
            return gh.ntk(model(xb))

    def func():
        f = lambda p, xi: functional_call(model, p, (xi[None],))[0]  # noqa: E731
        jac = vmap(jacrev(f), in_dims=(None, 0))(params, xb)
        flat = torch.cat([j.flatten(2) for j in jac.values()], 2)
        return torch.einsum("ncp,mdp->nmcd", flat, flat)

    peer = AsdlGGN(make_like(model), "classification")

    def asdl():  # (asdl.kernel.empirical_direct_ntk fails in the installed asdl: its per-op
        # results come back empty, "torch.cat(): expected a non-empty list"; its Jacobians
        # through laplace-torch's backend, then J J^T, stand in)
        flat = peer.jacobians(xb)[0]
        return torch.einsum("ncp,mdp->nmcd", flat, flat)

    return {"gradhooks ntk": ours, "torch.func": func, "ASDL jacobians + einsum": asdl}


def gram_methods(model, xb, yb):
    params = {k: v.detach() for k, v in model.named_parameters()}

    def ours():
        with gradhooks.attach(model, loss_reduction="sum", check=False) as gh:
            gh.backward(torch.nn.functional.cross_entropy(model(xb), yb, reduction="sum"))
            return gh.gram()

    def func():
        f = lambda p, xi, yi: torch.nn.functional.cross_entropy(  # noqa: E731
            functional_call(model, p, (xi[None],)), yi[None])
        g = vmap(grad(f), in_dims=(None, 0, 0))(params, xb, yb)
        flat = torch.cat([t.flatten(1) for t in g.values()], 1)
        return flat @ flat.T

    return {"gradhooks gram": ours, "torch.func vmap(grad)": func}


def memory_child(spec):
    """Peak RSS (MB) of one call of ``spec = [table, model, method]`` above the process after a
    warm-up call whose result is dropped (``peers.py``'s helpers: VmHWM reset through
    ``/proc/self/clear_refs``), in this (fresh) process; and the result's own size."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peers
    table, name, method = spec
    torch.manual_seed(0)
    x, y = digits()
    model = models()[name]()
    fn = {"jac": jacobian_methods}[table](model, x[:64], y[:64])[method]
    out = fn()  # (warm-up: lazy imports, kernels' first use)
    size = out.numel() * out.element_size() / 2**20
    del out
    peers._trim()
    peers._reset_peak()
    before = peers._rss_bytes()
    fn()
    return {"peak_mb": (peers._peak_bytes() - before) / 2**20, "result_mb": size}


def measure_memory(table, name, method):
    import json
    import subprocess
    got = subprocess.run([sys.executable, __file__, "--memory-child",
                          json.dumps([table, name, method])], capture_output=True, text=True)
    if got.returncode:
        return None
    return json.loads(got.stdout.strip().splitlines()[-1])


def digits():
    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    return x, torch.as_tensor(d.target)


def make_like(model):
    """A copy of ``model`` (BackPACK's backend extends the model it is given) with the
    ``output_size`` attribute laplace-torch sets at ``fit`` and its backends read."""
    import copy
    model = copy.deepcopy(model)
    model.output_size = 10
    return model


def timed(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def table(title, make_methods, args, memory_table=None):
    names = None
    for name, make in models().items():
        torch.manual_seed(0)
        x, y = digits()
        model = make()
        methods = make_methods(model, x[:64], y[:64])
        if names is None:
            names = list(methods)
            print(f"| model | {title} | " + " | ".join(names) + " |")
            print("|---|---|" + "---|" * len(names))
        cells, first, result_mb = [], None, 0.0
        for method in names:
            try:
                got = methods[method]()
                cell = f"{timed(methods[method], args.repeats):.1f} ms"
            except Exception as e:  # noqa: BLE001 (a backend without this layer)
                cells.append(f"n/a ({type(e).__name__})")
                continue
            got = got.reshape(first.shape) if first is not None else got
            if first is None:
                first = got
            elif not torch.allclose(got, first, rtol=1e-3, atol=1e-4 * first.abs().max()):
                cell += " (differs)"  # (curvlinops: (P, B C), transposed below)
            cells.append(cell)
            if memory_table and not args.no_memory:
                mem = measure_memory(memory_table, name, method)
                if mem is not None:
                    cells[-1] += f", {mem['peak_mb']:.0f} MB"
                    if first is got:
                        result_mb = mem["result_mb"]
        p = sum(q.numel() for q in model.parameters())
        if memory_table and not args.no_memory:
            p = f"{p}, result {result_mb:.0f} MB"
        print(f"| {name} | P={p} | " + " | ".join(cells) + " |")
    print()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--memory-child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child is not None:
        import json
        print(json.dumps(memory_child(json.loads(args.memory_child))))
        return
    torch.manual_seed(0)
    x, y = digits()
    print("Per-sample Jacobians (B=64, C=10), time and peak memory above the process "
          "(the result: 64 x 10 x P floats)")
    print()
    table("Jacobians", jacobian_methods, args, memory_table="jac")
    print("Empirical NTK (B, B, C, C) and Gram (B, B) of per-sample loss gradients, B=64")
    print()
    table("NTK", ntk_methods, args)
    table("Gram", gram_methods, args)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:256], y[:256]), batch_size=64)
    print()
    print("| model | weights | Laplace fit (256 digits) | gradhooks | curvlinops | ASDL | BackPACK |")
    print("|---|---|---|---|---|---|---|")
    for name, make in models().items():
        for subset, structure in [(s, h) for s in ("last_layer", "all")
                                  for h in ("diag", "kron", "full")]:
            row = []
            for backend in (GradHooksGGN, CurvlinopsGGN, AsdlGGN, BackPackGGN):
                model = make()

                def fit():
                    Laplace(model, "classification", hessian_structure=structure,
                            subset_of_weights=subset, backend=backend).fit(loader)
                try:
                    row.append(f"{timed(fit, max(3, args.repeats // 2)):.0f} ms")
                except Exception as e:  # a backend without this structure / layer
                    row.append(f"n/a ({type(e).__name__})")
            print(f"| {name} | {subset.replace('_', ' ')} | {structure} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
