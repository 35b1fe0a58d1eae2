"""Subcommands of the fsm-cache CLI, one module each."""
