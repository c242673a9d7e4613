"""The ops a forward runs without gradient, hashed (:class:`HiddenOps`): what the autograd
graph's fingerprint (:func:`~gradhooks.base.torch_internals.graph_ops`) cannot see, for the check
policy (:class:`~gradhooks.core.recorder.check_policy.SumCheck`). The mode runs inside the
provenance mode of an analysed forward, so that the user's ops reach it first; the frame walks
of :mod:`gradhooks.core.analysis.mixing` pass over its frame (:data:`HIDDEN_FILE`)."""
from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["HiddenOps", "HIDDEN_FILE", "under_compile"]

#: This module's file: a frame of it is the mode's, not the user's nor gradhooks' hooks'.
HIDDEN_FILE = os.path.abspath(__file__)
#: Where torch's and gradhooks' own source files lie (:class:`HiddenOps` skips their calls).
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


class HiddenOps(TorchFunctionMode):
    """Counts and hashes, while active, the ops a forward runs **without gradient** inside a
    custom ``torch.autograd.Function``'s ``forward`` or a reentrant ``torch.utils.checkpoint``
    (the user's code torch runs there), which the autograd graph holds as one node, so that
    :func:`~gradhooks.base.torch_internals.graph_ops` cannot see them change (a flag read
    inside a Function's forward). Each op adds its function and its plain arguments (ints, bools, strings, dtypes, slices,
    tuples of them: a tensor counts by its type, a float by its type) to :attr:`fingerprint`,
    in call order. Ops gradhooks itself calls (its hooks) are left out, so that a forward
    analysed under provenance and one that follows its plan agree. Ops traced by
    ``torch.compile`` are not hashed (its graph holds them; the tracing's own ops run without
    gradient). Cost: one grad-mode test per torch call while active, a frame walk and a hash
    per op run without gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.fingerprint = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():  # (traced by torch.compile: its graph is not hashed)
            return func(*args, **kwargs)
        if not torch.is_grad_enabled() and _in_hidden_code():
            self.count += 1
            self.fingerprint = hash((self.fingerprint, getattr(func, "__qualname__", None)
                                     or repr(func), _plain(args), _plain(sorted(kwargs.items()))))
        return func(*args, **kwargs)


#: Where torch calls the user's code that runs without gradient in a forward: a custom
#: Function's ``forward`` (``Function.apply``), a reentrant checkpoint's block.
_RUNNERS = (os.path.join(_TORCH_DIR, "autograd", "function.py"),
            os.path.join(_TORCH_DIR, "utils", "checkpoint.py"))


def _in_hidden_code() -> bool:
    # Whether the op (past HiddenOps.__torch_function__) runs inside the user's code that torch
    # runs without gradient (a frame of Function.apply or of a reentrant checkpoint above it),
    # not in gradhooks' own (its hooks: a frame of gradhooks' below that). Ops torch itself
    # runs without gradient in the forward (FSDP's all-gathers in its hooks) and a plain
    # no_grad block of the forward are not counted.
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if name in _RUNNERS:
            return True
        if name.startswith(_OWN_DIR):
            return False
        frame = frame.f_back
    return False


def _plain(x):
    # The structural part of an op's argument, hashable: what HiddenOps hashes.
    if x is None or isinstance(x, (bool, int, str, torch.dtype)):
        return x
    if isinstance(x, (tuple, list)):
        return tuple(_plain(v) for v in x)
    if isinstance(x, slice):
        return (_plain(x.start), _plain(x.stop), _plain(x.step))
    return type(x).__name__


_DYNAMO_DIR = os.path.join(_TORCH_DIR, "_dynamo") + os.sep
#: The frames ``torch.compile`` puts around a compiled call (``co_qualname``, Python 3.11+; the
#: ``co_name`` below it: ``torch.compiler.disable``'s own wrapper is a ``DisableContext``'s).
_COMPILED = ("_TorchDynamoContext.", "OptimizedModule.")


def under_compile() -> bool:
    """Whether the caller runs under ``torch.compile``: tracing, or a compiled call's wrapper on
    the stack (its hooks run eagerly, between graphs; gradhooks' hooks run inside
    ``torch.compiler.disable``'s wrapper either way, which does not count). :class:`HiddenOps`
    is not entered there: a second mode beside provenance's breaks dynamo's guards (torch
    2.13). A walk of the caller's frames: some microseconds."""
    if torch.compiler.is_compiling():
        return True
    frame = sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith(_DYNAMO_DIR) and (
                getattr(code, "co_qualname", "").startswith(_COMPILED)
                or code.co_name == "compile_wrapper"):
            return True
        frame = frame.f_back
    return False
