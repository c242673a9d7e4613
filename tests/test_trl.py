"""DP fine-tuning with TRL (issue 40, point 1; gradhooks/integrations/trl.py): :class:`DPSFTTrainer`
and :class:`DPDPOTrainer` on a tiny GPT-2 (2 layers, width 32, no dropout, random weights) and
a word-level tokenizer built here (no download), prompt-completion and preference data sets of
uneven lengths.

Each DP step (noise 0) is checked against a loop over the Poisson lot the trainer drew (re-drawn
from the same seed): each sample's (each pair's) gradient of *TRL's own loss* on a batch of that
sample (pair) alone -- a plain ``trl.SFTTrainer`` / ``trl.DPOTrainer``'s ``compute_loss``, its
fused LM head, no hooks -- clipped to ``C``, summed and divided by the expected lot size. TRL's
fused head computes in float32 whatever the model's dtype; for the float64 checks the reference
trainer's model returns the same outputs from its full logits in float64 (:func:`unfused`), TRL's
loss code unchanged around it; the float32 checks use TRL's fused head itself.
"""
import copy
import types

import pytest
import torch

import zoo_imports

zoo_imports.import_torchvision()
import datasets  # noqa: E402  (the test extra: trl brings datasets)
import tokenizers  # noqa: E402
import transformers  # noqa: E402
import trl  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402
from test_trainer import GradsBeforeStep, assert_grads_close  # noqa: E402

from gradhooks.base.errors import SampleMixingError, UnsupportedLossError  # noqa: E402
from gradhooks.integrations.transformers import DPConfig, PoissonMicroBatchSampler  # noqa: E402
from gradhooks.integrations.trl import DPDPOTrainer, DPSFTTrainer  # noqa: E402

C, N = 0.5, 24
WORDS = "the a cat dog sat ran on mat log fast slow red blue big small yes no".split()


def tokenizer():
    """A word-level tokenizer over ``WORDS`` (ids 3..), ``<pad>`` 0, ``<eos>`` 1, ``<unk>`` 2."""
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>",
                                                eos_token="<eos>", unk_token="<unk>")


V = len(WORDS) + 3


def _words(g, lo, hi, lead=""):
    n = int(torch.randint(lo, hi, (), generator=g))
    return lead + " ".join(WORDS[int(i)] for i in torch.randint(0, len(WORDS), (n,), generator=g))


def sft_data(n=N, seed=1):
    """Prompt-completion samples: prompts of 1 to 5 words, completions of 1 to 6."""
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([{"prompt": _words(g, 1, 6),
                                        "completion": _words(g, 1, 7, " ")} for _ in range(n)])


def dpo_data(n=N, seed=2):
    """Preference pairs: a prompt, a chosen and a rejected completion of uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    return datasets.Dataset.from_list([{"prompt": _words(g, 1, 6), "chosen": _words(g, 1, 7, " "),
                                        "rejected": _words(g, 1, 7, " ")} for _ in range(n)])


def model_of(dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    return zoo_imports.tiny_gpt2(V, positions=32).to(dtype)


def config(cls, tmp_path, **kw):
    kw = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 3, "max_steps": 1,
          "learning_rate": 1e-2, "report_to": [], "save_strategy": "no", "use_cpu": True,
          "logging_steps": 1, "seed": 0, "disable_tqdm": True, "bf16": False, **kw}
    return cls(str(tmp_path), **kw)  # (TRL's configs default to bf16=True: autocast)


def lot_of(trainer):
    """The first lot the trainer's sampler draws (same seed, rate and split) and its parts."""
    a = trainer.args
    sampler = PoissonMicroBatchSampler(len(trainer.train_dataset), trainer.sample_rate, 1,
                                       a.gradient_accumulation_steps,
                                       torch.Generator().manual_seed(a.seed))
    parts = list(sampler)
    return [i for p in parts for i in p], parts


def unfused(model):
    """``model(..., labels, fused_lm_head=True)`` (TRL's fused LM head: per-token log-probs,
    shifted, in float32) computed from the model's full logits in its own dtype."""
    original = model.forward

    def forward(*args, fused_lm_head=False, labels=None, **kw):
        if not fused_lm_head:
            return original(*args, labels=labels, **kw)
        logits = original(*args, **kw).logits[:, :-1]
        target = labels[:, 1:]
        mask = target != -100
        logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0)[..., None])[..., 0]
        logp = logp * mask
        zero = torch.zeros_like(logp)
        return types.SimpleNamespace(log_probs=logp, label_mask=mask, entropy=zero,
                                     mean_logits=zero, is_top1=mask & False, aux_loss=None)
    model.forward = forward
    return model


