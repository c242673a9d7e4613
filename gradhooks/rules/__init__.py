"""Built-in layer rules, one module per layer family; importing this package registers them
(``known``: other libraries' layers by name; ``parametrize``: ``torch.nn.utils.parametrize``)."""
from . import attention, conv, conv_transpose, embedding, linear, norm, recurrent, scale  # noqa: F401
from . import known, parametrize  # noqa: F401  (recognisers; after the rules they name)
