"""Tests against SGLang's real cache code, run by ``make test-sglang`` in a side environment."""
