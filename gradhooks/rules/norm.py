"""Placeholder: being written (issue 3)."""
