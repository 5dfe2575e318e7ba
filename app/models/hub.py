"""Whether the Hugging Face Hub can be reached, asked once in a while and quickly, and what to tell a
user when it cannot."""

from __future__ import annotations

import time

HUB_PROBE_TIMEOUT = 3.0  # seconds for the one look at the Hub before a download (instead of ~47 s of retries)
HUB_PROBE_TTL = 60.0  # seconds a probe's answer is reused
_hub_seen: dict[str, tuple[float, bool]] = {}  # endpoint -> (when probed, reachable)


def hub_reachable() -> bool:
    """Whether the Hugging Face Hub answers at all: False under HF_HUB_OFFLINE, else one quick probe."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    if constants.HF_HUB_OFFLINE:
        return False
    endpoint, now = constants.ENDPOINT, time.monotonic()
    seen = _hub_seen.get(endpoint)
    if seen is None or now - seen[0] > HUB_PROBE_TTL:
        try:  # any HTTP answer, even an error status, means the Hub can be reached
            get_session().head(endpoint, timeout=HUB_PROBE_TIMEOUT)
            seen = (now, True)
        except Exception:  # noqa: BLE001 - refused, unresolvable, timed out: all mean offline
            seen = (now, False)
        _hub_seen[endpoint] = seen
    return seen[1]


def offline_message(shown: str, repo_id: str) -> str:
    """How to get a Hub model when the Hub cannot be reached (repo_id is a Hub id, never a host path)."""
    from huggingface_hub import constants

    why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else f"the Hub ({constants.ENDPOINT}) cannot be reached"
    return (
        f"{shown!r} is not a local directory and is not in the Hugging Face cache, and {why}. "
        f"Download it where there is network (`hf download {repo_id}`, then HF_HUB_OFFLINE=1 loads it from "
        "the cache), or give the model's local directory."
    )
