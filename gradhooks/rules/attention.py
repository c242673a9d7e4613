"""Rule for ``nn.MultiheadAttention`` (and so the attention inside ``nn.Transformer*`` layers).

Index conventions: ``n`` sample, ``l`` query (target) position, ``s`` key/value (source) position,
``h`` head, ``d`` feature within a head (``D = E / H``), ``e`` embedding feature, ``i`` input
feature of a projection (``E``, ``kdim`` or ``vdim``).

Forward (Vaswani et al. 2017, arXiv:1706.03762, sec. 3.2; the semantics of the options are those
of ``torch.nn.functional.multi_head_attention_forward``, torch docs of ``nn.MultiheadAttention``)::

    q[n, l] = W_q x_q[n, l] + b_q      k[n, s] = W_k x_k[n, s] + b_k      v[n, s] = W_v x_v[n, s] + b_v
    k[n, S] = bias_k,  v[n, S] = bias_v                    (add_bias_kv: one appended key position)
    k[n, S'] = 0,      v[n, S'] = 0     per head            (add_zero_attn: another one)
    P[n, h] = softmax_s( q[n, h] k[n, h]^T / sqrt(D) + M[n, h] )   (M: attn_mask + key_padding_mask)
    c[n, l, h] = sum_s P[n, h, l, s] v[n, h, s]                     (heads concatenated: c[n, l] in R^E)
    y[n, l] = W_o c[n, l] + b_o

with ``W_q, W_k, W_v`` the three row blocks of ``in_proj_weight`` (or ``q/k/v_proj_weight`` when
``kdim``/``vdim`` differ from ``embed_dim``) and ``W_o, b_o`` = ``out_proj.weight/bias``. The
module returns ``y`` and, with ``need_weights=True``, ``P`` (averaged over heads unless
``average_attn_weights=False``); the loss may use either.

Per-sample gradients. Each projection is a Linear shared over positions, so with ``gq, gk, gv``
the gradients of the loss w.r.t. ``q, k, v`` and ``gy`` its gradient w.r.t. ``y`` (Goodfellow
2015, arXiv:1510.01799, sec. 3; Rochette et al. 2019, arXiv:1912.06015, sec. 3)::

    dL_n/dW_q = sum_l gq[n, l] x_q[n, l]^T      dL_n/db_q = sum_l gq[n, l]      (same for k, v)
    dL_n/dW_o = sum_l gy[n, l] c[n, l]^T        dL_n/db_o = sum_l gy[n, l]
    dL_n/dbias_k = gk[n, S]                     dL_n/dbias_v = gv[n, S]

``gy`` is recorded. When torch computes the attention core with ``scaled_dot_product_attention``
(``need_weights=False``, no ``bias_k``/``bias_v``, no ``add_zero_attn``: what
``nn.TransformerEncoderLayer`` and ``DecoderLayer`` call), ``gq, gk, gv`` are that node's input
gradients and ``c`` its saved output: the rule finds the node in the call's graph at the forward
(:meth:`MultiheadAttentionRule.internal`) and records them in the backward, without replaying
anything (Transformer block of ``benchmarks/``: per-sample gradients 1.45x the plain step
instead of 1.76x). Otherwise ``gq, gk, gv`` are not visible from outside the module, so the
attention core (everything between the projections and ``out_proj``) is *replayed*, batched, from the recorded
inputs with the projections ``q, k, v`` as leaves, as torch computes it (an explicit softmax when
``need_weights``, otherwise ``scaled_dot_product_attention`` itself, so that its handling of fully
masked rows -- zeros -- is reproduced), and one ``torch.autograd.grad`` call with the recorded
grad_outputs gives ``gq, gk, gv``. Samples are independent in attention (a 3-D ``attn_mask``
carries the batch and is replayed with it), so the batched replay gives every sample's gradient
at once. Attention dropout in training mode draws a mask that cannot be replayed and is refused.

Cost per replayed call, beyond the per-sample products themselves: the three projections once
more and one forward + backward of the attention core (no ``out_proj``, no second pass over the
rest of the model).
"""
from __future__ import annotations

