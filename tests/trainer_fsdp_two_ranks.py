"""Run by tests/test_trainer_fsdp.py under ``torchrun --nproc_per_node 2`` (gloo on CPU): a
``DPTrainer`` on the tiny GPT-2 of tests/test_trainer.py (float64), sharded by accelerate's
FSDP2 plugin (``fsdp=True, fsdp_config={"version": 2, ...}``: ``fully_shard`` of each
``GPT2Block`` and of the root). Each rank saves to ``OUT/rank{r}.pt``, for book-keeping
clipping (with adaptive clipping, noise off, two lots, one with rank 1's share empty) and
two-pass clipping (noise on, seeded): the whole gradients before each optimizer step
(``full_tensor()`` of the shards), its samples per lot, the whole parameters after training;
the adaptive bound, the epsilon, and the refusal of gradient accumulation.

accelerate 1.15 sets ``DistributedType.FSDP`` only for GPU-like devices (``AcceleratorState``:
``MULTI_GPU``, ``MULTI_NPU``, ...); on a CPU it drops the plugin and the run is DDP. So that
the test exercises accelerate's real FSDP2 preparation on this CPU, :func:`fsdp_on_cpu` sets
that state where accelerate would have chosen ``MULTI_CPU`` with an FSDP plugin; nothing else
is changed.

    torchrun --nproc_per_node 2 tests/trainer_fsdp_two_ranks.py OUT
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_trainer import C, GradsBeforeStep, arguments, collate, dataset, model_of  # noqa: E402

from gradhooks.integrations.transformers import DPConfig, DPTrainer  # noqa: E402

import zoo_imports  # noqa: E402,F401  (the torchvision import fix, before transformers)

FSDP = dict(ddp_backend="gloo", fsdp=True,
            fsdp_config={"version": 2, "transformer_layer_cls_to_wrap": ["GPT2Block"]})


def fsdp_on_cpu():
    """accelerate's FSDP state on a CPU (module docstring)."""
    import accelerate.state
    from accelerate.utils import DistributedType
    init = accelerate.state.AcceleratorState.__init__

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    accelerate.state.AcceleratorState.__init__ = __init__


class FullGrads(GradsBeforeStep):
    """The whole gradients before each optimizer step (every rank gathers its shards)."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append({n: p.grad.full_tensor().detach().clone()
                           for n, p in model.named_parameters() if p.requires_grad})


def run(out, dp, **kw):
    grads = FullGrads()
    trainer = DPTrainer(model=model_of(), args=arguments(out, **{**FSDP, **kw}),
                        train_dataset=dataset(), data_collator=collate, callbacks=[grads], dp=dp)
    trainer.train()
    assert trainer.is_fsdp_enabled
    params = {n: p.full_tensor().detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, {"grads": grads.grads, "lot_sizes": trainer.lot_sizes, "params": params}


def main():
    fsdp_on_cpu()
    out, saved = sys.argv[1], {}
    one = dict(gradient_accumulation_steps=1)
    # book-keeping with adaptive clipping (noise off), L = 2, two lots at lr 0: the first lot
    # has 1 sample, so rank 1's share is empty (a 0-weight stand-in); the bound after each lot
    adaptive, saved["book-keeping"] = run(
        out, DPConfig(max_grad_norm=C, noise_multiplier=0.0, target_unclipped_quantile=0.5,
                      clipbound_learning_rate=0.7, count_noise_std=0.0),
        per_device_train_batch_size=1, max_steps=2, learning_rate=0.0, **one)
    saved["book-keeping"]["bound"] = adaptive.clip_bound
    # two-pass, L = 4, the noise drawn once from seed 0, one step of lr 1e-2
    trainer, saved["two-pass"] = run(
        out, DPConfig(max_grad_norm=C, noise_multiplier=1.1, noise_seed=0, clipping="two-pass"),
        per_device_train_batch_size=2, **one)
    refused = None
    try:  # (FSDP1: accelerate's plugin itself needs a GPU; fsdp_refusal is tested alone)
        DPTrainer(model=model_of(), args=arguments(out, **FSDP, gradient_accumulation_steps=3),
                  train_dataset=dataset(), data_collator=collate,
                  dp=DPConfig(max_grad_norm=C, noise_multiplier=1.0))
    except ValueError as e:
        refused = str(e)
    saved.update(rate=trainer.sample_rate, world=trainer.args.world_size,
                 epsilon=trainer.epsilon(), refused=refused)
    torch.save(saved, pathlib.Path(out) / f"rank{trainer.args.process_index}.pt")


if __name__ == "__main__":
    main()
