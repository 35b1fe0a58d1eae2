"""Drop-in adapters that give existing caches fsm_cache residency checks."""
