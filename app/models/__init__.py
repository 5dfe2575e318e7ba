"""Loading targets and drafts: presets, the Hub, the wheel's GGUF, dtype, device and threads, and
which ids this host lets visitors load.

`loading` holds the loader; its names are read through this package (`models.load_pair`). They are
looked up on first use, so `from app.models import threads` (the CLI's --help) does not import torch.
"""

import importlib

_SUBMODULES = ("loading", "hosting", "hub", "threads", "gguf_target")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name.startswith("__"):
        raise AttributeError(name)
    loading = importlib.import_module(f"{__name__}.loading")
    try:
        value = getattr(loading, name)
    except AttributeError:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value  # later lookups (and monkeypatching) see a plain attribute
    return value
