"""Loading targets and drafts: presets, the Hub, the wheel's GGUF, dtype, device and threads, and
which ids this host lets visitors load.

`loading` holds the loader, `pair` a target with its draft and `presets` the names; all are read through
this package (`models.load_pair`, `models.TINY_TARGET`). They are
looked up on first use, so `from app.models import threads` (the CLI's --help) does not import torch.
"""

import importlib

_SUBMODULES = (
    "loading",
    "pair",
    "presets",
    "hosting",
    "hub",
    "threads",
    "gguf_target",
    "exact",
    "exact_model",
    "precision",
    "int8_kernel",
)


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name.startswith("__"):
        raise AttributeError(name)
    for module in ("loading", "pair", "presets"):
        found = importlib.import_module(f"{__name__}.{module}")
        if hasattr(found, name):
            value = getattr(found, name)
            break
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value  # later lookups (and monkeypatching) see a plain attribute
    return value
