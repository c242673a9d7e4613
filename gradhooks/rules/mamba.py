"""Rule for the selective state-space mixer of Mamba (transformers' ``MambaMixer``; Gu & Dao
2023, arXiv:2312.00752, sec. 3.2 and alg. 2).

The mixer's ``in_proj``, ``x_proj`` and ``out_proj`` are ``nn.Linear`` modules it calls, hooked by
their own rule. The rest of its parameters it reads itself: ``conv1d.weight``/``.bias`` in a
functional depthwise causal convolution, ``dt_proj.weight``/``.bias`` in a matmul and the scan's
``delta_bias``, and the raw ``A_log`` and ``D`` in the scan. This rule claims those six (so
``conv1d`` and ``dt_proj`` are not hooked themselves, and nothing is handed to the
``torch.func`` fallback).

Index conventions: ``n`` sample, ``t`` time step (token), ``i`` inner channel (``I`` =
``intermediate_size``), ``k`` conv tap (``K`` = ``conv_kernel``), ``r`` time-step rank, ``j``
state (``S`` = ``state_size``). Forward of one call on ``x`` ``(B, T, H)`` (the transformers slow
path, which this rule replays op for op)::

    h, z      = split(in_proj(x))                              (B, I, T) each
    c[n,i,t]  = sum_k w[i,k] hpad[n,i,t+k] + b_c[i]            causal depthwise conv, K-1 zeros left
    u         = silu(c)
    dt_r, Bm, Cm = split(x_proj(u))                            (B, T, R), (B, T, S), (B, T, S)
    q[n,i,t]  = sum_r W_dt[i,r] dt_r[n,t,r]                     (the "time_step")
    Δ         = softplus(q + b_dt)
    A         = -exp(A_log)                                    (I, S)
    s_t       = exp(Δ_t A) * s_{t-1} + Δ_t Bm_t u_t            s_0 = 0, (B, I, S)
    y_t       = s_t Cm_t + D u_t;   out = out_proj(y * silu(z))

With ``g_c = dL/dc``, ``g_q = dL/dq``, and ``A``, ``D`` taken per sample (``A_n = A``,
``D_n = D``: ``g_A[n] = dL/dA_n``, ``g_D[n] = dL/dD_n``)::

    dL_n/dconv1d.weight[i,0,k] = sum_t g_c[n,i,t] hpad[n,i,t+k]     dL_n/dconv1d.bias = sum_t g_c[n]
    dL_n/ddt_proj.weight       = g_q[n] dt_r[n]                       dL_n/ddt_proj.bias = sum_t g_q[n]
    dL_n/dA_log                = g_A[n] * A                           dL_n/dD = g_D[n]

The rule replays the call once, batched (no ``vmap``), from the recorded input with the
parameters detached: ``c`` and ``A_n``, ``D_n`` (``A``, ``D`` expanded to the batch, no copy) are
leaves, and one ``torch.autograd.grad`` of the replayed output against the recorded grad_output
gives ``g_c``, ``g_q``, ``g_A``, ``g_D``. Cost: about one forward and backward of the mixer
without its weight gradients (the fallback's replay costs the same per sample, vmapped, plus the
weight gradients of every parameter it covers). Measured (CPU, one thread, a shared machine:
medians of 5) on a 2-layer MambaForCausalLM (hidden 64, state 8, B = 8, T = 64), forward,
backward and ``per_sample_grads()``: 0.85 s with this rule, 1.91 s with the fallback, 0.42 s
for the forward and backward alone; Mamba-2 (:mod:`gradhooks.rules.mamba2`; 8 heads, chunk 16):
0.16 s, 0.22 s, 0.10 s. Taking ``g_c``, ``g_q``, ``g_A``, ``g_D`` from the model's own backward
instead of a replay needs several internal nodes per call (:meth:`LayerRule.internal` names one). The float32 casts of the slow path are kept
(``A`` and ``D`` in float32, the scan's ``Δ Bm u`` in float32), so at float64 the results agree
with a loop to float32's precision.

Calls the rule refuses (:class:`~gradhooks.base.errors.UnsupportedCallError` at the forward): a
call with a cache (generation: the conv and state caches carry earlier steps; pass
``use_cache=False``). The fused CUDA kernels (``mamba_ssm``, ``causal_conv1d``; taken in training
mode when installed) compute the same function with other rounding.
"""
from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.errors import BatchSizeError, UnsupportedCallError
from ..base.registry import Call, LayerRule

