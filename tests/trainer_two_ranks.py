"""Run by tests/test_trainer_ddp.py under ``torchrun --nproc_per_node 2`` (gloo on CPU): a
``DPTrainer`` on the tiny GPT-2 of tests/test_trainer.py, DDP through accelerate. Each rank
saves to ``OUT/rank{r}.pt``: for book-keeping and two-pass clipping, the gradient before its
first optimizer step (noise 0) and its samples per lot; the sample rate; the epsilon a third
run (sigma 1.1, 2 lots) logs.

    torchrun --nproc_per_node 2 tests/trainer_two_ranks.py OUT PER_DEVICE ACCUMULATION
"""
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from test_trainer import C, GradsBeforeStep, arguments, collate, dataset, model_of  # noqa: E402

from gradhooks.integrations.transformers import DPConfig, DPTrainer  # noqa: E402

import zoo_imports  # noqa: E402,F401  (the torchvision import fix, before transformers)


def main():
    out, per_device, accumulation = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kw = dict(per_device_train_batch_size=per_device, gradient_accumulation_steps=accumulation,
              ddp_backend="gloo")
    saved = {}
    for clipping in ("book-keeping", "two-pass"):
        grads = GradsBeforeStep()
        trainer = DPTrainer(model=model_of(), args=arguments(out, **kw),
                            train_dataset=dataset(), data_collator=collate, callbacks=[grads],
                            dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                        clipping=clipping))
        trainer.train()
        saved[clipping] = {"grads": {n.removeprefix("module."): g
                                     for n, g in grads.grads[0].items()},
                           "lot_sizes": trainer.lot_sizes}
    # adaptive clipping (noise off): two lots at learning rate 0, the bound after each lot
    grads = GradsBeforeStep()
    adaptive = DPTrainer(model=model_of(), args=arguments(out, max_steps=2, learning_rate=0.0,
                                                          **kw),
                         train_dataset=dataset(), data_collator=collate, callbacks=[grads],
                         dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0,
                                     target_unclipped_quantile=0.5, clipbound_learning_rate=0.7,
                                     count_noise_std=0.0))
    adaptive.train()
    saved["adaptive"] = {"grads": [{n.removeprefix("module."): g for n, g in step.items()}
                                   for step in grads.grads], "bound": adaptive.clip_bound}
    noisy = DPTrainer(model=model_of(), args=arguments(out, max_steps=2, **kw),
                      train_dataset=dataset(), data_collator=collate,
                      dp=DPConfig(max_grad_norm=C, noise_multiplier=1.1, noise_seed=0))
    noisy.train()
    saved.update(rate=trainer.sample_rate, world=trainer.args.world_size,
                 epsilon=noisy.epsilon())
    torch.save(saved, pathlib.Path(out) / f"rank{trainer.args.process_index}.pt")


if __name__ == "__main__":
    main()
