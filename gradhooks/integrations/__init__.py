"""Integrations with other libraries, each imported only by its user.

Lives here: ``laplace_backend`` (laplace-torch's ``GradHooksGGN`` / ``GradHooksEF`` backends;
it imports ``laplace``). Later integrations (a Hugging Face ``Trainer`` callback, Opacus
helpers) go here too.

May import: every layer below, the facade and the tools. Nothing in gradhooks imports an
integration (``import gradhooks`` needs only torch and opt_einsum).
"""
