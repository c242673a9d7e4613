"""``torch.einsum`` read by its equation: where the batch letter goes
(:mod:`gradhooks.core.analysis.batch_dims`), whether it stays one sample's
(:mod:`gradhooks.core.analysis.separation`), and how a shared operand meets the batch per
sample (:func:`einsum_shared`, for :mod:`gradhooks.core.analysis.provenance`'s split)."""
from __future__ import annotations

from typing import Optional

from torch import Tensor

from .indexing import dim_of

__all__ = ["einsum_subscripts", "einsum_dim", "einsum_shared"]


def einsum_subscripts(args):
    """``([subscripts of each operand], output subscripts, operands)`` of ``torch.einsum(equation,
    *operands)`` (or with the operands in a list), ellipses spelled out as letters not used
    elsewhere; ``None`` for the sublist form or an equation that does not fit the operands."""
    if not args or not isinstance(args[0], str):
        return None
    eq = args[0].replace(" ", "")
    ops = list(args[1]) if len(args) == 2 and isinstance(args[1], (list, tuple)) else list(
        args[1:])
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ops) or not all(isinstance(t, Tensor) for t in ops):
        return None
    used = set(c for c in eq if c.isalpha())
    spare = [c for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz" if c not in used]
    count = lambda s: sum(c.isalpha() for c in s)
    ell = "".join(spare[:max([op.dim() - count(s) for s, op in zip(terms, ops) if "..." in s],
                            default=0)])
    subs = []
    for s, op in zip(terms, ops):
        k = op.dim() - count(s)
        s = s.replace("...", ell[len(ell) - k:] if k > 0 else "")
        if len(s) != op.dim():
            return None
        subs.append(s)
    if arrow:
        out = rhs.replace("...", ell)
    else:  # (implicit: the ellipsis, then the letters seen once, sorted)
        joined = "".join(subs)
        out = ell + "".join(sorted(c for c in set(joined) if joined.count(c) == 1
                                   and c not in ell))
    return subs, out, ops


def einsum_dim(args, batched, out):
    """The output's batch dim of an ``einsum`` whose operands that carry the batch all have it
    at one letter (which the output keeps), else ``None``; a batch merged with the dims after
    it (``(dim, inner)``: Longformer's ``(B * H, ...)`` chunks) stays merged, with the same
    ``inner`` in every operand."""
    parsed = einsum_subscripts(args)
    if parsed is None or not isinstance(out, Tensor):
        return None
    subs, sub_out, ops = parsed
    dims = {id(t): b for t, b in batched}
    found = set()  # (the batch letter, and the rows per sample of a merged batch)
    for i, t in enumerate(ops):
        if id(t) in dims:
            parts = dim_of(dims[id(t)])
            found.add((subs[i][parts[0]], parts[1]) if parts is not None else (None, 0))
    if len(found) != 1:
        return None
    letter, inner = found.pop()
    if letter is None or sub_out.count(letter) != 1:
        return None
    return sub_out.index(letter) if inner == 1 else (sub_out.index(letter), inner)


def einsum_shared(args, ref: Tensor, bd, shared) -> Optional[str]:
    """The equation of ``torch.einsum(equation, *operands)`` with the batch letter (that of
    ``ref``, a batched operand, at its batch dim ``bd``) put in front of each operand in
    ``shared`` (tensors the batch did not reach: a learned query, a shared call's output), each
    of which is then passed expanded to ``(B, *shape)``, so that autograd forms its gradient
    per sample; ``None`` where that is no split: the output does not keep the batch letter
    exactly once (the samples summed), a shared operand has that letter already, or the
    equation does not fit the operands."""
    parsed = einsum_subscripts(args)
    if parsed is None or not isinstance(bd, int):
        return None
    subs, out, ops = parsed
    at = [i for i, t in enumerate(ops) if t is ref]
    if not at or bd >= len(subs[at[0]]) or out.count(subs[at[0]][bd]) != 1:
        return None
    letter = subs[at[0]][bd]
    for i, t in enumerate(ops):
        if any(t is u for u in shared):
            if letter in subs[i]:
                return None
            subs[i] = letter + subs[i]
    return ",".join(subs) + "->" + out
