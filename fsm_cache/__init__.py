"""fsm_cache: typed, formally checked state machines for KV-cache residency."""
