"""Built-in layer rules, one module per layer family; importing this package registers them
(``known``: other libraries' layers by name; ``parametrize``: ``torch.nn.utils.parametrize``).

A rule says how one call's records become per-sample gradients and canonical forms, nothing
more (``linear.py`` is the template). May import: ``gradhooks.base`` and this folder.
"""
from . import (  # noqa: F401  # noqa: F401  (named by known, not registered by type)  # noqa: F401  (recognisers; after the rules they name)
    attention,
    conv,
    conv_transpose,
    embedding,
    known,
    linear,
    mamba,
    mamba2,
    norm,
    norm_variants,
    parametrize,
    recurrent,
    scale,
)
