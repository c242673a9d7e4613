"""The user facade: :func:`attach` and :class:`GradHooks`.

:class:`GradHooks` owns a :class:`~gradhooks.core.recorder.capture.Recorder` (hooks, records, batch lifecycle)
and forwards each read to the module that computes it: per-sample gradients
(:mod:`gradhooks.readers.per_sample`), norms (:mod:`gradhooks.readers.norms`) and first-order
statistics (:mod:`gradhooks.readers.statistics`) here; the reads of each use in its mixin
(:mod:`gradhooks.api`: DP-SGD clipping, curvature, gradient features). It computes nothing
itself.
"""
from __future__ import annotations

import weakref
from typing import Callable, Dict, Optional, Sequence, Union

import torch
from torch import Tensor, nn

from .api.curvature import CurvatureReads
from .api.dp import DPReads
from .api.features import FeatureReads
from .base.errors import GradHooksError
from .core.analysis import check_token_normalisation
from .core.recorder.capture import Recorder
from .core.recorder.graph import warn_not_detached
from .readers.dp.accumulation import Accumulation
from .readers.norms import per_sample_grad_norms
from .readers.per_sample import per_sample_grads
from .readers.sample_losses import judged_backward
from .readers.spotcheck import check_samples
from .readers.statistics import sum_grad_squared, variance

__all__ = ["attach", "GradHooks"]


