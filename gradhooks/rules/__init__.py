"""Per-layer rules, one file per layer family; importing this package registers them all."""
from . import conv, linear  # noqa: F401  (registration side effect)
