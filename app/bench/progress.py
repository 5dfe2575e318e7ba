"""Progress of the long commands on stderr, so that stdout carries their JSON alone."""

from __future__ import annotations

import sys
from collections.abc import Iterable

from tqdm import tqdm

# "prompt 3/10 [00:41<01:35]": the count first, as a log line reads best; no bar to wrap.
FORMAT = "{desc} {n_fmt}/{total_fmt} [{elapsed}<{remaining}]"


def say(command: str, text: str) -> None:
    """One line before a slow step: what the command is doing now."""
    tqdm.write(f"{command}: {text}", file=sys.stderr)
    sys.stderr.flush()


def counted(items: Iterable, what: str, total: int | None = None) -> tqdm:
    """`items` with a running count on stderr ("prompt 3/10"), shown before the first item starts."""
    return tqdm(items, desc=what, total=total, file=sys.stderr, bar_format=FORMAT, mininterval=1, delay=0)


def bar(what: str, total: int) -> tqdm:
    """A running count that the caller advances (bar.update()), for work spread over several loops."""
    return tqdm(desc=what, total=total, file=sys.stderr, bar_format=FORMAT, mininterval=1, delay=0)
