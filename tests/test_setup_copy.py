"""deepcopy / pickle / torch.save of an attached model give a plain model: no hooks, no records,
no grad_sample, and a pickle the size of the plain model's."""
import copy
import io
import pickle

import torch
import torch.nn.functional as F
from torch import nn

import gradhooks


def test_copies_of_an_attached_model_are_plain():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(16, 3))
    x, y = torch.randn(6, 2, 6), torch.randint(0, 3, (6,))
    plain_size = len(pickle.dumps(model))
    with gradhooks.attach(model) as gh:
        F.cross_entropy(model(x), y).backward()
        gh.per_sample_grads()
        assert hasattr(model[0].weight, "grad_sample")
        copies = [copy.deepcopy(model), pickle.loads(pickle.dumps(model))]
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        copies.append(torch.load(buffer, weights_only=False))
        assert len(pickle.dumps(model)) == plain_size
        for c in copies:
            for m in c.modules():
                assert not (m._forward_hooks or m._forward_pre_hooks or m._backward_hooks)
            for p in c.parameters():
                assert not hasattr(p, "grad_sample") and not p._backward_hooks
            torch.testing.assert_close(c(x), model(x))
            # a copy trains as a plain model; the original's hooks do not record it
            F.cross_entropy(c(x), y).backward()
        assert gh.batch_size == 6 and all(r.layer.module in set(model.modules())
                                          for r in gh.recorder.records)
    assert len(pickle.dumps(model)) == plain_size
