"""Per-sample Jacobians and laplace-torch fits: gradhooks against torch.func and laplace-torch's
other backends (median of repeats, CPU, float32, one process).

    python benchmarks/jacobians_laplace.py [--repeats 5]

Models: the digits MLP (64-32-10, tanh) and the small digits CNN of examples/laplace_digits.py,
batch 64 of scikit-learn's digits. Jacobians: (B, C, P) of the logits, by gradhooks, torch.func
``vmap(jacrev)``, and laplace-torch's ASDL and BackPACK backends' ``jacobians`` (ASDL's gradient
per output dimension; BackPACK's ``BatchGrad`` per output dimension). Laplace: fit on 256 digits
(batch 64) per Hessian structure, gradhooks against laplace-torch's curvlinops, ASDL and BackPACK
backends.
"""
import argparse
import statistics
import sys
import time
import types

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))
from laplace import Laplace  # noqa: E402
from laplace.curvature import AsdlGGN, BackPackGGN, CurvlinopsGGN  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

import gradhooks  # noqa: E402
from gradhooks.laplace_backend import GradHooksGGN  # noqa: E402


def models():
    return {"mlp": lambda: nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)),
            "cnn": lambda: nn.Sequential(nn.Conv2d(1, 16, 3), nn.ReLU(), nn.Conv2d(16, 32, 3), nn.ReLU(),
                                         nn.MaxPool2d(2), nn.Flatten(), nn.Linear(128, 10))}


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


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.manual_seed(0)
    d = load_digits()
    x = torch.as_tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.as_tensor(d.target)
    xb = x[:64]
    print("| model | per-sample Jacobians (B=64) | gradhooks | torch.func vmap(jacrev) | ASDL | BackPACK BatchGrad |")
    print("|---|---|---|---|---|---|")
    for name, make in models().items():
        model = make()
        params = {k: v.detach() for k, v in model.named_parameters()}

        def ours():
            with gradhooks.attach(model, check=False) as gh:
                gh.per_sample_jacobians(model(xb))

        def func():
            f = lambda p, xi: functional_call(model, p, (xi[None],))[0]  # noqa: E731
            vmap(jacrev(f), in_dims=(None, 0))(params, xb)

        peers = []
        for backend in (AsdlGGN, BackPackGGN):
            try:
                peer = backend(make_like(model), "classification")
                peers.append(f"{timed(lambda: peer.jacobians(xb), args.repeats):.1f} ms")
            except Exception as e:  # noqa: BLE001 (a backend without this layer)
                peers.append(f"n/a ({type(e).__name__})")
        print(f"| {name} | P={sum(p.numel() for p in params.values())} | {timed(ours, args.repeats):.1f} ms "
              f"| {timed(func, args.repeats):.1f} ms | " + " | ".join(peers) + " |")
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[:256], y[:256]), batch_size=64)
    print()
    print("| model | Laplace fit (256 digits) | gradhooks | curvlinops | ASDL | BackPACK |")
    print("|---|---|---|---|---|---|")
    for name, make in models().items():
        for structure in ("diag", "kron", "full"):
            row = []
            for backend in (GradHooksGGN, CurvlinopsGGN, AsdlGGN, BackPackGGN):
                model = make()

                def fit():
                    Laplace(model, "classification", hessian_structure=structure,
                            backend=backend).fit(loader)
                try:
                    row.append(f"{timed(fit, max(1, args.repeats // 2)):.0f} ms")
                except Exception as e:  # a backend without this structure / layer
                    row.append(f"n/a ({type(e).__name__})")
            print(f"| {name} | {structure} | " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
