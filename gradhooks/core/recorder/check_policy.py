"""When the sum check (:mod:`gradhooks.readers.verify`) runs, and when a forward is analysed
again: :class:`SumCheck`, the policy of ``attach(..., check=mode)``, kept by the recorder."""
from __future__ import annotations

from typing import Optional

__all__ = ["SumCheck"]


class SumCheck:
    """When the sum check runs, given ``attach(..., check=mode)``.

    ``mode=True``: on every read whose *structure* has not passed before -- which modules were
    called how often, by how many backward passes, and which parameters autograd reached -- and
    on every 100th read (the failures the check catches are properties of that structure);
    ``"always"``: every read; ``False``: never. :meth:`~gradhooks.GradHooks.backward` asks
    :meth:`edges_allowed` whether it may skip the parameter gradients (then the batch's reads
    skip the check), with its own structure key (the forward's recorded calls).
    """

    #: one read (and one ``backward()``) in this many runs the check whatever the structure;
    #: one forward in this many of an input signature is analysed again (:meth:`forward_due`).
    EVERY = 100

    def __init__(self, mode) -> None:
        if mode not in (True, False, "always"):
            raise ValueError(f"check must be True, False or 'always', got {mode!r}")
        self.mode = mode
        self._passed: set = set()  # read structures whose check passed
        self._reads = 0
        self._drive_passed: set = set()  # backward() structures whose check passed
        self._drives = 0
        self._forwards: dict = {}  # input signature -> its forwards that followed its plan

    def read_due(self, structure: tuple) -> bool:
        """Count a read of ``structure``; whether it runs the check."""
        self._reads += 1
        return (self.mode == "always" or structure not in self._passed
                or self._reads % self.EVERY == 0)

    def forward_due(self, signature: tuple) -> bool:
        """Count a forward of an input signature whose first forward was analysed (provenance,
        the op whitelist: :class:`~gradhooks.core.recorder.placement.Placement`); whether this
        one is analysed again: every one under ``"always"``, otherwise every :attr:`EVERY`-th
        whatever ``mode`` (the analysis proves the forward keeps samples apart, it is not the
        sum check). A forward whose structure changes with the same input shapes (a branch on
        a flag or on a tensor's value) is judged on that forward as on its signature's first."""
        if self.mode == "always":
            return True
        count = self._forwards.get(signature, 0) + 1
        self._forwards[signature] = count
        return count % self.EVERY == 0

    def edges_allowed(self, drive_key: tuple) -> bool:
        """Count a ``backward()``; whether it may skip the parameter gradients."""
        self._drives += 1
        return not (self.mode == "always" or (self.mode and (
            drive_key not in self._drive_passed or self._drives % self.EVERY == 0)))

    def passed(self, structure: tuple, drive_key: Optional[tuple]) -> None:
        """Remember that the check of ``structure`` (reached by ``drive_key``'s backward, if
        any) passed."""
        self._passed.add(structure)
        if drive_key is not None:
            self._drive_passed.add(drive_key)
