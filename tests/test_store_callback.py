"""Attribution while training (gradhooks/integrations/store_callback.py): the projected gradient
store written by a ``TrainerCallback`` from the training batches' own records, on a tiny GPT-2
(2 layers, width 16, no dropout) from a config, padded causal-LM batches with uneven valid-token
counts, float64 (and float32 with tolerances).

Each step's rows are checked against (1) a store written after training the ordinary way
(``GradientStore.add_batch``: its own forward and backward) from the weights of that step,
saved while training, on the samples the keys name, and (2) a loop of one-sample forwards
(no padding) whose autograd gradients are projected by the same matrices; the keys against the
Trainer's epochs; resuming from a checkpoint against an uninterrupted run; and each refusal.
"""
import copy
import pathlib
import time

import pytest
import torch

import zoo_imports

zoo_imports.import_torchvision()
import transformers  # noqa: E402  (after the torchvision stub)
from test_ggn import close  # noqa: E402

import gradhooks  # noqa: E402
from gradhooks import per_sample_token_loss  # noqa: E402
from gradhooks.base.errors import GradHooksError  # noqa: E402
from gradhooks.integrations.store_callback import GradientStoreCallback, SampleIndexDataset  # noqa: E402
from gradhooks.readers.attribution.gradient_store import GradientStore, StoreSpecError  # noqa: E402
from gradhooks.readers.attribution.projections import projection  # noqa: E402

KI, KO, SEED, N = 3, 2, 5, 10
MODULE = "transformer.h"


def model_of(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=40, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                  bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(cfg).to(dtype)


def data_of(n=N):
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": torch.randint(0, 40, (int(torch.randint(3, 9, (), generator=g)),),
                                        generator=g).tolist()} for _ in range(n)]


