"""Layer rules: the registry and the base class every rule derives from.

A *rule* knows one family of layers (``nn.Linear``, the ``nn.ConvNd`` ...). Given what the
hooks recorded for one call of a module -- its input activations ``a`` and the gradient of the
loss w.r.t. its output ``g`` (grad_output, "backprops") -- it forms the per-sample gradient of
each parameter the module owns. Adding a layer family means adding one file under
``gradhooks/rules/`` with a class decorated by :func:`register_rule`; nothing else changes.

Lookup is by exact type first; then the *recognisers* (:func:`register_recogniser`) may name a
rule for a module whose class gradhooks cannot import (transformers' ``Conv1D``, timm's
``LayerNorm2d``: :mod:`gradhooks.rules.known`) or whose class is made at run time
(``torch.nn.utils.parametrize``: :mod:`gradhooks.rules.parametrize`); then the class's parents
(``type(module).__mro__``) so that subclasses are covered, but only if the subclass keeps the
parent's ``forward``: a subclass that overrides ``forward`` computes something else, and the
parent's rule would silently give wrong numbers, so :func:`find_rule` refuses it with
:class:`UnsupportedModuleError`.
"""
from __future__ import annotations

from typing import Callable, Dict, Iterable, List, Optional, Tuple, Type

import torch
from torch import Tensor, nn

from .errors import UnsupportedModuleError
from .forms import Block, Call, Rows, from_blocks

