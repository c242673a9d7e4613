"""Rules for torch's recurrent layers: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells.

Index conventions: ``n`` sample, ``t`` time step (the weight-sharing position ``s`` of
:mod:`gradhooks.readers.per_sample`), ``i`` input feature, ``o`` gate row of a weight. Sizes: ``B``
samples, ``T`` steps, ``H`` hidden size, ``P = proj_size or H`` (the size of ``h``), ``G`` gate
rows, stacked as torch stores them: ``4H`` ``(i, f, g, o)`` for an LSTM, ``3H`` ``(r, z, n)``
for a GRU, ``H`` for an RNN; ``L`` layers, ``D`` directions (2 with ``_reverse`` weights).

Forward equations (the torch docs of ``nn.LSTM``, ``nn.GRU``, ``nn.RNN``), per sample, layer and
direction (the reverse direction runs ``t = T-1, ..., 0``; a ``PackedSequence`` sample of length
``T_n`` runs only its own ``T_n`` steps and its ``h_n`` is its state after them)::

    LSTM  i_t = σ(W_ii x_t + b_ii + W_hi h_{t-1} + b_hi)      c_t = f_t ⊙ c_{t-1} + i_t ⊙ g_t
          f_t = σ(W_if x_t + b_if + W_hf h_{t-1} + b_hf)      m_t = o_t ⊙ tanh(c_t)
          g_t = tanh(W_ig x_t + b_ig + W_hg h_{t-1} + b_hg)   h_t = m_t  (proj_size > 0: h_t = W_p m_t,
          o_t = σ(W_io x_t + b_io + W_ho h_{t-1} + b_ho)                 W_p = weight_hr_l{k})
    GRU   r_t = σ(W_ir x_t + b_ir + W_hr h_{t-1} + b_hr)
          z_t = σ(W_iz x_t + b_iz + W_hz h_{t-1} + b_hz)
          n_t = tanh(W_in x_t + b_in + r_t ⊙ (W_hn h_{t-1} + b_hn))
          h_t = (1 - z_t) ⊙ n_t + z_t ⊙ h_{t-1}
    RNN   h_t = tanh(W_ih x_t + b_ih + W_hh h_{t-1} + b_hh)   (nonlinearity='relu': ReLU)

The input ``x_t`` of layer ``k > 0`` is the output of layer ``k - 1`` (both directions
concatenated); ``h_{-1}`` / ``c_{-1}`` are the given initial states (``h0``, ``c0``), zero when
not given. A cell (``nn.LSTMCell`` ...) is one step of one layer.

Per-sample gradients. Every sample runs its own recurrence, so the gradient of the summed loss
restricted to the rows of sample ``n`` is the gradient of ``L_n``. With ``δ_t`` the gradient of
the loss w.r.t. the gate pre-activations at step ``t`` (``δ^ih`` of ``W_i* x_t + b_i*``, ``δ^hh``
of ``W_h* h_{t-1} + b_h*``; equal for LSTM and RNN, while a GRU's ``n`` block has
``δ^hh_n = r_t ⊙ δ^ih_n``), the weights are shared over time steps and the outer-product form
(Goodfellow 2015, arXiv:1510.01799, sec. 3, summed over shared positions as in
:mod:`gradhooks.readers.per_sample`) gives::

    dL_n/dW_ih = sum_t δ^ih_{n,t} x_{n,t}^T        dL_n/db_ih = sum_t δ^ih_{n,t}
    dL_n/dW_hh = sum_t δ^hh_{n,t} h_{n,t-1}^T      dL_n/db_hh = sum_t δ^hh_{n,t}
    dL_n/dW_p  = sum_t (dL/dh_{n,t}) m_{n,t}^T     (LSTM projection)

Method. The hooks record the call's inputs (``x`` or a ``PackedSequence``, and ``h0`` / ``(h0,
c0)``) and the grad_outputs (of ``output``, ``h_n``, ``c_n``; ``None`` = not reached = zero).
The rule replays the call batched over samples (never per sample), with the module's weights:

1. every step's state ``h_t`` of each layer: the last layer's is the call's output, recorded
   by the forward hook (:meth:`RecurrentRule.internal`); the layers below (and the last one
   if its output was modified in place) are replayed with torch's own kernel (``torch.lstm`` /
   ``gru`` / ``rnn_tanh`` / ``rnn_relu``, one layer at a time, no dropout), which also gives
   the next layer's input;
2. from these, the gate activations of all steps at once: ``W_ih x_t + b_ih`` and
   ``W_hh h_{t-1} + b_hh`` are two matmuls over all steps; only the LSTM cell state
   ``c_t = f_t c_{t-1} + i_t g_t`` is an (elementwise) loop over ``t``;
3. backpropagation through time by hand (Werbos 1990, Proc. IEEE 78(10)) from the recorded
   grad_outputs, layers top-down: a loop over ``t`` with one ``(B, G) x (G, P)`` matmul and a
   few elementwise ops per step, the derivative factors that do not depend on the recursion
   formed for all steps at once; the gradient w.r.t. layer ``k``'s output is
   ``sum_d δ^ih W_ih`` of layer ``k + 1``;
4. the per-sample contractions above, one batched matmul over ``t`` per weight
   (:func:`gradhooks.base.forms.weight_grad`), ``B G (I + P) T`` multiply-adds per layer and
   direction.

Unlike BackPACK's LSTM extension, which assumes a zero initial state, the recorded ``h0`` / ``c0``
are used, and ``h_n`` / ``c_n`` gradients enter at each sample's own last step.

PackedSequence inputs are replayed in the packed (length-sorted) order, zero-padded: at step
``t`` the first ``batch_sizes[t]`` samples are active, the others keep their state. The given
``h0`` and the ``h_n`` / ``c_n`` grad_outputs are in the user's sample order and are permuted
with ``sorted_indices`` as torch does; results are returned in the user's order.

Computation is in float32 at least (bfloat16/float16 under autocast is promoted), so under
autocast the replay is the float32 recurrence. Not supported (typed errors): inter-layer dropout
in training mode (the masks torch drew cannot be replayed) and unbatched inputs.
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Optional

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pad_packed_sequence

from ..base.errors import UnsupportedCallError
from ..base.registry import Block, Call, LayerRule, register_rule
from .recurrent_replay import Output, call_inputs, replay_dtype, run, unbatched_error, weights_of

__all__ = ["RecurrentRule", "RecurrentCellRule"]

@register_rule(nn.LSTM, nn.GRU, nn.RNN)
class RecurrentRule(LayerRule):
    """``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` (tanh / relu), any ``num_layers``, ``bidirectional``,
    ``bias``, ``proj_size``, the module's own ``batch_first``, given or default initial states,
    Tensor or ``PackedSequence`` input.

    ``a`` is the recorded call ``module(input, hx)``; ``g`` the output structure ``(output,
    h_n)`` (LSTM: ``(output, (h_n, c_n))``) holding grad_outputs or ``None``. The global
    ``batch_first`` flag of :func:`gradhooks.attach` is not used: the module's own layout is.

    Returns ``{name: (B, *param.shape)}``, e.g. ``weight_ih_l0``: ``(B, G*H, in)``,
    ``weight_hh_l1_reverse``: ``(B, G*H, P)``, ``weight_hr_l0``: ``(B, P, H)``, ``bias_ih_l0``:
    ``(B, G*H)`` (``G`` = 4 / 3 / 1 gates, ``P = proj_size or hidden_size``), in the user's
    sample order for PackedSequence inputs.
    """

    multi_io = True
    param_names = ()

    def params_of(self, module: nn.Module) -> Dict[str, nn.Parameter]:
        return dict(module.named_parameters(recurse=False))

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options: Dict[str, object]) -> None:
        """Raises :class:`UnsupportedCallError` for inter-layer dropout in training mode."""
        if module.training and module.dropout > 0 and module.num_layers > 1:
            raise UnsupportedCallError(
                f"{type(module).__name__} with dropout={module.dropout} between its "
                f"{module.num_layers} layers in training mode: torch draws the dropout masks "
                f"inside its recurrent kernel and does not expose them, so the layer inputs cannot "
                f"be replayed and per-sample gradients would be wrong. Call module.eval(), or build "
                f"it with dropout=0 and apply nn.Dropout between separate single-layer modules"
            )

    def batch_size(self, module: nn.Module, x, batch_first: bool) -> int:
        """``B`` of a ``(B, T, in)`` / ``(T, B, in)`` input (the module's ``batch_first``) or of a
        PackedSequence; :class:`BatchSizeError` for an unbatched ``(T, in)`` input."""
        if isinstance(x, PackedSequence):
            return int(x.batch_sizes[0])
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise unbatched_error(module, x)
        return x.shape[0 if module.batch_first else 1]

    def output_dims(self, module: nn.Module, args: tuple, output, dim_of=None) -> list:
        """The output sequence (the module's layout, or a packed sequence's rows: those of time
        step ``t`` are the samples ``sorted_indices[:batch_sizes[t]]``) and the final states
        ``(layers * directions, B, H)`` on dim 1, in the samples' order (torch's contract)."""
        y, states = output
        states = states if isinstance(states, tuple) else (states,)
        if isinstance(y, PackedSequence):
            pos = torch.cat([torch.arange(int(n)) for n in y.batch_sizes])
            order = y.sorted_indices
            rows = (pos if order is None else order.cpu()[pos]).to(y.data.device)
            return [(y.data, (rows, int(y.batch_sizes[0])))] + [(h, 1) for h in states]
        if y.dim() != 3:  # (unbatched)
            return []
        return [(y, 0 if module.batch_first else 1)] + [(h, 1) for h in states]

    def internal(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Optional[tuple]:
        """Records the call's output sequence (no autograd node): it is the last layer's
        states ``h_t``, which the rule then need not replay with torch's kernel. Kept with its
        version, out of the inputs' in-place check: if it is modified in place afterwards, the
        rule replays the layer instead."""
        y = output[0]
        data = y.data if isinstance(y, PackedSequence) else y
        if not isinstance(data, Tensor):
            return None
        return None, {"output": Output(data.detach())}

    has_forms = True  # per_sample_grads: LayerRule's, from forms()

    def forms(self, module: nn.Module, a: Call, g, batch_first: bool,
              names: Iterable[str]) -> Dict[str, List[Block]]:
        """Factored form of :meth:`per_sample_grads`: one :class:`~gradhooks.base.forms.Block`
        per parameter, ``a`` the layer input / previous state / cell output ``(B, T, .)``, ``g``
        the gate (or projection) gradients ``(B, T, .)``."""
        x, hx = call_inputs(a)
        g_out, g_state = g
        gh, gc = g_state if module.mode == "LSTM" else (g_state, None)
        if isinstance(g_out, PackedSequence):
            g_out = g_out.data
        h0, c0 = hx if module.mode == "LSTM" and hx is not None else (hx, None)
        data = x.data if isinstance(x, PackedSequence) else x
        dt = replay_dtype(data, module.weight_ih_l0, h0, c0, g_out, gh, gc)
        D, L, H = 1 + module.bidirectional, module.num_layers, module.hidden_size
        P = module.proj_size or H
        lengths = order = None
        if isinstance(x, PackedSequence):
            xs, lengths = pad_packed_sequence(PackedSequence(data, x.batch_sizes))
            if g_out is not None:
                g_out = pad_packed_sequence(PackedSequence(g_out, x.batch_sizes))[0]
            if x.sorted_indices is not None:  # h0 and the h_n / c_n grads are in the user's order
                h0, c0, gh, gc = (None if t is None else t.index_select(1, x.sorted_indices)
                                  for t in (h0, c0, gh, gc))
                order = x.unsorted_indices
            if lengths[-1] == lengths[0]:
                lengths = None
        elif module.batch_first:  # time-major from here on (views: the steps are strided)
            xs = x.transpose(0, 1)
            g_out = None if g_out is None else g_out.transpose(0, 1)
        else:
            xs = x
        B = xs.shape[1]
        top = None
        saved = a.internal.get("output") if a.internal else None
        if saved is not None and saved.intact() and saved.data.dtype == dt:
            top = saved.data  # the output sequence as the forward computed it, time-major
            if isinstance(x, PackedSequence):
                top = pad_packed_sequence(PackedSequence(top, x.batch_sizes), total_length=xs.shape[0])[0]
            elif module.batch_first:
                top = top.transpose(0, 1)
        new = dict(dtype=dt, device=xs.device)
        h0 = torch.zeros(L * D, B, P, **new) if h0 is None else h0.to(dt)
        if module.mode == "LSTM":
            c0 = torch.zeros(L * D, B, H, **new) if c0 is None else c0.to(dt)
        layers = [[weights_of(module, f"_l{k}" + ("_reverse" if d else ""), dt) for d in range(D)]
                  for k in range(L)]
        cast = (lambda t: None if t is None else t.to(dt))
        with torch.no_grad():
            return run(module.mode, layers, xs.to(dt), lengths, h0, c0, cast(g_out), cast(gh),
                        cast(gc), tuple(names), order, top=top)


@register_rule(nn.LSTMCell, nn.GRUCell, nn.RNNCell)
class RecurrentCellRule(LayerRule):
    """``nn.LSTMCell``, ``nn.GRUCell``, ``nn.RNNCell``: one step of the recurrence.

    ``a`` is the recorded call ``cell(input (B, in), hx)`` (``hx`` ``(B, H)``, LSTM ``(h, c)``,
    or ``None`` = zeros); ``g`` the grad_output of ``h'`` (LSTM: ``(h', c')``) or ``None``.
    Returns ``weight_ih`` ``(B, G*H, in)``, ``weight_hh`` ``(B, G*H, H)``, ``bias_ih`` /
    ``bias_hh`` ``(B, G*H)``. A cell called once per time step in a Python loop is one call per
    step; the hook manager sums them per sample.
    """

    multi_io = True
    param_names = ("weight_ih", "weight_hh", "bias_ih", "bias_hh")

    @staticmethod
    def _mode(module: nn.Module) -> str:
        if isinstance(module, nn.LSTMCell):
            return "LSTM"
        if isinstance(module, nn.GRUCell):
            return "GRU"
        return "RNN_TANH" if module.nonlinearity == "tanh" else "RNN_RELU"

    def batch_size(self, module: nn.Module, x, batch_first: bool) -> int:
        """``B`` of a ``(B, in)`` input; :class:`BatchSizeError` for an unbatched ``(in,)`` one."""
        if not isinstance(x, Tensor) or x.dim() != 2:
            raise unbatched_error(module, x)
        return x.shape[0]

    has_forms = True  # per_sample_grads: LayerRule's, from forms()

    def forms(self, module: nn.Module, a: Call, g, batch_first: bool,
              names: Iterable[str]) -> Dict[str, List[Block]]:
        """Factored form of :meth:`per_sample_grads` (``S = 1``)."""
        mode = self._mode(module)
        x, hx = call_inputs(a)
        gh, gc = g if mode == "LSTM" else (g, None)
        h0, c0 = hx if mode == "LSTM" and hx is not None else (hx, None)
        dt = replay_dtype(x, module.weight_ih, h0, c0, gh, gc)
        new = dict(dtype=dt, device=x.device)
        B, H = x.shape[0], module.hidden_size

        def state(t: Optional[Tensor], zero: bool) -> Optional[Tensor]:  # (B, H) -> (1, B, H)
            if t is None:
                return torch.zeros(1, B, H, **new) if zero else None
            return t.to(dt).unsqueeze(0)

        with torch.no_grad():
            return run(mode, [[weights_of(module, "", dt)]], x.to(dt).unsqueeze(0), None,
                        state(h0, True), state(c0, mode == "LSTM"), None, state(gh, False),
                        state(gc, False), tuple(names), cell=True)
