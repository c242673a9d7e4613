"""The batch analysis: what the forward and the loss do with the batch, proven from the ops.

Where the batch dim of every tensor derived from the batch is (``provenance``, through each op:
``batch_dims``, ``einsum``; per-sample weights of ``F.linear`` on merged or routed rows:
``rows``), whether an op keeps the samples apart (``separation``'s whitelist, ``mixing``: the
ops that pair samples; ``alone``: the check of the forward alone, a sample run by itself), and
how a loss splits into per-sample terms (``backward_losses``: the graph walk of a loss;
``loss_graph``: a loss after the model, proven per sample from its graph;
``token_means``: token means over padded rows). It records nothing: the recorder
(:mod:`gradhooks.core.recorder`) asks it and applies the answers.

The interface: this ``__init__`` names everything the rest of the package uses of it; modules
outside this folder import from ``gradhooks.core.analysis`` only, never a module inside it
(``tests/test_layering.py``).

May import: ``gradhooks.base``, ``gradhooks.rules`` and this folder. Never the recorder or a
reader.
"""
from .alone import (
    FORWARD_RTOL,
    NO_CHECK,
    checked_rows,
    forward_alone,
    largest_difference,
    sample_rows,
)
from .backward_losses import (
    Split,
    backward_roots,
    constant_of,
    fixed_normaliser,
    flattened_logits,
    ignore_index_of,
    loss_of,
    position_rows,
    row_counts,
    split_of,
    target_counts,
    valid_rows,
)
from .batch_dims import Routed, relayout
from .hidden import HiddenOps, under_compile
from .loss_graph import ForwardSpans, judge, rows_of
from .mixing import IN_ORDER, UNCHECKED, Mixing, user_line
from .provenance import (
    Provenance,
    as_batch,
    input_batch_dim,
    shared_layout,
    source_cotangent,
)
from .rows import meeting_cotangent
from .separation import BY_VALUES, UNPROVEN
from .token_means import TARGETS, check_token_normalisation, rows_mean_message

__all__ = ["FORWARD_RTOL", "NO_CHECK", "checked_rows", "forward_alone", "largest_difference", "sample_rows", "Split",
           "backward_roots", "constant_of", "flattened_logits", "ignore_index_of", "loss_of", "fixed_normaliser", "position_rows", "relayout",
           "row_counts", "split_of", "target_counts", "valid_rows", "Routed", "Mixing", "user_line", "BY_VALUES", "ForwardSpans", "judge", "rows_of",
           "Provenance", "as_batch", "input_batch_dim", "meeting_cotangent", "shared_layout",
           "source_cotangent", "UNPROVEN", "UNCHECKED", "IN_ORDER", "TARGETS", "check_token_normalisation",
           "rows_mean_message", "HiddenOps", "under_compile"]
