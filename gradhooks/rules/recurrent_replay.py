"""The replay of torch's recurrent layers behind :mod:`gradhooks.rules.recurrent`: every
step's states and gates from the recorded call, backpropagation through time by hand, and the
per-sample contractions (the method, the forward equations and the index conventions are in
that module's docstring; this module is its math, apart from the rules that say when it runs,
as BackPACK keeps ``core/derivatives`` apart from its extensions).

Entry points: :func:`run` (replay one call of an ``nn.LSTM`` / ``nn.GRU`` / ``nn.RNN`` or a
cell and form its per-sample gradient blocks), :func:`weights_of` (a layer's weights of one
layer and direction), :func:`call_inputs`, :func:`replay_dtype`, :func:`unbatched_error` and
:class:`Output` (the recorded output, checked for in-place changes).
"""
from __future__ import annotations

import functools
from typing import Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from ..base.errors import BatchSizeError
from ..base.registry import Block, Call
from ..base.torch_internals import version
from ..base.utils import compute_dtype

__all__ = ["Output", "run", "weights_of", "call_inputs", "replay_dtype", "unbatched_error", "Sizes"]

Sizes = Optional[List[int]]  # active samples per replayed step; None: all B at every step


class _Weights(NamedTuple):
    """One layer and direction, in the compute dtype: ``w_ih`` ``(G, I)``, ``w_hh`` ``(G, P)``,
    ``b_ih``/``b_hh`` ``(G,)`` or ``None``, ``w_hr`` ``(P, H)`` or ``None``; ``names`` maps
    ``"w_ih"``... to the module's parameter names."""

    w_ih: Tensor
    w_hh: Tensor
    b_ih: Optional[Tensor]
    b_hh: Optional[Tensor]
    w_hr: Optional[Tensor]
    names: Dict[str, str]


class Output:
    """A recorded output sequence and its version at the forward: not a pytree node, so the
    hook manager's in-place check of the inputs does not see it (:meth:`RecurrentRule.internal`)."""

    __slots__ = ("data", "version")

    def __init__(self, data: Tensor):
        self.data, self.version = data, version(data)

    def intact(self) -> bool:
        """Whether the output was not modified in place since the forward."""
        return version(self.data) == self.version


class _Tape(NamedTuple):
    """What the replay of one layer and direction keeps, in replay order (``K`` steps)."""

    x: Tensor               # (K, B, I) the layer input
    hprev: Tensor           # (K, B, P) the state each step starts from (h0 where a sample starts)
    act: Tensor             # (K, B, G) gate activations (LSTM: i, f, g, o, overwritten by its backprop; GRU: r, z, n; RNN: h)
    cs: Optional[Tensor]    # LSTM: (K+1, B, H) cell states; cs[0] = c0, cs[k+1] after step k
    aux: Optional[Tensor]   # LSTM: (K, B, H) tanh(c_t); GRU: (K, B, H) W_hn h_{t-1} + b_hn
    ms: Optional[Tensor]    # LSTM with proj_size: (K, B, H) m_t = o_t * tanh(c_t)


def _steps(t: Tensor, sizes: Sizes) -> List[Tensor]:
    """``t[k, :sizes[k]]`` for every step ``k`` (views)."""
    steps = t.unbind(0)
    return list(steps) if sizes is None else [s[:b] for s, b in zip(steps, sizes)]


def _tanh_(t: Tensor) -> Tensor:
    """``t.tanh_()``, on CPU computed as ``2 σ(2t) - 1``: torch's CPU tanh is about 5x slower
    than its sigmoid (measured: 152 vs 30 µs for 65k float32 values, AVX512); the result is
    within 2e-7 (float32) of tanh."""
    if t.device.type != "cpu":
        return t.tanh_()
    return t.mul_(2).sigmoid_().mul_(2).sub_(1)


