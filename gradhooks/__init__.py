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
from .errors import (
    AccumulationError,
    BatchSizeError,
    FallbackWarning,
    GradHooksError,
    GradientMismatchError,
    HigherOrderGradError,
    NoBackwardError,
    NotDetachedWarning,
    RecordsReleasedError,
    UnsupportedCallError,
    UnsupportedLossError,
    UnsupportedModuleError,
)
from .accumulation import micro_batches
from .forms import Block, Call, Rows
from .gram import GradientFeatures
from .hooks import GradHooks, attach
from .ekfac import EKFACFactors
from .kfac import DiagonalFactors, KFACFactors
from .registry import LayerRule, register_rule, supported_types
from .fisher import kfac  # noqa: E402  (after .kfac: the name gradhooks.kfac is this function)
from .reference import (
    Comparison,
    ParamError,
    batched_forward_per_sample_grads,
    compare,
    looped_per_sample_grads,
    max_rel_error,
)

__version__ = "0.1.0"

__all__ = [
    "attach",
    "GradHooks",
    "micro_batches",
    "kfac",
    "KFACFactors",
    "DiagonalFactors",
    "EKFACFactors",
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
    "HigherOrderGradError",
    "FallbackWarning",
    "NotDetachedWarning",
]