def looped_clipped(reference, model, rows, expected, c=C):
    """``sum_n min(1, c / ||g_n||) g_n / expected``, ``g_n`` the gradient of ``reference``'s
    (a plain TRL trainer's) ``compute_loss`` on a batch of row ``n`` alone."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    total = {n: torch.zeros_like(p) for n, p in params.items()}
    norms = []
    for row in rows:
        batch = reference.data_collator([row])
        loss = reference.compute_loss(model, batch)
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = float(torch.sqrt(sum((g.double() ** 2).sum() for g in grads)))
        norms.append(norm)
        for n, g in zip(params, grads):
            total[n] += min(1.0, c / norm) * g
    assert any(n > c for n in norms), norms  # clipping is active in the lot
    return {n: v / expected for n, v in total.items()}


PRECISIONS = pytest.mark.parametrize("dtype,rtol", [(torch.float64, 1e-10),
                                                    (torch.float32, 1e-5)],
                                     ids=["float64", "float32"])
CLIPPING = pytest.mark.parametrize("clipping", ["book-keeping", "two-pass"])
# the lot (expected 6) as one micro-batch of several, or six of 0, 1 or 2 samples
MICRO = pytest.mark.parametrize("micro", [(6, 1), (1, 6)], ids=["G1", "G6"])


def _check_micro_batches(parts, micro):
    sizes = [len(p) for p in parts]
    assert sum(sizes) > 0
    if micro[1] > 1:
        assert min(sizes) <= 1, sizes  # a micro-batch of 0 or 1 sample(s) ran


@PRECISIONS
@CLIPPING
@MICRO
def test_sft_step_equals_looped_clipped_sum(tmp_path, dtype, rtol, clipping, micro):
    """SFT, completion-only loss on prompt-completion data, packing off: the step's gradient
    equals the loop of each sample's gradient of TRL's loss on it alone, clipped and summed."""
    model, tok = model_of(dtype), tokenizer()
    start = copy.deepcopy(model)
    grads = GradsBeforeStep()
    args = config(trl.SFTConfig, tmp_path, per_device_train_batch_size=micro[0],
                  gradient_accumulation_steps=micro[1], packing=False)
    trainer = DPSFTTrainer(model=model, args=args, train_dataset=sft_data(),
                           processing_class=tok, callbacks=[grads],
                           dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0, clipping=clipping))
    row = trainer.train_dataset[0]
    assert trainer.completion_only_loss and -100 in row["labels"]  # the prompt is masked
    trainer.train()
    lot, parts = lot_of(trainer)
    assert trainer.lot_sizes == [len(lot)]
    _check_micro_batches(parts, micro)
    reference = trl.SFTTrainer(model=start, args=args, train_dataset=sft_data(),
                               processing_class=tok)
    if dtype == torch.float64:
        unfused(start)
    want = looped_clipped(reference, start, [trainer.train_dataset[i] for i in lot], 6)
    assert_grads_close(grads.grads[0], want, rtol)


@PRECISIONS
@CLIPPING
@MICRO
def test_dpo_step_equals_looped_clipped_sum_of_pairs(tmp_path, dtype, rtol, clipping, micro):
    """DPO: TRL's ``[chosen; rejected]`` forward, the pair the sample: the step's gradient
    equals the loop of each pair's gradient of TRL's DPO loss on that pair alone (a reference
    model's log-probs), clipped to ``C`` *as a pair* and summed."""
    model, tok = model_of(dtype), tokenizer()
    start, ref = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():  # a reference different from the policy: non-zero log-ratios
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grads = GradsBeforeStep()
    args = config(trl.DPOConfig, tmp_path, per_device_train_batch_size=micro[0],
                  gradient_accumulation_steps=micro[1], beta=0.5)
    trainer = DPDPOTrainer(model=model, ref_model=copy.deepcopy(ref), args=args,
                           train_dataset=dpo_data(), processing_class=tok, callbacks=[grads],
                           dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0, clipping=clipping))
    if dtype == torch.float64:  # (the reference's log-probs: TRL's fused head is float32)
        unfused(trainer.ref_model)
    trainer.train()
    lot, parts = lot_of(trainer)
    assert trainer.lot_sizes == [len(lot)]  # pairs, not rows
    _check_micro_batches(parts, micro)
    reference = trl.DPOTrainer(model=start, ref_model=ref, args=args, train_dataset=dpo_data(),
                               processing_class=tok)
    if dtype == torch.float64:
        unfused(start), unfused(ref)
    want = looped_clipped(reference, start, [trainer.train_dataset[i] for i in lot], 6)
    assert_grads_close(grads.grads[0], want, rtol)


