"""Data attribution while training: a Hugging Face ``TrainerCallback`` that writes the projected
:class:`~gradhooks.readers.attribution.gradient_store.GradientStore` from the training batches' own records
(no second forward or backward pass)::

    from gradhooks.integrations.store_callback import GradientStoreCallback
    store_cb = GradientStoreCallback("grads/", k_in=16, k_out=16, module="transformer.h")
    trainer = Trainer(model=model, args=args, train_dataset=store_cb.track(train_set),
                      data_collator=collate, compute_loss_func=token_mean_loss,
                      callbacks=[store_cb])
    trainer.train()            # or trainer.train(resume_from_checkpoint=True)

Importing this module imports transformers; ``import gradhooks`` does not.

**What is written.** At each optimizer step, after the Trainer's backward and before its
optimizer steps, the batch's per-sample gradients of each sample's own loss are projected as
the store projects them (LoGra's ``P_g d_n P_a^T`` per layer, a Gaussian ``R`` for the other
parameters, :meth:`GradientStore.project`, from the hooks' ``a`` and ``g``: no per-sample
``(O, I)`` gradient; the records of the mean loss, projected, times ``B``: the rows of
``loss_reduction="mean"`` without its scaled copy of every layer's grad_output) and appended
as ``B`` rows with their
keys: each sample's index in the training data set (:attr:`GradientStore.sample_index`) and
the step (:attr:`GradientStore.steps`): the Trainer's ``state.global_step`` when the gradient
was taken, i.e. the number of optimizer steps before it, so the row is the gradient at the
weights a ``checkpoint-{step}`` holds, and the update it fed made ``checkpoint-{step + 1}``.
TracIn's checkpoint sum (Pruthi et al. 2020, arXiv:2002.08484, sec. 3.1) over the steps is then
``sum_t lr_t <q_t, phi_t>`` with the query projected at step ``t``'s weights
(``store.project``). The store holds ``N = state.max_steps * train_batch_size`` rows (an upper
bound: the last batch of an epoch may be smaller; :attr:`GradientStore.rows` counts those written).

**The sample indices.** :meth:`GradientStoreCallback.track` wraps the training set in a
:class:`SampleIndexDataset` whose ``__getitems__`` (what torch's ``DataLoader`` calls with a
batch's indices) notes each batch's indices in order; the callback takes the oldest at each step
(the Trainer's data loader fetches ahead, in order). Batches fetched in worker processes are
not seen: ``dataloader_num_workers`` must be 0.

**Resuming.** ``trainer.train(resume_from_checkpoint=...)`` at ``state.global_step = s`` keeps
the rows of steps ``0 .. s - 1`` (each must be present, else :class:`StoreSpecError`: rows would be
lost), forgets the rows of later steps (written after that checkpoint; the Trainer redoes
them) and continues: no row is written twice or lost.

**The loss** must be a mean over the batch's samples of each sample's own loss (what the
factor ``B`` assumes): a classification loss, or on padded causal-LM batches a
``compute_loss_func`` returning the mean of :func:`gradhooks.per_sample_token_loss` (the
model's own loss, a mean over the batch's tokens, is refused by gradhooks where the samples'
valid-token counts differ).

Limits: one process, one micro-batch per step (``gradient_accumulation_steps == 1``), no
DataParallel (``n_gpu <= 1``), ``dataloader_num_workers == 0``. Layers to cover: ``module``, a
submodule's path; leave out a large embedding (a dense projection of GPT-2's 50257 x 768 token
embedding needs ``k_in k_out`` times its entries), as LoGra and LESS do.
"""
from __future__ import annotations

import collections
import os
from typing import Any, Deque, List, Optional, Union

import torch
import transformers

from ..base.errors import GradHooksError
from ..hooks import attach
from ..readers.attribution.gradient_store import GradientStore, StoreSpecError

__all__ = ["GradientStoreCallback", "SampleIndexDataset"]


class SampleIndexDataset(torch.utils.data.Dataset):
    """A map-style data set that notes the indices of each batch fetched from it.

    ``dataset[i]`` is the wrapped ``dataset[i]``; ``__getitems__(indices)`` (called by torch's
    ``DataLoader`` once per batch, with the batch's indices) appends ``indices`` to
    :attr:`fetched` and returns the items (through the wrapped set's ``__getitems__`` when it has
    one, as Hugging Face ``datasets`` do).

    Attributes:
        dataset: the wrapped data set.
        fetched: a deque of index lists, one per batch fetched, oldest first.
    """

    def __init__(self, dataset):
        self.dataset = dataset
        self.fetched: Deque[List[int]] = collections.deque()

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        return self.dataset[index]

    def __getitems__(self, indices: List[int]) -> List[Any]:
        indices = [int(i) for i in indices]
        self.fetched.append(indices)
        many = getattr(self.dataset, "__getitems__", None)
        return list(many(indices)) if many is not None else [self.dataset[i] for i in indices]


