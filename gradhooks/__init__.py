"""gradhooks: exact per-sample gradients of an existing PyTorch model, through layer hooks.

Public API::

    gh = gradhooks.attach(model, loss_reduction="mean")   # or: with gradhooks.attach(model) as gh:
    loss.backward()
    gh.per_sample_grads()          # {name: (B, *param.shape)}; also param.grad_sample
    gh.detach()

    gh.per_sample_grad_norms()     # (B,) norms without materialising
    gh.clip_and_accumulate(1.0, noise_multiplier=1.0)   # DP-SGD: clipped, noised sum -> .grad
    gh.clip_and_accumulate(1.0, accumulate=True)        # ... per micro-batch of a logical batch,
    gh.finish_step(noise_multiplier=1.0)                #     then the noise once -> .grad
    gh.kfac_factors()              # {module: KFACFactors(A, G) or DiagonalFactors} from the same records
    gradhooks.kfac(model, x, y, nn.CrossEntropyLoss(), fisher="type-2")  # one-call KFAC

    gradhooks.batched_forward_per_sample_grads(model, loss_fn, inputs, targets)  # same forward
    gradhooks.looped_per_sample_grads(model, loss_fn, inputs, targets)   # one forward per sample
    gradhooks.compare(model, loss_fn, inputs, targets)   # check against both, time the loop
"""
import importlib
import importlib.abc
import importlib.util
import sys

from ._version import __version__
from .base import torch_internals as _torch_internals  # (first: names a torch it cannot run on)
from .base.errors import (
    AccumulationError,
    BatchSizeError,
    FallbackWarning,
    FrozenModelWarning,
    GradHooksError,
    GradientMismatchError,
    HigherOrderGradError,
    LossScaleWarning,
    NoBackwardError,
    NotDetachedWarning,
    RecordsReleasedError,
    ReplayError,
    ReplayMismatchError,
    SampleIdsError,
    SampleMixingError,
    UnprovenOpError,
    UnsupportedCallError,
    UnsupportedLossError,
    UnsupportedModuleError,
)
from .readers.accumulation import micro_batches
from .readers.adaptive_clipping import AdaptiveClipping
from .base.forms import Block, Call, Rows
from .readers.gram import GradientFeatures
from .hooks import GradHooks, attach
from .readers.ekfac import EKFACFactors
from .readers import attribution  # gradhooks.attribution: influence scores from the records
from .readers.attribution import FactorFit
from .readers.kfac import DiagonalFactors, KFACFactors
from .base.registry import LayerRule, register_rule, supported_types
from .tools.token_losses import per_sample_token_loss
from .fisher import kfac  # noqa: E402  (after .kfac: the name gradhooks.kfac is this function)
from .tools.reference import (
    Comparison,
    ParamError,
    batched_forward_per_sample_grads,
    compare,
    looped_per_sample_grads,
    max_rel_error,
)


# The layers of the design, lowest first (README, "Development"; tests/test_layering.py): a
# module imports only from its own layer and those below. Each is a folder of the package,
# except "api": the modules at its top (the facade ``hooks`` and the one-call ``fisher``).
LAYERS = ("base", "rules", "core", "readers", "api", "tools", "integrations")

# Module paths from before the folders: {old: new}, relative to ``gradhooks``. Importing an
# old path gives the module at the new one (the same object), and the README lists them.
RENAMED = {
    '_pool': 'base._pool',
    'accumulation': 'readers.accumulation',
    'attribution': 'readers.attribution',  # (not renamed: the public name of the module)
    'capture': 'core.capture',
    'checks': 'core.checks',
    'cli': 'tools.cli',
    'clipping': 'readers.clipping',
    'ekfac': 'readers.ekfac',
    'errors': 'base.errors',
    'forms': 'base.forms',
    'ggn': 'readers.ggn',
    'gram': 'readers.gram',
    'graph': 'core.graph',
    'jacobians': 'readers.jacobians',
    'kfac': 'readers.kfac',
    'kinks': 'tools.kinks',
    'laplace_backend': 'integrations.laplace_backend',
    'losses': 'readers.losses',
    'norms': 'readers.norms',
    'passes': 'readers.passes',
    'per_sample': 'readers.per_sample',
    'projections': 'readers.projections',
    'provenance': 'core.provenance',
    'records': 'core.records',
    'reference': 'tools.reference',
    'registry': 'base.registry',
    'spotcheck': 'readers.spotcheck',
    'statistics': 'readers.statistics',
    'utils': 'base.utils',
    'workloads': 'tools.workloads',
}


class _RenamedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``gradhooks.<old>`` (a key of :data:`RENAMED`) as the module at its new path.
    Modules already imported are aliased in ``sys.modules`` at once (below), so that importing
    ``gradhooks.kfac`` never rebinds the function ``gradhooks.kfac`` to the module."""

    def find_spec(self, fullname, path=None, target=None):
        prefix, _, old = fullname.rpartition(".")
        if prefix == __name__ and old in RENAMED:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{RENAMED[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module) -> None:
        pass


for _old, _new in RENAMED.items():
    if f"{__name__}.{_new}" in sys.modules:
        sys.modules.setdefault(f"{__name__}.{_old}", sys.modules[f"{__name__}.{_new}"])
if not any(type(_f).__name__ == "_RenamedModules" and getattr(_f, "package", None) == __name__
           for _f in sys.meta_path):
    _finder = _RenamedModules()
    _finder.package = __name__
    sys.meta_path.insert(0, _finder)


def __getattr__(name: str):
    # ``gradhooks.norms`` and the other old module paths as attributes of the package.
    if name in RENAMED:
        return importlib.import_module(f"{__name__}.{RENAMED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "attach",
    "GradHooks",
    "micro_batches",
    "per_sample_token_loss",
    "kfac",
    "KFACFactors",
    "DiagonalFactors",
    "EKFACFactors",
    "attribution",
    "FactorFit",
    "GradientFeatures",
    "UnsupportedLossError",
    "looped_per_sample_grads",
    "batched_forward_per_sample_grads",
    "compare",
    "Comparison",
    "ParamError",
    "max_rel_error",
    "register_rule",
    "supported_types",
    "LayerRule",
    "Call",
    "Block",
    "Rows",
    "GradHooksError",
    "AccumulationError",
    "UnsupportedModuleError",
    "BatchSizeError",
    "NoBackwardError",
    "RecordsReleasedError",
    "GradientMismatchError",
    "UnsupportedCallError",
    "ReplayError",
    "ReplayMismatchError",
    "HigherOrderGradError",
    "FallbackWarning",
    "NotDetachedWarning",
    "SampleIdsError",
    "SampleMixingError",
    "UnprovenOpError",
    "LossScaleWarning",
    "FrozenModelWarning",
]
