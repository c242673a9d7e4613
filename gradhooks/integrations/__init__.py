"""Integrations with other libraries, each imported only by its user.

Lives here: ``laplace_backend`` (laplace-torch's ``GradHooksGGN`` / ``GradHooksEF`` backends;
it imports ``laplace``); ``transformers`` (the Hugging Face ``Trainer``: ``DPTrainer`` for DP
fine-tuning, ``DPTrainerMixin`` its DP step for any ``Trainer`` subclass,
``GradientStatsCallback`` for per-sample gradient statistics; it imports ``transformers`` and
Opacus' accountants); ``trl`` (TRL's ``SFTTrainer`` / ``DPOTrainer`` with that DP step:
``DPSFTTrainer``, ``DPDPOTrainer``; it imports ``trl``); ``store_callback``
(``GradientStoreCallback``: the projected gradient store written while a ``Trainer`` trains; it
imports ``transformers``).

May import: every layer below, the facade and the tools. Nothing in gradhooks imports an
integration (``import gradhooks`` needs only torch and opt_einsum).
"""
