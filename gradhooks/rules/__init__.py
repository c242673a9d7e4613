"""Built-in layer rules, one module per layer family; importing this package registers them."""
from . import attention, conv, conv_transpose, embedding, linear, norm, recurrent  # noqa: F401