import inspect
import math
from typing import Dict, Iterable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..base.errors import BatchSizeError, UnsupportedCallError
from ..base.registry import Block, Call, LayerRule, register_rule
from ..base.torch_internals import saved

__all__ = ["MultiheadAttentionRule"]

_FORWARD = inspect.signature(nn.MultiheadAttention.forward)
_IN_WEIGHTS = ("q_proj_weight", "k_proj_weight", "v_proj_weight")


def _same(x: Tensor, y: Tensor) -> bool:
    """Whether two recorded (detached) tensors are views of the same values."""
    return (x.data_ptr() == y.data_ptr() and x.shape == y.shape and x.stride() == y.stride()
            and x.dtype == y.dtype)


def _find_node(start, stop: set, prefix: str, limit: int = 64):
    """Breadth-first from the autograd node ``start`` towards the inputs, not past the nodes
    whose ids are in ``stop`` (the module inputs' ``grad_fn``): the first node whose type name
    starts with ``prefix``, or ``None`` (also after ``limit`` nodes)."""
    seen, frontier = set(), [start]
    while frontier and len(seen) < limit:
        node = frontier.pop(0)
        if node is None or id(node) in seen or id(node) in stop:
            continue
        seen.add(id(node))
        if type(node).__name__.startswith(prefix):
            return node
        frontier.extend(f for f, _ in node.next_functions)
    return None


def _from_graph(internal, g_y, g_w, groups, n: int, embed: int, dt):
    """``(c, g_leaves)`` from what :meth:`MultiheadAttentionRule.internal` recorded: the
    attention output ``c`` ``(N, L, E)`` (input of ``out_proj``) and, per group of projections,
    the gradient w.r.t. its output ``(N, L_x, rows)`` -- or ``None`` when the call was not
    recorded that way or a needed gradient is missing (the rule then replays)."""
    if not internal or g_w is not None or g_y is None:
        return None
    grads = internal.get("grad_inputs")
    if grads is None or len(grads) < 3 or any(t is None for t in grads[:3]):
        return None

    def tokens(t: Tensor) -> Tensor:  # (N, H, L, head_dim) -> (N, L, E)
        return t.permute(0, 2, 1, 3).reshape(n, -1, embed).to(dt)

    d = [tokens(t) for t in grads[:3]]
    g_leaves = [d[grp[0]] if len(grp) == 1 else torch.cat([d[i] for i in grp], -1) for grp in groups]
    return tokens(internal["attn_output"]), g_leaves


