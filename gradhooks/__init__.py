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
import sys as _sys

from ._version import __version__  # noqa: F401  (gradhooks.__version__)
from .base import torch_internals as _torch_internals  # noqa: F401  (names a torch it cannot run on)
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
from .base.forms import Block, Call, Rows
from .base.registry import LayerRule, register_rule, supported_types
from .base.utils import is_paused
from .fisher import kfac  # gradhooks.kfac: the one-call KFAC driver (a function)
from .hooks import GradHooks, attach
from .readers import attribution  # gradhooks.attribution: influence scores from the records
from .readers.attribution import FactorFit
from .readers.curvature.ekfac import EKFACFactors
from .readers.curvature.kfac import DiagonalFactors, KFACFactors
from .readers.dp.accumulation import micro_batches
from .readers.dp.adaptive_clipping import AdaptiveClipping
from .readers.gram import GradientFeatures
from .tools.reference import (
    Comparison,
    ParamError,
    batched_forward_per_sample_grads,
    compare,
    looped_per_sample_grads,
    max_rel_error,
)
from .tools.token_losses import per_sample_token_loss

# gradhooks.attribution is the public name of readers.attribution (docs/api.md): importable as
# a module path too (``from gradhooks.attribution import GradientStore``)
_sys.modules[f"{__name__}.attribution"] = attribution

# The layers of the design, lowest first (README, "Development"; tests/test_layering.py): a
# module imports only from its own layer and those below. Each is a folder of the package,
# except "api": the modules at its top (the facade ``hooks`` and the one-call ``fisher``).
LAYERS = ("base", "rules", "core", "readers", "api", "tools", "integrations")

__all__ = [
    "attach",
    "GradHooks",
    "is_paused",
    "AdaptiveClipping",
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
