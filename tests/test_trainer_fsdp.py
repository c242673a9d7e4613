"""The Trainer's DP step with FSDP2 on 2 processes (issue 40, point 2): ``torchrun
--nproc_per_node 2``, accelerate's FSDP2 plugin (``fully_shard`` of each ``GPT2Block`` and the
root), gloo on CPU (tests/trainer_fsdp_two_ranks.py; accelerate enables FSDP on GPUs only, so
that script sets accelerate's FSDP state on this CPU). One Poisson lot over both ranks, one
micro-batch per rank; the step's whole gradient (gathered from the shards), the same on both
ranks, equals the one-process loop's clipped sum of that lot over ``L`` plus the noise one
process draws from the same seed (float64, 1e-10 of the largest entry); the parameters after
the step equal a one-process ``DPTrainer``'s on the same lot; the epsilon equals Opacus'
accountant's at the one-process rate. Adaptive clipping's bound follows both ranks' count.
"""
import math
import os
import pathlib
import subprocess
import sys
import types

import pytest
import torch
from opacus.accountants import RDPAccountant
from test_trainer import (
    C,
    arguments,
    assert_grads_close,
    clipped_reference,
    collate,
    dataset,
    model_of,
    own_grads,
)
from test_trainer_ddp import _port

from gradhooks.integrations.transformers import (
    DPConfig,
    DPTrainer,
    PoissonMicroBatchSampler,
    fsdp_refusal,
)

HERE = pathlib.Path(__file__).resolve().parent


def lots(data, expected, count):
    """The lots one process draws at rate ``expected / N`` (the trainer's seed 0)."""
    sampler = PoissonMicroBatchSampler(len(data), expected / len(data), count, 1,
                                       torch.Generator().manual_seed(0))
    return [list(part) for part in sampler]


def test_fsdp2_two_ranks_equal_one_process_on_the_same_lot(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE)]),
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(_port()), str(HERE / "trainer_fsdp_two_ranks.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    data = dataset()
    assert all(r["world"] == 2 and r["rate"] == 4 / len(data) for r in ranks)
    # book-keeping, adaptive clipping, L = 2: lot 0 has 1 sample (rank 1's share empty)
    bound, model = C, model_of()
    for k, lot in enumerate(lots(data, 2, 2)):
        shares = [len(h) for h in torch.tensor_split(torch.tensor(lot), 2)]
        assert [r["book-keeping"]["lot_sizes"][k] for r in ranks] == shares
        if k == 0:
            assert shares == [1, 0]
        samples = [data[i] for i in lot]
        want = clipped_reference(model, samples, 2, bound=bound)
        for r in ranks:
            assert_grads_close(r["book-keeping"]["grads"][k], want, 1e-10)
        norms = [float(torch.sqrt(sum((v ** 2).sum() for v in own_grads(model, x).values())))
                 for x in samples]
        bound = bound * math.exp(-0.7 * (sum(n <= bound for n in norms) / len(norms) - 0.5))
    assert all(r["book-keeping"]["bound"] == pytest.approx(bound, rel=1e-12) for r in ranks)
    # two-pass, L = 4, noise sigma C z / L with z drawn once, as one process draws it
    (lot,) = lots(data, 4, 1)
    assert [r["two-pass"]["lot_sizes"] for r in ranks] == [[2], [2]]
    gen = torch.Generator().manual_seed(0)
    want = {n: v + 1.1 * C * torch.randn(v.shape, generator=gen, dtype=v.dtype) / 4
            for n, v in clipped_reference(model_of(), [data[i] for i in lot], 4).items()}
    for r in ranks:
        assert_grads_close(r["two-pass"]["grads"][0], want, 1e-10)
    one = DPTrainer(model=model_of(), args=arguments(tmp_path, per_device_train_batch_size=4,
                                                     gradient_accumulation_steps=1),
                    train_dataset=data, data_collator=collate,
                    dp=DPConfig(max_grad_norm=C, noise_multiplier=1.1, noise_seed=0,
                                clipping="two-pass"))
    one.train()
    assert one.lot_sizes == [len(lot)]
    after = {n: p.detach() for n, p in one.model.named_parameters()}
    for r in ranks:
        assert_grads_close(r["two-pass"]["params"], after, 1e-10)
    acc = RDPAccountant()
    acc.step(noise_multiplier=1.1, sample_rate=4 / len(data))
    assert all(r["epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-12)
               and r["epsilon"] == pytest.approx(one.epsilon(), rel=1e-12) for r in ranks)
    assert all("gradient_accumulation_steps=3" in r["refused"] and "full-size on every rank"
               in r["refused"] for r in ranks)


@pytest.mark.parametrize("version,world,accumulation,precision,match", [
    (1, 2, 1, None, "FSDP2 .fully_shard. models only; set fsdp_config=.'version': 2."),
    (2, 1, 1, None, "one process has nothing to shard"),
    (2, 2, 4, None, "gradient_accumulation_steps=1, or use DDP"),
    (2, 2, 1, "fp16", "fp16: fp16 / bf16 mixed precision is not supported with FSDP"),
    (2, 2, 1, "bf16", "bf16: fp16 / bf16 mixed precision is not supported with FSDP"),
    (2, 2, 1, None, None),
], ids=["fsdp1", "one-process", "accumulation", "fp16", "bf16", "runs"])
def test_fsdp_refusals_name_the_reason_and_the_way_out(version, world, accumulation, precision,
                                                        match):
    args = types.SimpleNamespace(world_size=world, gradient_accumulation_steps=accumulation,
                                 fp16=precision == "fp16", bf16=precision == "bf16")
    why = fsdp_refusal(args, version)
    if match is None:
        assert why is None
    else:
        import re
        assert why.startswith(f"DPTrainer with FSDP version {version} on {world} processes")
        assert re.search(match, why), why
