"""Hugging Face ``Trainer`` integration: DP fine-tuning (:class:`DPTrainer`) and per-sample
gradient statistics during ordinary training (:class:`GradientStatsCallback`)::

    from gradhooks.integrations.transformers import DPConfig, DPTrainer
    trainer = DPTrainer(model=model, args=TrainingArguments(..., per_device_train_batch_size=16,
                                                            gradient_accumulation_steps=4),
                        train_dataset=train, data_collator=collate,
                        dp=DPConfig(target_epsilon=8.0, delta=1e-5, max_grad_norm=1.0))
    trainer.train()            # logs "epsilon" beside the loss

Importing this module imports transformers and opacus (its accountants; ``pip install
gradhooks[transformers]``); ``import gradhooks`` does not.

**The DP step** (DP-SGD, Abadi et al. 2016, arXiv:1607.00133). A logical batch ("lot") of
expected size ``L = per_device_train_batch_size * gradient_accumulation_steps`` is drawn by
Poisson sampling: each of the ``N`` training samples joins it with probability ``q = L / N``
(:class:`PoissonMicroBatchSampler`, the draw of Opacus' ``UniformWithReplacementSampler``:
``torch.rand(N) < q``), so its size varies and may be 0; there are ``ceil(N / L)`` lots per
epoch. The Trainer's gradient accumulation runs it as ``gradient_accumulation_steps``
micro-batches (the lot split in that many nearly equal parts, some possibly empty). Each
micro-batch's per-sample gradients ``g_n`` (of each sample's own loss, below) are clipped and
summed into gradhooks' accumulator (``clip_and_accumulate(C, accumulate=True)`` after
``gh.backward``, "book-keeping" ghost clipping, Bu et al. 2023; or ``clipped_backward(losses,
C, accumulate=True)``, "two-pass" ghost clipping, Li et al. 2022); after the lot's last
micro-batch ``finish_step`` writes ``param.grad = (sum_n min(1, C / ||g_n||) g_n + sigma C z) /
L`` (the noise drawn once per lot, divided by the *expected* lot size as Opacus does), and the
Trainer's optimizer steps on it. The Trainer's own gradient clipping (``args.max_grad_norm``)
is turned off: it would clip the noised mean, which is post-processing, not DP clipping.

**Per-sample loss.** Default :func:`causal_lm_losses`: for ``(B, T, V)`` logits, each sample's
mean over *its own* valid tokens (labels not ``-100``, shifted as transformers' causal LM;
:func:`gradhooks.per_sample_token_loss`), ``DPConfig(token_reduction="sum")`` for the sum;
``(B, C)`` logits (sequence classification): cross-entropy per sample. The noise
multiplier comes from ``DPConfig.noise_multiplier`` or from ``target_epsilon`` through Opacus'
``get_noise_multiplier`` for the run's ``state.max_steps`` lots at ``q``; the same accountant
(``"rdp"``, ``"prv"``, ``"gdp"``) is stepped once per lot and its epsilon at ``delta`` is logged
as ``"epsilon"`` with the training metrics.

**Statistics** (:class:`GradientStatsCallback`): per-sample gradient norms and the gradient
noise scale of McCandlish et al. 2018 (arXiv:1812.06162, appendix A) from the Gram matrix
``K[n, m] = <g_n, g_m>`` of each batch's per-sample gradients (:meth:`gradhooks.GradHooks.gram`,
Gram form per layer: no per-sample gradient tensor), read after the Trainer's ordinary backward.

**Mixed precision.** ``bf16=True``: the forward under accelerate's bfloat16 autocast, nothing
else changes (no loss scale). ``fp16=True`` where accelerate gives a ``GradScaler`` (a GPU):
the hooks are attached with it (``attach(..., grad_scaler=scaler)``), so each micro-batch's
per-sample norms and clipping are those of the *unscaled* loss (the backward runs at the scale
``S``), ``finish_step`` writes ``S`` times the noised lot gradient, and ``inf`` when a
micro-batch's norms overflowed; the Trainer's ``optimizer.step()`` is ``scaler.step`` (it
unscales, skips a step with ``inf`` and lowers ``S``) and the Trainer skips the scheduler's step
as for any overflow (where accelerate reports it: not with a fused AdamW, docs/trainer.md). A
skipped lot is still counted by the accountant (its samples were drawn); whether a lot
overflows depends on its unnoised per-sample values, which the accountant does not cover: keep
overflows rare (the scaler's default growth makes them so). On a CPU, accelerate ignores
``fp16=True`` (no autocast, no scaler: a float32 run).

**Many processes** (``torchrun --nproc_per_node W``, DDP through accelerate): the lot is one
Poisson draw over all ranks (every rank draws the same mask from the same seed and takes its
share, :class:`PoissonMicroBatchSampler`), of expected size ``L = per_device_train_batch_size
* gradient_accumulation_steps * W`` (``q = L / N``, the rate of one process with that ``L``);
each rank clips its share's samples under DDP's ``no_sync`` (no all-reduce of unclipped or
clipped micro-batches), and ``finish_step`` adds the ranks' clipped sums once (one all-reduce
per parameter), the noise drawn once, on rank 0. A rank whose share is empty clips one sample
of weight 0 (a zero gradient), so that it joins those all-reduces. ``lot_sizes`` counts this
rank's samples.

**FSDP2** (accelerate's plugin, ``TrainingArguments(fsdp=True, fsdp_config={"version": 2,
...})``): the same lot, one micro-batch per rank per lot (``gradient_accumulation_steps=1``:
gradhooks' accumulation of micro-batches would hold full-size sums on every rank), clipped with
the lot's noise in that call (``clip_and_accumulate`` after ``loss.backward()``, or
``clipped_backward``; attached with ``check=False``), the ranks' clipped sums reduce-scattered
into the shards once, the noise drawn once, on rank 0; then divided by ``L``. A rank whose share
is empty runs one sample of weight 0 (FSDP's forward gathers the parameters on every rank).
accelerate 1.15 enables FSDP on GPUs only: on a CPU it drops the plugin and the run is DDP.
FSDP1, FSDP2 with accumulation or with ``fp16`` / ``bf16``, and DeepSpeed are refused.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F
import transformers
from opacus.accountants import RDPAccountant, create_accountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.utils import get_noise_multiplier
from torch import Tensor, nn
from torch.utils.data import DataLoader, Sampler

from ..hooks import attach
from ..readers.dp.adaptive_clipping import AdaptiveClipping
from ..tools.token_losses import per_sample_token_loss

__all__ = ["DPConfig", "DPTrainer", "DPTrainerMixin", "PoissonMicroBatchSampler", "fsdp_refusal",
           "causal_lm_collate", "causal_lm_losses", "token_mean_loss", "GradientStatsCallback"]


@dataclasses.dataclass
class DPConfig:
    """The privacy settings of a :class:`DPTrainer`.

    Attributes:
        max_grad_norm: ``C``, the bound each sample's gradient is clipped to.
        noise_multiplier: ``sigma`` (noise std ``sigma C``); ``None``: from ``target_epsilon``.
        target_epsilon: epsilon at ``delta`` after the run's ``max_steps`` lots (used when
            ``noise_multiplier`` is ``None``).
        delta: the ``delta`` of the guarantee and of the logged epsilon.
        accountant: Opacus' accountant, ``"rdp"``, ``"prv"`` or ``"gdp"``.
        clipping: ``"book-keeping"`` (``gh.backward`` + ``clip_and_accumulate``, default) or
            ``"two-pass"`` (``gh.clipped_backward``: less memory, a second backward).
        token_reduction: ``"mean"`` (each sample's mean over its own valid tokens) or ``"sum"``.
        per_sample_loss: ``f(model, inputs) -> (B,)`` losses; default :func:`causal_lm_losses`.
        noise_seed: seed of the noise generator (``None``: drawn from the OS; set it only to
            reproduce a run, never for a release).
        epsilon_tolerance: the tolerance of ``get_noise_multiplier``'s search.
        target_unclipped_quantile: adaptive clipping (Andrew et al. 2021, arXiv:1905.03871;
            :class:`gradhooks.AdaptiveClipping`, Opacus' ``AdaClipDPOptimizer`` names): the
            fraction of a lot's samples the bound should leave unclipped; ``max_grad_norm`` is
            then the first lot's bound, updated after each lot from the lot's noised unclipped
            count (one count over all ranks). ``None`` (default): a fixed bound.
        clipbound_learning_rate: ``eta`` of the bound's geometric update (0.2, the paper's).
        count_noise_std: ``sigma_b``, the noise on the unclipped count (required with
            ``target_unclipped_quantile``; ``2 sigma_b > sigma``); the gradient's noise is then
            drawn with ``sigma_Delta = (sigma^-2 - (2 sigma_b)^-2)^(-1/2)`` and the accountant
            sees ``sigma``, so the pair is as private as ``sigma`` alone (the paper's Theorem 1).
        min_clipbound, max_clipbound: the bound is kept in ``[min_clipbound, max_clipbound]``.
    """

    max_grad_norm: float = 1.0
    noise_multiplier: Optional[float] = None
    target_epsilon: Optional[float] = None
    delta: float = 1e-5
    accountant: str = "rdp"
    clipping: str = "book-keeping"
    token_reduction: str = "mean"
    per_sample_loss: Optional[Callable[[nn.Module, Dict[str, Any]], Tensor]] = None
    noise_seed: Optional[int] = None
    epsilon_tolerance: float = 0.01
    target_unclipped_quantile: Optional[float] = None
    clipbound_learning_rate: float = 0.2
    count_noise_std: Optional[float] = None
    min_clipbound: float = 0.0
    max_clipbound: float = math.inf

    def __post_init__(self):
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("DPConfig: give exactly one of noise_multiplier and target_epsilon")
        if self.clipping not in ("book-keeping", "two-pass"):
            raise ValueError(f"DPConfig: clipping must be 'book-keeping' or 'two-pass', got "
                             f"{self.clipping!r}")
        if self.token_reduction not in ("mean", "sum"):
            raise ValueError(f"DPConfig: token_reduction must be 'mean' or 'sum', got "
                             f"{self.token_reduction!r}")
        if not self.max_grad_norm > 0:
            raise ValueError(f"DPConfig: max_grad_norm must be > 0, got {self.max_grad_norm}")
        if (self.target_unclipped_quantile is not None) != (self.count_noise_std is not None):
            raise ValueError("DPConfig: adaptive clipping needs both target_unclipped_quantile "
                             "and count_noise_std (the unclipped count's noise)")


def causal_lm_losses(model: nn.Module, inputs: Dict[str, Any], reduction: str = "mean") -> Tensor:
    """``(B,)`` per-sample losses of a transformers model on a Trainer batch with ``labels``:
    ``(B, T, V)`` logits: :func:`gradhooks.per_sample_token_loss` (causal shift, ``-100``
    ignored, ``reduction`` over each sample's own valid tokens); ``(B, C)`` logits:
    cross-entropy of each sample. The labels are not passed to the model (its own loss would be
    a mean over the batch's tokens)."""
    inputs = dict(inputs)
    labels = inputs.pop("labels")
    logits = model(**inputs).logits
    if logits.dim() == 3:
        return per_sample_token_loss(logits, labels, reduction=reduction)
    return F.cross_entropy(logits.float(), labels, reduction="none")


def token_mean_loss(outputs, labels: Tensor, num_items_in_batch=None) -> Tensor:
    """A ``compute_loss_func`` for a plain ``Trainer`` on padded causal-LM batches: the mean
    over samples of each sample's own token mean (:func:`gradhooks.per_sample_token_loss`), so
    that per-sample gradients (:class:`GradientStatsCallback`) are each sample's own; the
    model's own loss, a mean over the batch's tokens, weighs samples by their token counts."""
    return per_sample_token_loss(outputs.logits, labels).mean()


def causal_lm_collate(features: List[Dict[str, Any]], pad_id: int = 0) -> Dict[str, Tensor]:
    """A ``data_collator`` for token-id samples without a tokenizer: right padding with
    ``pad_id``, an attention mask, and labels ``-100`` past each sample's end (transformers'
    ``ignore_index``: the per-sample loss counts each sample's own tokens only).

    Args:
        features: ``[{"input_ids": list of ints}]``, ``B`` samples of any lengths ``T_n``.
        pad_id: the id written past each sample's end.

    Returns:
        ``{"input_ids", "attention_mask", "labels"}``, each ``(B, max T_n)`` int64.
    """
    t = max((len(f["input_ids"]) for f in features), default=0)
    ids = torch.full((len(features), t), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.as_tensor(f["input_ids"], dtype=torch.long)
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


class PoissonMicroBatchSampler(Sampler[List[int]]):
    """Poisson-sampled lots, each yielded as ``micro_batches`` index lists (a batch sampler).

    Each lot: ``mask = torch.rand(num_samples, generator) < sample_rate`` (Opacus'
    ``UniformWithReplacementSampler``, the same draws from the same generator); with ``world``
    ranks, rank ``rank`` takes part ``rank`` of the lot's indices split in ``world`` parts of
    sizes differing by at most one (every rank draws the same mask: its generator has the same
    seed), and splits its part in ``micro_batches`` parts of sizes differing by at most one
    (empty ones when the lot has fewer samples). ``lots`` lots per pass, ``lots *
    micro_batches`` lists.
    """

    def __init__(self, num_samples: int, sample_rate: float, lots: int, micro_batches: int,
                 generator: Optional[torch.Generator] = None, rank: int = 0, world: int = 1):
        self.num_samples, self.sample_rate = num_samples, sample_rate
        self.lots, self.micro_batches, self.generator = lots, micro_batches, generator
        self.rank, self.world = rank, world

    def __len__(self) -> int:
        return self.lots * self.micro_batches

    def __iter__(self) -> Iterator[List[int]]:
        for _ in range(self.lots):
            mask = torch.rand(self.num_samples, generator=self.generator) < self.sample_rate
            lot = mask.nonzero().reshape(-1).tensor_split(self.world)[self.rank]
            for part in torch.tensor_split(lot, self.micro_batches):
                yield part.tolist()


class _EmptyBatchCollator:
    """Collates an empty index list into a batch of 0 samples (the template's tensors sliced to
    ``[:0]``): the Trainer's loop still gets one batch per micro-batch, and
    :meth:`DPTrainerMixin.training_step` skips the empty ones (no forward)."""

    def __init__(self, collate: Callable, dataset):
        self.collate, self.dataset = collate, dataset

    def __call__(self, features):
        if len(features) > 0:
            return self.collate(features)
        batch = self.collate([self.dataset[0]])
        return {k: v[:0] if isinstance(v, Tensor) else v for k, v in batch.items()}


def _batch_size(inputs: Dict[str, Any]) -> int:
    return next(len(v) for v in inputs.values() if isinstance(v, Tensor))


def fsdp_refusal(args, version: int) -> Optional[str]:
    """Why :class:`DPTrainerMixin` refuses FSDP with these ``TrainingArguments`` and FSDP
    ``version`` (the way out included), or ``None`` where it runs: FSDP2 on several processes,
    ``gradient_accumulation_steps=1`` (accumulated micro-batches would hold full-size clipped
    sums on every rank), in float32."""
    why = ("gradhooks clips FSDP2 (fully_shard) models only; set fsdp_config={'version': 2}"
           if version != 2 else "one process has nothing to shard; leave fsdp off"
           if args.world_size < 2 else
           "the micro-batches' clipped sums would be full-size on every rank; give the lot's "
           "share as per_device_train_batch_size with gradient_accumulation_steps=1, or use DDP"
           if args.gradient_accumulation_steps != 1 else
           "fp16 / bf16 mixed precision is not supported with FSDP; train in float32 or use DDP"
           if args.fp16 or args.bf16 else None)
    return None if why is None else (
        f"DPTrainer with FSDP version {version} on {args.world_size} processes, "
        f"gradient_accumulation_steps={args.gradient_accumulation_steps}"
        f"{', fp16' if args.fp16 else ''}{', bf16' if args.bf16 else ''}: {why}")



@functools.lru_cache(maxsize=64)
def _rdp_of_one_lot(sample_rate: float, sigma: float):
    """Opacus' RDP of one lot of the sampled Gaussian mechanism at the accountant's default
    orders (``compute_rdp(..., steps=1)``; Mironov et al. 2019): ``steps`` lots are this times
    ``steps``, as ``compute_rdp`` forms it, so the epsilon is Opacus' to the last digit."""
    return rdp_analysis.compute_rdp(q=sample_rate, noise_multiplier=sigma, steps=1,
                                    orders=RDPAccountant.DEFAULT_ALPHAS)


class DPTrainerMixin:
    """The DP-SGD step of :class:`DPTrainer` for any ``transformers.Trainer`` subclass (module
    docstring): put it first among the bases, ``class MyDPTrainer(DPTrainerMixin, MyTrainer)``.

    It replaces the trainer's data loader (Poisson lots as micro-batches), ``training_step``
    (per-sample losses, clipped into gradhooks' accumulator; the noise, the division by the
    expected lot size and the accountant's step after each lot) and adds ``epsilon`` to the
    logs. The trainer's own ``compute_loss`` is not called: the per-sample losses come from
    :meth:`per_sample_losses`, which a subclass overrides for its loss (TRL's SFT and DPO:
    :mod:`gradhooks.integrations.trl`); a subclass whose samples are several rows of the batch
    declares them in it with ``self.gh.set_sample_ids(ids)`` after the forward and returns one
    loss per sample (``(G,)``, in sorted-id order).

    Takes the trainer's arguments plus ``dp`` (:class:`DPConfig`). The per-device batch size and
    ``gradient_accumulation_steps`` give the expected lot size ``L``.

    Attributes (after the first step): ``gh`` (the :class:`gradhooks.GradHooks`), ``accountant``,
    ``noise_multiplier``, ``sample_rate``, ``expected_batch_size``, ``lot_sizes`` (samples per
    lot so far), :meth:`epsilon`, ``adaptive`` (adaptive clipping's
    :class:`~gradhooks.AdaptiveClipping`, or ``None``) and :attr:`clip_bound`.

    Raises:
        ValueError: several processes other than DDP and FSDP2 (DeepSpeed, ...); FSDP other
            than FSDP2 on several processes with ``gradient_accumulation_steps=1`` in float32.
    """

    def __init__(self, *args, dp: DPConfig, **kwargs):
        super().__init__(*args, **kwargs)
        a = self.args
        ddp = a.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
        self._sharded = self.is_fsdp_enabled  # (FSDP2: refused below otherwise)
        if self.is_fsdp_enabled:
            why = fsdp_refusal(a, getattr(self.accelerator.state.fsdp_plugin, "fsdp_version", 1))
            if why is not None:
                raise ValueError(why)
        elif a.world_size != 1 and (self.is_deepspeed_enabled or not ddp):
            raise ValueError(
                f"DPTrainer: {a.world_size} processes other than DDP and FSDP2 (DeepSpeed or "
                f"{a.parallel_mode}) are not supported; launch with torchrun / accelerate "
                f"without DeepSpeed (DDP, or FSDP2), or run one process")
        self.dp = dp
        self.args.max_grad_norm = 0.0  # DP clips per sample; see the module docstring
        self.gh = None
        self.accountant = create_accountant(dp.accountant)
        self.noise_multiplier: Optional[float] = dp.noise_multiplier
        self.expected_batch_size = (a.per_device_train_batch_size
                                    * a.gradient_accumulation_steps * a.world_size)
        self.sample_rate = min(1.0, self.expected_batch_size / len(self.train_dataset))
        self.lot_sizes: List[int] = []
        self.adaptive: Optional[AdaptiveClipping] = None  # (set by _start)
        self._generator = torch.Generator(device=self.args.device)  # (the noise's)
        if dp.noise_seed is not None:
            self._generator.manual_seed(dp.noise_seed)
        else:
            self._generator.seed()

    # ---- data -------------------------------------------------------------------------------
    def get_train_dataloader(self) -> DataLoader:
        """Poisson-sampled lots as micro-batches (:class:`PoissonMicroBatchSampler`), sampled
        from a generator seeded by ``args.data_seed`` (else ``args.seed``)."""
        dataset = self.train_dataset
        collate = self.data_collator
        if hasattr(self, "_remove_unused_columns") and hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="training")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="training")
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = PoissonMicroBatchSampler(
            len(dataset), self.sample_rate, math.ceil(len(dataset) / self.expected_batch_size),
            self.args.gradient_accumulation_steps, torch.Generator().manual_seed(seed),
            rank=self.args.process_index, world=self.args.world_size)
        self._stand_in = lambda: collate([dataset[0]])  # (an empty DDP share's, _finish_lot)
        return DataLoader(dataset, batch_sampler=sampler,
                          collate_fn=_EmptyBatchCollator(collate, dataset),
                          num_workers=self.args.dataloader_num_workers)

    # ---- the step ---------------------------------------------------------------------------
    def _start(self, model: nn.Module) -> None:
        if self.noise_multiplier is None:
            self.noise_multiplier = get_noise_multiplier(
                target_epsilon=self.dp.target_epsilon, target_delta=self.dp.delta,
                sample_rate=self.sample_rate, steps=self.state.max_steps,
                accountant=self.dp.accountant, epsilon_tolerance=self.dp.epsilon_tolerance)
        # fp16: the scaler accelerate made (None on a CPU or without fp16); see the module docstring
        self.gh = attach(model, loss_reduction="sum", grad_scaler=self.accelerator.scaler,
                         check=not self._sharded)  # (FSDP2's sharded parameters: no sum check)
        self._lot, self._clipped, self._norms = 0, False, []
        dp = self.dp
        #: adaptive clipping's state (:class:`gradhooks.AdaptiveClipping`), or ``None``
        self.adaptive = None if dp.target_unclipped_quantile is None else AdaptiveClipping(
            dp.max_grad_norm, noise_multiplier=self.noise_multiplier,
            count_noise_std=dp.count_noise_std, target_quantile=dp.target_unclipped_quantile,
            learning_rate=dp.clipbound_learning_rate, min_norm=dp.min_clipbound,
            max_norm_bound=dp.max_clipbound, generator=self._generator)

    @property
    def clip_bound(self) -> float:
        """The clipping bound of the current lot: ``dp.max_grad_norm``, or adaptive clipping's
        bound."""
        return self.dp.max_grad_norm if self.adaptive is None else self.adaptive.max_norm

    @property
    def _gradient_noise(self) -> float:
        # sigma, or adaptive clipping's sigma_Delta (the count takes the rest of sigma's budget)
        return (self.noise_multiplier if self.adaptive is None
                else self.adaptive.gradient_noise_multiplier)

    def per_sample_losses(self, model: nn.Module, inputs: Dict[str, Any]) -> Tensor:
        """``(B,)`` losses of the micro-batch: ``dp.per_sample_loss``, else
        :func:`causal_lm_losses`."""
        if self.dp.per_sample_loss is not None:
            return self.dp.per_sample_loss(model, inputs)
        return causal_lm_losses(model, inputs, self.dp.token_reduction)

    def training_step(self, model: nn.Module, inputs: Dict[str, Any],
                      num_items_in_batch=None) -> Tensor:
        """One micro-batch: per-sample losses, clipped into the lot's accumulator; after the
        lot's last micro-batch the noise, the division by the expected lot size and the
        accountant's step. Returns the micro-batch's mean loss over the micro-batches' count
        (the Trainer's logging convention)."""
        if self.gh is None:
            self._start(model)
        model.train()
        inputs = self._prepare_inputs(inputs)
        losses = None
        if _batch_size(inputs) > 0:  # (an empty micro-batch of a Poisson lot adds nothing)
            losses = self._clip(model, inputs)
            self._lot += len(losses)
        if self.accelerator.sync_gradients:
            self._finish_lot(model)
        if losses is None or len(losses) == 0:
            return torch.zeros((), device=self.args.device)
        return losses.detach().mean() / self.current_gradient_accumulation_steps

    def _clip(self, model: nn.Module, inputs: Dict[str, Any], weight: float = 1.0) -> Tensor:
        # One micro-batch's per-sample losses (times ``weight``), clipped into the accumulator;
        # under DDP without DDP's all-reduce (no_sync): finish_step sums the ranks' clipped sums.
        # FSDP2: the micro-batch is the lot's share, clipped with the lot's noise (summed into
        # the shards by the clip; drawn on rank 0), after FSDP's own backward (book-keeping).
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        once = (dict(noise_multiplier=self._gradient_noise, generator=self._generator)
                if self._sharded else dict(accumulate=True))
        with model.no_sync() if ddp else contextlib.nullcontext():
            with self.compute_loss_context_manager():
                losses = self.per_sample_losses(model, inputs)
            if weight != 1.0:
                losses = losses * weight
            if self.dp.clipping == "two-pass":
                norms = self.gh.clipped_backward(losses, self.clip_bound, **once)
            else:
                scaler = self.accelerator.scaler
                total = losses.sum()
                if self._sharded:
                    total.backward()
                else:
                    self.gh.backward(total if scaler is None else scaler.scale(total))
                norms = self.gh.clip_and_accumulate(self.clip_bound, **once)
        if weight == 1.0:  # (a stand-in of weight 0 is no sample of the lot: not counted)
            self._norms.append(norms.detach())
        self._clipped = True
        return losses

    def _finish_lot(self, model: nn.Module) -> None:
        # The noise once, the division by the expected lot size, the accountant's step; with
        # adaptive clipping the gradient's noise at sigma_Delta and the bound's update.
        sigma, noise = self.noise_multiplier, self._gradient_noise
        std = noise * self.clip_bound
        ddp = isinstance(model, nn.parallel.DistributedDataParallel)
        if (ddp or self._sharded) and not self._clipped:
            # This rank's share of the lot is empty (the model may not run a batch of 0): one
            # sample of weight 0 (its gradient 0, clipped to 0), so that the rank joins the
            # collectives (DDP: finish_step's all-reduces; FSDP2: the forward's and the clip's)
            # and receives the ranks' sum and rank 0's noise.
            self._clip(model, self._prepare_inputs(self._stand_in()), weight=0.0)
        if self._sharded:  # (clipped and noised in _clip; .grad: this rank's shards)
            for p in model.parameters():
                if p.requires_grad:
                    p.grad.div_(self.expected_batch_size)
        elif self._lot > 0 or self._clipped:
            self.gh.finish_step(noise_multiplier=noise, generator=self._generator,
                                expected_batch_size=self.expected_batch_size)
        else:  # an empty lot: the noise alone, drawn as finish_step draws it (at the loss scale)
            scaler = self.accelerator.scaler
            scale = 1.0 if scaler is None else float(scaler.get_scale())
            for p in model.parameters():
                if p.requires_grad:
                    p.grad = torch.randn(p.shape, generator=self._generator, dtype=p.dtype,
                                         device=p.device).mul_(std / self.expected_batch_size
                                                               * scale)
        if self.adaptive is not None:  # (every rank takes part: the count is all-reduced)
            device = self.args.device
            self.adaptive.update(torch.cat(self._norms).to(device) if self._norms
                                 else torch.zeros(0, device=device))
        self.accountant.step(noise_multiplier=sigma, sample_rate=self.sample_rate)
        self.lot_sizes.append(self._lot)
        self._lot, self._clipped, self._norms = 0, False, []

    def epsilon(self) -> float:
        """Epsilon at ``dp.delta`` of the lots taken so far (0 before the first): the
        accountant's; for ``"rdp"`` its own formula with each ``(sigma, q)``'s one-lot RDP
        computed once (:func:`_rdp_of_one_lot`), the same numbers as
        ``accountant.get_epsilon`` without its cost per log (about 1.5 s at a 2-core CPU)."""
        if not self.lot_sizes:
            return 0.0
        if type(self.accountant) is not RDPAccountant:
            return float(self.accountant.get_epsilon(delta=self.dp.delta))
        rdp = sum([_rdp_of_one_lot(q, sigma) * steps for sigma, q, steps in self.accountant.history])
        eps, _ = rdp_analysis.get_privacy_spent(orders=RDPAccountant.DEFAULT_ALPHAS, rdp=rdp,
                                                delta=self.dp.delta)
        return float(eps)

    def log(self, logs: Dict[str, float], start_time: Optional[float] = None) -> None:
        """The Trainer's logs plus ``epsilon`` (and ``noise_multiplier``)."""
        logs["epsilon"] = self.epsilon()
        if self.noise_multiplier is not None:
            logs["noise_multiplier"] = float(self.noise_multiplier)
        super().log(logs, start_time)

    def train(self, *args, **kwargs):
        """``Trainer.train``; the hooks are removed when it returns or raises."""
        try:
            return super().train(*args, **kwargs)
        finally:
            if self.gh is not None:
                self.gh.detach()
                self.gh = None


class DPTrainer(DPTrainerMixin, transformers.Trainer):
    """A ``transformers.Trainer`` that trains with DP-SGD through gradhooks (module docstring,
    :class:`DPTrainerMixin`).

    Takes the Trainer's arguments plus ``dp`` (:class:`DPConfig`). The user's script stays the
    usual one: model, ``TrainingArguments``, dataset, collator, ``trainer.train()``; the
    per-device batch size and ``gradient_accumulation_steps`` give the expected lot size.
    """


class GradientStatsCallback(transformers.TrainerCallback):
    """Per-sample gradient norms and the gradient noise scale during ordinary training.

    After each optimizer step's backward, from the Gram matrix ``K (B, B)``,
    ``K[n, m] = <g_n, g_m>`` of the per-sample gradients of each sample's own loss (loss
    reduced as a mean over samples), with ``S = sum_{n,m} K[n, m]`` and ``tr K``:

    - ``grad_norm_mean``, ``grad_norm_max``: of ``||g_n|| = sqrt(K[n, n])``;
    - ``trace_sigma = (B tr K - S) / (B (B - 1))``: the unbiased estimate of ``tr(Sigma)``;
    - ``g2 = (S - tr K) / (B (B - 1))``: the unbiased estimate of ``|G|^2`` (the mean of
      the off-diagonal entries of ``K``);
    - ``noise_scale``: ``B_simple = EMA(trace_sigma) / EMA(g2)`` (McCandlish et al. 2018,
      sec. 2.2 and appendix A; exponential moving averages with ``decay``).

    Each step's values are appended to :attr:`history` and added to the Trainer's next logs.
    The Trainer's loss must be a mean over samples of their own losses: a classification loss,
    or on padded causal-LM batches ``Trainer(..., compute_loss_func=token_mean_loss)`` (the
    model's own loss is a mean over the batch's tokens: gradhooks refuses it with unequal
    valid-token counts). One micro-batch per step (``gradient_accumulation_steps == 1``).
    """

    def __init__(self, decay: float = 0.9, every: int = 1):
        self.decay, self.every = decay, every
        self.history: List[Dict[str, float]] = []
        self.gh = None
        self._ema: Optional[List[float]] = None
        self._pending: Dict[str, float] = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if args.gradient_accumulation_steps != 1:
            raise ValueError("GradientStatsCallback reads one micro-batch per step "
                             "(gradient_accumulation_steps == 1)")
        self.gh = attach(model, loss_reduction="mean")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if state.global_step % self.every == 0:
            self.record(state.global_step + 1)

    def record(self, step: int) -> Dict[str, float]:
        """Reads this batch's Gram matrix and appends its statistics (for optimizer step
        ``step``, counted from 1 as the Trainer's logs) to :attr:`history`."""
        k = self.gh.gram().double()
        b = k.shape[0]
        trace, total = float(k.diagonal().sum()), float(k.sum())
        norms = k.diagonal().clamp(min=0).sqrt()
        row = {"step": step, "batch_size": b, "grad_norm_mean": float(norms.mean()),
               "grad_norm_max": float(norms.max())}
        if b > 1:
            trace_sigma = (b * trace - total) / (b * (b - 1))
            g2 = (total - trace) / (b * (b - 1))
            if self._ema is None:
                self._ema = [trace_sigma, g2]
            else:
                d = self.decay
                self._ema = [d * self._ema[0] + (1 - d) * trace_sigma,
                             d * self._ema[1] + (1 - d) * g2]
            row.update(trace_sigma=trace_sigma, g2=g2, noise_scale=self._ema[0] / self._ema[1])
        self.history.append(row)
        self._pending = {k: v for k, v in row.items() if k not in ("step", "batch_size")}
        return row

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs is not None and self._pending:
            logs.update(self._pending)
            if state.log_history:
                state.log_history[-1].update(self._pending)
            self._pending = {}

    def on_train_end(self, args, state, control, **kwargs):
        if self.gh is not None:
            self.gh.detach()
            self.gh = None