@pytest.mark.parametrize("loss_type", [["hinge"], ["ipo"], ["sigmoid", "robust"]],
                         ids=["hinge", "ipo", "sigmoid+robust"])
def test_dpo_loss_types_against_trl(tmp_path, loss_type):
    """The other per-pair DPO losses (and a weighted sum of two) against TRL's own, float64."""
    model, tok = model_of(), tokenizer()
    start, ref = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn_like(p))
    grads = GradsBeforeStep()
    weights = [1.0, 0.5] if len(loss_type) == 2 else None
    args = config(trl.DPOConfig, tmp_path, beta=0.5, loss_type=loss_type, loss_weights=weights,
                  label_smoothing=0.1 if "robust" in loss_type else 0.0)
    trainer = DPDPOTrainer(model=model, ref_model=copy.deepcopy(ref), args=args,
                           train_dataset=dpo_data(), processing_class=tok, callbacks=[grads],
                           dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0))
    unfused(trainer.ref_model)
    trainer.train()
    reference = trl.DPOTrainer(model=start, ref_model=ref, args=args, train_dataset=dpo_data(),
                               processing_class=tok)
    lot, _ = lot_of(trainer)
    unfused(start), unfused(ref)
    want = looped_clipped(reference, start, [trainer.train_dataset[i] for i in lot], 6)
    assert_grads_close(grads.grads[0], want, 1e-10)


def test_epsilon_from_opacus_accountant(tmp_path):
    """The logged epsilon of a DP SFT run is Opacus' RDP accountant's for its lots; with a
    target epsilon the final one meets it."""
    args = config(trl.SFTConfig, tmp_path, max_steps=3, packing=False)
    trainer = DPSFTTrainer(model=model_of(torch.float32), args=args, train_dataset=sft_data(),
                           processing_class=tokenizer(),
                           dp=DPConfig(max_grad_norm=C, noise_multiplier=1.1, noise_seed=0))
    trainer.train()
    logged = [h["epsilon"] for h in trainer.state.log_history if "loss" in h]
    acc = RDPAccountant()
    for step in range(3):
        acc.step(noise_multiplier=1.1, sample_rate=6 / len(trainer.train_dataset))
        assert logged[step] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    trainer = DPDPOTrainer(model=model_of(torch.float32), ref_model=model_of(torch.float32),
                           args=config(trl.DPOConfig, tmp_path, max_steps=3),
                           train_dataset=dpo_data(), processing_class=tokenizer(),
                           dp=DPConfig(max_grad_norm=C, target_epsilon=4.0, noise_seed=0))
    trainer.train()
    final = trainer.state.log_history[-1]["epsilon"]
    assert final <= 4.0 and final == pytest.approx(4.0, abs=0.05)


def test_sft_refusals(tmp_path):
    """Packing / padding-free rows mix samples; DFT and label smoothing are other losses."""
    dp = DPConfig(max_grad_norm=C, noise_multiplier=1.0)
    for kw in ({"packing": True, "max_length": 16}, {"padding_free": True, "max_length": None}):
        with pytest.raises(SampleMixingError, match="packing=True / padding_free=True"):
            DPSFTTrainer(model=model_of(), args=config(trl.SFTConfig, tmp_path, **kw),
                         train_dataset=sft_data(), processing_class=tokenizer(), dp=dp)
    with pytest.raises(UnsupportedLossError, match="loss_type='dft'"):
        DPSFTTrainer(model=model_of(), args=config(trl.SFTConfig, tmp_path, loss_type="dft"),
                     train_dataset=sft_data(), processing_class=tokenizer(), dp=dp)


@pytest.mark.parametrize("kw,match", [({"loss_type": ["aot"]}, "sorts the log-ratios"),
                                      ({"loss_type": ["sft"]}, "mean over the batch's chosen"),
                                      ({"loss_type": ["nca_pair"]}, "not written as a per-pair"),
                                      ({"ld_alpha": 0.5}, "ld_alpha=0.5")],
                         ids=["aot", "sft", "nca_pair", "ld_alpha"])