# --------------------------------------------------------------------------- replay
_KERNELS = {"LSTM": torch.lstm, "GRU": torch.gru, "RNN_TANH": torch.rnn_tanh, "RNN_RELU": torch.rnn_relu}


def _layer_output(mode: str, dirs: List[_Weights], x: Tensor, lengths: Optional[Tensor],
                  h0: Tensor, c0: Optional[Tensor]) -> Tensor:
    """Output ``(T, B, D*P)`` of one layer (all directions) on ``x`` ``(T, B, I)`` from ``h0``
    ``(D, B, P)`` (``c0`` ``(D, B, H)``), computed by torch's own recurrent kernel (what the
    module runs, without dropout); ``lengths`` ``(B,)`` (sorted, CPU) for packed input, where
    the output is zero past each sample's length."""
    params = [t for w in dirs for t in (w.w_ih, w.w_hh, w.b_ih, w.b_hh, w.w_hr) if t is not None]
    # (hx, params, has_biases, num_layers, dropout, train, bidirectional)
    args = ((h0, c0) if mode == "LSTM" else h0, params, dirs[0].b_ih is not None, 1, 0.0, False,
            len(dirs) == 2)
    if lengths is None:
        return _KERNELS[mode](x, *args, False)[0]
    packed = pack_padded_sequence(x, lengths)
    out = _KERNELS[mode](packed.data, packed.batch_sizes, *args)[0]
    return pad_packed_sequence(PackedSequence(out, packed.batch_sizes), total_length=x.shape[0])[0]


def _tape(mode: str, w: _Weights, x: Tensor, hprev: Tensor, c0: Optional[Tensor],
          sizes: Sizes) -> _Tape:
    """The gates of one layer and direction for all steps at once, given the state each step
    starts from (``hprev`` ``(K, B, P)``, replay order): two matmuls and elementwise ops; only
    the LSTM cell state ``c_t = f_t c_{t-1} + i_t g_t`` is a loop over steps (elementwise)."""
    K, B = x.shape[0], x.shape[1]
    G = w.w_hh.shape[0]
    bias = w.b_ih
    if mode != "GRU" and w.b_hh is not None:  # the hh bias adds like the ih bias (not for GRU's n)
        bias = w.b_hh if bias is None else bias + w.b_hh

    def affine(a: Tensor, weight: Tensor, b: Optional[Tensor]) -> Tensor:
        """``a @ weight^T + b`` over all steps: ``(K, B, G)``."""
        a2 = a.reshape(K * B, a.shape[2])
        out = torch.mm(a2, weight.t()) if b is None else torch.addmm(b, a2, weight.t())
        return out.view(K, B, G)

    xp = affine(x, w.w_ih, bias)
    cs = aux = ms = None
    if mode == "GRU":
        H = G // 3
        hh = affine(hprev, w.w_hh, w.b_hh)
        act = torch.empty_like(xp)
        torch.add(xp[..., : 2 * H], hh[..., : 2 * H], out=act[..., : 2 * H]).sigmoid_()
        _tanh_(torch.addcmul(xp[..., 2 * H:], act[..., :H], hh[..., 2 * H:], out=act[..., 2 * H:]))
        aux = hh[..., 2 * H:]
        return _Tape(x, hprev, act, cs, aux, ms)
    act = xp.view(K * B, G).addmm_(hprev.reshape(K * B, -1), w.w_hh.t()).view(K, B, G)
    if mode != "LSTM":
        _tanh_(act) if mode == "RNN_TANH" else act.relu_()
        return _Tape(x, hprev, act, cs, aux, ms)
    H = G // 4
    act[..., : 2 * H].sigmoid_()
    _tanh_(act[..., 2 * H: 3 * H])
    act[..., 3 * H:].sigmoid_()
    i, f, g, o = act.chunk(4, -1)
    cs = (torch.empty if sizes is None else torch.zeros)(K + 1, B, H, dtype=x.dtype, device=x.device)
    cs[0] = c0
    c_s = _steps(cs, None)
    for k, (f_k, ig_k) in enumerate(zip(_steps(f, sizes), _steps(i * g, sizes))):
        b = ig_k.shape[0]
        if b == B:
            torch.addcmul(ig_k, f_k, c_s[k], out=c_s[k + 1])
        else:  # samples whose sequence has not started / has ended keep their state
            torch.addcmul(ig_k, f_k, c_s[k][:b], out=c_s[k + 1][:b])
            c_s[k + 1][b:] = c_s[k][b:]
    aux = _tanh_(cs[1:].clone())
    ms = o * aux if w.w_hr is not None else None
    return _Tape(x, hprev, act, cs, aux, ms)