__all__ = [
    "LayerRule",
    "Call",
    "Block",
    "Rows",
    "register_rule",
    "register_recogniser",
    "find_rule",
    "find_type_rule",
    "supported_types",
]


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

    #: ``multi_io`` rules that read ``g``'s leaves by their position in the output (the
    #: torch.func fallback pairs each with the output leaf of its replay): ``g`` holds
    #: :data:`~gradhooks.base.forms.NO_GRAD` instead of ``None`` for an output no backward pass
    #: reached, so that every leaf keeps its place.
    positional_grads: bool = False

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

    def output_dims(self, module: nn.Module, args: tuple, output, dim_of) -> list:
        """``[(tensor, batch dim)]`` of the call's outputs whose batch dim the rule's reading of
        the module fixes, where provenance may not have followed it through the module's own
        ops (``dim_of(t)``: the batch dim provenance followed to the input ``t``); the batch dim
        an int, or ``(samples, B)``: rows on dim 0, row ``r`` of sample ``samples[r]`` (int64).
        Default: a :attr:`position_wise` layer's output keeps its input's leading dims, and
        with them its batch dim (HF's ``Conv1D`` merges them in a view inside); else none."""
        x = args[0] if args else None
        if not (self.position_wise and isinstance(x, Tensor) and isinstance(output, Tensor)):
            return []
        lead = x.dim() - self.feature_dims  # (an embedding's: all of its indices' dims)
        d = dim_of(x)
        return [(output, d)] if (isinstance(d, int) and d < lead
                                 and output.shape[:lead] == x.shape[:lead]) else []

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

    #: ``True`` if the module stores its weight transposed, ``(I, O)`` instead of ``(O, I)``
    #: (transformers' ``Conv1D``: ``y = x @ W + b``). :meth:`linear_form` is unchanged (the
    #: canonical ``a``, ``g``; ``W[g]`` there is ``weight.T``), so norms (Frobenius, layout-free)
    #: need nothing; a reader that reshapes a weight-shaped tensor into ``(G, O, I)`` (KFAC's
    #: ``grad_matrix``) must transpose it first, and the rule's :meth:`per_sample_grads` and
    #: :meth:`weighted_sum` return the weight's own layout ``(B, I, O)`` / ``(I, O)``. Only
    #: ``G = 1`` is allowed with it.
    weight_transposed: bool = False

    #: ``True`` if the layer acts on each position of its input alike, over the trailing
    #: feature dims (Linear, LayerNorm, RMSNorm, Embedding): its records may then have two
    #: leading dims swapped, input and grad_output alike, to put the batch where the rule reads
    #: it.
    position_wise: bool = False

    #: With :attr:`position_wise`: how many trailing dims of the input are features, not
    #: positions (1: Linear, the norms over the last dim; 0: Embedding's indices).
    feature_dims: int = 1

    #: ``True`` if :meth:`per_sample_grads` is differentiable in its inputs ``a`` and ``g``
    #: (ops with autograd formulas, no ``out=``, nothing detached), so that reads of
    #: ``attach(..., differentiable=True)`` records carry the autograd graph.
    differentiable: bool = False

    #: ``True`` if the rule implements :meth:`linear_form` (the layer is linear in its weight:
    #: ``nn.Linear``, ``nn.ConvNd``). Readers then form norms, clipped sums and KFAC factors from
    #: the canonical form instead of a per-sample tensor.
    has_linear_form: bool = False

    def linear_form(self, module: nn.Module, a: Optional[Tensor], g: Tensor, batch_first: bool
                    ) -> Optional[Tuple[Optional[Tensor], Tensor]]:
        """Optional: one call's records in the canonical form of :mod:`gradhooks.base.forms`.

        Args:
            module: the layer.
            a: its input activations as recorded, or ``None`` when only ``g`` is wanted (a
                convolution's patches cost an unfold).
            g: its grad_output (summed over backward passes), same layout as the output.
            batch_first: the layout flag given to :func:`gradhooks.attach`.

        Returns:
            ``(a, g)`` with ``a`` ``(N, G, S, I)`` (``None`` if ``a`` was ``None``) and ``g``
            ``(N, G, S, O)``, such that the layer computes ``y[n,g,s] = W[g] a[n,g,s] + b[g]``
            with ``W[g]`` the ``(O, I)`` matrix of group ``g``'s rows of ``weight``
            (``weight.view(G, O, I)``) and ``b[g]`` its bias entries (``bias.view(G, O)``), in
            the dtypes given; or ``None`` (default) if the layer has no such form (then set
            :attr:`has_linear_form` to ``False``).
        """
        return None

    def input_gram_cost(self, module: nn.Module, a: Tensor) -> Optional[int]:
        """Optional: multiply-adds per ``(sample, group)`` of :meth:`input_gram` for the recorded
        input ``a``, or ``None`` (default) where the rule has no form of it cheaper than the
        canonical input's ``S^2 I`` (the norm plan then counts that)."""
        return None

    def input_gram(self, module: nn.Module, a: Tensor, batch_first: bool) -> Optional[Tensor]:
        """Optional: ``(N, G, S, S)`` Gram matrix ``a_c a_c^T`` of one call's canonical input
        ``a_c`` (:meth:`linear_form`) formed without ``a_c`` (a convolution's patches from its
        input's pixels: :func:`gradhooks.rules.conv.patch_gram`), in ``a``'s dtype; ``None``
        (default) where :meth:`input_gram_cost` is ``None``: readers then form ``a_c``."""
        return None

    @property
    def has_kfac_form(self) -> bool:
        """Whether :meth:`kfac_form` gives this layer's Kronecker-factored form: rules with a
        :meth:`linear_form`, and rules that override :meth:`kfac_form` only (layers linear in
        their weight whose canonical form is too costly for norms and clipping:
        ``nn.ConvTranspose``, ``nn.Embedding``)."""
        return self.has_linear_form or type(self).kfac_form is not LayerRule.kfac_form

    #: ``True`` if the matrix ``W[g]`` of :meth:`kfac_form` is stored with its two leading dims
    #: swapped: the weight is ``(G * I_g, O, *kernel)`` and ``W[g]`` is
    #: ``weight.view(G, I_g, O, K).transpose(1, 2).reshape(G, O, I_g * K)`` (transformers'
    #: ``Conv1D`` ``(I, O)``, ``nn.Embedding`` ``(V, D)``, ``nn.ConvTranspose``
    #: ``(C_in, C_out/G, *kernel)``). Default: :attr:`weight_transposed`.
    @property
    def kfac_transposed(self) -> bool:
        return self.weight_transposed

    def kfac_form(self, module: nn.Module, a, g, batch_first: bool):
        """One call's records in the canonical form KFAC reads (:mod:`gradhooks.kfac`).

        Args:
            module: the layer.
            a: its recorded input (a :class:`Call` for ``multi_io`` rules), or ``None`` when
                only ``g`` is wanted.
            g: one backward pass's grad_output (the output's structure for ``multi_io`` rules).
            batch_first: as given to :func:`gradhooks.attach`.

        Returns:
            ``(a, g)``: ``a`` ``(N, G, S, I)`` (or a :class:`~gradhooks.base.forms.OneHot` of
            indices, or ``None`` when ``a`` was ``None``), ``g`` ``(N, G, S, O)``, such that
            ``y[n,g,s] = W[g] a[n,g,s] + b[g]`` with ``W[g]`` the ``(O, I)`` matrix of group
            ``g`` (see :attr:`kfac_transposed`) and ``b[g] = bias.view(G, O)``. Default:
            :meth:`linear_form`.
        """
        return self.linear_form(module, a, g, batch_first)

    def weighted_sum(self, module: nn.Module, a: Tensor, g: Tensor, c: Tensor, batch_first: bool,
                     names: Iterable[str], out: Optional[Dict[str, Tensor]] = None
                     ) -> Dict[str, Tensor]:
        """``sum_n c_n d(param)_n`` of one call from its records, for rules with a linear form,
        without a per-sample tensor: ``sum_{n,s} (c_n g[n,g,s]) a[n,g,s]^T`` for the weight and
        ``sum_{n,s} c_n g[n,g,s]`` for the bias (Bu et al. 2023, arXiv:2210.00038, sec. 3,
        book-keeping).

        Args:
            module, a, g, batch_first: as for :meth:`linear_form` (``a``, ``g`` in one dtype, at
                least float32).
            c: ``(N,)`` the per-sample weights, in that dtype.
            names: the wanted parameters among ``"weight"``, ``"bias"``.
            out: optional ``{name: tensor}`` of the parameter's shape to write into.

        Returns:
            ``{name: tensor of the parameter's shape}``. The default contracts the canonical
            form (one ``mm`` for ``G = 1``, a batched one over groups otherwise); a rule with a
            faster kernel (convolutions: torch's weight-backward) overrides it.
        """
        out = out or {}
        names = tuple(names)
        a_c, g_c = self.linear_form(module, a if "weight" in names else None, g, batch_first)
        n, groups, _, o = g_c.shape
        result = {}
        if "weight" in names:
            shape = module.weight.shape
            a_w, g_w = a_c, g_c
            if a_c.numel() < g_c.numel():  # weigh the smaller one (the sum is linear in both)
                a_w = a_c * c.view(n, 1, 1, 1)
            else:
                g_w = g_c * c.view(n, 1, 1, 1)
            dest = out.get("weight")
            if groups == 1:  # (N S, O)^T (N S, I): positions and samples in any order
                w = torch.mm(g_w.reshape(-1, o).t(), a_w.reshape(-1, a_w.shape[-1]),
                             out=None if dest is None else dest.view(o, -1))
            else:
                a2 = a_w.transpose(0, 1).reshape(groups, -1, a_w.shape[-1])  # (G, N S, I)
                g2 = g_w.transpose(0, 1).reshape(groups, -1, o)  # (G, N S, O)
                w = torch.bmm(g2.transpose(1, 2), a2)
            result["weight"] = w.view(shape) if dest is None else dest
        if "bias" in names:
            dest = out.get("bias")
            per = (g_c if g_c.shape[2] == 1 else g_c.sum(2, keepdim=True)).reshape(n, groups * o)
            result["bias"] = torch.mv(per.t(), c, out=dest)
        return result

    #: ``True`` if the rule implements :meth:`forms`.
    has_forms: bool = False

    def forms(self, module: nn.Module, a, g, batch_first: bool,
              names: Iterable[str]) -> Dict[str, List[Block]]:
        """Optional: the per-sample gradients of one call in factored form.

        Same arguments as :meth:`per_sample_grads`. Returns ``{name: [Block, ...]}``, the
        blocks covering disjoint rows of the parameter (together all of it, in increasing row
        order); :func:`gradhooks.base.forms.from_blocks` materialises them. Set
        :attr:`has_forms` when implementing it. KFAC (:mod:`gradhooks.kfac`) pairs a
        weight-like parameter with the bias-like one named like it with ``weight`` replaced by
        ``bias`` (``weight_ih_l0`` / ``bias_ih_l0``, ``in_proj_weight`` / ``in_proj_bias``,
        ``out_proj.weight`` / ``out_proj.bias``): such a pair's blocks must cover the same rows
        with the same ``g``.
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
            :func:`gradhooks.base.utils.own_loss_scale`). The tensors must be new (owned by the caller, which
            scales them in place), never views of ``a`` or ``g``. Default for rules with
            :attr:`has_forms`: :meth:`forms` materialised by
            :func:`gradhooks.base.forms.from_blocks`.
        """
        if not self.has_forms:
            raise NotImplementedError
        params = self.params_of(module)
        return {name: from_blocks(blocks, (blocks[0].g.shape[0], *params[name].shape))
                for name, blocks in self.forms(module, a, g, batch_first, names).items()}


