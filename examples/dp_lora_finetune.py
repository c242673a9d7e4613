"""Private LoRA fine-tuning of a small Llama-style decoder on text that ships with Python.

    python examples/dp_lora_finetune.py [--steps 150] [--batch 16] [--length 64] [--sigma 0.8]
        [--max-norm 1.0] [--lr 3e-3] [--delta 1e-5] [--seed 0] [--out dp_lora.png]

A character-level Llama (transformers' ``LlamaForCausalLM`` from a small config: 2 layers, hidden
64, 4 heads with 2 key/value heads, random weights: nothing is downloaded) is first trained
briefly on the text of Python's ``argparse.py`` (the "pre-trained" model), then fine-tuned on the
text of ``textwrap.py`` with peft LoRA (rank 8 on the attention's q and v projections; the base
weights frozen), twice from the same start: without privacy, and with DP-SGD (Abadi et al. 2016)
as gradhooks does it: **Poisson sampling** of 64-character windows (each joins a step with
probability q = batch / N), book-keeping ghost clipping of each window's gradient to ``C``
(``gh.backward(loss)`` then ``gh.clip_and_accumulate``: no per-sample gradient tensor; Bu et al.
2023), Gaussian noise ``sigma C``, division by the expected batch size, Adam. epsilon at
``delta`` comes from Opacus' RDP accountant, which assumes exactly this mechanism.

Prints epsilon, the held-out perplexity of the start, the non-private and the private fine-tune,
and the time per step of each (plain LoRA step against the private one), and plots both loss
curves (PNG). Needs transformers, peft, opacus and matplotlib (``pip install -e .[examples]``).
"""
import argparse
import os
import sys
import textwrap
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The registry's torchvision 0.28 is a CUDA build whose import fails beside the CPU torch (in
# torchvision/_meta_registrations.py); transformers imports torchvision when it is installed and
# needs none of its ops here.
sys.modules.setdefault("torchvision._meta_registrations",
                       types.ModuleType("torchvision._meta_registrations"))

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from opacus.accountants import RDPAccountant  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import gradhooks  # noqa: E402
from gradhooks.tools.workloads import VOCAB  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument("--steps", type=int, default=150, help="fine-tuning steps of each run")
parser.add_argument("--pretrain-steps", type=int, default=150)
parser.add_argument("--batch", type=int, default=16, help="expected batch size q N")
parser.add_argument("--length", type=int, default=64, help="characters per window")
parser.add_argument("--sigma", type=float, default=0.8, help="noise multiplier")
parser.add_argument("--max-norm", type=float, default=1.0, help="clipping bound C")
parser.add_argument("--lr", type=float, default=3e-3)
parser.add_argument("--delta", type=float, default=1e-5)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--out", default="dp_lora.png", help="loss-curve plot (PNG)")
args = parser.parse_args()
torch.manual_seed(args.seed)


def tokens(module) -> torch.Tensor:
    """The characters of a standard-library module's source as ids in [0, VOCAB)."""
    with open(module.__file__, encoding="utf-8") as f:
        text = f.read()
    return torch.tensor([min(ord(c), VOCAB - 1) for c in text], dtype=torch.long)


def windows(ids: torch.Tensor, length: int) -> torch.Tensor:
    n = (len(ids) - 1) // (length + 1)
    return ids[: n * (length + 1)].view(n, length + 1)


pretrain = windows(tokens(argparse), args.length)
data = windows(tokens(textwrap), args.length)
split = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed))
train, test = data[split[: int(0.8 * len(data))]], data[split[int(0.8 * len(data)):]]


def lm_loss(model, batch: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-character cross-entropy; ``reduction="none"``: each window's mean over its tokens."""
    logits = model(input_ids=batch[:, :-1]).logits
    loss = F.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none").mean(1)
    return loss.mean() if reduction == "mean" else loss.sum() if reduction == "sum" else loss


@torch.no_grad()
def perplexity(model) -> float:
    return float(torch.exp(lm_loss(model, test)))


config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
base = LlamaForCausalLM(config)
opt = torch.optim.Adam(base.parameters(), lr=3e-3)
for step in range(args.pretrain_steps):  # a brief "pre-training" on another text
    idx = torch.randint(0, len(pretrain), (args.batch,))
    opt.zero_grad()
    lm_loss(base, pretrain[idx]).backward()
    opt.step()
start_state = {k: v.clone() for k, v in base.state_dict().items()}


def lora_model():
    base.load_state_dict(start_state)
    torch.manual_seed(args.seed)
    return get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                           lora_dropout=0.0))


