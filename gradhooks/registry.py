"""Layer rules: the registry, the base class every rule derives from, and the typed errors.

A *rule* knows one family of layers (``nn.Linear``, the ``nn.ConvNd`` ...). Given what the
hooks recorded for one call of a module -- its input activations ``a`` and the gradient of the
loss w.r.t. its output ``g`` (grad_output, "backprops") -- it forms the per-sample gradient of
each parameter the module owns. Adding a layer family means adding one file under
``gradhooks/rules/`` with a class decorated by :func:`register_rule`; nothing else changes.

Lookup is by exact type first, then by the class's parents (``type(module).__mro__``) so that
subclasses are covered, but only if the subclass keeps the parent's ``forward``: a subclass that
overrides ``forward`` computes something else, and the parent's rule would silently give wrong
numbers, so :func:`find_rule` refuses it with :class:`UnsupportedModuleError`.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple, Type

from torch import Tensor, nn

__all__ = [
    "GradHooksError",
    "UnsupportedModuleError",
    "BatchSizeError",
    "UnsupportedCallError",
    "HigherOrderGradError",
    "FallbackWarning",
    "NoBackwardError",
    "RecordsReleasedError",
    "GradientMismatchError",
    "LayerRule",
    "Call",
    "Block",
    "register_rule",
    "find_rule",
    "supported_types",
]


# --------------------------------------------------------------------------- errors
class GradHooksError(RuntimeError):
    """Base class of every error gradhooks raises on purpose."""


class UnsupportedModuleError(GradHooksError, TypeError):
    """A module owns trainable parameters that no rule can give per-sample gradients for.

    Raised by :func:`gradhooks.attach`; the message names the module's path in the model, its
    type, and the supported types.
    """


class UnsupportedCallError(GradHooksError, ValueError):
    """A supported module was called in a way whose per-sample gradients are not defined.

    Raised at the forward, naming the module: ``BatchNorm`` in training mode (batch statistics
    mix the samples), a recurrent layer with inter-layer dropout in training mode (the dropout
    masks cannot be replayed). The message says what to do instead.
    """


class HigherOrderGradError(GradHooksError):
    """A backward pass ran with ``create_graph=True`` through a hooked layer.

    The loss then contains derivatives (a gradient penalty, a Laplacian built with
    ``torch.autograd.grad(..., create_graph=True)``), and the parameter gradient has terms that
    grad_output-based rules do not see; per-sample results are refused rather than wrong.
    """


class BatchSizeError(GradHooksError, ValueError):
    """A layer's input has no batch dimension, or layers of one forward disagree on its size."""


class NoBackwardError(GradHooksError):
    """Per-sample results were asked for before any backward pass reached a hooked layer."""


class RecordsReleasedError(NoBackwardError):
    """A read needs the activations and grad_outputs of the batch, but
    :meth:`~gradhooks.GradHooks.per_sample_grads` released them (its default, as
    ``loss.backward()`` frees the graph), or a backward pass reached the hooked layers after it
    did. The message says what to do: read what needs them first, or pass
    ``retain_records=True``."""


class GradientMismatchError(GradHooksError):
    """The per-sample gradients do not sum to the gradient autograd computed for a parameter.

    This happens when a parameter also receives gradient outside the module that owns it (for
    instance used functionally, ``x @ layer.weight.T``), or when the captured input was modified
    in place after the forward. The result would be wrong, so it is refused.
    """


class FallbackWarning(UserWarning):
    """Issued once per :func:`gradhooks.attach`, listing the modules the torch.func fallback covers."""


# --------------------------------------------------------------------------- rules
class Call(NamedTuple):
    """The inputs of one recorded call of a ``multi_io`` rule's module: ``module(*args, **kwargs)``.

    Tensors are detached copies (sharing storage) of what the module received; other values
    (ints, ``None``, ``PackedSequence`` fields ...) are kept as they were. ``internal``: what
    the rule's :meth:`LayerRule.internal` asked to record for this call (``None`` otherwise).
    """

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]
    internal: Optional[Dict[str, Any]] = None


