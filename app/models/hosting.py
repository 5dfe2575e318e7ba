"""Who may load which model, and with whose Hub token, when the app is reachable by others.

Public hosting (a Space, any non-loopback bind, or a loopback bind that requests reach through a
proxy or tunnel) defaults to the presets alone; the owner
opens it up with SPECDEC_ALLOWED_MODELS=any or a comma list. Every check reads the id as the
visitor typed it, before anything touches the filesystem, and no message echoes a host path.
"""

from __future__ import annotations

import os

LOOPBACK = {"127.0.0.1", "localhost", "::1", ""}
MAX_ID_CHARS = 200  # longer ids are refused before they reach the filesystem or the Hub

_bind_host: str | None = None
_serving = False  # this process serves visitors (app.py): an id typed there is a visitor's


def configure(host: str | None) -> None:
    """Record the address the server binds to (app.py calls this before launching)."""
    global _bind_host
    _bind_host = host


def serving(on: bool = True) -> None:
    """Record that this process serves visitors (ui.launch): every id typed there is a visitor's."""
    global _serving
    _serving = on


_proxied = False  # a request came through a proxy or tunnel (serve/boundary.py's ProxyWatch saw it)


def mark_proxied() -> bool:
    """Record that the server is reached through a proxy or tunnel; True the first time."""
    global _proxied
    first, _proxied = not _proxied, True
    return first


def public() -> bool:
    """True on Hugging Face Spaces, when bound to a non-loopback address, or once any request has come
    through a proxy or tunnel (a loopback bind behind one is public too), unless SPECDEC_PRIVATE=1."""
    host = _bind_host if _bind_host is not None else os.environ.get("GRADIO_SERVER_NAME", "127.0.0.1")
    if _proxied and os.environ.get("SPECDEC_PRIVATE") != "1":
        return True
    return bool(os.environ.get("SPACE_ID")) or host.strip() not in LOOPBACK


def allowed_ids(presets: set[str]) -> set[str] | None:
    """The ids a visitor may load, or None for any id.

    SPECDEC_ALLOWED_MODELS: 'any' (open), 'presets', or a comma list (added to the presets).
    Unset means presets-only when public and open on a private machine.
    """
    raw = os.environ.get("SPECDEC_ALLOWED_MODELS", "").strip()
    if raw == "any" or (not raw and not public()):
        return None
    if raw in ("", "presets"):
        return set(presets)
    return set(presets) | {x.strip() for x in raw.split(",") if x.strip()}


def shown(model_id: str) -> str:
    """The id as it may appear in a message: as typed, printable, and short."""
    text = "".join(c if c.isprintable() else "?" for c in model_id.strip())
    return text if len(text) <= 60 else text[:57] + "..."


def check(model_id: str, role: str, presets: set[str], means: str | None = None) -> None:
    """Refuse an id for `role` ('target' or 'draft') before it reaches disk or network.

    The id is parsed as a draft spec first (from its text alone: `means`, what a preset label
    stands for, else the id), so only what really is prompt lookup or early exit skips the
    model list: `prompt-lookup-evil/tiny` is a model id like any other.
    """
    from app.core.config import UserError
    from app.drafts import kinds

    typed = (model_id or "").strip()
    if len(typed) > MAX_ID_CHARS:
        raise UserError(f"model id is too long ({len(typed)} characters; at most {MAX_ID_CHARS})")
    meant = (means or typed).strip()
    kind = kinds.parse(meant, probe=False).kind if meant else None
    if role == "target" and kind is not None and not kind.can_be_target:
        raise UserError(f"{shown(typed)!r} is a draft source, not a target model: pick it as the draft")
    if kind is not None and not kind.loads_weights:
        return  # no weights of their own: nothing to list
    allowed = allowed_ids(presets)
    if allowed is not None and typed not in allowed:
        raise UserError(f"{shown(typed)!r} is not on this server's model list: pick one of the presets")


def max_params() -> float | None:
    """The largest model (in parameters) a public server fetches: SPECDEC_MAX_PARAMS, 8e9 by default."""
    raw = os.environ.get("SPECDEC_MAX_PARAMS", "").strip()
    if raw:
        return float(raw) if float(raw) > 0 else None
    return 8e9 if public() else None


def memory_bytes(device: str = "cpu") -> int | None:
    """The memory a model is loaded into: the GPU's for CUDA, else the host's physical memory."""
    try:
        if device.startswith("cuda"):
            import torch

            return torch.cuda.get_device_properties(torch.device(device)).total_memory
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, RuntimeError, AttributeError):
        return None


FIT = 0.75  # a model may take at most this share of the memory it loads into; the rest is caches and runs


def check_size(repo_id: str, token: str | bool | None, bytes_per_param: int = 4, device: str = "cpu") -> None:
    """Refuse a Hub model over the cap, or too big for this host's memory, before any weight is downloaded.

    The safetensors parameter count the Hub reports is used; without it, one estimated from
    config.json (12 L H^2 + V H). A model with neither is refused, since its size is unknown.
    """
    from app.core.config import UserError

    cap = max_params()
    if cap is None:
        return
    from huggingface_hub import HfApi, hf_hub_download

    try:
        info = HfApi().model_info(repo_id, token=token)
        params = info.safetensors.total if info.safetensors else None
        if params is None:
            import json

            config = json.loads(open(hf_hub_download(repo_id, "config.json", token=token)).read())
            hidden, layers = config.get("hidden_size") or config.get("n_embd"), config.get("num_hidden_layers")
            layers = layers or config.get("n_layer")
            params = 12 * layers * hidden**2 + config.get("vocab_size", 0) * hidden if hidden and layers else None
    except Exception:  # noqa: BLE001 - unreachable or unknown repos fail later with the loader's own message
        return
    if params is None:
        raise UserError(f"{shown(repo_id)!r}: its size is unknown, and this server only loads models it can size")
    if params > cap:
        raise UserError(
            f"{shown(repo_id)!r} has {params / 1e9:.1f}B parameters; this server loads at most "
            f"{cap / 1e9:.1f}B (SPECDEC_MAX_PARAMS)"
        )
    memory = memory_bytes(device)
    if memory and params * bytes_per_param > FIT * memory:
        raise UserError(
            f"{shown(repo_id)!r} needs about {params * bytes_per_param / 2**30:.0f} GiB at {8 * bytes_per_param} "
            f"bits a weight, more than this server's {memory / 2**30:.0f} GiB can hold: pick a smaller model"
        )


def token_for(model_id: str, presets: set[str]) -> str | bool | None:
    """The Hub token for loading `model_id`: the owner's only for listed ids, and only on opt-in.

    None lets huggingface_hub use the owner's login (the CLI, where the user is the owner); False
    sends no token at all. Every id typed into a server gets False unless the owner opts in with
    SPECDEC_OWNER_TOKEN=1 on a private server: a plain reverse proxy can make visitors look local.
    """
    if not public():
        typed = _serving and model_id not in presets
        return False if typed and os.environ.get("SPECDEC_OWNER_TOKEN") != "1" else None
    listed = allowed_ids(presets)
    opted_in = os.environ.get("SPECDEC_OWNER_TOKEN_FOR_PRESETS") == "1"
    if opted_in and listed is not None and model_id in listed:
        return None
    return False