def _mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A mask as torch's ``_canonical_mask`` makes it: bool ``True`` -> ``-inf``, float added as is."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def attention_core(module: nn.MultiheadAttention, q: Tensor, k: Tensor, v: Tensor,
                   key_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor],
                   need_weights: bool, average_attn_weights: bool,
                   is_causal: bool) -> Tuple[Tensor, Optional[Tensor]]:
    """The attention of ``nn.MultiheadAttention`` between its in- and out-projections, batch first.

    Computes what ``torch.nn.functional.multi_head_attention_forward`` (torch 2.x) computes with
    dropout 0, step by step, in a batch-first ``(N, H, L, D)`` layout instead of torch's
    ``(N*H, L, D)`` (the same values, without the copies): masks canonicalised (bool ``True`` ->
    ``-inf``) and merged as there, ``bias_k``/``bias_v`` already appended to ``k``/``v`` by the
    caller (the masks get a visible column for them), zero attention appended per head, and the
    same kernel choice -- explicit ``softmax(q k^T / sqrt(D) + M) v`` when the weights are
    returned, ``scaled_dot_product_attention`` otherwise, including torch's ``is_causal``
    shortcut (the given ``attn_mask`` is then ignored, as torch ignores it).

    Args:
        module: the layer (``num_heads``, ``add_zero_attn`` are read).
        q: ``(N, L, E)`` projected queries.
        k, v: ``(N, S, E)`` projected keys and values (``S`` includes the ``bias_k`` position).
        key_padding_mask: ``(N, S_in)`` bool or float, or ``None``.
        attn_mask: ``(L, S_in)`` or ``(N*H, L, S_in)``, bool or float, or ``None``.
        need_weights, average_attn_weights, is_causal: as given to the module's forward.

    Returns:
        ``c`` ``(N, L, E)`` (heads concatenated, before ``out_proj``) and the attention weights
        ``(N, L, S')`` or ``(N, H, L, S')`` as the module returns them (``None`` unless
        ``need_weights``).
    """
    n, tgt, embed = q.shape
    heads = module.num_heads
    hd = embed // heads
    dt = q.dtype
    key_padding_mask = _mask(key_padding_mask, dt)
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None  # torch hands is_causal to scaled_dot_product_attention
    else:
        attn_mask = _mask(attn_mask, dt)
        if key_padding_mask is not None:
            is_causal = False
    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    if module.bias_k is not None:  # the caller appended the bias position to k and v
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    # heads: (N, L, E) -> (N, H, L, D), views (torch's (L, N*H, D) layout holds the same values)
    q, k, v = (t.view(n, t.shape[1], heads, hd).transpose(1, 2) for t in (q, k, v))
    if module.add_zero_attn:
        zeros = q.new_zeros(n, heads, 1, hd)
        k, v = torch.cat([k, zeros], 2), torch.cat([v, zeros], 2)
        attn_mask = None if attn_mask is None else F.pad(attn_mask, (0, 1))
        key_padding_mask = None if key_padding_mask is None else F.pad(key_padding_mask, (0, 1))
    src = k.shape[2]
    if attn_mask is not None:  # (1 or N*H, L, S) -> (1 or N, 1 or H, L, S)
        attn_mask = attn_mask.unsqueeze(0) if attn_mask.shape[0] == 1 else attn_mask.view(n, heads, tgt, src)
    if key_padding_mask is not None:
        kpm = key_padding_mask.view(n, 1, 1, src)
        attn_mask = kpm if attn_mask is None else attn_mask + kpm
    if need_weights:
        weights = (q * math.sqrt(1.0 / float(hd))) @ k.transpose(-2, -1)
        if attn_mask is not None:
            weights = weights + attn_mask
        weights = torch.softmax(weights, dim=-1)
        c = weights @ v
        return (c.transpose(1, 2).reshape(n, tgt, embed),
                weights.mean(dim=1) if average_attn_weights else weights)
    c = F.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, is_causal)
    return c.transpose(1, 2).reshape(n, tgt, embed), None


