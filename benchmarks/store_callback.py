"""Attribution while training (gradhooks.integrations.store_callback): the cost of
:class:`GradientStoreCallback` on a ``transformers.Trainer`` step of GPT-2 small, against the
plain Trainer step, in one process, runs alternating, medians.

    python benchmarks/store_callback.py [--batch 16] [--seq 128] [--rounds 3] [--steps 2]

``GPT2Config()`` defaults (12 layers, n_embd 768, tied 50257 x 768 embedding), dropout 0 (as
benchmarks/scale.py), random weights, random token ids ``(B, T)`` (every sample ``T`` tokens),
the loss the mean of each sample's own token mean (``per_sample_token_loss``) in both
variants, AdamW over every parameter, the Trainer's clipping at 1.0, float32, CPU:

* ``plain``: ``Trainer.train()`` without the callback;
* ``callback``: the same with ``GradientStoreCallback(k_in=k_out=16, float16,
  module="transformer.h")``: hooks on the 12 blocks' 48 ``Conv1D`` layers and 24 LayerNorms
  (K = 96 x 256 = 24576 per row), each step's B rows projected and written.

Each round runs one ``plain`` and one ``callback`` training of ``1 + steps`` steps (a fresh
model from the same seed); a step's time is the Trainer's ``on_step_begin`` to ``on_step_end``
(forward, backward, clipping, the callback's read and write, AdamW), on the wall clock and in
this process's CPU time (``time.process_time``, all threads: on a machine shared with other
processes the wall clock also counts their time slices); the first step of each run (the hooks'
first-structure checks) is reported apart. ``read`` is the time inside the callback's
``on_pre_optimizer_step`` (features, projection, float16 write).
"""
import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import torch  # noqa: E402

import zoo_imports  # noqa: E402  (torchvision beside the CPU torch)

zoo_imports.import_torchvision()
import transformers  # noqa: E402

from gradhooks import per_sample_token_loss  # noqa: E402
from gradhooks.integrations.store_callback import GradientStoreCallback  # noqa: E402


def clocks():
    # (wall, this process's CPU time over all its threads): the CPU time is what the step costs
    # this process, less sensitive than the wall clock to other processes on a shared machine
    return time.perf_counter(), time.process_time()


class StepTimer(transformers.TrainerCallback):
    def __init__(self):
        self.times = []

    def on_step_begin(self, args, state, control, **kwargs):
        self._t = clocks()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append([b - a for a, b in zip(self._t, clocks())])


class TimedStore(GradientStoreCallback):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.read_times = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        t = clocks()
        super().on_pre_optimizer_step(args, state, control, **kwargs)
        self.read_times.append([b - a for a, b in zip(t, clocks())])


def token_mean(outputs, labels, num_items_in_batch=None):
    return per_sample_token_loss(outputs.logits, labels).mean()


def collate(features):
    ids = torch.stack([f["input_ids"] for f in features])
    return {"input_ids": ids, "labels": ids}


def run(variant, batch, seq, steps, tmp):
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": torch.randint(0, 50257, (seq,), generator=g)} for _ in range(batch * steps)]
    timer = StepTimer()
    callbacks = [timer]
    store = None
    if variant == "callback":
        store = TimedStore(tempfile.mkdtemp(dir=tmp), k_in=16, k_out=16, module="transformer.h")
        data = store.track(data)
        callbacks.append(store)
    args = transformers.TrainingArguments(
        tempfile.mkdtemp(dir=tmp), per_device_train_batch_size=batch, max_steps=steps,
        learning_rate=1e-5, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True, seed=0)
    transformers.Trainer(model=model, args=args, train_dataset=data, data_collator=collate,
                         compute_loss_func=token_mean, callbacks=callbacks).train()
    return timer.times, (store.read_times if store else []), (store.store.dim if store else None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per run (after 1 warm-up)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "store_callback.json"))
    a = ap.parse_args()
    rec = {"batch": a.batch, "seq": a.seq, "rounds": a.rounds, "steps": a.steps,
           "torch": torch.__version__, "transformers": transformers.__version__,
           "threads": torch.get_num_threads(), "machine": platform.machine(),
           "load_before": os.getloadavg(), "plain": [], "callback": [], "read": [],
           "first": {"plain": [], "callback": []}, "load": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for variant in ("plain", "callback") if r % 2 == 0 else ("callback", "plain"):
                times, reads, dim = run(variant, a.batch, a.seq, 1 + a.steps, tmp)
                rec["first"][variant].append(times[0])
                rec[variant].extend(times[1:])
                rec["read"].extend(reads[1:])
                if dim:
                    rec["K"] = dim
                rec["load"].append(os.getloadavg()[0])
                print(variant, [f"{w:.2f} s ({c:.2f} s CPU)" for w, c in times], flush=True)
    med = {clock: {k: statistics.median(t[i] for t in rec[k]) for k in ("plain", "callback", "read")}
           for i, clock in enumerate(("wall", "cpu"))}
    rec["median"] = med
    rec["ratio"] = {c: m["callback"] / m["plain"] for c, m in med.items()}
    rec["read_share_of_plain"] = {c: m["read"] / m["plain"] for c, m in med.items()}
    rec["load_after"] = os.getloadavg()
    print(json.dumps({k: rec[k] for k in ("median", "ratio", "read_share_of_plain", "K")}))
    with open(a.out, "w") as f:
        json.dump(rec, f, indent=1)


if __name__ == "__main__":
    main()