def test_dpo_refusals(tmp_path, kw, match):
    with pytest.raises(UnsupportedLossError, match=match):
        DPDPOTrainer(model=model_of(), ref_model=model_of(),
                     args=config(trl.DPOConfig, tmp_path, **kw),
                     train_dataset=dpo_data(), processing_class=tokenizer(),
                     dp=DPConfig(max_grad_norm=C, noise_multiplier=1.0))


def test_docs_example(tmp_path, monkeypatch):
    """The SFT and DPO example of docs/trainer.md runs (3 DP lots each) and reaches an epsilon
    at most its target."""
    import pathlib

    from test_docs import blocks
    page = pathlib.Path(__file__).resolve().parent.parent / "docs" / "trainer.md"
    code = [c for lang, _, c, skip in blocks(page)
            if lang == "python" and "DPDPOTrainer(" in c]
    assert len(code) == 1
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "docs_trainer_trl"}
    exec(compile(code[0], "docs/trainer.md", "exec"), namespace)
    trainer = namespace["trainer"]
    assert len(trainer.lot_sizes) == 3 and 0 < trainer.epsilon() <= 8.0


def test_dpo_with_peft_reference_is_the_adapterless_model(tmp_path):
    """peft LoRA: TRL's reference is the same model with its adapter disabled, so the reference
    forward runs through the hooked modules; it records nothing (under ``no_grad``, hooks
    paused) and the step equals the loop of each pair's clipped gradient of TRL's loss (float64;
    the adapters are the only trainable parameters)."""
    import peft
    tok = tokenizer()
    args = config(trl.DPOConfig, tmp_path, beta=0.5)

    def lora():
        torch.manual_seed(0)
        model = peft.get_peft_model(model_of(), peft.LoraConfig(r=4, target_modules=["c_attn"],
                                                                 lora_dropout=0.0))
        for n, p in model.named_parameters():  # non-zero B: the policy differs from the reference
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)
        return model
    grads = GradsBeforeStep()
    trainer = DPDPOTrainer(model=lora(), args=args, train_dataset=dpo_data(),
                           processing_class=tok, callbacks=[grads],
                           dp=DPConfig(max_grad_norm=0.3, noise_multiplier=0.0))
    assert trainer.ref_model is None  # (the adapter-less model is the reference)
    base_model = trainer.model.get_base_model()
    unfused(base_model)  # (float64 log-probs for the reference forward too)
    trainer.train()
    start = lora()
    reference = trl.DPOTrainer(model=start, args=args, train_dataset=dpo_data(),
                               processing_class=tok)
    unfused(start.get_base_model())
    lot, _ = lot_of(trainer)
    want = looped_clipped(reference, start, [trainer.train_dataset[i] for i in lot], 6, c=0.3)
    assert set(want) == set(grads.grads[0]) and all("lora_" in n for n in want)
    assert_grads_close(grads.grads[0], want, 1e-10)


def test_sft_with_trl_default_bf16_near_the_loop(tmp_path):
    """TRL's configs default to ``bf16=True``: the DP SFT step then runs under bfloat16
    autocast and stays within bfloat16's tolerance (3e-2 of the largest entry, as
    tests/test_trainer_precision.py) of the float64 loop, and is not the float32 step."""
    model, tok = model_of(torch.float32), tokenizer()
    start = copy.deepcopy(model)
    grads = GradsBeforeStep()
    args = config(trl.SFTConfig, tmp_path, packing=False, bf16=True)
    trainer = DPSFTTrainer(model=model, args=args, train_dataset=sft_data(),
                           processing_class=tok, callbacks=[grads],
                           dp=DPConfig(max_grad_norm=C, noise_multiplier=0.0))
    trainer.train()
    reference = trl.SFTTrainer(model=start, args=args, train_dataset=sft_data(),
                               processing_class=tok)
    unfused(start.double())
    lot, _ = lot_of(trainer)
    want = looped_clipped(reference, start, [trainer.train_dataset[i] for i in lot], 6)
    scale = max(float(v.abs().max()) for v in want.values())
    err = max(float((grads.grads[0][n].double() - want[n]).abs().max()) for n in want) / scale
    assert 1e-5 < err <= 3e-2
