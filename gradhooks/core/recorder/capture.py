"""The recorder: attach to a model, record activations and grad_outputs per call, detach.

How it works (Goodfellow 2015, arXiv:1510.01799): for every module that has a rule, a forward
hook records the call's input activations ``a`` and registers a pre-hook on the autograd node that
produced the call's output (like curvlinops' ``output.register_hook``, but cheaper to register;
unlike ``register_full_backward_hook`` it works when an in-place op such as
``ReLU(inplace=True)`` follows the layer). In the backward the pre-hook receives the gradient
w.r.t. that output, ``g``. Each call gets its own :class:`~gradhooks.core.recorder.records.Record`, so a layer called several times
in one forward pairs every input with its own grad_output.

The recorder computes nothing from its records. Readers (:mod:`gradhooks.readers.per_sample`,
:mod:`gradhooks.readers.norms`, :mod:`gradhooks.readers.dp.clipping`, :mod:`gradhooks.kfac`, ...) ask it for a
:class:`~gradhooks.core.recorder.records.Batch`: a read-only snapshot of the batch's records, its size ``B``, the own-loss scale
(computed once, :func:`gradhooks.base.utils.own_loss_scale`) and autograd's parameter gradients for
the sum check, validated once (records released, stale, modified in place, ``create_graph``).

All state lives in the :class:`Recorder` and the parts it owns and delegates to: its
:class:`~gradhooks.core.recorder.attachment.Attachment` (which modules and parameters are hooked, kept in step
with the model), :class:`~gradhooks.core.recorder.placement.Placement` (where the batch sits in each call:
shared calls, provenance), :class:`~gradhooks.core.recorder.forward_pass.ForwardPass` (each call's record),
:class:`~gradhooks.core.recorder.backward_pass.BackwardPass` (what the backward pass delivers,
:meth:`Recorder.drive`) and :class:`~gradhooks.core.recorder.batch_reads.BatchReads` (a read's validation).
The only attribute put on user objects is
``param.grad_sample`` (set by the per-sample reader), removed by :meth:`Recorder.detach`.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from ...base import utils
from ...base._pool import BufferPool
from ...base.utils import check_loss_reduction
from ...rules.fallback import FALLBACK, UNVERIFIED_FALLBACK
from .attachment import Attachment, is_hooked, unwrap_compiled
from .backward_pass import BackwardPass
from .batch_reads import BatchReads
from .check_policy import SumCheck
from .forward_pass import ForwardPass
from .graph import GlobalHooks, call_kwargs, module_hooks
from .placement import Placement
from .records import FORWARDS, Batch, Layer, Memo, Record
from .totals import GradTotal

__all__ = ["Recorder", "Batch", "Layer", "Record", "is_hooked"]


class Recorder:
    """The hook manager behind :class:`~gradhooks.GradHooks`: hooks, records, batch lifecycle.

    Batches and memory are as the :class:`~gradhooks.GradHooks` docstring says. Readers use the
    public attributes below (read only) and :meth:`snapshot`; the facade adds the user API. The
    recorder owns its parts and delegates to them: :attr:`attachment` (what is hooked),
    :attr:`placement` (where the batch sits in each call), :attr:`forward_pass` (the record of
    each call), :attr:`backward_pass` (what the backward pass delivers) and :attr:`reads` (a
    read's validation).

    Attributes:
        model: the attached model.
        loss_reduction: ``"mean"`` or ``"sum"``, as given to :func:`gradhooks.attach`.
        batch_first: the layout flag given to :func:`gradhooks.attach`.
        differentiable: records keep their inputs' and grad_outputs' autograd graphs
            (:func:`gradhooks.attach`).
        strict: refuse modules without a dedicated rule instead of the fallback.
        sum_check: the :class:`~gradhooks.core.recorder.check_policy.SumCheck` policy (``check=``).
        names: ``{id(param): name}`` of every parameter of the model, in
            ``model.named_parameters()`` order.
        order: ``{id(param): position}`` in that order (results are in this order).
        params: ``{id(param): param}`` of the hooked parameters.
        layers: the hooked :class:`Layer` objects, in ``model.named_modules()`` order.
        memo: the :class:`~gradhooks.core.recorder.records.Memo` of per-structure decisions readers keep
            between batches (the norm plan's templates; cleared when the model changes).
        totals: ``{id(param): GradTotal}``: autograd's gradients of this batch (sum check).
        pool: the :class:`~gradhooks.base._pool.BufferPool` results' tensors are reused from.
        attachment: the :class:`~gradhooks.core.recorder.attachment.Attachment` (hooked modules and
            parameters, kept in step with the model).
        placement: the :class:`~gradhooks.core.recorder.placement.Placement` (per call: batched, shared or
            planned; provenance and its plans).
        forward_pass: the :class:`~gradhooks.core.recorder.forward_pass.ForwardPass` (each hooked call's
            record, the batch size).
        backward_pass: the :class:`~gradhooks.core.recorder.backward_pass.BackwardPass` (grad_outputs,
            parameter gradients, :meth:`drive`).
        reads: the :class:`~gradhooks.core.recorder.batch_reads.BatchReads` (:meth:`snapshot`'s validation).
        sample_checked: the structures whose sample check through the batched graph passed
            (:mod:`gradhooks.readers.sample_check`); ``sample_checks`` counts the backwards.
        attached: whether the hooks are attached (``False`` after :meth:`detach`).
        options: the layer options given to :func:`gradhooks.attach` (``allow_batchnorm_train``).
        layer_of: ``{id(module): Layer}`` of the hooked modules (the global hooks' filter).
        on_grad_output, on_internal: the backward pass's hooks, bound once (the hot path hands
            them to every record).
        driven: :meth:`drive` was called once: forwards record their outputs' autograd edges.
        hooks_muted: the hooks record nothing (inside :meth:`muted`).

    The batch's state, written by the recorder and its parts (:attr:`forward_pass`,
    :attr:`backward_pass`, :attr:`placement`, :attr:`reads`), read only elsewhere; each is reset
    by :meth:`reset_batch`:

    Attributes:
        batch_id: a number that changes whenever a batch starts (:meth:`reset_batch`: the first
            recording forward after a backward pass, :meth:`clear`, a consumed batch); equal for
            every backward pass through one forward (:mod:`gradhooks.readers.dp.accumulation`
            tells batches apart by it).
        forward_id: counts the model's top-level forwards.
        batch_size: ``B`` of the current batch, or ``None`` before its first forward;
            ``batch_source`` says where it was read, ``batch_forward`` in which forward.
        calls: the hooked-layer calls recorded in this batch.
        reached_records: the records a backward pass reached, in that order (:attr:`records`
            is a tuple of them).
        param_passes: ``{id(param): backward passes that reached it}``.
        backward_seen: a backward pass delivered a grad_output to a record.
        edges_complete: every forward of the batch marked its output nodes for :meth:`drive`.
        sum_check_state: how this batch's reads run the sum check: ``None`` (decided at the
            read by :attr:`sum_check`), ``"due"`` (:meth:`drive` computed autograd's parameter
            gradients for it) or ``"skip"`` (:meth:`drive` computed none); ``drive_key`` the
            structure :meth:`drive` computed them for.
        higher_order: a layer a ``create_graph=True`` backward reached, or ``None``.
        released: a read released this batch's records (``per_sample_grads()``'s default);
            ``stale`` names a module a backward then reached.
    """

    def __init__(self, model: nn.Module, *, loss_reduction: str = "mean", batch_first: bool = True,
                 check=True, strict: bool = False, allow_batchnorm_train: bool = False,
                 forwards: str = "one", grad_scaler=None, differentiable: bool = False,
                 allow_sample_mixing: bool = False, unsafe_skip_replay_check: bool = False,
                 unsafe_skip_sample_check: bool = False):
        check_loss_reduction(loss_reduction)
        if forwards not in FORWARDS:
            raise ValueError(f"forwards must be one of {FORWARDS}, got {forwards!r}")
        if grad_scaler is not None and not callable(getattr(grad_scaler, "get_scale", None)):
            raise TypeError(f"grad_scaler must be a torch.amp.GradScaler, got "
                            f"{type(grad_scaler).__name__}")
        self.forwards = forwards
        self.grad_scaler = grad_scaler
        self.differentiable = bool(differentiable)
        if not isinstance(model, nn.Module):
            raise TypeError(f"attach expects an nn.Module, got {type(model).__name__}")
        model = unwrap_compiled(model)  # (torch.compile(model): hook the module it wraps)
        self.model = model
        self.loss_reduction = loss_reduction
        self.batch_first = bool(batch_first)
        self.sum_check = SumCheck(check)
        self.check = check  # (read on every forward: a plain attribute)
        self.strict = bool(strict)
        # ``"sample"`` or ``"batch"``: how a token-mean loss splits (the facade's
        # ``token_normalisation=``; :mod:`gradhooks.readers.loss_reduction` reads it)
        self.token_normalisation = "sample"
        self.options = {"allow_batchnorm_train": bool(allow_batchnorm_train)}
        self.allow_sample_mixing = bool(allow_sample_mixing)  # (read by placement.mixing)
        # The sample check through the batched graph (readers.sample_check): structures passed
        self.unsafe_skip_sample_check = bool(unsafe_skip_sample_check)
        self.sample_checked: set = set()
        self.sample_checks = 0
        # The rule of modules without one: its replays verified, unless the user said not to
        self.fallback = UNVERIFIED_FALLBACK if unsafe_skip_replay_check else FALLBACK
        self.layers: List[Layer] = []
        self.names: Dict[int, str] = {}  # id(param) -> name in model.named_parameters()
        self.order: Dict[int, int] = {}
        self.layer_of: Dict[int, Layer] = {}  # id(module) -> its Layer, for the global hooks
        self.attachment = Attachment(self)
        self.params: Dict[int, nn.Parameter] = self.attachment.params
        self._hooks: Optional[GlobalHooks] = None  # the global module hooks (graph.module_hooks)
        self.attached = False
        self.pool = BufferPool()
        self.memo = Memo()
        # backward(): once called, forwards record their outputs' autograd edges.
        self.driven = False
        self.hooks_muted = False  # hooks record nothing (muted(): clipped_backward's second pass)
        self.batch_id = 0
        self.forward_id = 0
        self.backward_pass = BackwardPass(self)
        # (bound once: the hot path hands them to every record's hooks)
        self.on_grad_output = self.backward_pass.on_grad_output
        self.on_internal = self.backward_pass.on_internal
        self.placement = Placement(self, self.attachment.demote)
        self.reads = BatchReads(self)
        self.forward_pass = ForwardPass(self)
        # Under torch.compile the recording runs eagerly (a graph break), instead of dynamo
        # tracing it and recompiling for every record; the filters above stay traceable.
        self._record = torch.compiler.disable(self.forward_pass.record_call)
        self._model_forward = torch.compiler.disable(self.forward_pass.model_forward)
        self._note_forward = torch.compiler.disable(self.attachment.note_forward)
        self.reset_batch()
        self._attach()

    # ------------------------------------------------------------------ attach / detach
    def _attach(self) -> None:
        # Global module hooks, filtered by module: the model itself carries no hook of ours, so
        # copy.deepcopy / pickle / torch.save of an attached model give a plain model.
        self._hook_modules()
        self.attached = True
        try:
            self.sync()
        except BaseException:  # (a refused model: nothing of the attempt stays installed)
            self.detach()
            raise

    def _hook_modules(self) -> None:
        # Removed by detach(), or with the parameters' hooks when the recorder is collected
        # while attached (a GradHooks that drops its recorder detaches it first).
        self._hooks = module_hooks(self, pre=Recorder._on_pre_forward,
                                   post=Recorder._on_any_forward, done=Recorder._on_done,
                                   registration=Recorder._on_registration,
                                   what=f"a gradhooks recorder of a {type(self.model).__name__}",
                                   also=self.attachment.param_handles)

    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Within this context the global module hooks are removed, the recorder's state kept:
        every module of the process, this model's included, runs torch's hook-free fast path and
        nothing is recorded. For benchmarks that time other methods in the same process
        (``benchmarks/peers.py``), whose models would otherwise pay the hooks' dispatch."""
        if not self.attached:
            yield
            return
        self.placement.stop()
        self.backward_pass.spans.stop()
        self._hooks.remove()
        try:
            yield
        finally:
            if self.attached:
                self._hook_modules()

    def sync(self) -> None:
        # (Re)build what is hooked from the model as it is now (Attachment.sync); the readers'
        # cache, the signatures' plans and the batch go with the old layer maps.
        self.attachment.sync()
        self.memo.clear()
        self.placement.forget_signatures()
        self.reset_batch()

    def _on_registration(self, module: nn.Module, name: str, value) -> None:
        # Global registration hook: a parameter or submodule is set on some module.
        self.attachment.on_registration(module, name, value)
        return None


    def detach(self) -> None:
        """Remove every hook, record and ``grad_sample`` attribute; the model is as before attach.

        Afterwards the model's hook dictionaries, ``state_dict()``, ``copy.deepcopy`` and
        ``pickle`` behave exactly as before :func:`attach`. Calling it twice is harmless.
        """
        if not self.attached:
            return
        self.placement.stop()
        self.backward_pass.spans.stop()
        self._hooks.remove()
        self._hooks = None
        self.attachment.unsync()
        self.attached = False  # graphs built before: their hooks now do nothing
        self.reset_batch()
        self.pool.clear()

    # ------------------------------------------------------------------ batch state
    def reset_batch(self) -> None:
        """Drop the current batch's records and result; the next forward starts a new batch."""
        for record in getattr(self, "reached_records", ()):
            record.release()
        self.batch_id += 1
        self.reached_records: List[Record] = []
        # Whether every forward of this batch marked its output nodes for GradHooks.backward.
        self.edges_complete = self.driven
        # How reads run the sum check: None (decided at the read), "due" (backward() computed
        # autograd's parameter gradients for it), "skip" (backward() computed none).
        self.sum_check_state: Optional[str] = None
        self.drive_key: Optional[tuple] = None
        self.higher_order: Optional[str] = None  # a layer a create_graph=True backward reached
        self.batch_size: Optional[int] = None
        self.batch_source: Optional[str] = None
        self.batch_forward = -1  # the top-level forward in which the batch size was set
        self.backward_seen = False
        # per_sample_grads() released the records; _stale: a module a backward then reached.
        self.released = False
        self.stale: Optional[str] = None
        self.totals: Dict[int, GradTotal] = {}  # autograd's, for the sum check
        self.param_passes: Dict[int, int] = {}
        self.calls = 0  # hooked-layer calls recorded in this batch
        self.sum_check.changed = False
        self.placement.reset_batch()
        self.backward_pass.spans.reset_batch()
        self.reads.seen = None  # (the loss scale seen on this batch's loss)
        self.drop_result()

    def drop_result(self) -> None:
        # A superseded result's tensors may be reused for the next one (BufferPool), unless the
        # user still holds them.
        result = getattr(self, "_result", None)
        if result:
            self.pool.give(result.values())
        self._result: Optional[Dict[str, Tensor]] = None

    def clear(self) -> None:
        """Drop everything recorded (activations, grad_outputs, results) and set every
        ``param.grad_sample`` to ``None``. The next forward starts a new batch."""
        self.reset_batch()
        for p in self.params.values():
            if "grad_sample" in p.__dict__:
                p.grad_sample = None


    # ------------------------------------------------------------------ hooks
    def _on_pre_forward(self, module: nn.Module, args) -> None:
        # Global forward pre-hook: only the model's own forward starts anything; under
        # provenance the hooked layers whose forward runs are noted.
        if module is self.model:
            if not utils.PAUSED:  # (the loss's graph is judged above its span)
                self.backward_pass.spans.start()
            if self.batch_size is None:  # (a new batch: no scale seen on its loss yet)
                self.reads.seen = None
            self._model_forward(module, args, call_kwargs())
            self._note_forward()  # (after: a forward that follows a model change syncs first)
        elif self.placement.provenance is not None:
            layer = self.layer_of.get(id(module))
            if layer is not None:
                self.placement.enter(layer, args)

    def _on_done(self, module: nn.Module, completed: bool = False, call=None) -> None:
        # The model's forward returned (completed, ``call``: its args, kwargs and output) or
        # raised: the placement ends its forward.
        if module is self.model:
            if not utils.PAUSED:  # (not a replay's call of the model)
                self.backward_pass.spans.end(None if call is None else call[2], self.placement)
            self.placement.end_forward(completed, self.forward_id, call)

    def _on_any_forward(self, module: nn.Module, args, kwargs, output) -> None:
        # Global forward hook: the hooked layers' calls.
        layer = self.layer_of.get(id(module))
        if module is not self.model:
            if layer is None:
                return None
            result = self._record(layer, module, args, kwargs, output)
            if self.placement.provenance is not None:
                self.placement.leave(layer)
            return result
        completed = False
        try:
            result = None if layer is None else self._record(layer, module, args, kwargs, output)
            completed = True
        finally:
            self._on_done(module, completed, (args, kwargs, output if result is None else result)
                          if completed else None)  # (the output handed on: the model's)
        return result

    # ------------------------------------------------------------------ what readers see

    @property
    def records(self) -> Tuple["Record", ...]:
        """The current batch's records that a backward pass reached, in the order reached."""
        return tuple(self.reached_records)



    @property
    def result(self) -> Optional[Dict[str, Tensor]]:
        """The per-sample gradients kept by :meth:`keep_result` for this batch, or ``None``."""
        return self._result

    def keep_result(self, result: Dict[str, Tensor]) -> Dict[str, Tensor]:
        """Keep ``result`` (the per-sample reader's, :meth:`Batch.keep`) until the next backward
        pass or batch, when its tensors are offered to :attr:`pool`; returns it."""
        self._result = result
        return result

    def release_record(self, record: Record) -> None:
        """Free ``record``'s tensors on a reader's request (:meth:`Batch.release`)."""
        record.release()

    def sum_check_passed(self, key: tuple) -> None:
        """A read's sum check of structure ``key`` passed (:meth:`Batch.check_passed`)."""
        self.reads.check_passed(key)

    def snapshot(self, read: str, *, records: Optional[List["Record"]] = None,
                 release: bool = False, sum_check: bool = True, result: bool = False) -> "Batch":
        """The batch as a reader sees it (``read`` names the reading call), validated once:
        :meth:`gradhooks.core.recorder.batch_reads.BatchReads.snapshot` documents the arguments and the
        errors raised (records released or stale, no backward, ``create_graph``, a refused
        shared call, an input modified in place)."""
        return self.reads.snapshot(read, records, release, sum_check, result)

    def grad_scale(self) -> float:
        """The loss scale ``S`` of the ``grad_scaler`` given to :func:`gradhooks.attach`, else the
        one seen on this batch's loss, or ``1.0``
        (:meth:`gradhooks.core.recorder.batch_reads.BatchReads.grad_scale`)."""
        return self.reads.grad_scale()

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Within this context the hooks record nothing (an ordinary backward pass through a
        batch whose records were consumed: two-pass clipping's second pass)."""
        self.hooks_muted = True
        try:
            yield
        finally:
            self.hooks_muted = False

    # ------------------------------------------------------------------ backward
    def drive(self, loss: Tensor, gradient: Optional[Tensor], retain_graph: bool,
              listen: Optional[Callable[[list, Dict[int, int]], object]] = None,
              create_graph: bool = False) -> bool:
        """The backward pass of :meth:`gradhooks.GradHooks.backward`: asks autograd for the
        hooked layers' output gradients instead of the parameters'
        (:meth:`gradhooks.core.recorder.backward_pass.BackwardPass.drive` documents the arguments, the result
        and the errors raised)."""
        return self.backward_pass.drive(loss, gradient, retain_graph, listen, create_graph)