@register_rule(nn.MultiheadAttention)
class MultiheadAttentionRule(LayerRule):
    """``nn.MultiheadAttention``: per-sample gradients of the projections, ``bias_k``/``bias_v``
    and ``out_proj``, from the recorded call (``a``: ``Call(args, kwargs)``) and the grad_outputs
    ``g = (g_y, g_weights)`` (``(N, L, E)`` or ``(L, N, E)`` following ``module.batch_first``;
    ``g_weights`` ``(N, L, S)`` / ``(N, H, L, S)`` or ``None``).

    Returns ``in_proj_weight`` ``(N, 3E, E)`` (or ``q_proj_weight`` ``(N, E, E)``,
    ``k_proj_weight`` ``(N, E, kdim)``, ``v_proj_weight`` ``(N, E, vdim)``), ``in_proj_bias``
    ``(N, 3E)``, ``bias_k``/``bias_v`` ``(N, 1, 1, E)``, ``out_proj.weight`` ``(N, E, E)``,
    ``out_proj.bias`` ``(N, E)``. Parameters the backward did not reach (``out_proj``, the value
    path when only the returned attention weights enter the loss) are left out, as autograd leaves
    their ``.grad`` alone.

    The batch dim follows ``module.batch_first`` (the attach-level ``batch_first`` is not used:
    the module states its own layout). Computes in float32 at least (autocast inputs/grads).

    Raises (at the forward):
        UnsupportedCallError: attention dropout > 0 in training mode.
        BatchSizeError: an unbatched (2-D) query.
    """

    multi_io = True
    param_names = ("in_proj_weight", *_IN_WEIGHTS, "in_proj_bias", "bias_k", "bias_v")

    def params_of(self, module: nn.Module) -> Dict[str, nn.Parameter]:
        out = super().params_of(module)
        out.update((f"out_proj.{n}", p) for n, p in module.out_proj.named_parameters(recurse=False))
        return out

    def check_call(self, module: nn.Module, args: tuple, kwargs: dict, options) -> None:
        if module.training and module.dropout > 0:
            raise UnsupportedCallError(
                f"MultiheadAttention with dropout={module.dropout} in training mode draws a random "
                f"mask on the attention weights inside its forward, which per-sample gradients "
                f"cannot replay; call .eval() on it or build it with dropout=0.0"
            )

    def batch_size(self, module: nn.Module, x: Tensor, batch_first: bool) -> int:
        if not isinstance(x, Tensor) or x.dim() != 3:
            shape = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
            layout = "(N, L, E)" if module.batch_first else "(L, N, E)"
            raise BatchSizeError(
                f"MultiheadAttention got an unbatched query {shape}; per-sample gradients need a "
                f"batched {layout} query (module.batch_first={module.batch_first}), e.g. "
                f"query.unsqueeze({0 if module.batch_first else 1})"
            )
        return x.shape[0 if module.batch_first else 1]

    has_forms = True  # per_sample_grads: LayerRule's, from forms()

    def forms(self, module: nn.Module, a: Call, g, batch_first: bool,
              names: Iterable[str]) -> Dict[str, List[Block]]:
        """Factored form of :meth:`per_sample_grads`: ``out_proj`` from the attention output
        ``(N, L, E)`` and ``g_y``; the input projections from each input ``(N, L_x, E_x)`` and
        the replayed gradient of its projection (one row block per group of rows of a packed
        ``in_proj_weight``); ``bias_k``/``bias_v`` as bias-like blocks with ``S = 1``."""
        names = tuple(names)
        call = _FORWARD.bind(module, *a.args, **a.kwargs)
        call.apply_defaults()
        arg = call.arguments
        g_y, g_w = g[0], g[1]
        xs = [arg["query"], arg["key"], arg["value"]]
        if not module.batch_first:
            xs = [x.transpose(0, 1) for x in xs]
            g_y = None if g_y is None else g_y.transpose(0, 1)
        params = dict(self.params_of(module))
        dt = torch.float32
        for t in (*xs, g_y, g_w, *params.values()):
            if t is not None:
                dt = torch.promote_types(dt, t.dtype)
        n = xs[0].shape[0]
        p = {k: t.detach().to(dt) for k, t in params.items()}
        embed = module.embed_dim
        packed = module.in_proj_weight is not None

        # groups of projections computed from one input by one matmul (self-attention: q, k, v
        # from x; cross-attention with key is value: k, v from memory)
        groups: List[List[int]] = []
        for i in range(3):
            if packed and groups and _same(xs[i], xs[groups[-1][-1]]):
                groups[-1].append(i)
            else:
                groups.append([i])
        xs = [x.to(dt) for x in xs]
        want_in = any(nm in names for nm in self.param_names)
        out: Dict[str, List[Block]] = {}
        taken = _from_graph(a.internal, g_y, g_w, groups, n, embed, dt)
        if taken is not None:  # the attention core's gradients, recorded in the backward
            c, g_leaves = taken
            bias_leaves, found = [], ()
        else:  # replay the projections and the attention core
            with torch.enable_grad() if want_in else torch.no_grad():
                leaves, bias_leaves, (c, weights) = self._replay(module, arg, xs, p, groups, want_in)
        if g_y is not None:
            g_y = g_y.to(dt)
            if "out_proj.weight" in names:
                out["out_proj.weight"] = [Block(None, c.detach(), g_y)]
            if "out_proj.bias" in names:
                out["out_proj.bias"] = [Block(None, None, g_y)]
        if not want_in:
            return out
        if taken is None:
            outputs, grads = [], []
            if g_y is not None:
                outputs.append(c)
                grads.append(g_y @ p["out_proj.weight"])  # gradient w.r.t. c
            if g_w is not None:
                outputs.append(weights)
                grads.append(g_w.to(dt))
            found = torch.autograd.grad(outputs, leaves + bias_leaves, grads, materialize_grads=True)
            g_leaves = found[:len(leaves)]
        # the value path (v_proj_weight, bias_v) is not reached when only the weights enter the loss
        reached = {"bias_v": g_y is not None, "v_proj_weight": g_y is not None}
        if bias_leaves:
            out["bias_k"], out["bias_v"] = ([Block(None, None, t)] for t in found[-2:])  # (N, 1, E)
        rows = [slice(grp[0] * embed, (grp[-1] + 1) * embed) for grp in groups]
        if packed:
            out["in_proj_weight"] = [Block(r, xs[grp[0]], gl) for r, grp, gl in zip(rows, groups, g_leaves)]
        else:
            out.update((_IN_WEIGHTS[grp[0]], [Block(None, xs[grp[0]], gl)])
                       for grp, gl in zip(groups, g_leaves))
        if "in_proj_bias" in names:
            out["in_proj_bias"] = [Block(r, None, gl) for r, gl in zip(rows, g_leaves)]
        return {nm: t for nm, t in out.items() if nm in names and reached.get(nm, True)}

    def internal(self, module: nn.Module, args: tuple, kwargs: dict, output) -> Optional[tuple]:
        """The ``scaled_dot_product_attention`` node of this call, when torch computed the
        attention core with it (``need_weights=False``, no ``bias_k``/``bias_v``, no
        ``add_zero_attn``): its input gradients are the gradients w.r.t. the projected
        ``q, k, v`` and its saved output is the input of ``out_proj``, so the rule need not
        replay the call. ``None`` otherwise (the rule replays)."""
        if module.bias_k is not None or module.add_zero_attn:
            return None
        call = _FORWARD.bind(module, *args, **kwargs)
        call.apply_defaults()
        arg = call.arguments
        y = output[0] if isinstance(output, tuple) else None
        if arg["need_weights"] or not isinstance(y, Tensor) or y.grad_fn is None:
            return None
        inputs = {id(t.grad_fn) for t in (arg["query"], arg["key"], arg["value"])
                  if isinstance(t, Tensor) and t.grad_fn is not None}
        node = _find_node(y.grad_fn, inputs, "ScaledDotProduct")
        if node is None:
            return None
        try:
            attn = saved(node, "output")
        except (AttributeError, RuntimeError):
            return None
        q = arg["query"]
        n, length = (q.shape[0], q.shape[1]) if module.batch_first else (q.shape[1], q.shape[0])
        if tuple(attn.shape) != (n, module.num_heads, length, module.head_dim):
            return None
        return node, {"attn_output": attn.detach()}

    @staticmethod
    def _replay(module, arg, xs, p, groups, want_in):
        """Projections as leaves (one per group of inputs), then the attention core.

        Returns the projection leaves ``(N, L_x, rows)``, the ``bias_k``/``bias_v`` leaves
        ``(N, 1, E)`` (empty list without ``add_bias_kv``), and :func:`attention_core`'s result.
        """
        embed, n = module.embed_dim, xs[0].shape[0]
        b_in = p.get("in_proj_bias")
        leaves, proj = [], [None, None, None]
        for grp in groups:
            rows = slice(grp[0] * embed, (grp[-1] + 1) * embed)
            w = p["in_proj_weight"][rows] if module.in_proj_weight is not None else p[_IN_WEIGHTS[grp[0]]]
            leaf = F.linear(xs[grp[0]], w, None if b_in is None else b_in[rows]).requires_grad_(want_in)
            leaves.append(leaf)
            proj[grp[0]:grp[-1] + 1] = leaf.chunk(len(grp), dim=-1)
        q, k, v = proj
        bias_leaves = []
        if module.bias_k is not None:
            bias_leaves = [p[nm].reshape(1, 1, embed).expand(n, 1, embed).clone().requires_grad_(want_in)
                           for nm in ("bias_k", "bias_v")]
            k, v = torch.cat([k, bias_leaves[0]], 1), torch.cat([v, bias_leaves[1]], 1)
        return leaves, bias_leaves, attention_core(
            module, q, k, v, arg["key_padding_mask"], arg["attn_mask"], arg["need_weights"],
            arg["average_attn_weights"], arg["is_causal"])
