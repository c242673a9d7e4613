"""Rule for the state-space-duality mixer of Mamba-2 (transformers' ``Mamba2Mixer``; Dao & Gu
2024, arXiv:2405.21060, sec. 6 and 7), built like :mod:`gradhooks.rules.mamba`'s Mamba-1 rule.

The mixer's ``in_proj`` and ``out_proj`` (``nn.Linear``) and its ``norm``
(``MambaRMSNormGated``, :class:`~gradhooks.rules.norm_variants.GatedRMSNormRule`) are modules it
calls, hooked by their own rules. It reads itself ``conv1d.weight``/``.bias`` (a functional
causal depthwise convolution) and the raw ``dt_bias``, ``A_log``, ``D`` (the chunked scan): this
rule claims those five.

Index conventions: ``n`` sample, ``t`` token, ``h`` head (``H`` = ``num_heads``), ``p`` channel of
a head (``P`` = ``head_dim``), ``c`` channel of the conv (``I + 2 G S``). Forward on ``x``
``(B, T, D_model)`` (the transformers reference path, replayed op for op)::

    z, xBC, δ  = split(in_proj(x))                 (B, T, I), (B, T, I + 2GS), (B, T, H)
    xBC        = silu(conv(xBC))                   causal depthwise conv; pre-activation c
    x, Bm, Cm  = split(xBC)
    Δ          = clamp(softplus(δ + dt_bias), time_step_limit)
    A          = -exp(A_log)                                              (H,)
    s_t[h]     = exp(Δ_t[h] A[h]) s_{t-1}[h] + Δ_t[h] x_t[h] ⊗ Bm_t       (chunked: SSD)
    y_t[h]     = s_t[h] Cm_t + D[h] x_t[h];   out = out_proj(norm(y, z))

With ``g_c = dL/dc``, ``g_δ = dL/dδ`` and ``A``, ``D`` taken per sample::

    dL_n/dconv1d.weight[c,0,k] = sum_t g_c[n,c,t] cpad[n,c,t+k]     dL_n/dconv1d.bias = sum_t g_c[n]
    dL_n/ddt_bias = sum_t g_δ[n, t]      dL_n/dA_log = g_A[n] * A      dL_n/dD = g_D[n]

from one batched replay of the call with ``c``, ``δ``, ``A_n``, ``D_n`` as leaves (see
:mod:`gradhooks.rules.mamba` for the cost). Calls with a cache are refused as there.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .mamba import MambaMixerRule, _conv_grads, _masked
from .norm_variants import GatedRMSNormRule

__all__ = ["Mamba2MixerRule"]

_GATED = GatedRMSNormRule()


def _pad_time(t: Tensor, pad: int) -> Tensor:
    # transformers' pad_tensor_by_size: pad dim 1 (time) of a 3-D or 4-D tensor at its end
    return F.pad(t, (0, 0, 0, 0, 0, pad, 0, 0) if t.dim() == 4 else (0, 0, 0, pad, 0, 0))


def _chunks(t: Tensor, pad: int, size: int) -> Tensor:
    t = _pad_time(t, pad)
    return t.reshape(t.shape[0], -1, size, *t.shape[2:])


def _segment_sum(t: Tensor) -> Tensor:
    """``out[..., i, j] = sum_{j < k <= i} t[..., k]`` below the diagonal, ``-inf`` above
    (transformers' ``segment_sum``)."""
    size = t.size(-1)
    t = t[..., None].expand(*t.size(), size)
    t = t.masked_fill(~torch.tril(torch.ones(size, size, device=t.device, dtype=torch.bool), -1), 0)
    t = torch.cumsum(t, dim=-2)
    return t.masked_fill(~torch.tril(torch.ones(size, size, device=t.device, dtype=torch.bool), 0),
                         -torch.inf)


def _chunk_scan(x: Tensor, dt: Tensor, A: Tensor, b_m: Tensor, c_m: Tensor, size: int, D: Tensor,
                dt_bias: Optional[Tensor], limit) -> Tensor:
    """transformers' ``mamba2_chunk_scan`` (reference path, ``dt_softplus=True``, no initial
    state), with ``A``, ``D`` ``(H,)`` or per sample ``(B, 1, H)``.

    ``x`` ``(B, T, H, P)``, ``dt`` ``(B, T, H)``, ``b_m``, ``c_m`` ``(B, T, G, S)``. Returns
    ``(B, T, H, P)``."""
    n, length, heads, _ = x.shape
    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    dt = torch.clamp(F.softplus(dt), min=limit[0], max=limit[1])
    x = x.float()
    b_m = b_m.float().repeat_interleave(heads // b_m.shape[2], dim=2, output_size=heads)
    c_m = c_m.float().repeat_interleave(heads // c_m.shape[2], dim=2, output_size=heads)
    pad = (size - length % size) % size
    d_residual = D[..., None] * _pad_time(x, pad)
    x = x * dt[..., None].float()
    A = A.to(x.dtype) * dt.float()
    x, A, b_m, c_m = [_chunks(t, pad, size) for t in (x, A, b_m, c_m)]
    A = A.permute(0, 3, 1, 2)
    a_cum = torch.cumsum(A, dim=-1)
    decay = torch.exp(_segment_sum(A))
    scores = torch.einsum("bclhn,bcshn->bclsh", c_m, b_m) * decay.permute(0, 2, 3, 4, 1)
    y_diag = torch.einsum("bclsh,bcshp->bclhp", scores, x)
    decay_states = torch.exp(a_cum[:, :, :, -1:] - a_cum)
    states = torch.einsum("bclhn,bclhp->bchpn", b_m * decay_states.permute(0, -2, -1, 1)[..., None], x)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(a_cum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)[:, :-1]
    y_off = torch.einsum("bclhn,bchpn->bclhp", c_m, states) * torch.exp(a_cum).permute(0, 2, 3, 1)[..., None]
    y = (y_diag + y_off).contiguous().reshape(n, -1, heads, x.shape[-1]) + d_residual
    return y[:, :length] if pad > 0 else y


def _replay2(module: nn.Module, x: Tensor, mask: Optional[Tensor], per_sample: bool
             ) -> Tuple[Tensor, Dict[str, Tensor]]:
    """The mixer's output ``(B, T, D_model)`` and ``saved``: ``h`` (the conv input), ``c``,
    ``dt`` (before ``dt_bias``), ``A``, ``D`` (leaves with ``per_sample``, as
    :func:`gradhooks.rules.mamba._replay`)."""
    p = {n: t.detach() if per_sample else t for n, t in module.named_parameters()}
    dtype, n, length = x.dtype, x.shape[0], x.shape[1]
    proj = F.linear(_masked(x, mask), p["in_proj.weight"], p.get("in_proj.bias"))
    A, D = -torch.exp(p["A_log"].float()), p["D"]
    inner, heads = module.intermediate_size, module.num_heads
    gate, hbc, dt = proj.split([inner, module.conv_dim, heads], dim=-1)
    w = p["conv1d.weight"].squeeze(1)
    h_in = hbc.transpose(1, 2).to(w.dtype)
    c = F.conv1d(h_in, w.unsqueeze(1), p.get("conv1d.bias"), padding=w.shape[-1] - 1,
                 groups=h_in.shape[1])[:, :, :length]
    if per_sample:
        c, dt = c.detach().requires_grad_(), dt.detach().requires_grad_()
        A = A.expand(n, 1, *A.shape).requires_grad_()
        D = D.expand(n, 1, *D.shape).requires_grad_()
    hbc = _masked((c if module.activation is None else module.act(c)).to(hbc.dtype).transpose(1, 2), mask)
    gs = module.n_groups * module.ssm_state_size
    hs, b_m, c_m = torch.split(hbc, [inner, gs, gs], dim=-1)
    y = _chunk_scan(hs.view(n, length, heads, module.head_dim), dt, A,
                    b_m.view(n, length, module.n_groups, -1), c_m.view(n, length, module.n_groups, -1),
                    module.chunk_size, D, p["dt_bias"], module.time_step_limit)
    y = y.reshape(n, length, -1)
    y = p["norm.weight"] * _GATED.normalised(module.norm, y, gate)
    out = F.linear(y.to(dtype), p["out_proj.weight"], p.get("out_proj.bias"))
    return out, {"h": h_in, "c": c, "dt": dt, "A": A, "D": D}


class Mamba2MixerRule(MambaMixerRule):
    """transformers' ``Mamba2Mixer``: per-sample gradients of ``dt_bias``, ``A_log``, ``D``
    ``(H,)``, ``conv1d.weight`` ``(C, 1, K)``, ``conv1d.bias`` ``(C,)`` (the module docstring has
    the formulas); ``in_proj``, ``out_proj`` and ``norm`` keep their own rules.

    ``a``: the call (``hidden_states`` ``(B, T, D_model)``, ``attention_mask`` ``(B, T)`` or
    ``None``); ``g``: the output's grad_output. Returns ``{name: (B, *param.shape)}``.

    Raises:
        BatchSizeError: for an input that is not ``(B, T, D_model)``.
        UnsupportedCallError: at the forward, for a call with a cache.
    """

    param_names = ("dt_bias", "A_log", "D", "conv1d.weight", "conv1d.bias")

    @staticmethod
    def replay(module: nn.Module, x: Tensor, mask: Optional[Tensor], per_sample: bool
               ) -> Tuple[Tensor, Dict[str, Tensor]]:
        return _replay2(module, x, mask, per_sample)

    def wanted(self, names: Tuple[str, ...]) -> Dict[str, bool]:
        return {"c": any(n.startswith("conv1d.") for n in names), "dt": "dt_bias" in names,
                "A": "A_log" in names, "D": "D" in names}

    def assemble(self, s: Dict[str, Tensor], got: Dict[str, Tensor], params: Dict[str, Tensor],
                 names: Tuple[str, ...]) -> Dict[str, Tensor]:
        result = _conv_grads(got.get("c"), s["h"], params, names)
        if "dt_bias" in names:
            result["dt_bias"] = got["dt"].sum(1)
        if "A_log" in names:
            result["A_log"] = got["A"][:, 0] * s["A"][0, 0].detach()
        if "D" in names:
            result["D"] = got["D"][:, 0]
        return result

    def probe_input(self, module: nn.Module) -> Optional[Tensor]:
        """``(2, 3, D_model)`` in ``in_proj``'s dtype, or ``None`` unless the module has the
        layout of transformers' ``Mamba2Mixer``."""
        own = dict(module.named_parameters())
        need = ("dt_bias", "A_log", "D", "conv1d.weight", "in_proj.weight", "norm.weight",
                "out_proj.weight")
        attrs = ("intermediate_size", "conv_dim", "num_heads", "head_dim", "n_groups",
                 "ssm_state_size", "chunk_size", "time_step_limit", "activation", "act")
        if (any(n not in own for n in need) or own["A_log"].dim() != 1
                or not all(hasattr(module, n) for n in attrs)
                or not isinstance(module.conv1d, nn.Conv1d)
                or not isinstance(getattr(module.norm, "group_size", None), int)
                or set(own) - set(need) - {"conv1d.bias", "in_proj.bias", "out_proj.bias"}):
            return None
        w = own["in_proj.weight"]
        return torch.randn(2, 3, w.shape[1], dtype=w.dtype, device=w.device)