def collate(features):
    """Right padding; labels -100 past each sample's end."""
    t = max(len(f["input_ids"]) for f in features)
    ids = torch.zeros(len(features), t, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, f in enumerate(features):
        ids[i, :len(f["input_ids"])] = torch.tensor(f["input_ids"])
        mask[i, :len(f["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def token_mean(outputs, labels, num_items_in_batch=None):
    """The mean over samples of each sample's own token mean (splits into per-sample terms)."""
    return per_sample_token_loss(outputs.logits, labels).mean()


def per_sample_losses(model, batch):
    return per_sample_token_loss(model(input_ids=batch["input_ids"],
                                       attention_mask=batch["attention_mask"]).logits,
                                 batch["labels"])


class WeightsPerStep(transformers.TrainerCallback):
    """The weights each step's gradient is taken at, ``{global_step: state_dict}``."""

    def __init__(self):
        self.weights = {}

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.weights[state.global_step] = copy.deepcopy(model.state_dict())


class Crash(transformers.TrainerCallback):
    class Stop(Exception):
        pass

    def __init__(self, at):
        self.at = at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.at:
            raise Crash.Stop


def trainer_of(tmp, model, cb, batch, steps, callbacks=(), data=None, eval_data=None, **kw):
    args = dict(per_device_train_batch_size=batch, max_steps=steps, learning_rate=0.05,
                report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True, seed=3,
                logging_strategy="no")
    args.update(kw)
    data = data_of() if data is None else data
    return transformers.Trainer(model=model, args=transformers.TrainingArguments(str(tmp), **args),
                                train_dataset=cb.track(data), data_collator=collate,
                                compute_loss_func=token_mean, callbacks=[cb, *callbacks],
                                eval_dataset=eval_data)


def loop_rows(model, features, dtype):
    """``(B, K)``: each sample's own gradient (a one-sample forward, no padding) of the blocks'
    parameters, projected by the store's matrices in its column order."""
    sub = model.get_submodule(MODULE)
    params = dict(sub.named_parameters())
    rows = []
    for ids in features:
        x = torch.tensor([ids["input_ids"]])
        loss = per_sample_token_loss(model(input_ids=x).logits, x)[0]
        grads = dict(zip(params, torch.autograd.grad(loss, list(params.values()))))
        parts = []
        for path in dict(sub.named_modules()):
            m = sub.get_submodule(path)
            if type(m).__name__ != "Conv1D":
                continue
            mat = torch.cat([grads[f"{path}.weight"].T, grads[f"{path}.bias"][:, None]], 1)  # (O, I+1)
            pa = projection(path, "a", KI, mat.shape[1], SEED, dtype)
            pg = projection(path, "g", KO, mat.shape[0], SEED, dtype)
            parts.append((pg @ mat @ pa.T).flatten())
        for name, g in grads.items():
            if ".ln_" in name:
                parts.append(projection(name, "dense", KI * KO, g.numel(), SEED, dtype) @ g.flatten())
        rows.append(torch.cat(parts))
    return torch.stack(rows)


@pytest.mark.parametrize("batch,steps", [(1, 3), (4, 4)], ids=["B1", "B4-4-2-4"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_rows_equal_the_store_written_after_training(batch, steps, dtype, tmp_path):
    """Each step's rows equal a store written after training from that step's weights, and the
    loop; the keys are the Trainer's batches (every sample once per epoch)."""
    data = data_of()
    cb = GradientStoreCallback(tmp_path / "store", k_in=KI, k_out=KO, seed=SEED, dtype=dtype,
                               module=MODULE)
    weights = WeightsPerStep()
    trainer_of(tmp_path / "out", model_of(dtype), cb, batch, steps, [weights], data).train()
    store = cb.store
    assert cb.gh is None  # detached at the end
    index, step = store.sample_index, store.steps
    sizes = [batch] * steps if batch == 1 else [4, 4, 2, 4]
    assert store.rows == sum(sizes) and store.size == steps * batch
    assert step.tolist() == [t for t, b in enumerate(sizes) for _ in range(b)]
    if batch == 4:
        assert sorted(index[:N].tolist()) == list(range(N))  # the first epoch: each sample once

    after = GradientStore(tmp_path / "after", store.size, k_in=KI, k_out=KO, seed=SEED, dtype=dtype)
    model = model_of(dtype, seed=1)
    loops = []
    with gradhooks.attach(model.get_submodule(MODULE)) as gh:
        for t in range(steps):
            model.load_state_dict(weights.weights[t])
            samples = [data[i] for i in index[step == t].tolist()]
            after.add_batch(gh, collate(samples), lambda _, b: per_sample_losses(model, b))
            loops.append(loop_rows(model, samples, dtype))
    ours = store.features(dtype=torch.float64)
    close(ours, after.features(dtype=torch.float64), dtype, "during vs after training")
    close(ours, torch.cat(loops).double(), dtype, "during training vs loop")
    query = after.features(0, 2, dtype)
    close(store.scores(query), after.scores(query), dtype, "scores")


def test_resume_continues_without_duplicates(tmp_path):
    """Interrupted after step 5 (checkpoint at 4), resumed: the rows of the uninterrupted run,
    each (step, sample) once; step 4's rows, written after the checkpoint, are redone."""
    kw = dict(k_in=KI, k_out=KO, seed=SEED, dtype=torch.float64, module=MODULE)
    full = GradientStoreCallback(tmp_path / "full", **kw)
    trainer_of(tmp_path / "a", model_of(), full, 4, 6).train()

    cb = GradientStoreCallback(tmp_path / "store", **kw)
    with pytest.raises(Crash.Stop):
        trainer_of(tmp_path / "b", model_of(), cb, 4, 6, [Crash(5)], save_strategy="steps",
                   save_steps=2).train()
    assert cb.store.steps.tolist()[-1] == 4  # written, but after checkpoint-4
    again = GradientStoreCallback(tmp_path / "store", **kw)
    trainer_of(tmp_path / "b", model_of(seed=9), again, 4, 6, save_strategy="steps",
               save_steps=2).train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-4"))
    reopened = GradientStore(tmp_path / "store", full.store.size, k_in=KI, k_out=KO, seed=SEED,
                             dtype=torch.float64)
    for store in (again.store, reopened):
        assert store.rows == full.store.rows
        assert torch.equal(store.steps, full.store.steps)
        assert torch.equal(store.sample_index, full.store.sample_index)
        close(store.features(dtype=torch.float64), full.store.features(dtype=torch.float64),
              torch.float64, "resumed vs uninterrupted")


def test_resume_refuses_a_store_missing_steps(tmp_path):
    kw = dict(k_in=KI, k_out=KO, seed=SEED, module=MODULE)
    cb = GradientStoreCallback(tmp_path / "store", **kw)
    trainer_of(tmp_path / "b", model_of(), cb, 4, 2, save_strategy="steps", save_steps=2).train()
    fresh = GradientStoreCallback(tmp_path / "other", **kw)
    with pytest.raises(StoreSpecError, match=r"resumes at step 2.*no rows of steps \[0, 1\]"):
        trainer_of(tmp_path / "b", model_of(), fresh, 4, 4, save_strategy="steps",
                   save_steps=2).train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))


@pytest.mark.parametrize("change,match", [
    (dict(gradient_accumulation_steps=2), "gradient_accumulation_steps = 2"),
    (dict(dataloader_num_workers=1), "dataloader_num_workers = 1"),
], ids=["accumulation", "workers"])
def test_refusals(change, match, tmp_path):
    cb = GradientStoreCallback(tmp_path / "store", k_in=KI, k_out=KO, module=MODULE)
    with pytest.raises(GradHooksError, match=match):
        trainer_of(tmp_path / "out", model_of(), cb, 2, 2, **change).train()


def test_evaluation_between_steps(tmp_path):
    """An evaluation every step leaves the rows as they are; on the tracked set it is refused
    (its batches would be noted as training batches)."""
    kw = dict(k_in=KI, k_out=KO, seed=SEED, dtype=torch.float64, module=MODULE)
    plain = GradientStoreCallback(tmp_path / "a", **kw)
    trainer_of(tmp_path / "oa", model_of(), plain, 4, 4).train()
    cb = GradientStoreCallback(tmp_path / "b", **kw)
    trainer_of(tmp_path / "ob", model_of(), cb, 4, 4, eval_data=data_of(5), eval_strategy="steps",
               eval_steps=1).train()
    assert torch.equal(cb.store.sample_index, plain.store.sample_index)
    assert torch.equal(cb.store.features(dtype=torch.float64), plain.store.features(dtype=torch.float64))
    bad = GradientStoreCallback(tmp_path / "c", **kw)
    trainer = trainer_of(tmp_path / "oc", model_of(), bad, 4, 4, eval_data=data_of(5),
                         eval_strategy="steps", eval_steps=1)
    trainer.eval_dataset = trainer.train_dataset
    with pytest.raises(GradHooksError, match="the evaluation set is the tracked training set"):
        trainer.train()


def test_refuses_an_untracked_training_set(tmp_path):
    cb = GradientStoreCallback(tmp_path / "store", k_in=KI, k_out=KO, module=MODULE)
    trainer = trainer_of(tmp_path / "out", model_of(), cb, 2, 2)
    trainer.train_dataset = data_of()  # not cb.track(...)
    with pytest.raises(GradHooksError, match=r"train_dataset=callback.track\(train_set\)"):
        trainer.train()


def test_sample_index_dataset_notes_batches():
    ds = SampleIndexDataset(data_of(4))
    loader = torch.utils.data.DataLoader(ds, batch_size=3, collate_fn=collate)
    assert [b["input_ids"].shape[0] for b in loader] == [3, 1]
    assert list(ds.fetched) == [[0, 1, 2], [3]]
    assert ds[2] == data_of(4)[2] and len(ds) == 4


def test_store_keys_errors(tmp_path):
    store = GradientStore(tmp_path / "s", 4, k_in=1, k_out=1, dtype=torch.float64)
    with pytest.raises(StoreSpecError, match="together"):
        store.add(torch.zeros(2, 3), sample_index=torch.arange(2))
    with pytest.raises(StoreSpecError, match="3 sample indices for 2 rows"):
        store.add(torch.zeros(2, 3), sample_index=torch.arange(3), step=0)
    store.add(torch.ones(2, 3), sample_index=torch.tensor([5, 7]), step=3)
    with pytest.raises(StoreSpecError, match="every batch or for none"):
        store.add(torch.zeros(1, 3))
    assert store.sample_index.tolist() == [5, 7] and store.steps.tolist() == [3, 3]
    with pytest.raises(GradHooksError, match=r"rows must be in \[0, 2\]"):
        store.truncate(3)
    store.truncate(1)
    again = GradientStore(tmp_path / "s", 4, k_in=1, k_out=1, dtype=torch.float64)
    assert again.rows == 1 and again.sample_index.tolist() == [5]


def test_resume_refuses_a_store_without_keys(tmp_path):
    cb = GradientStoreCallback(tmp_path / "store", k_in=KI, k_out=KO, module=MODULE)
    trainer_of(tmp_path / "b", model_of(), cb, 4, 2, save_strategy="steps", save_steps=2).train()
    plain = GradientStore(tmp_path / "plain", 16, k_in=KI, k_out=KO)  # written without keys
    plain.add(torch.zeros(2, cb.store.dim))
    again = GradientStoreCallback(tmp_path / "plain", k_in=KI, k_out=KO, module=MODULE)
    with pytest.raises(StoreSpecError, match="without sample indices and steps"):
        trainer_of(tmp_path / "b", model_of(), again, 4, 4, save_strategy="steps",
                   save_steps=2).train(resume_from_checkpoint=str(tmp_path / "b" / "checkpoint-2"))


def test_step_refuses_missing_or_mismatched_indices(tmp_path):
    cb = GradientStoreCallback(tmp_path / "store", k_in=KI, k_out=KO, module=MODULE)
    data = data_of()
    cb.track(data)
    state = transformers.TrainerState()
    with pytest.raises(GradHooksError, match="no batch's sample indices were noted for step 0"):
        cb.on_pre_optimizer_step(None, state, None)
    model = model_of()
    with gradhooks.attach(model.get_submodule(MODULE)) as cb.gh:
        per_sample_losses(model, collate(data[:2])).mean().backward()
        cb.dataset.fetched.append([0, 1, 2])
        with pytest.raises(GradHooksError, match="has 2 samples, the batch fetched 3 indices"):
            cb.on_pre_optimizer_step(None, state, None)


def test_docs_example_runs(tmp_path, monkeypatch):
    """The example of docs/gradient-store.md's section on training (tests/test_docs.py skips it:
    it needs the torchvision stub above) runs in under a minute, and its per-sample sums are the
    sums of each sample's rows."""
    from test_docs import blocks
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "gradient-store.md"
    code = [c for lang, _, c, _ in blocks(page) if lang == "python" and "GradientStoreCallback(" in c]
    assert len(code) == 1
    monkeypatch.chdir(tmp_path)
    ns = {}
    start = time.perf_counter()
    exec(compile(code[0], str(page), "exec"), ns)
    assert time.perf_counter() - start < 60
    store, scores = ns["store"], ns["scores"]
    assert store.rows == 48 and sorted(store.sample_index[:24].tolist()) == list(range(24))
    for i in (0, 5):
        close(ns["per_sample"][:, i], scores[:, store.sample_index == i].sum(1), torch.float32)