class Block(NamedTuple):
    """Part of a parameter's per-sample gradient in factored form (the rows ``rows`` of dim 0,
    or the whole parameter for ``rows=None``)::

        weight-like (a given):  d(param)_n[rows] = sum_s g[n, s] a[n, s]^T   (O, I), reshaped
        bias-like  (a = None):  d(param)_n[rows] = sum_s g[n, s]             (O,), reshaped

    The Linear form of Goodfellow 2015 (arXiv:1510.01799, sec. 3) with ``S`` shared positions
    (time steps, tokens). Rules that can give their gradients this way (recurrent layers,
    attention: :meth:`LayerRule.forms`) let per-sample norms use the Gram form and DP clipping
    form the clipped sum with one matmul, without a per-sample tensor (Li et al. 2022,
    arXiv:2110.05679, sec. 4).

    Attributes:
        rows: a ``slice`` of the parameter's dim 0, or ``None`` for all of it.
        a: ``(N, S, I)`` activations, or ``None`` for a bias-like block.
        g: ``(N, S, O)`` the gradients the block's rows multiply (``O * I`` = number of elements
            of ``param[rows]``, or ``O`` of them for a bias-like block).
    """

    rows: Optional[slice]
    a: Optional[Tensor]
    g: Tensor


class Rows(NamedTuple):
    """A parameter's per-sample gradient as a scatter of row contributions (a lookup table:
    ``nn.Embedding``)::

        d(param)_n[v] = sum_j [sample_j = n] [row_j = v] values_j          (D,)

    for a parameter of shape ``(V, D)``. Per-sample norms then need no ``(B, V, D)`` tensor:
    ``||d(param)_n||^2 = sum_v ||sum_{j: sample_j = n, row_j = v} values_j||^2``, the squared
    norms of the entries summed per ``(sample, row)`` pair (``O(E D)``); and the clipped sum
    ``sum_n c_n d(param)_n`` is one ``index_add`` of ``c[sample_j] values_j`` at ``row_j``.
    (An embedding is a Linear layer on one-hot inputs, whose Gram form ``sum_{s,t} [x_s = x_t]
    (g_s . g_t)`` Li et al. 2022, arXiv:2110.05679, sec. 4, use for ghost clipping; summing
    per row first gives the same value in ``O(E D)`` instead of ``O(S^2 D)`` per sample.)

    Attributes:
        sample: ``(E,)`` int64, the sample of each entry, in ``[0, B)``.
        row: ``(E,)`` int64, the row of the table it adds to, in ``[0, V)``.
        values: ``(E, D)`` what it adds (grad_output rows, at least float32).
    """

    sample: Tensor
    row: Tensor
    values: Tensor


