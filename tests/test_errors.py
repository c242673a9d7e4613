"""Bad input gets a clear, typed error that names the module -- never a wrong number."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradhooks

from conftest import weighted_square_loss


class WithPReLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 3), nn.PReLU())
        self.head = nn.Linear(3, 1)

    def forward(self, x):
        return self.head(self.body(x))


def test_unsupported_module_named_at_attach_when_strict():
    with pytest.raises(gradhooks.UnsupportedModuleError) as e:
        gradhooks.attach(WithPReLU(), strict=True)
    msg = str(e.value)
    assert "'body.1'" in msg and "PReLU" in msg and "weight" in msg
    assert "Linear" in msg and "Conv2d" in msg  # lists the supported types
    assert "'head'" not in msg


def test_raw_parameter_on_root_module():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.s = nn.Parameter(torch.ones(3))
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x) * self.s

    with pytest.raises(gradhooks.UnsupportedModuleError, match=r"'<root>' \(.*Scale\): parameters s"):
        gradhooks.attach(Scale(), strict=True)


def test_frozen_unsupported_module_is_fine():
    model = WithPReLU()
    model.body[1].weight.requires_grad_(False)
    with gradhooks.attach(model) as gh:
        weighted_square_loss()(model(torch.randn(2, 3)), torch.ones(2)).backward()
        assert "body.1.weight" not in gh.per_sample_grads()


def test_subclass_overriding_forward_is_refused_when_strict():
    class Standardized(nn.Conv2d):
        def forward(self, x):
            w = (self.weight - self.weight.mean()) / (self.weight.std() + 1e-5)
            return F.conv2d(x, w, self.bias)

    with pytest.raises(gradhooks.UnsupportedModuleError, match="overrides forward"):
        gradhooks.attach(nn.Sequential(Standardized(1, 2, 3)), strict=True)


def test_subclass_keeping_forward_is_supported():
    class MyLinear(nn.Linear):
        pass

    model = MyLinear(3, 2).double()
    from conftest import check_against_loop
    check_against_loop(model, torch.randn(3, 3), torch.ones(3), loss_reduction="mean", dtype=torch.float64)


def test_extra_parameter_on_supported_module_is_refused_when_strict():
    lin = nn.Linear(3, 2)
    lin.register_parameter("gain", nn.Parameter(torch.ones(2)))
    with pytest.raises(gradhooks.UnsupportedModuleError, match="parameters gain"):
        gradhooks.attach(lin, strict=True)


def test_per_sample_grads_before_backward():
    model = nn.Linear(3, 2)
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.NoBackwardError, match="loss.backward"):
            gh.per_sample_grads()
        model(torch.randn(4, 3))
        with pytest.raises(gradhooks.NoBackwardError):
            gh.per_sample_grads()


def test_layers_seeing_different_batch_sizes():
    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(8, 2)

        def forward(self, x):
            return self.b(self.a(x).reshape(-1, 8))  # merges pairs of samples

    model = Mixer()
    with gradhooks.attach(model):
        with pytest.raises(gradhooks.BatchSizeError, match=r"'b' \(Linear\) sees batch size 2.*'a' \(Linear\) saw 4"):
            model(torch.randn(4, 4))


def test_unreached_forward_then_another_batch_size():
    """A forward no backward reached (e.g. evaluation without no_grad) does not fix the size."""
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with gradhooks.attach(model) as gh:
        model(torch.randn(32, 3))
        weighted_square_loss()(model(torch.randn(16, 3)), torch.ones(16)).backward()
        assert gh.per_sample_grads()["0.weight"].shape == (16, 3, 3)
        # but one loss over outputs of two batch sizes cannot have per-sample gradients
        out4, out8 = model(torch.randn(4, 3)), model(torch.randn(8, 3))
        with pytest.raises(gradhooks.GradHooksError, match="another batch size"):
            (out4.sum() + out8.sum()).backward()


def test_failed_forward_does_not_poison_the_next():
    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
    with gradhooks.attach(model) as gh:
        with pytest.raises(gradhooks.BatchSizeError):
            model(torch.randn(3))  # unbatched
        weighted_square_loss()(model(torch.randn(5, 3)), torch.ones(5)).backward()
        assert gh.batch_size == 5


def test_unbatched_inputs_are_refused():
    with gradhooks.attach(nn.Linear(3, 2)) as gh:
        with pytest.raises(gradhooks.BatchSizeError, match="unbatched"):
            gh.model(torch.randn(3))
    with gradhooks.attach(nn.Conv2d(1, 2, 3)) as gh:
        with pytest.raises(gradhooks.BatchSizeError, match=r"\(B, C_in, \*spatial\) with 4 dims"):
            gh.model(torch.randn(1, 5, 5))


@pytest.mark.parametrize("bad", ["none", "batchmean", None])
def test_bad_loss_reduction(bad):
    with pytest.raises(ValueError, match="loss_reduction must be 'mean' or 'sum'"):
        gradhooks.attach(nn.Linear(2, 2), loss_reduction=bad)
    with pytest.raises(ValueError, match="loss_reduction"):
        gradhooks.looped_per_sample_grads(nn.Linear(2, 2), lambda o, t: o.sum(), torch.randn(2, 2),
                                          torch.zeros(2), loss_reduction=bad)


def test_functional_use_of_a_parameter_is_detected(grad_totals):
    class TiedHead(nn.Module):
        def __init__(self):
            super().__init__()
            self.enc = nn.Linear(4, 4)

        def forward(self, x):
            return torch.tanh(self.enc(x))

    def loss(model, x):  # the weight is used outside its module, in the loss
        return weighted_square_loss()(model(x) @ model.enc.weight.T, torch.ones(3))

    model = TiedHead()
    with gradhooks.attach(model) as gh:
        loss(model, torch.randn(3, 4)).backward()
        with pytest.raises(gradhooks.GradientMismatchError, match="'enc.weight'.*outside the module"):
            gh.per_sample_grads()
        # the bias is only used through the module, but the error is raised before any result
    with gradhooks.attach(model, check=False) as gh:  # opting out of the check gives numbers
        loss(model, torch.randn(3, 4)).backward()
        assert "enc.weight" in gh.per_sample_grads()


def test_input_modified_in_place_after_forward():
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    with gradhooks.attach(model) as gh:
        weighted_square_loss()(model(x), torch.ones(4)).backward()
        x.mul_(2)  # e.g. a reused input buffer
        with pytest.raises(gradhooks.GradientMismatchError, match="modified in place"):
            gh.per_sample_grads()


def test_input_gradient_only_backward_is_refused(grad_totals):
    model = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    with gradhooks.attach(model) as gh:
        (gx,) = torch.autograd.grad(model(x).pow(2).sum(), x)
        with pytest.raises(gradhooks.GradientMismatchError, match="no gradient"):
            gh.per_sample_grads()


def test_second_attach_is_refused():
    model = nn.Sequential(nn.Linear(2, 2))
    with gradhooks.attach(model):
        with pytest.raises(gradhooks.GradHooksError, match="already hooked"):
            gradhooks.attach(model[0])
        with pytest.raises(gradhooks.GradHooksError, match="detach"):
            gradhooks.compare(model, lambda o, t: o.sum(), torch.randn(2, 2), torch.zeros(2))


def test_backward_through_a_previous_batch_graph():
    model = nn.Linear(2, 2)
    with gradhooks.attach(model):
        out1 = model(torch.randn(3, 2))
        out1.sum().backward(retain_graph=True)
        model(torch.randn(3, 2))  # new batch
        with pytest.raises(gradhooks.GradHooksError, match="before the current batch"):
            out1.sum().backward()


def test_attach_rejects_non_modules():
    with pytest.raises(TypeError, match="nn.Module"):
        gradhooks.attach(lambda x: x)


def test_sum_check_tolerates_float32_rounding_and_names_the_culprit(grad_totals):
    from gradhooks.readers.verify import check_sums
    torch.manual_seed(0)
    a = torch.randn(4096, 300)                # many samples, > 256 coordinates: probed
    b = torch.randn(4096, 7) * 1e-3           # a small parameter next to a large one
    a_sum = a.double().sum(0).float()         # autograd's value, summed in another order
    b_sum = b.double().sum(0).float()
    check_sums([("a", a, a_sum), ("b", b, b_sum)], None)
    check_sums([("a", a, a_sum / 4096)], 4096.0)  # mean reduction: autograd saw sum / B
    with pytest.raises(gradhooks.GradientMismatchError, match="'b'"):
        check_sums([("a", a, a_sum), ("b", b, b_sum + 0.05 * b.abs().sum(0))], None)
    with pytest.raises(gradhooks.GradientMismatchError, match="no gradient for 'a'"):
        check_sums([("a", a, None)], None)
    nan = b.clone()
    nan[3, 2] = float("nan")  # a NaN per-sample value where autograd's gradient is finite
    with pytest.raises(gradhooks.GradientMismatchError, match="'b'"):
        check_sums([("a", a, a_sum), ("b", nan, b_sum)], None)


def test_parameter_of_a_module_whose_forward_never_runs_is_reported(grad_totals):
    class Parent(nn.Module):  # reads its child's weight functionally (like MHA's out_proj)
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 3)
            self.child = nn.Linear(3, 3)

        def forward(self, box):
            return F.linear(self.inner(box.x), self.child.weight, self.child.bias)

    class Box:  # (inputs that hold no tensor gradhooks can see: no provenance, which would
        def __init__(self, x):  # hand the child to the parent's replay, tests/test_dp.py;
            self.x = x  # the sum check's refusal is what remains)

    model = Parent()
    with gradhooks.attach(model) as gh:
        # (a linear loss: a non-linear one on an output provenance never saw is refused first)
        model(Box(torch.randn(4, 3))).sum().backward()
        with pytest.raises(gradhooks.GradientMismatchError, match="'child.weight', 'child.bias'.*saw no call"):
            gh.per_sample_grads()


def test_sum_check_runs_once_per_structure_and_again_when_it_changes():
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2)).double()
    calls = []
    import gradhooks.readers.verify as per_sample_mod  # (where the per-sample read's check is judged)
    real = per_sample_mod.check_sums
    per_sample_mod.check_sums = lambda *a, **k: (calls.append(1), real(*a, **k))[1]
    try:
        with gradhooks.attach(model, loss_reduction="sum") as gh:
            for _ in range(3):
                (model(torch.randn(5, 3, dtype=torch.float64)) ** 2).sum().backward()
                gh.per_sample_grads()
            # same structure: checked once (the signature's first planned forward runs the
            # analysed forward's ops: SumCheck.forward_end)
            assert len(calls) == 1
            x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
            out = model(x)
            torch.autograd.grad(out.sum(), x, retain_graph=True)  # a new structure ...
            (out ** 2).sum().backward()
            with pytest.raises(gradhooks.GradientMismatchError):  # ... is checked, and caught
                gh.per_sample_grads()
        with gradhooks.attach(model, loss_reduction="sum", check="always") as gh:
            for _ in range(3):
                (model(torch.randn(5, 3, dtype=torch.float64)) ** 2).sum().backward()
                gh.per_sample_grads()
        assert len(calls) == 2 + 3
    finally:
        per_sample_mod.check_sums = real
    with pytest.raises(ValueError, match="check must be"):
        gradhooks.attach(model, check="sometimes")
