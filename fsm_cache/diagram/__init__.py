"""Diagrams generated from specs: an IR built from the spec, and renderers of it."""

from __future__ import annotations

from fsm_cache.diagram.ir import FORMATS, Diagram, DiagramError, build, render


__all__ = ["FORMATS", "Diagram", "DiagramError", "build", "render"]
