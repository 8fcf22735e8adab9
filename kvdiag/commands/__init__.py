"""Subcommands of the ``kvdiag`` CLI, one module each."""