class GradientStoreCallback(transformers.TrainerCallback):
    """Writes the projected :class:`~gradhooks.readers.attribution.gradient_store.GradientStore` of the
    training batches during ``trainer.train()`` (module docstring).

    Args:
        path: the store's folder (created, or reopened and continued when resuming).
        k_in, k_out, seed, dtype: the store's projection sizes, seed and storage dtype
            (:class:`~gradhooks.readers.attribution.gradient_store.GradientStore`; ``K = k_in k_out`` per
            layer and per other parameter).
        module: the path of the submodule whose layers the store covers (``"transformer.h"``:
            GPT-2's blocks), or ``None`` for the whole model. Only its trainable parameters are
            projected; the rest of the model trains as usual.

    Attributes:
        store: the :class:`GradientStore` (from ``on_train_begin``).
        gh: the :class:`gradhooks.GradHooks` on ``module`` during training.

    Raises (at ``on_train_begin``):
        GradHooksError: if ``gradient_accumulation_steps != 1``, several processes or GPUs,
            ``dataloader_num_workers > 0``, or the Trainer's training set is not
            :meth:`track`'s; at a step, if no batch's indices were noted or their count is not
            the batch's; after an evaluation on the tracked set (give the plain one).
        StoreSpecError: if ``path`` holds a store of another spec (another ``max_steps``, batch
            size, ``k_in`` ...), or, when resuming at step ``s``, lacks rows of a step before ``s``.
    """

    def __init__(self, path: Union[str, os.PathLike], *, k_in: int = 16, k_out: int = 16,
                 seed: int = 0, dtype=torch.float16, module: Optional[str] = None):
        self.path, self.module = path, module
        self.spec = dict(k_in=k_in, k_out=k_out, seed=seed, dtype=dtype)
        self.dataset: Optional[SampleIndexDataset] = None
        self.store: Optional[GradientStore] = None
        self.gh = None

    def track(self, dataset) -> SampleIndexDataset:
        """The training set to give the Trainer (``train_dataset=callback.track(train_set)``):
        ``dataset`` wrapped in a :class:`SampleIndexDataset`."""
        self.dataset = dataset if isinstance(dataset, SampleIndexDataset) else SampleIndexDataset(dataset)
        return self.dataset

    # ---- the Trainer's events ---------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self._check(args, train_dataloader)
        self.store = GradientStore(self.path, state.max_steps * args.train_batch_size,
                                   output="loss", **self.spec)
        self._resume(state.global_step)
        self.dataset.fetched.clear()
        target = model if self.module is None else model.get_submodule(self.module)
        # "sum" and the rows times B below: the same rows as loss_reduction="mean" (the
        # projection is linear in g), without a scaled copy of every layer's grad_output
        self.gh = attach(target, loss_reduction="sum")

    def on_epoch_begin(self, args, state, control, **kwargs):
        # (the epoch's batches are fetched after this event; nothing fetched before is trained)
        self.dataset.fetched.clear()

    def on_step_begin(self, args, state, control, **kwargs):
        self.gh.clear()  # (records of an evaluation between steps, if any)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if not self.dataset.fetched:
            raise GradHooksError("GradientStoreCallback: no batch's sample indices were noted for "
                                 f"step {state.global_step}; the Trainer's training set must be "
                                 "callback.track(train_set), fetched in the main process")
        indices = self.dataset.fetched.popleft()
        features = self.gh.gradient_features()
        if features.size != len(indices):
            raise GradHooksError(f"GradientStoreCallback: step {state.global_step}'s batch has "
                                 f"{features.size} samples, the batch fetched {len(indices)} "
                                 f"indices; the data loader must fetch each batch once, in order")
        rows = self.store.project(features).mul_(features.size)  # the mean's own-loss scale B
        self.store.add(rows, sample_index=torch.tensor(indices), step=state.global_step)
        self.gh.clear()

    def on_evaluate(self, args, state, control, eval_dataloader=None, **kwargs):
        if eval_dataloader is not None and getattr(eval_dataloader, "dataset", None) is self.dataset:
            raise GradHooksError("GradientStoreCallback: the evaluation set is the tracked training "
                                 "set, whose batches would be taken for training batches; pass "
                                 "the plain data set as eval_dataset")

    def on_train_end(self, args, state, control, **kwargs):
        if self.gh is not None:
            self.gh.detach()
            self.gh = None
        if self.dataset is not None:
            self.dataset.fetched.clear()

    # ---- checks -----------------------------------------------------------------------------
    def _check(self, args, train_dataloader) -> None:
        why = []
        if args.gradient_accumulation_steps != 1:
            why.append(f"gradient_accumulation_steps = {args.gradient_accumulation_steps} (one "
                       f"micro-batch per step: raise per_device_train_batch_size instead)")
        if args.world_size != 1 or args.n_gpu > 1:
            why.append(f"{args.world_size} processes, {args.n_gpu} GPUs (one process, one device)")
        if args.dataloader_num_workers != 0:
            why.append(f"dataloader_num_workers = {args.dataloader_num_workers} (the batches' "
                       f"indices are noted in the main process: set it to 0)")
        if self.dataset is None or (train_dataloader is not None
                                    and getattr(train_dataloader, "dataset", None) is not self.dataset):
            why.append("the Trainer's training set is not this callback's "
                       "(pass train_dataset=callback.track(train_set))")
        if why:
            raise GradHooksError("GradientStoreCallback: " + "; ".join(why))

    def _resume(self, step: int) -> None:
        # Keep the rows of steps before ``step`` (each present), forget the later ones.
        store = self.store
        if store.rows == 0 and step == 0:
            return
        steps = store.steps if store.rows else torch.zeros(0, dtype=torch.int64)
        if steps is None:
            raise StoreSpecError(f"GradientStoreCallback: {store.path!r} holds rows without "
                                 f"sample indices and steps (not written during training); use "
                                 f"another folder")
        keep = int((steps < step).sum())
        missing = sorted(set(range(step)) - set(steps[:keep].tolist()))
        if missing:
            raise StoreSpecError(
                f"GradientStoreCallback: training resumes at step {step}, but {store.path!r} holds "
                f"no rows of steps {missing[:8]}{' ...' if len(missing) > 8 else ''} "
                f"({len(missing)} of {step}); resume with the store folder the run was started "
                f"with, or start the run again from step 0 (its rows are rewritten)")
        if keep < store.rows:
            store.truncate(keep)