__all__ = ["MambaMixerRule"]

_PARAMS = ("A_log", "D", "conv1d.weight", "conv1d.bias", "dt_proj.weight", "dt_proj.bias")


def _masked(h: Tensor, mask: Optional[Tensor]) -> Tensor:
    # transformers' apply_mask_to_padding_states: padding tokens zeroed, (B, T, C) * (B, T)
    return h if mask is None else (h * mask[:, :, None]).to(h.dtype)


def _replay(module: nn.Module, x: Tensor, mask: Optional[Tensor], per_sample: bool
            ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The mixer's output ``(B, T, H)`` on ``x`` and the tensors the gradients are read at.

    With ``per_sample``, the parameters are detached, the conv output ``c`` is a leaf and ``A``,
    ``D`` are leaves expanded to ``(B, I, S)``, ``(B, I)``; otherwise the module's parameters are
    used as they are (the probe's formula). Returns ``(out, saved)`` with ``saved`` holding
    ``h`` (the conv input), ``c``, ``dt_r`` ``(B, T, R)``, ``q``, ``A``, ``D``.
    """
    p = {n: t.detach() if per_sample else t for n, t in module.named_parameters()}
    dtype, n, length = x.dtype, x.shape[0], x.shape[1]
    proj = F.linear(_masked(x, mask), p["in_proj.weight"], p.get("in_proj.bias")).transpose(1, 2)
    A = -torch.exp(p["A_log"].float())
    D = p["D"].float()
    h, gate = proj.chunk(2, dim=1)
    w = p["conv1d.weight"].squeeze(1)  # (I, K)
    h_in = h.to(w.dtype)
    c = F.conv1d(h_in, w.unsqueeze(1), p.get("conv1d.bias"), padding=w.shape[-1] - 1,
                 groups=h.shape[1])[:, :, :length]
    if per_sample:
        c = c.detach().requires_grad_()
        A = A.expand(n, *A.shape).requires_grad_()
        D = D.expand(n, *D.shape).requires_grad_()
    u = (c if module.activation is None else module.act(c)).to(h.dtype)
    u = _masked(u.transpose(1, 2), mask)  # (B, T, I)
    rank, states = module.time_step_rank, module.ssm_state_size
    dt_r, b_m, c_m = torch.split(F.linear(u, p["x_proj.weight"], p.get("x_proj.bias")),
                                 [rank, states, states], dim=-1)
    q = p["dt_proj.weight"] @ dt_r.transpose(1, 2)  # (B, I, T)
    b_dt = p.get("dt_proj.bias")
    y = _scan(u.transpose(1, 2), q, A, b_m, c_m, D, gate, None if b_dt is None else b_dt.float())
    out = F.linear(y.transpose(1, 2).to(dtype), p["out_proj.weight"], p.get("out_proj.bias"))
    return out, {"h": h_in, "c": c, "dt_r": dt_r, "q": q, "A": A, "D": D}


def _conv_grads(g_c: Optional[Tensor], h: Tensor, params: Dict[str, Tensor],
                names: Iterable[str]) -> Dict[str, Tensor]:
    """Per-sample gradients of the causal depthwise ``conv1d`` (``K - 1`` zeros on the left,
    the first ``T`` outputs kept) from ``g_c = dL/dc`` ``(B, C, T)`` and its input ``h``
    ``(B, C, T)``: ``weight`` ``(B, C, 1, K)`` = ``sum_t g_c[n,c,t] hpad[n,c,t+k]`` (one product
    per channel: no cross-group product), ``bias`` ``(B, C)`` = ``sum_t g_c``."""
    out = {}
    if "conv1d.weight" in names:
        k = params["conv1d.weight"].shape[-1]
        windows = F.pad(h, (k - 1, 0)).unfold(2, k, 1)  # (B, C, T, K), a view
        out["conv1d.weight"] = torch.einsum("nit,nitk->nik", g_c, windows).unsqueeze(2)
    if "conv1d.bias" in names:
        out["conv1d.bias"] = g_c.sum(2)
    return out


def _scan(u: Tensor, q: Tensor, A: Tensor, b_m: Tensor, c_m: Tensor, D: Tensor, gate: Tensor,
          delta_bias: Optional[Tensor]) -> Tensor:
    """transformers' ``mamba_selective_scan`` (sequential path, ``delta_softplus=True``), with
    ``A`` ``(I, S)`` or per sample ``(B, I, S)`` and ``D`` ``(I,)`` or ``(B, I)``.

    ``u``, ``q``, ``gate``: ``(B, I, T)``; ``b_m``, ``c_m``: ``(B, T, S)``. Returns ``(B, I, T)``.
    """
    dt = q if delta_bias is None else q + delta_bias.to(q.dtype)[..., None]
    dt = F.softplus(dt)
    a4 = A[None, :, None, :] if A.dim() == 2 else A[:, :, None, :]
    d3 = D[None, :, None] if D.dim() == 1 else D[:, :, None]
    discrete_a = torch.exp(a4 * dt[:, :, :, None])
    delta_b_u = dt[:, :, :, None] * b_m[:, None, :, :].float() * u[:, :, :, None].float()
    state = torch.zeros(u.shape[0], u.shape[1], A.shape[-1], dtype=u.dtype, device=u.device)
    outs = []
    for t in range(u.shape[2]):
        state = discrete_a[:, :, t] * state + delta_b_u[:, :, t]
        outs.append(torch.matmul(state.to(u.dtype), c_m[:, t, :].unsqueeze(-1))[:, :, 0])
    y = torch.stack(outs, dim=-1) if outs else u.new_zeros(u.shape)
    return (y + u * d3) * F.silu(gate)


class MambaMixerRule(LayerRule):
    """transformers' ``MambaMixer`` (Mamba-1): per-sample gradients of ``A_log`` ``(I, S)``,
    ``D`` ``(I,)``, ``conv1d.weight`` ``(I, 1, K)``, ``conv1d.bias`` ``(I,)``,
    ``dt_proj.weight`` ``(I, R)``, ``dt_proj.bias`` ``(I,)`` (the module docstring has the
    formulas); ``in_proj``, ``x_proj``, ``out_proj`` keep their own ``nn.Linear`` rule.

    ``multi_io``: ``a`` is the call (``hidden_states`` ``(B, T, H)``, batch first, and
    ``attention_mask`` ``(B, T)`` or ``None``: padding tokens zeroed before ``in_proj`` and
    ``x_proj``, as transformers does), ``g`` the output's grad_output ``(B, T, H)``. Returns
    ``{name: (B, *param.shape)}``. Subclasses (:class:`~gradhooks.rules.mamba2.Mamba2MixerRule`)
    change :meth:`replay`, :meth:`wanted` and :meth:`assemble`.

    Raises:
        BatchSizeError: for an input that is not ``(B, T, H)``.
        UnsupportedCallError: at the forward, for a call with a cache.
    """

    multi_io = True
    param_names = _PARAMS

    def params_of(self, module: nn.Module) -> Dict[str, nn.Parameter]:
        """The parameters the mixer reads itself (dotted names claim ``conv1d``, ``dt_proj``)."""
        own = dict(module.named_parameters())
        return {n: own[n] for n in self.param_names if n in own}

    @staticmethod
    def replay(module: nn.Module, x: Tensor, mask: Optional[Tensor], per_sample: bool
               ) -> Tuple[Tensor, Dict[str, Tensor]]:
        """The module's output and the tensors the gradients are read at (:func:`_replay`)."""
        return _replay(module, x, mask, per_sample)

    def wanted(self, names: Tuple[str, ...]) -> Dict[str, bool]:
        """Which of the replay's tensors the wanted parameters need the gradients of."""
        return {"c": any(n.startswith("conv1d.") for n in names),
                "q": any(n.startswith("dt_proj.") for n in names),
                "A": "A_log" in names, "D": "D" in names}

    def assemble(self, s: Dict[str, Tensor], got: Dict[str, Tensor], params: Dict[str, Tensor],
                 names: Tuple[str, ...]) -> Dict[str, Tensor]:
        """``{name: (B, *param.shape)}`` from the replay's tensors ``s`` and their gradients."""
        result = _conv_grads(got.get("c"), s["h"], params, names)
        if "dt_proj.weight" in names:
            result["dt_proj.weight"] = torch.bmm(got["q"], s["dt_r"].detach())
        if "dt_proj.bias" in names:
            result["dt_proj.bias"] = got["q"].sum(2)
        if "A_log" in names:
            result["A_log"] = got["A"] * s["A"].detach()
        if "D" in names:
            result["D"] = got["D"]
        return result

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise BatchSizeError(
                f"{type(module).__name__} takes hidden states (B, T, H); got "
                f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
        return x.shape[0]

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options: Dict[str, object]) -> None:
        cache = args[1] if len(args) > 1 else kwargs.get("cache", kwargs.get("cache_params"))
        if cache is not None:
            raise UnsupportedCallError(
                f"{type(module).__name__} called with a cache (generation, or an eval-mode forward with "
                "use_cache=True): its conv and state caches carry earlier calls, which per-sample "
                "gradients of this call do not see; call the model with use_cache=False")

    @staticmethod
    def _inputs(a: Call) -> Tuple[Tensor, Optional[Tensor]]:
        x = a.args[0] if a.args else a.kwargs["hidden_states"]
        mask = a.args[2] if len(a.args) > 2 else a.kwargs.get("attention_mask")
        return x, mask

    def per_sample_grads(self, module: nn.Module, a: Call, g, batch_first: bool,
                         names: Iterable[str]) -> Dict[str, Tensor]:
        names = tuple(names)
        x, mask = self._inputs(a)
        params = self.params_of(module)
        if g is None or x.shape[0] == 0:
            return {n: params[n].new_zeros(x.shape[0], *params[n].shape) for n in names}
        w = module.in_proj.weight
        if x.dtype != w.dtype:  # (recorded under autocast: replayed in the weights' dtype)
            x = x.to(w.dtype)
        with torch.enable_grad():
            out, s = self.replay(module, x, mask, per_sample=True)
            keys = [k for k, on in self.wanted(names).items() if on]
            grads = torch.autograd.grad(out, [s[k] for k in keys], g.to(out.dtype),
                                        allow_unused=True)
        got = {k: torch.zeros_like(s[k]) if t is None else t for k, t in zip(keys, grads)}
        result = self.assemble(s, got, params, names)
        return {n: result[n].to(params[n].dtype).contiguous() for n in names}

    def formula(self, module: nn.Module, x: Tensor) -> Tensor:
        """The slow path's output on ``x`` ``(B, T, H)``, as the rule replays it."""
        return self.replay(module, x, None, per_sample=False)[0]

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, 3, H)`` in ``in_proj``'s dtype, or ``None`` unless the module has the layout of
        transformers' ``MambaMixer``."""
        own = dict(module.named_parameters())
        need = ("A_log", "D", "conv1d.weight", "in_proj.weight", "x_proj.weight",
                "dt_proj.weight", "out_proj.weight")
        if (any(n not in own for n in need) or own["A_log"].dim() != 2
                or not all(hasattr(module, n) for n in ("time_step_rank", "ssm_state_size",
                                                        "activation", "act"))
                or not isinstance(module.conv1d, nn.Conv1d)
                or set(own) - set(need) - {"conv1d.bias", "dt_proj.bias", "in_proj.bias",
                                           "x_proj.bias", "out_proj.bias"}):
            return None
        w = own["in_proj.weight"]
        return torch.randn(2, 3, w.shape[1], dtype=w.dtype, device=w.device)
