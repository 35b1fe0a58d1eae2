"""Import stand-ins that let vLLM's scheduler-side offloading code import on a CPU machine.

Used by ``make test-vllm`` (tests/vllm_real) and ``make bench-vllm``, and by
anyone who wants vLLM's offloading manager in a CPU test: call :func:`install`
before importing ``vllm``.

vLLM's CPU offloading manager (``vllm/v1/kv_offload/cpu/manager.py``) and its
scheduler-side connector need only torch and numpy at run time, but importing
them runs vLLM's package ``__init__`` files, which pull in the distributed
runtime, the model configs (``pydantic``, ``transformers``), the platform
probes and a web stack. None of that runs in these tests. So:

* **Hollow packages** (:data:`HOLLOW`): vLLM's own packages whose ``__init__``
  is not run. Their real submodules still import from the wheel; any other
  name asked of them is a stand-in. The offloading code itself, the manager,
  its policies, ``base.py`` and the connector, is vLLM's own, from the wheel.
* **Stand-in modules** (:data:`ALWAYS`, :data:`IF_MISSING`): answered by a
  permissive empty module whose every attribute is a stand-in class. ``ALWAYS``
  are vLLM's modules outside the offloading code (configs, logger, platforms);
  ``IF_MISSING`` are third-party modules, stood in only when not installed.

A stand-in class is subclassable, callable, indexable (``X[int]``), usable as
a pass-through decorator, and answers every attribute with another stand-in.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from fsm_cache.testing import standins


HOLLOW = (
    "vllm",
    "vllm.distributed",
    "vllm.distributed.kv_transfer",
    "vllm.distributed.kv_transfer.kv_connector",
    "vllm.distributed.kv_transfer.kv_connector.v1",
    "vllm.v1",
    "vllm.v1.core",
)
"""vLLM packages imported without running their ``__init__``."""

ALWAYS = (
    "vllm.config",
    "vllm.platforms",
    "vllm.logger",
    "vllm._custom_ops",
    "vllm.distributed.parallel_state",
    "vllm.v1.kv_offload.cpu.gpu_worker",
    "vllm.compilation",
    "vllm.model_executor",
    "vllm.v1.metrics.perf",
    "vllm.outputs",
    "vllm.parser",
    "vllm.entrypoints",
    "vllm.renderers",
    "vllm.multimodal",
)
"""vLLM modules outside the scheduler-side offloading code, replaced although the wheel has
them: configs, platform probes, the logger (it asks the distributed runtime for ranks), the
custom ops and the GPU<->CPU worker (GPU kernels)."""

IF_MISSING = (
    "regex",
    "pydantic",
    "pydantic_core",
    "transformers",
    "psutil",
    "zmq",
    "msgspec",
    "cbor2",
    "prometheus_client",
    "cachetools",
    "blake3",
    "openai",
    "fastapi",
    "triton",
    "PIL",
    "pybase64",
    "aiohttp",
    "huggingface_hub",
    "safetensors",
    "cloudpickle",
    "uvloop",
    "cpuinfo",
    "xgrammar",
    "openai_harmony",
    "llguidance",
)
"""Third-party modules vLLM's import chain names, replaced only when absent."""


def _logger(name: str = "vllm", *args: Any, **kwargs: Any) -> logging.Logger:
    """``vllm.logger.init_logger``: a plain logger with vLLM's ``*_once`` methods."""
    del args, kwargs
    log = logging.getLogger(name)
    for level in ("debug", "info", "warning", "error"):
        if not hasattr(log, f"{level}_once"):
            setattr(log, f"{level}_once", getattr(log, level))
    return log


def vllm_present() -> bool:
    """Whether a vLLM wheel is installed in this interpreter (the side environment)."""
    return importlib.util.find_spec("vllm") is not None


def install() -> standins.StandInFinder:
    """Put vLLM's stand-ins in front of the import system, once; return the finder.

    Raises:
        ModuleNotFoundError: vLLM is not installed in this interpreter.
    """
    return standins.install(ALWAYS, IF_MISSING, hollows=HOLLOW, presets={"init_logger": _logger})