_RULES: Dict[Type[nn.Module], LayerRule] = {}

#: ``recognise(module, path) -> LayerRule | None``, asked in order after the exact-type lookup.
_RECOGNISERS: List[Callable[[nn.Module, str], Optional[LayerRule]]] = []


def register_recogniser(recognise: Callable[[nn.Module, str], Optional[LayerRule]]
                        ) -> Callable[[nn.Module, str], Optional[LayerRule]]:
    """Register a function that names a rule for modules the type registry cannot list.

    ``recognise(module, path)`` returns a :class:`LayerRule` for ``module`` or ``None`` (not
    its kind). :func:`find_rule` asks the recognisers, in registration order, for every module
    whose exact type has no rule, before it looks at the class's parents; so a recogniser runs
    at :func:`gradhooks.attach` only, and may afford a check of what the module computes (one
    small forward). Used by :mod:`gradhooks.rules.known` (layers of transformers / timm /
    torchvision matched by class name and checked on a probe input) and
    :mod:`gradhooks.rules.parametrize` (``torch.nn.utils.parametrize``). Returns
    ``recognise`` (usable as a decorator).
    """
    _RECOGNISERS.append(recognise)
    return recognise


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

    Exact type first, then the recognisers (:func:`register_recogniser`), then the parents in
    method resolution order (:func:`find_type_rule`).

    Raises:
        UnsupportedModuleError: if ``module`` is a subclass of a supported type that overrides
            ``forward`` (the parent's rule would not match what it computes) and no recogniser
            claims it.
    """
    cls = type(module)
    if cls in _RULES:
        return _RULES[cls]
    for recognise in _RECOGNISERS:
        rule = recognise(module, path)
        if rule is not None:
            return rule
    return find_type_rule(cls, path)


def find_type_rule(cls: Type[nn.Module], path: str = "") -> Optional[LayerRule]:
    """The registered rule of the class ``cls`` or of its nearest registered parent whose
    ``forward`` it keeps; ``None`` if there is none (no recognisers asked).

    Raises:
        UnsupportedModuleError: as :func:`find_rule`.
    """
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