class GradHooks(DPReads, CurvatureReads, FeatureReads):
    """Per-sample gradients of an existing model, through hooks on its layers.

    Create it with :func:`attach`. Typical use::

        with gradhooks.attach(model, loss_reduction="mean") as gh:
            loss = F.cross_entropy(model(x), y)          # reduction="mean"
            loss.backward()
            grads = gh.per_sample_grads()                 # {name: (B, *param.shape)}

    **Batches and backward passes.** A *batch* starts with the first forward (with autograd
    enabled) after a backward pass, or after :meth:`clear`. All calls of hooked layers until the
    next backward belong to that batch; within one forward of the model they must agree on the
    batch size ``B`` (a forward that no backward reached may be followed by one of another size,
    which starts a new batch). Several backward
    passes through the same forward (``retain_graph=True``) *accumulate*: the per-sample
    gradients are summed over them, like ``param.grad``. The next forward after a backward starts
    a new batch and *replaces* the previous results (per-sample gradients of different batches
    cannot be added sample by sample). :meth:`clear` drops everything recorded at once.

    **Backward without the batch gradient.** ``gh.backward(loss)`` (:meth:`backward`) replaces
    ``loss.backward()`` when only per-sample results are wanted: autograd then computes the
    gradients w.r.t. the layers' outputs only, not the batch weight gradients (which per-sample
    rules recompute sample by sample anyway), and ``param.grad`` is left alone.

    **Memory.** Inputs of calls whose output never reaches a backward are freed with the autograd
    graph. Inputs and grad_outputs of calls the backward reached are kept until the next
    recording forward of the model starts, :meth:`clear` or :meth:`detach`, so that norms,
    clipping and KFAC factors can be read in any order, or until :meth:`per_sample_grads`
    releases them layer by layer as it forms its result (its default, ``retain_records=False``;
    later norms and clipping then read the result).

    **Sum check.** :meth:`per_sample_grads` verifies, on up to 256 coordinates of each
    parameter, that the per-sample gradients sum to the gradient autograd computed for the
    parameter in the same backward passes. It catches a parameter that also receives gradient
    outside its module (used functionally, ``x @ layer.weight.T``), a module that mixes samples
    under the fallback, or a backward that computed no parameter gradient
    (``torch.autograd.grad`` w.r.t. the input only). Its cost is a few torch calls and a read
    of ``B x 256`` values per parameter (0.5 ms per read on a 3-layer MLP, noise on real
    models); autograd's gradients are taken in the backward as
    :class:`~gradhooks.core.recorder.totals.GradTotal` (large ones reduced at once, so that autograd
    still moves them into ``.grad``). With ``check=True`` (default) it runs on every read whose *structure* has not
    been checked before -- which modules were called how often, by how many backward passes,
    and which parameters autograd reached --, on the reads of a batch whose forward had a
    structure its input signature had not shown (a branch taken), and on every
    100th read: the failures above are
    properties of that structure, so a training loop pays for the check once, and any new
    structure is checked when it appears. ``check="always"`` checks every read; ``check=False``
    never. Calls whose input was modified in place after the forward, and ``create_graph``
    backward passes, are refused on every read whatever ``check`` is.

    **What an attachment installs process-wide.** Four entries in torch's global module hook
    dictionaries (``torch.nn.modules.module._global_*``: a forward pre-hook, an always-called
    forward hook with kwargs, a parameter- and a module-registration hook), filtered by module,
    so that the model itself carries no hook. While any attachment is live every module call of
    the process, other models' included, leaves torch's hook-free fast path (measured in the
    README, "Training set-ups"). :meth:`detach` removes exactly this attachment's entries;
    a ``GradHooks`` garbage-collected while attached is detached then, with a
    :class:`~gradhooks.base.errors.NotDetachedWarning` (a ``ResourceWarning``, as for an unclosed
    file). With nothing attached, the dictionaries are as they were.
    """

    def __init__(self, model: nn.Module, *, loss_reduction: str = "mean", batch_first: bool = True,
                 check: Union[bool, str] = True, strict: bool = False,
                 allow_batchnorm_train: bool = False, forwards: str = "one",
                 grad_scaler: Optional[torch.amp.GradScaler] = None, differentiable: bool = False,
                 allow_sample_mixing: bool = False, unsafe_skip_replay_check: bool = False,
                 unsafe_skip_sample_check: bool = False,
                 token_normalisation: str = "sample") -> None:
        #: The :class:`~gradhooks.core.recorder.capture.Recorder`: hooks and records (read-only for users).
        self.recorder = Recorder(
            model, loss_reduction=loss_reduction, batch_first=batch_first, check=check,
            strict=strict, allow_batchnorm_train=allow_batchnorm_train, forwards=forwards,
            grad_scaler=grad_scaler, differentiable=differentiable,
            allow_sample_mixing=allow_sample_mixing, unsafe_skip_replay_check=unsafe_skip_replay_check,
            unsafe_skip_sample_check=unsafe_skip_sample_check)
        self.recorder.token_normalisation = check_token_normalisation(token_normalisation)
        # Dropped while attached: detached, with a warning (atexit off: the process ends).
        weakref.finalize(self, _dropped, self.recorder).atexit = False
        #: The DP-SGD accumulator (:class:`~gradhooks.readers.dp.accumulation.Accumulation`).
        self.accumulation = Accumulation(self.recorder)

    @property
    def model(self) -> nn.Module:
        """The attached model."""
        return self.recorder.model

    @property
    def loss_reduction(self) -> str:
        """``"mean"`` or ``"sum"``, as given to :func:`attach`."""
        return self.recorder.loss_reduction

    @property
    def batch_first(self) -> bool:
        """The layout flag given to :func:`attach`."""
        return self.recorder.batch_first

    @property
    def check(self) -> Union[bool, str]:
        """The sum-check option given to :func:`attach`: ``True``, ``False`` or ``"always"``."""
        return self.recorder.check

    @property
    def strict(self) -> bool:
        """Whether modules without a dedicated rule are refused (:func:`attach`)."""
        return self.recorder.strict

    @property
    def batch_size(self) -> Optional[int]:
        """Batch size ``B`` of the current batch, or ``None`` before its first forward."""
        return self.recorder.batch_size

    def detach(self) -> None:
        """Remove every hook, record and ``grad_sample`` attribute; the model is as before attach.

        Afterwards the model's hook dictionaries, ``state_dict()``, ``copy.deepcopy`` and
        ``pickle`` behave exactly as before :func:`attach`. Calling it twice is harmless. A DP
        accumulation not finished (:meth:`finish_step`) is dropped.
        """
        self.accumulation.close()
        self.recorder.detach()

    def clear(self) -> None:
        """Drop the records, results and sample_ids, set ``grad_sample`` to ``None``: a new batch."""
        self.recorder.clear()
        self.recorder.reads.set_groups(None)

    def __enter__(self) -> "GradHooks":
        return self

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def set_sample_ids(self, sample_ids: Optional[Tensor]) -> None:
        """Rows sharing an id are one sample: :meth:`~gradhooks.core.recorder.batch_reads.BatchReads.set_groups`."""
        self.recorder.reads.set_groups(sample_ids)

    def backward(self, loss: Tensor, gradient: Optional[Tensor] = None, *,
                 retain_graph: bool = False) -> None:
        """A backward pass that records the grad_outputs without forming the batch gradient.

        Use it instead of ``loss.backward()`` when only per-sample quantities are wanted
        (:meth:`per_sample_grads`, :meth:`per_sample_grad_norms`, :meth:`clip_and_accumulate`,
        :meth:`kfac_factors`, ...): it asks autograd for the gradients w.r.t. the hooked layers'
        outputs (``torch.autograd.grad`` with :class:`torch.autograd.graph.GradientEdge` inputs)
        instead of the parameters, so autograd skips every weight-gradient product (``g^T a``
        of a Linear, the weight-backward convolution of a Conv, the gate products of an LSTM):
        the part of the backward that per-sample rules compute sample by sample anyway (about
        a third of a Linear network's backward; measured in ``benchmarks/``). Everything
        gradhooks reads is recorded exactly as by ``loss.backward()``.

        ``param.grad`` is neither allocated nor changed; parameters the hooks do not cover get
        no gradient either (use ``loss.backward()`` for those). Several calls through one
        forward (``retain_graph=True``) accumulate, like backward passes do.

        **Sum check.** Without the parameters' gradients the sum check of the class docstring
        has nothing to compare with. So on the steps where it is due -- the first call (whose
        forward ran before the hooks knew of this mode and recorded no edges), each new forward
        structure (which modules were called, in which order), a forward of a structure its
        input signature had not shown (its ops' count and fingerprint, a branch taken:
        :class:`~gradhooks.core.recorder.check_policy.SumCheck`), every 100th call, and every
        call with ``check="always"`` -- this computes the parameters' gradients instead
        (``torch.autograd.grad(loss, params)``, handed to the check and dropped, ``.grad``
        untouched), and the next read runs the check. On the other steps reads skip it.

        A ``loss`` that is ``scaler.scale(x)`` (a ``torch.amp.GradScaler``) is read as with
        ``attach(..., grad_scaler=scaler)``: results of ``x``, ``.grad`` written at the scale.

        Args:
            loss: the tensor to differentiate, usually the scalar batch loss reduced as the
                ``loss_reduction`` given to :func:`attach` says.
            gradient: the gradient w.r.t. ``loss`` (its shape) for a non-scalar ``loss``, as in
                ``Tensor.backward``.
            retain_graph: keep the graph for another backward pass through it.

        Raises:
            GradHooksError: if ``loss`` does not require grad, or nothing trainable is hooked.
            UnsupportedLossError: if the loss's graph shows a token-level mean over samples with
                unequal valid-token counts, or a reduction over the batch that contradicts
                ``loss_reduction`` (:mod:`gradhooks.readers.loss_reduction`; use
                :func:`gradhooks.per_sample_token_loss`).
            RuntimeError: from autograd, e.g. a non-scalar ``loss`` without ``gradient``, or a
                graph already freed by an earlier backward.
        """
        if not isinstance(loss, Tensor) or not loss.requires_grad:
            raise GradHooksError(
                "GradHooks.backward(loss): loss must be a tensor that requires grad (the output of "
                "a forward of the hooked model, not under torch.no_grad())")
        judged_backward(self.recorder, loss, gradient, retain_graph)

    def per_sample_grads(self, *, retain_records: bool = False) -> Dict[str, Tensor]:
        """Per-sample gradients of every trainable parameter the backward reached.

        Args:
            retain_records: keep the batch's records (input activations, grad_outputs) after
                the read. By default they are released layer by layer as the result is formed,
                like ``loss.backward()`` frees the graph (``retain_graph=False``): the peak
                memory of the read is then about the result plus one layer's records, not all
                records plus the result. Later reads of this batch still work where the result
                suffices (this call again, :meth:`per_sample_grad_norms`,
                :meth:`clip_and_accumulate`); :meth:`kfac_factors`, and reads after another
                backward pass through the hooked layers, need the records: call them first or
                pass ``retain_records=True``.

        Returns:
            ``{name: tensor}`` keyed by the parameter's name in ``model.named_parameters()``
            (a parameter tied between modules appears once, summed over them), in that order.
            Each tensor has shape ``(B, *param.shape)`` and the parameter's dtype; entry ``n`` is
            the gradient of sample ``n``'s own loss: with ``loss_reduction="mean"`` the recorded
            gradients are multiplied by ``B``, so the result does not depend on the batch size.
            The same tensor is set as ``param.grad_sample``; ``param.grad`` is left as autograd
            computed it. The result is computed on first call and cached until the next
            backward pass or batch.

        Raises:
            NoBackwardError: if no backward pass reached a hooked layer since the batch started.
            RecordsReleasedError: if a backward pass reached the hooked layers after a read
                released the records, or a read that released them failed.
            HigherOrderGradError: if a backward pass ran with ``create_graph=True`` through a
                hooked layer (a loss containing input derivatives).
            GradientMismatchError: if the sum check fails (see the class docstring), or an input
                recorded in the forward was modified in place afterwards.
        """
        return per_sample_grads(self.recorder.snapshot(
            "per_sample_grads()", release=not retain_records, result=True))

    def per_sample_grad_norms(self, *, per_param: bool = False) -> Union[Tensor, Dict[str, Tensor]]:
        """``(B,)`` L2 norms of the per-sample gradients over all trainable parameters (or
        ``{name: (B,)}`` with ``per_param=True``), by the Gram form where cheaper (Li et al.
        2022, arXiv:2110.05679, sec. 4); conventions and errors:
        :func:`gradhooks.readers.norms.per_sample_grad_norms`."""
        return per_sample_grad_norms(self.recorder.snapshot("per_sample_grad_norms()", result=True),
                                     per_param=per_param)

    def check_samples(self, loss_fn: Callable[..., Tensor], inputs: Union[Tensor, Sequence[Tensor]],
                      targets: Union[Tensor, Sequence[Tensor]], *, samples: int = 2,
                      generator: Optional[torch.Generator] = None) -> None:
        """Spot check against mixing samples: recompute ``samples`` random samples of the
        current batch alone (``model(*inputs[n:n+1])``, ``loss_fn`` of it) and compare with their
        rows of :meth:`per_sample_grads`; raises :class:`~gradhooks.GradientMismatchError` when
        the loss or the model mixes samples (which the sum check cannot see). Arguments:
        :func:`gradhooks.readers.spotcheck.check_samples`."""
        check_samples(self.recorder, loss_fn, inputs, targets, samples=samples,
                      generator=generator)

    def sum_grad_squared(self) -> Dict[str, Tensor]:
        """Diagonal of the empirical Fisher ``{name: (*param.shape)}``, ``sum_n g_n**2`` of the
        per-sample gradients (BackPACK's SumGradSquared); scaling convention and errors:
        :func:`gradhooks.readers.statistics.sum_grad_squared`."""
        return sum_grad_squared(self.recorder.snapshot("per_sample_grads()", release=True,
                                                       result=True))

    def variance(self) -> Dict[str, Tensor]:
        """Per-parameter gradient variance over the batch ``{name: (*param.shape)}`` (``1/B``
        normalisation, BackPACK's Variance); see :func:`gradhooks.readers.statistics.variance`."""
        return variance(self.recorder.snapshot("per_sample_grads()", release=True, result=True))


