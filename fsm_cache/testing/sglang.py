"""Import stand-ins that let SGLang's real cache modules import on a CPU-only machine.

Used by ``make test-sglang`` (tests/sglang_real) and ``fsm-cache bench sglang``,
and by anyone who wants SGLang's radix caches in a CPU test: call
:func:`install` before importing ``sglang.srt.mem_cache``.

SGLang's ``radix_cache.py`` and ``hiradix_cache.py`` need only ``torch`` at run
time, but importing them pulls in half of SGLang: ``memory_pool.py`` imports
the attention layers (GPU kernels), the model configs (``transformers``) and
through them the server arguments and the OpenAI protocol; ``utils/common.py``
imports a web stack. None of that runs in a radix-cache test. Each name below
is answered by a permissive empty module instead; everything else, the cache
code above all, is SGLang's own, from the installed wheel.

* ``sglang`` itself is registered as a bare package, so its ``__init__`` (the
  frontend language: ``tqdm``, ``requests``, ``IPython``...) never runs.
* SGLang's own modules that are not cache code: ``sglang.srt.layers`` (model
  layers, attention kernels), ``sglang.srt.configs`` (model configs, built on
  ``transformers``), ``sglang.srt.server_args``, ``sglang.srt.distributed``,
  and ``sglang.srt.managers.schedule_batch`` (the request batch, which 0.5.23's
  ``unified_radix_cache.py`` imports through its streaming sessions; it pulls
  in the grammar backends and the OpenAI protocol).
* Third-party modules, stood in only when not installed: GPU kernels
  (``triton``, ``sgl_kernel``, ``aiter``), the KV-event transport (``msgspec``,
  ``zmq``, ``pydantic``, ``pydantic_core``; events stay disabled) and
  ``utils/common.py``'s module-level imports (``orjson``, ``psutil``,
  ``pybase64``, ``fastapi``, ``starlette``, ``PIL``).
"""

from __future__ import annotations

import importlib.util

from fsm_cache.testing import standins


ALWAYS = (
    "sglang.srt.layers",
    "sglang.srt.configs",
    "sglang.srt.server_args",
    "sglang.srt.distributed",
    "sglang.srt.managers.schedule_batch",
)
"""SGLang modules outside the cache, replaced even though the wheel has them."""

IF_MISSING = (
    "triton",
    "sgl_kernel",
    "aiter",
    "msgspec",
    "zmq",
    "pydantic",
    "pydantic_core",
    "orjson",
    "psutil",
    "pybase64",
    "fastapi",
    "starlette",
    "PIL",
)
"""Third-party modules SGLang's import chain names, replaced only when absent."""


def sglang_present() -> bool:
    """Whether an SGLang wheel is installed in this interpreter (the side environment)."""
    return importlib.util.find_spec("sglang") is not None


def install() -> standins.StandInFinder:
    """Put SGLang's stand-ins in front of the import system, once; return the finder.

    ``sglang`` itself is registered hollow, so its ``__init__`` (the frontend
    language) never runs.

    Raises:
        ModuleNotFoundError: SGLang is not installed in this interpreter.
    """
    return standins.install(ALWAYS, IF_MISSING, hollows=("sglang",))