def finetune(private: bool):
    model = lora_model()
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.Adam(params, lr=args.lr)
    sampler = torch.Generator().manual_seed(args.seed + 1)
    noise = torch.Generator().manual_seed(args.seed + 2)
    q = args.batch / len(train)
    losses, times = [], []
    gh = gradhooks.attach(model, loss_reduction="sum") if private else None
    for _ in range(args.steps):
        if private:  # Poisson sampling: the batch size varies, and may be 0
            idx = (torch.rand(len(train), generator=sampler) < q).nonzero().squeeze(1)
        else:
            idx = torch.randint(0, len(train), (args.batch,), generator=sampler)
        batch = train[idx]
        t0 = time.perf_counter()
        opt.zero_grad()
        if private:
            loss = lm_loss(model, batch, "sum")
            gh.backward(loss)
            gh.clip_and_accumulate(args.max_norm, noise_multiplier=args.sigma, generator=noise)
            for p in params:  # the sum over the expected batch size q N
                p.grad.div_(q * len(train))
            loss = loss.detach() / max(len(idx), 1)
        else:
            loss = lm_loss(model, batch)
            loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss.detach()))
    if gh is not None:
        gh.detach()
    model.eval()
    ppl = perplexity(model)
    model.unload()  # the base model back without the adapters, for the next run
    return losses, times, ppl


start_ppl = perplexity(base)
plain_losses, plain_times, plain_ppl = finetune(private=False)
dp_losses, dp_times, dp_ppl = finetune(private=True)
accountant = RDPAccountant()
for _ in range(args.steps):
    accountant.step(noise_multiplier=args.sigma, sample_rate=args.batch / len(train))
eps = accountant.get_epsilon(delta=args.delta)
median = lambda ts: sorted(ts)[len(ts) // 2] * 1e3  # noqa: E731

print(f"LoRA fine-tune of a Llama-style decoder ({sum(p.numel() for p in base.parameters())} "
      f"base parameters) on {len(train)} windows of {args.length} characters of textwrap.py")
print("| run | held-out perplexity | ms per step (median) |")
print("|---|--:|--:|")
print(f"| start (pre-trained on argparse.py) | {start_ppl:.2f} | - |")
print(f"| LoRA, not private | {plain_ppl:.2f} | {median(plain_times):.1f} |")
print(f"| LoRA, DP-SGD (book-keeping, sigma {args.sigma}, C {args.max_norm}) | {dp_ppl:.2f} | "
      f"{median(dp_times):.1f} |")
print(f"epsilon = {eps:.2f} at delta = {args.delta:g} (RDP accountant, Poisson sampling q = "
      f"{args.batch / len(train):.4f}, {args.steps} steps); private step / plain step = "
      f"{median(dp_times) / median(plain_times):.2f}x")

def smooth(values, k=10):
    """Running mean over the last ``k`` steps (the per-batch losses are noisy)."""
    return [sum(values[max(0, i - k + 1): i + 1]) / len(values[max(0, i - k + 1): i + 1])
            for i in range(len(values))]


plt.figure(figsize=(6, 3.5))
plt.plot(smooth(plain_losses), label=f"LoRA (held-out perplexity {plain_ppl:.2f})")
plt.plot(smooth(dp_losses), label=f"DP LoRA, eps {eps:.1f} (held-out perplexity {dp_ppl:.2f})")
plt.xlabel("step")
plt.ylabel("training loss, nats per character\n(running mean of 10 steps)")
plt.legend()
plt.tight_layout()
plt.savefig(args.out, dpi=120)
print(f"wrote {args.out}")