class LayerRule:
    """Base class of a per-layer rule.

    Index conventions used by every rule: ``n`` sample (batch), ``s`` weight-sharing position
    (token, pixel, time step; ``S = 1`` for a plain Linear on ``(B, in)``), ``g`` group (``G = 1``
    except for grouped convolutions), ``i`` input feature, ``o`` output feature.

    Subclasses set :attr:`param_names` (the direct parameters of the module they handle) and
    implement :meth:`batch_size` and :meth:`per_sample_grads`. Rules are stateless; one instance
    serves every module of its types.
    """

    #: Names of the module's own parameters this rule computes per-sample gradients for.
    param_names: Tuple[str, ...] = ("weight", "bias")

    #: ``False`` (Linear, Conv): the hooks record the first input ``a`` and the grad_output
    #: ``g`` of the one output tensor. ``True`` (recurrent layers, attention, the fallback): the
    #: hooks record every input and the grad_output of every output tensor, and
    #: :meth:`per_sample_grads` receives ``a = Call(args, kwargs)`` (tensors detached) and
    #: ``g`` = the output's structure (tuples, ``PackedSequence`` ...) with each tensor replaced
    #: by its grad_output (summed over backward passes, ``loss_reduction`` scale applied) or
    #: ``None`` where no backward pass reached it.
    multi_io: bool = False

    def params_of(self, module: nn.Module) -> Dict[str, nn.Parameter]:
        """The parameters this rule handles for ``module``, by their name relative to it.

        Default: the module's own parameters listed in :attr:`param_names`. A rule may claim
        parameters of submodules with dotted names (``"out_proj.weight"``): those submodules
        are then not hooked themselves.
        """
        return {n: p for n, p in module.named_parameters(recurse=False) if n in self.param_names}

    #: ``True`` if :meth:`check_call` must run for every forward with autograd on, even when
    #: the module has no trainable parameters to record (``BatchNorm`` with ``affine=False`` or
    #: frozen): such a forward can still mix samples and make every layer before it wrong.
    check_always: bool = False

    def call_batch_size(self, module: nn.Module, args: tuple, kwargs: dict, batch_first: bool) -> int:
        """The batch size of the call ``module(*args, **kwargs)``; default: :meth:`batch_size` of
        the first argument (override when it depends on others, e.g. ``EmbeddingBag`` offsets)."""
        x = args[0] if args else next(iter(kwargs.values()), None)
        return self.batch_size(module, x, batch_first)

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options: Dict[str, object]) -> None:
        """Validate one forward call before it is recorded (default: accept everything).

        ``options`` are the keyword options given to :func:`gradhooks.attach`. Raise a
        :class:`GradHooksError` subclass (without the module path: the caller adds it) for calls
        whose per-sample gradients would be wrong, e.g. ``BatchNorm`` in training mode.
        """

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        """Return the batch size ``B`` of the input ``x`` of ``module``.

        Raises:
            BatchSizeError: if ``x`` has no batch dimension (an unbatched input).
        """
        raise NotImplementedError

    def internal(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Optional[tuple]:
        """Optional, ``multi_io`` rules: an autograd node inside this call's graph whose input
        gradients the rule wants, so that it need not replay the call to get them.

        Called by the forward hook with the call's arguments and output (graph alive). Returns
        ``None`` (default: nothing to record) or ``(node, saved)``: the hook manager registers
        a post-hook on ``node`` and stores in the dict ``saved`` under ``"grad_inputs"`` the
        node's input gradients (``Node.register_hook``'s ``grad_inputs``, detached, summed over
        backward passes; absent if no backward reached the node). ``saved`` may also hold
        forward values the rule takes from the graph now (e.g. a node's saved tensors, which
        the backward frees). The rule receives it as ``a.internal`` (:class:`Call`). ``node``
        may be ``None``: nothing to hook, ``saved`` holds forward values only.
        """
        return None

    #: ``True`` if the ``weight`` result is linear in the input activations ``a`` and the
    #: ``bias`` result does not depend on them (Linear, Conv): the ``loss_reduction`` scale may
    #: then be applied to ``a`` when it is the smallest tensor.
    weight_linear_in_input: bool = False

    #: ``True`` if the rule implements :meth:`forms`.
    has_forms: bool = False

    def forms(self, module: nn.Module, a, g, batch_first: bool,
              names: Iterable[str]) -> Dict[str, List[Block]]:
        """Optional: the per-sample gradients of one call in factored form.

        Same arguments as :meth:`per_sample_grads`. Returns ``{name: [Block, ...]}``, the
        blocks covering disjoint rows of the parameter (together all of it, in increasing row
        order); :func:`gradhooks.per_sample.from_blocks` materialises them. Set
        :attr:`has_forms` when implementing it.
        """
        raise NotImplementedError

    #: ``True`` if the rule implements :meth:`rows`.
    has_rows: bool = False

    def rows(self, module: nn.Module, a, g, batch_first: bool, names: Iterable[str]) -> Dict[str, Rows]:
        """Optional: the per-sample gradients of one call as row scatters (:class:`Rows`).

        Same arguments as :meth:`per_sample_grads`. Returns ``{name: Rows}`` for the wanted
        parameters of shape ``(V, D)``. Set :attr:`has_rows` when implementing it.
        """
        raise NotImplementedError

    def per_sample_grads(
        self,
        module: nn.Module,
        a: Tensor,
        g: Tensor,
        batch_first: bool,
        names: Iterable[str],
    ) -> Dict[str, Tensor]:
        """Per-sample gradients of the *summed* loss for one call of ``module``.

        Args:
            module: the layer.
            a: its input activations, as recorded in the forward (layout as the layer takes it).
            g: the gradient of the loss w.r.t. its output (grad_output), same layout as the output.
            batch_first: the layout flag given to :func:`gradhooks.attach`.
            names: which of :attr:`param_names` are wanted (the trainable ones).

        Returns:
            ``{name: tensor of shape (B, *param.shape)}``; entry ``n`` is ``d loss / d param``
            restricted to sample ``n`` (no ``loss_reduction`` scaling: that is applied once, in
            :mod:`gradhooks.per_sample`). The tensors must be new (owned by the caller, which
            scales them in place), never views of ``a`` or ``g``. Default for rules with
            :attr:`has_forms`: :meth:`forms` materialised by
            :func:`gradhooks.per_sample.from_blocks`.
        """
        if not self.has_forms:
            raise NotImplementedError
        from .per_sample import from_blocks  # (per_sample imports this module)

        params = self.params_of(module)
        return {name: from_blocks(blocks, (blocks[0].g.shape[0], *params[name].shape))
                for name, blocks in self.forms(module, a, g, batch_first, names).items()}


_RULES: Dict[Type[nn.Module], LayerRule] = {}


def register_rule(*module_types: Type[nn.Module]) -> Callable[[type], type]:
    """Class decorator: register a :class:`LayerRule` subclass for ``module_types``.

    Example::

        @register_rule(nn.Conv1d, nn.Conv2d, nn.Conv3d)
        class ConvRule(LayerRule): ...

    Raises:
        TypeError: if a type is not an ``nn.Module`` subclass or the class is not a LayerRule.
    """
    for t in module_types:
        if not (isinstance(t, type) and issubclass(t, nn.Module)):
            raise TypeError(f"register_rule expects nn.Module subclasses, got {t!r}")

    def decorate(cls: type) -> type:
        if not (isinstance(cls, type) and issubclass(cls, LayerRule)):
            raise TypeError(f"register_rule decorates LayerRule subclasses, got {cls!r}")
        rule = cls()
        for t in module_types:
            _RULES[t] = rule
        return cls

    return decorate


def supported_types() -> Tuple[str, ...]:
    """Names of the module types that have a rule, sorted (e.g. ``('Conv1d', ..., 'Linear')``)."""
    return tuple(sorted(t.__name__ for t in _RULES))


def find_rule(module: nn.Module, path: str = "") -> Optional[LayerRule]:
    """Return the rule for ``module``'s type, or ``None`` if it has none.

    Exact type first, then the parents in method resolution order.

    Raises:
        UnsupportedModuleError: if ``module`` is a subclass of a supported type that overrides
            ``forward`` (the parent's rule would not match what it computes).
    """
    cls = type(module)
    if cls in _RULES:
        return _RULES[cls]
    for parent in cls.__mro__[1:]:
        if parent in _RULES:
            if cls.forward is not parent.forward:
                raise UnsupportedModuleError(
                    f"module {path or '<root>'!r} of type {cls.__qualname__} subclasses "
                    f"{parent.__name__} but overrides forward(), so the {parent.__name__} rule "
                    f"does not describe it. Register a rule for it with "
                    f"@gradhooks.register_rule({cls.__name__}), or do not override forward."
                )
            return _RULES[parent]
    return None