def _dropped(recorder: Recorder) -> None:
    # A GradHooks was garbage-collected: a recorder still attached is detached.
    if recorder.attached:
        warn_not_detached(f"GradHooks of a {type(recorder.model).__name__}")
        recorder.detach()


def attach(model: nn.Module, *, loss_reduction: str = "mean", batch_first: bool = True,
           check: Union[bool, str] = True, strict: bool = False,
           allow_batchnorm_train: bool = False, forwards: str = "one",
           grad_scaler: Optional[torch.amp.GradScaler] = None, differentiable: bool = False,
           allow_sample_mixing: bool = False, unsafe_skip_replay_check: bool = False,
           unsafe_skip_sample_check: bool = False, token_normalisation: str = "sample"
           ) -> GradHooks:
    """Attach per-sample-gradient hooks to every supported layer of an existing model.

    Registers a forward hook on each module that has a rule (``nn.Linear``, ``nn.Conv1d/2d/3d``;
    see :func:`gradhooks.supported_types`) and a gradient hook on each of their parameters, and
    changes nothing else: nested containers, residual connections and functional ops between the
    layers work as they are.

    Args:
        model: the ``nn.Module``. For ``torch.compile(model)`` (an ``OptimizedModule``) the
            module it wraps is hooked (``gh.model`` is that module), and calls of the compiled
            module are recorded, provided it is first called after attach (compiled code sees
            the hooks that exist when it is compiled; otherwise ``torch._dynamo.reset()``).
        loss_reduction: ``"mean"`` or ``"sum"``: how the batch loss was reduced over samples.
            With ``"mean"`` per-sample gradients are multiplied by ``B`` (gradient of each
            sample's own loss).
        batch_first: ``True`` if the batch is dim 0 of every layer input; ``False`` for torch's
            sequence layout ``(T, B, ..., features)`` (a 2-D ``(B, features)`` input is then still
            read as batch-first). Convolutions always take the batch on dim 0.
        check: the sum check of :class:`GradHooks`: ``True`` (each new call structure, and
            every 100th read), ``"always"`` (every read) or ``False``. ``False`` does not skip
            the verification of the ``torch.func`` fallback's replays (see
            ``unsafe_skip_replay_check``), nor the forward-alone check of ops no rule proves
            keep the samples apart (:mod:`gradhooks.core.analysis.alone`): without it they are refused,
            nor the sample check through the batched graph (``unsafe_skip_sample_check``).
        strict: refuse modules that own trainable parameters but have no dedicated rule
            (raise :class:`UnsupportedModuleError`) instead of covering them with the
            ``torch.func`` fallback (:mod:`gradhooks.rules.fallback`, with one
            :class:`FallbackWarning` listing them).
        allow_batchnorm_train: accept ``BatchNorm`` in training mode; its per-sample results are
            then each sample's *contribution* to the batch gradient with the batch statistics
            held fixed (they sum to ``param.grad``), not gradients of each sample's own loss;
            the layers before the BatchNorm then also get such contributions.
        allow_sample_mixing: accept a forward that mixes the samples through the parameters (an
            op that reduces or normalises over the batch dim between a hooked layer and the
            loss: ``h - h.mean(0)``, ``h / h.std(0)``, a softmax or sort over the batch, batch
            statistics; :mod:`gradhooks.core.analysis.mixing`), which reads otherwise refuse with
            :class:`SampleMixingError`. Sample ``n``'s result is then its activations times the
            gradient of the *whole batch loss* with respect to its own outputs of the layer:
            its contribution to the batch gradient (they still sum to ``param.grad``, with the
            ``loss_reduction`` scale), not the gradient of its own loss; layers after the last
            mixing op still get exact own-loss gradients.
        unsafe_skip_replay_check: do not verify the ``torch.func`` fallback's replays. By default
            every read of each module the fallback replays compares the replay's per-sample
            gradients, summed, with autograd's gradient of the module's parameters through its
            batched call, and refuses a replay that computes
            something else (:class:`~gradhooks.base.errors.ReplayMismatchError`;
            :mod:`gradhooks.rules.fallback_replay`). ``check=False`` does **not** skip that
            verification; only this switch does, and a module whose replay is wrong then gets
            wrong per-sample gradients without an error. Its cost is one batched forward and
            backward of the module per new structure.
        unsafe_skip_sample_check: do not run the sample check through the batched graph. By
            default, where per-sample losses exist (``gh.clipped_backward(losses)``,
            ``gh.backward`` of ``(B,)`` losses or of their ``.mean()`` / ``.sum()``), the first
            backward of each new structure (and every 100th) compares rows ``0`` and ``B - 1``
            of the records with autograd's gradient of those samples' own loss terms through
            the batched forward, and refuses a forward or a loss that pairs samples, whatever
            the op (:class:`SampleMixingError`; :mod:`gradhooks.readers.sample_check`).
            ``check=False`` does **not** skip it; only this switch (or
            ``allow_sample_mixing=True``) does. Its cost is two backward passes through the
            batched graph per new structure. Where no per-sample losses exist (a plain
            ``loss.backward()``, ``gh.backward`` of another scalar loss), the loss computed
            after the model must prove its split from its autograd graph instead, whatever
            this switch says (:mod:`gradhooks.core.analysis.loss_graph`; refused as
            :class:`SampleMixingError` / :class:`UnprovenOpError` at the read).
        token_normalisation: ``"sample"`` (default): a loss whose split into per-sample terms
            its graph does not prove (anything but ``.mean()`` / ``.sum()`` of ``(B,)``
            per-sample losses: a token mean, class weights, label smoothing, a z-loss, a sum
            over ``num_items_in_batch``) is refused where the samples' valid-token counts
            differ (:class:`UnsupportedLossError`; use
            :func:`gradhooks.per_sample_token_loss`). ``"batch"``: the batch's token
            normalisation is wanted; sample ``n``'s result is then its contribution to the
            batch gradient (with the ``loss_reduction`` scale), which under DP-SGD depends on
            the batch's token count.

        forwards: ``"one"`` (default): one forward of the model per backward; the records of
            several top-level forwards reached by one backward are refused at the read (their
            rows would be added sample by sample). ``"same_samples"``: every forward before a
            backward saw the same samples in the same order (two views or augmentations of one
            batch); the per-sample results then sum over the forwards.
        grad_scaler: the ``torch.amp.GradScaler`` that scales the loss
            (``scaler.scale(loss).backward()``): per-sample results, norms and KFAC factors
            are those of the unscaled loss, and clipping writes ``.grad`` at the scaler's scale
            for ``scaler.step(optimizer)`` (:func:`gradhooks.readers.dp.clipping.clip_and_accumulate`).
        differentiable: the records keep the autograd graphs of the layer inputs and of the
            grad_outputs of a ``backward(create_graph=True)``, so that
            :meth:`GradHooks.per_sample_grads` after such a backward and
            :meth:`GradHooks.per_sample_jacobians` with ``create_graph=True`` return tensors
            that can be differentiated w.r.t. the parameters and the inputs (a per-sample
            gradient or Jacobian penalty; ASDL's Jacobians cannot). Layers whose rules have a
            differentiable path: Linear, transformers' ``Conv1D``, Conv, Embedding, the affine
            norm layers (:attr:`~gradhooks.base.registry.LayerRule.differentiable`); a read that
            needs another raises :class:`UnsupportedModuleError`. A loss that itself contains
            derivatives through the hooked layers is then not refused by the higher-order
            check (the sum check still runs). Default ``False``: records are detached.

    Returns:
        A :class:`GradHooks`, also a context manager that detaches on exit.

    Raises:
        ValueError: if ``loss_reduction`` is not ``"mean"`` or ``"sum"``.
        UnsupportedModuleError: with ``strict=True``, if a module owns trainable parameters and
            has no rule; the message names each such module's path and type.
        UnsupportedModuleError: for a TorchScript module (``torch.jit.script`` / ``trace``) with
            trainable parameters in the model: its forward runs no Python hooks.
        GradHooksError: if a layer is already hooked by another live :class:`GradHooks`, or
            the model has no parameters. A model none of whose parameters is trainable gets a
            :class:`~gradhooks.base.errors.FrozenModelWarning`.

    Warns:
        LossScaleWarning: once, at the first read after a float16 (autocast) forward when no
            ``grad_scaler`` was given: a ``scaler.scale(loss)`` would scale every result.
    """
    return GradHooks(model, loss_reduction=loss_reduction, batch_first=batch_first, check=check,
                     strict=strict, allow_batchnorm_train=allow_batchnorm_train,
                     forwards=forwards, grad_scaler=grad_scaler, differentiable=differentiable,
                     allow_sample_mixing=allow_sample_mixing,
                     unsafe_skip_replay_check=unsafe_skip_replay_check,
                     unsafe_skip_sample_check=unsafe_skip_sample_check,
                     token_normalisation=token_normalisation)
