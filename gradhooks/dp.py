"""Placeholder: being written (issue 5)."""