# --------------------------------------------------------------------------- backprop through time
def _backprop(mode: str, w: _Weights, tape: _Tape, sizes: Sizes, gout: Optional[Tensor],
              gh: Optional[Tensor], gc: Optional[Tensor],
              c_total: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """Backpropagation through time over a replayed layer and direction.

    Args:
        gout: ``(K, B, P)`` grad of the layer's output per step (replay order, zero at inactive
            steps) or ``None``.
        gh, gc: ``(B, P)`` / ``(B, H)`` grad of the final ``h`` / ``c`` or ``None`` (zero).
        c_total: ``gc`` already holds the path through the final ``h`` (see
            :func:`_lstm_cell_h_uses_c`), so it is not added again at the last step.

    Returns:
        ``δ^ih`` ``(K, B, G)``, ``δ^hh`` ``(K, B, G)`` (the same tensor except for GRU), and
        ``dL/dh_t`` ``(K, B, P)`` (the total gradient of each step's state; ``None`` for an
        LSTM without projection, which does not need it); zero at inactive rows.
    """
    K, B = tape.act.shape[0], tape.act.shape[1]
    G, P = w.w_hh.shape
    alloc = torch.empty if sizes is None else torch.zeros
    new = dict(dtype=tape.act.dtype, device=tape.act.device)
    # dhs[k]: gradient w.r.t. the state after step k; rows inactive at step k carry it to the
    # step before (their state is carried), plus the output grad of that step (zero if inactive).
    # An LSTM without projection on whole sequences needs only the last one (_backprop_lstm).
    only_last = mode == "LSTM" and sizes is None and w.w_hr is None
    delta, dhs = alloc(K, B, G, **new), torch.empty(1 if only_last else K, B, P, **new)
    if gh is None and gout is None:
        dhs[-1].zero_()
    elif gh is None or gout is None:
        dhs[-1].copy_(gout[K - 1] if gh is None else gh)
    else:
        torch.add(gh, gout[K - 1], out=dhs[-1])
    rows = [B] * K if sizes is None else sizes
    outs = _steps(gout, None) if gout is not None else None

    def down(k: int, d: Tensor, carry: Optional[Tuple[Tensor, Tensor]] = None) -> None:
        """dhs[k-1] = gout[k-1] (+ carry[0] * carry[1]) + δ_k W_hh on the rows active at step k;
        the other rows carry dhs[k] (+ gout[k-1])."""
        b = rows[k]
        nxt = dhs[k - 1] if b == B else dhs[k - 1, :b]
        base = None if outs is None else (outs[k - 1] if b == B else outs[k - 1][:b])
        if carry is not None:
            torch.mul(*carry, out=nxt) if base is None else torch.addcmul(base, *carry, out=nxt)
            nxt.addmm_(d, w.w_hh)
        else:
            torch.mm(d, w.w_hh, out=nxt) if base is None else torch.addmm(base, d, w.w_hh, out=nxt)
        if b < B:
            if outs is None:
                dhs[k - 1, b:] = dhs[k, b:]
            else:
                torch.add(dhs[k, b:], outs[k - 1][b:], out=dhs[k - 1, b:])

    if mode == "LSTM":
        return _backprop_lstm(w, tape, sizes, rows, delta, dhs, outs, gc, c_total, down)
    dh_s, d_s = _steps(dhs, sizes), _steps(delta, sizes)
    if mode == "GRU":
        H = G // 3
        r, z, n = tape.act.chunk(3, -1)
        # δ_n = dh (1 - z)(1 - n^2);  δ_z = dh (h_{t-1} - n) z (1 - z);
        # δ_r = δ_n (W_hn h_{t-1} + b_hn) r (1 - r);  δ^hh_n = r δ_n;  dh_{t-1} = dh z + δ^hh W_hh
        k_n = (1 - z) * (1 - n * n)
        k_hh = torch.stack([k_n * tape.aux * r * (1 - r), (tape.hprev - n) * z * (1 - z), k_n * r], 2)
        k_hh = _steps(k_hh, sizes)
        z_s = _steps(z, sizes)
        for k in reversed(range(K)):
            dh, d = dh_s[k], d_s[k]
            torch.mul(dh.unsqueeze(1), k_hh[k], out=d.unflatten(1, (3, H)))
            if k > 0:
                down(k, d, (dh, z_s[k]))
        _mask_inactive(dhs, sizes)
        delta_ih = delta.clone()
        torch.mul(dhs, k_n, out=delta_ih[..., 2 * H:])  # the ih part of n is not gated by r
        return delta_ih, delta, dhs
    h = tape.act
    k_a = _steps(1 - h * h if mode == "RNN_TANH" else (h > 0).to(h.dtype), sizes)
    for k in reversed(range(K)):
        d = torch.mul(dh_s[k], k_a[k], out=d_s[k])
        if k > 0:
            down(k, d)
    return delta, delta, _mask_inactive(dhs, sizes)


def _backprop_lstm(w: _Weights, tape: _Tape, sizes: Sizes, rows: List[int], delta: Tensor,
                   dhs: Tensor, outs: Optional[List[Tensor]], gc: Optional[Tensor],
                   c_total: bool, down) -> Tuple[Tensor, Tensor, Optional[Tensor]]:
    """The LSTM case of :func:`_backprop` (same arguments and results; ``dhs[-1]`` holds the
    gradient w.r.t. the last state, ``down(k, δ_k)`` writes ``dhs[k-1]``; without projection
    and on whole sequences ``dhs`` is that last state's only). ``dL/dh_t`` is
    returned only with a projection (``weight_hr``, the only user), else ``None``.

    Per step (Hochreiter & Schmidhuber 1997; the LSTM backward of Graves 2012, "Supervised
    sequence labelling with recurrent neural networks", sec. 4.6), with ``dm = dL/dm_t``
    (``= dL/dh_t``, or ``dL/dh_t W_hr`` with a projection) and ``dc`` the gradient w.r.t.
    ``c_t`` from the steps after ``t``::

        dc   += dm o (1 - tanh^2 c_t)
        δ     = (dc g i (1 - i), dc c_{t-1} f (1 - f), dc i (1 - g^2), dm tanh(c_t) o (1 - o))
        dc   *= f_t                                    (towards c_{t-1})
        dm'   = dL/dh_{t-1} = gout_{t-1} + δ W_hh      (one matmul)

    The factors that do not depend on the recursion are formed for all steps at once, and
    ``dc`` (three copies) and ``dm`` are kept side by side in one ``(B, 4, H)`` buffer, so that
    ``δ`` is one multiply by the ``(B, 4, H)`` factors: four torch calls per step.
    """
    K, B = tape.act.shape[0], tape.act.shape[1]
    H = w.w_hh.shape[0] // 4
    new = dict(dtype=tape.act.dtype, device=tape.act.device)
    i, f, g, o = tape.act.chunk(4, -1)
    tc = tape.aux  # tanh(c_t)
    # The factors overwrite the gate activations (nothing reads the tape's act afterwards): no
    # second (K, B, 4H) tensor; f is kept as itself for the carry of dc.
    f_s = _steps(f.unsqueeze(2).clone(), sizes)
    k_c = _steps(torch.addcmul(o, o, tc * tc, value=-1).unsqueeze(2), sizes)    # o (1 - tanh^2 c)
    k_g = torch.addcmul(i, i, g * g, value=-1)                                  # i (1 - g^2)
    i.addcmul_(i, i, value=-1).mul_(g)                                          # g i (1 - i)
    g.copy_(k_g)
    del k_g
    f.addcmul_(f, f, value=-1).mul_(tape.cs[:-1])                               # c_{t-1} f (1 - f)
    o.addcmul_(o, o, value=-1).mul_(tc)                                         # tanh(c) o (1 - o)
    k4_s = _steps(tape.act.view(K, B, 4, H), sizes)
    d4_s, d_s = _steps(delta.view(K, B, 4, H), sizes), _steps(delta, sizes)
    state = torch.zeros(B, 4, H, **new)  # (dc, dc, dc, dm)
    dc3, dm, dm1 = state[:, :3], state[:, 3], state[:, 3:4]
    if gc is not None:
        dc3.copy_(gc.unsqueeze(1))
    proj = w.w_hr is not None
    torch.mm(dhs[-1], w.w_hr, out=dm) if proj else dm.copy_(dhs[-1])
    direct = sizes is None and not proj  # dm' straight from the matmul: dhs holds the last only
    for k in reversed(range(K)):
        b = rows[k]
        st, c3, m1 = (state, dc3, dm1) if b == B else (state[:b], dc3[:b], dm1[:b])
        if not (c_total and k == K - 1):
            c3.addcmul_(m1, k_c[k])
        torch.mul(st, k4_s[k], out=d4_s[k])
        if k == 0:
            break
        c3.mul_(f_s[k])
        if direct:
            if outs is None:
                torch.mm(d_s[k], w.w_hh, out=dm)
            else:
                torch.addmm(outs[k - 1], d_s[k], w.w_hh, out=dm)
        else:
            down(k, d_s[k])
            torch.mm(dhs[k - 1], w.w_hr, out=dm) if proj else dm.copy_(dhs[k - 1])
    return delta, delta, (_mask_inactive(dhs, sizes) if proj else None)


def _mask_inactive(t: Tensor, sizes: Sizes) -> Tensor:
    """Zero ``t[k, sizes[k]:]`` in place (steps outside a sample's sequence); returns ``t``."""
    if sizes is not None:
        b = torch.arange(t.shape[1], device=t.device)
        t.mul_((b < torch.tensor(sizes, device=t.device)[:, None]).unsqueeze(-1))
    return t


# --------------------------------------------------------------------------- layers and directions
def _layer_grads(w: _Weights, tape: _Tape, d_ih: Tensor, d_hh: Tensor, dhs: Tensor,
                 names: Iterable[str], order: Optional[Tensor]) -> Dict[str, List[Block]]:
    """Per-sample gradients of one layer and direction's parameters in ``names``, in factored
    form: ``{name: [Block(None, a (B, K, in) or None, g (B, K, out))]}`` with the ``K`` replayed
    steps as shared positions (``sum_t g[t, n] a[t, n]^T``, the canonical form of
    :func:`~gradhooks.base.forms.weight_grad`); ``order`` (``(B,)`` or ``None``) maps the
    replay's sample order to the user's."""
    def user(t: Tensor) -> Tensor:  # (K, B, .) time-major -> (B, K, .) in the user's order
        return (t if order is None else t.index_select(1, order)).transpose(0, 1)

    factors = {"w_ih": (d_ih, tape.x), "w_hh": (d_hh, tape.hprev), "w_hr": (dhs, tape.ms),
               "b_ih": (d_ih, None), "b_hh": (d_hh, None)}
    out = {}
    for role, name in w.names.items():
        if name in names:
            g, a = factors[role]
            out[name] = [Block(None, None if a is None else user(a), user(g))]
    return out


def _state_before(out: Tensor, h0: Tensor, sizes: Sizes) -> Tensor:
    """``(K, B, P)``: the state each replayed step starts from, given the states after each step
    ``out`` ``(K, B, P)`` (replay order, zero where inactive): the previous step's, or ``h0``
    ``(B, P)`` at a sample's first step (step 0, or later for a short sequence run in reverse)."""
    hprev = torch.cat([h0[None], out[:-1]])
    if sizes is not None and sizes[-1] > sizes[0]:  # samples start at the step where they join
        B = out.shape[1]
        before = torch.tensor([B] + sizes[:-1], device=out.device)  # active the step before
        joined = torch.arange(B, device=out.device) >= before[:, None]
        hprev = torch.where(joined.unsqueeze(-1), h0, hprev)
    return hprev


def run(mode: str, layers: List[List[_Weights]], x: Tensor, lengths: Optional[Tensor], h0: Tensor,
         c0: Optional[Tensor], gout: Optional[Tensor], gh: Optional[Tensor], gc: Optional[Tensor],
         names: Tuple[str, ...], order: Optional[Tensor] = None,
         cell: bool = False, top: Optional[Tensor] = None) -> Dict[str, Tensor]:
    """Replay every layer bottom-up, backpropagate top-down, contract per sample.

    Args:
        layers: ``[layer][direction]`` weights (direction 1 = reverse).
        x: ``(T, B, I)`` the input, time-major (zero-padded and sorted by length for a
            PackedSequence).
        lengths: ``(B,)`` sequence lengths (CPU, sorted, descending) or ``None`` when all are T.
        h0, c0: ``(L*D, B, P)`` / ``(L*D, B, H)`` initial states (``c0`` LSTM only).
        gout: ``(T, B, D*P)`` grad of the output (zero past each length), or ``None``; gh, gc:
            like ``h0`` / ``c0``, or ``None``.
        order: see :func:`_layer_grads`.
        cell: a cell call (``T = 1``): its output is not needed to replay it, and for an LSTM
            cell the recorded ``gc`` may be a total derivative (:func:`_lstm_cell_h_uses_c`).
        top: ``(T, B, D*P)`` the last layer's output as the forward computed it (recorded, zero
            past each length), or ``None``: replayed with torch's kernel like the other layers.

    Returns:
        ``{name: [Block]}`` (:func:`_layer_grads`) for the parameters in ``names``.
    """
    T, B = x.shape[0], x.shape[1]
    D = len(layers[0])
    sizes = None if lengths is None else (lengths[None, :] > torch.arange(T)[:, None]).sum(1).tolist()
    # sizes[t]: samples active at time t (PackedSequence.batch_sizes)
    lowest = min(k for k, dirs in enumerate(layers) for w in dirs
                 if set(w.names.values()) & set(names))  # no backprop below the lowest one wanted

    def rev(t: Optional[Tensor], d: int) -> Optional[Tensor]:  # time order <-> replay order
        return t.flip(0) if d == 1 and t is not None else t

    def at(t: Optional[Tensor], j) -> Optional[Tensor]:  # layer / direction j of a (L*D, B, .) state
        return None if t is None else t[j]

    def steps(d: int) -> Sizes:
        return sizes if d == 0 or sizes is None else sizes[::-1]

    tapes, inp = {}, x
    for k, dirs in enumerate(layers):
        j = slice(k * D, (k + 1) * D)
        if cell:
            out = None
        elif top is not None and k == len(layers) - 1:
            out = top
        else:
            out = _layer_output(mode, dirs, inp, lengths, h0[j], at(c0, j))
        if k >= lowest:  # layers below only feed the next one
            tapes[k] = []
            for d, w in enumerate(dirs):
                P, start = w.w_hh.shape[1], h0[k * D + d]
                hprev = start[None] if cell else _state_before(rev(out[..., d * P:(d + 1) * P], d),
                                                                start, steps(d))
                tapes[k].append(_tape(mode, w, rev(inp, d), hprev, at(c0, k * D + d), steps(d)))
        inp = out
    result: Dict[str, List[Block]] = {}
    for k in reversed(range(lowest, len(layers))):
        gx = None
        for d, (w, tape) in enumerate(zip(layers[k], tapes[k])):
            P = w.w_hh.shape[1]
            g = None if gout is None else rev(gout[..., d * P:(d + 1) * P], d)
            j = k * D + d
            c_total = cell and gc is not None and _lstm_cell_h_uses_c(x.device, x.dtype)
            d_ih, d_hh, dhs = _backprop(mode, w, tape, steps(d), g, at(gh, j), at(gc, j), c_total)
            result.update(_layer_grads(w, tape, d_ih, d_hh, dhs, names, order))
            if k > lowest:
                K, _, G = d_ih.shape
                gxd = rev(torch.mm(d_ih.view(K * B, G), w.w_ih).view(K, B, -1), d)
                gx = gxd if gx is None else gx.add_(gxd)
        gout = gx
    return result


def weights_of(module: nn.Module, suffix: str, dtype: torch.dtype) -> _Weights:
    """The parameters ``weight_ih{suffix}`` ... of ``module``, detached, in ``dtype``."""
    roles = {"w_ih": "weight_ih", "w_hh": "weight_hh", "b_ih": "bias_ih", "b_hh": "bias_hh",
             "w_hr": "weight_hr"}
    names, tensors = {}, {}
    for role, base in roles.items():
        p = getattr(module, base + suffix, None)
        if p is not None:
            names[role] = base + suffix
        tensors[role] = None if p is None else p.detach().to(dtype)
    return _Weights(names=names, **tensors)


def call_inputs(a: Call) -> Tuple[object, object]:
    """``(input, hx)`` of a recorded ``module(input, hx=None)`` call."""
    x = a.args[0] if a.args else a.kwargs["input"]
    hx = a.args[1] if len(a.args) > 1 else a.kwargs.get("hx")
    return x, hx


def replay_dtype(*items) -> torch.dtype:
    return compute_dtype(*[t for t in items if isinstance(t, Tensor)])


def unbatched_error(module: nn.Module, x) -> BatchSizeError:
    shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
    cell = isinstance(module, nn.RNNCellBase)
    layout = "(B, in)" if cell else "(B, T, in)" if module.batch_first else "(T, B, in)"
    dim = 0 if cell or module.batch_first else 1
    return BatchSizeError(
        f"got an unbatched input of shape {shape}; per-sample gradients need a batch dimension: "
        f"pass {layout} (e.g. x.unsqueeze({dim}))"
    )


@functools.lru_cache(maxsize=None)
def _lstm_cell_h_uses_c(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch.lstm_cell`` (what ``nn.LSTMCell`` calls) on ``device`` computes ``h'`` from
    the ``c'`` tensor it returns.

    The CPU kernel does (``h' = o * tanh(c')`` on the returned ``c'``), so the grad_output the
    hooks record for ``c'`` is the total derivative, already holding the path through ``h'``;
    CUDA's fused kernel returns both from one autograd node, so the recorded grad holds only the
    loss's direct uses of ``c'``. Found out once per device and dtype with a 1x1 cell.
    """
    with torch.enable_grad():
        new = dict(device=device, dtype=dtype)
        x = torch.zeros(1, 1, requires_grad=True, **new)
        w, s = torch.zeros(4, 1, **new), torch.zeros(1, 1, **new)
        h, c = torch.lstm_cell(x, (s, s), w, w)
        return torch.autograd.grad(h.sum(), c, allow_unused=True)[0] is not None


# --------------------------------------------------------------------------- rules
