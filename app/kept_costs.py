"""This machine's calibrations, kept: each measured once per kind of request in a process, and kept on
disk so that a later process starts from one instead of measuring.

A calibration takes seconds (calibrate.measure), and a CLI command or a restarted server would otherwise
pay them on its first request for each pair. A kept one is filed under what the costs depend on (the key:
pair, precision, k_max, threads, cache kind, cost class) and under the machine and the code that measured
them, so another CPU, card, torch or version of this app never reads it; a few passes are timed against
the ones timed beside it before it is used, and the machine is measured again where they disagree.
A run that drifts from its costs (drift) drops them from both. SPECDEC_KEEP_COSTS=0 keeps nothing on disk.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

from app import calibrate
from app.core.config import SamplingConfig, SpecConfig
from app.core.costs import Costs
from app.kv.cache import DynamicRollbackCache
from app.models import threads
from app.models.gguf_target import cache_root
from app.models.loading import precision_of

log = logging.getLogger(__name__)

_cache: dict[tuple, Costs] = {}
_lock = threading.Lock()
MAX_CACHED = 16


def costs_for(
    pair,
    spec: SpecConfig,
    target_cache: Callable = DynamicRollbackCache,
    sampling: SamplingConfig | None = None,
    report: Callable[[float], None] | None = None,
) -> Costs:
    """This machine's costs for `pair`, measured once per pair, draft, k_max, threads, cache kind and
    cost class of the sampling settings (`cost_class`; default greedy), under the first request's;
    `report` hears a measurement's progress (measure)."""
    sampling = sampling or SamplingConfig()
    tree = spec.tree if spec.tree_auto else 0  # the widest tree the cost model may choose
    key = (
        pair.target_name,
        pair.draft_name,
        str(pair.target.device),
        precision_of(pair.target),  # an int8 model holds fp32 tensors too: its dtype does not name it
        spec.k_max,
        threads.key(),
        getattr(target_cache, "__name__", str(target_cache)),
        calibrate.cost_class(sampling),
        tree,
    )
    with _lock:
        if key not in _cache:
            if len(_cache) >= MAX_CACHED:  # the least recently used goes: greedy stays while it is in use
                _cache.pop(next(iter(_cache)))
            _cache[key] = _kept_or_measured(pair, spec.k_max, target_cache, sampling, tree, key, report)
        _cache[key] = _cache.pop(key)  # now the most recently used
        return _cache[key]


_origins: dict[tuple, str] = {}  # key -> where its costs came from, when another process measured them


def _kept_or_measured(pair, k_max: int, target_cache: Callable, sampling, tree: int, key: tuple, report) -> Costs:
    """The calibration kept on disk for `key` where passes timed now agree with those kept beside it
    (reused), else a new measurement, kept for the next process."""
    device, check = str(pair.target.device), lambda: calibrate.check_passes(pair, k_max, target_cache)
    _origins.pop(key, None)
    kept = reused(key, device, check, DRIFT)
    if kept is not None:
        _origins[key] = kept.note
        return kept.costs
    costs = calibrate.measure(pair, k_max, target_cache, sampling=sampling, tree=tree, report=report)
    save(key, device, costs, check())
    return costs


def origin(costs: Costs) -> str | None:
    """Where `costs` came from when an earlier process measured them (kept on disk), else None."""
    with _lock:
        return next((_origins.get(k) for k, held in _cache.items() if held is costs), None)


DRIFT = 1.3  # a run's one-token passes this many times slower or faster than measured: measure again
DRIFT_ROUNDS = 8  # the fewest one-token passes a check reads


def forget(costs: Costs | None = None) -> int:
    """Drop the measurement `costs` came from (None: every measurement here), so that the next request
    of its kind measures this machine again; how many were dropped."""
    with _lock:
        gone = [key for key, held in _cache.items() if costs is None or held is costs]
        for key in gone:
            del _cache[key]
            _origins.pop(key, None)
            drop(key)
    return len(gone)


def drift(costs: Costs, plain_steps) -> float | None:
    """How many times its measured time a run's one-token passes took (the median over the rounds of a
    plain run beside it, each at its own context), when that is off by more than DRIFT either way: the
    measurement is then forgotten and the next request measures again. None: within DRIFT, or too few
    rounds to tell. A measurement taken while the machine was busy (a browser drawing the first page
    beside it, say) would otherwise steer every later run on this server."""
    ratios = [
        s.verify_time / costs.verify_time(1, s.context)
        for s in plain_steps[1:]  # the first round holds the prefill
        if not s.drafted and s.verify_time > 0
    ]
    if len(ratios) < DRIFT_ROUNDS:
        return None
    ratio = statistics.median(ratios)
    if 1 / DRIFT <= ratio <= DRIFT:
        return None
    forget(costs)
    return ratio


# On disk

FORMAT = 1  # bumped when what a file holds changes meaning
STALE_S = 30 * 86400  # a kept file unused this long is removed when another is written
APP = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Kept:
    costs: Costs
    reference_s: tuple[float, ...]  # calibrate.check_passes's seconds, timed right after the measurement
    saved: float  # when, as time.time()
    note: str = ""  # where the costs came from, as a run reports it


def reused(key: tuple, device: str, check: Callable[[], list[float]], tolerance: float) -> Kept | None:
    """The calibration kept for `key` where `check()`'s seconds, timed now, are each within `tolerance`
    times (either way) of those timed beside it when it was measured; None: measure again."""
    kept = load(key, device)
    if kept is None:
        return None
    ratios = [now / then for now, then in zip(check(), kept.reference_s, strict=True) if then > 0]
    if len(ratios) != len(kept.reference_s) or not all(1 / tolerance <= r <= tolerance for r in ratios):
        return None
    try:
        _files[key].touch()  # in use: not stale (save)
    except OSError:
        pass
    times = " and ".join(f"{r:.2f}x" for r in ratios)
    note = f"round costs measured here {_ago(time.time() - kept.saved)}; passes timed now take {times} their time then"
    return replace(kept, note=note)


def _ago(seconds: float) -> str:
    if seconds < 3600:
        return f"{max(seconds, 0) / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago" if seconds < 2 * 86400 else f"{seconds / 86400:.0f} days ago"


def enabled() -> bool:
    return os.environ.get("SPECDEC_KEEP_COSTS", "1").strip() != "0"


def load(key: tuple, device: str) -> Kept | None:
    """The calibration kept for `key` on this machine and code, or None (none kept, or unreadable)."""
    path = _path(key, device)
    if not enabled() or not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
        names = {f.name for f in fields(Costs)}
        costs = Costs(**{k: tuple(v) if isinstance(v, list) else v for k, v in doc["costs"].items() if k in names})
        return Kept(costs, tuple(float(s) for s in doc["reference_s"]), float(doc["saved"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.warning("kept calibration %s unreadable (%s): measuring again", path.name, e)
        return None


def save(key: tuple, device: str, costs: Costs, reference_s: list[float]) -> None:
    """Keep `costs` for `key`, with the check's seconds timed beside them; a failure to write only logs."""
    if not enabled():
        return
    path = _path(key, device)
    doc = dict(key=repr(key), machine=_machine(device), costs=asdict(costs), reference_s=reference_s, saved=time.time())
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes writing at once each rename a whole file
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
        # A file unused that long (another version of the app wrote it, or its settings went out of use).
        for old in path.parent.glob("*.json"):
            if time.time() - old.stat().st_mtime > STALE_S:
                old.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not keep the calibration (%s)", e)


_files: dict[tuple, Path] = {}  # key -> the file this process read its costs from or wrote them to


def drop(key: tuple) -> None:
    """Forget what is kept on disk for `key` (a run drifted from it)."""
    path = _files.pop(key, None)
    try:
        if path is not None:
            path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not drop the kept calibration (%s)", e)


def _path(key: tuple, device: str) -> Path:
    name = hashlib.sha256(repr((key, _machine(device))).encode()).hexdigest()[:24]
    _files[key] = folder() / f"{name}.json"
    return _files[key]


def folder() -> Path:
    return cache_root() / "costs"


def _machine(device: str) -> dict:
    """What besides the key a measurement depends on: this CPU (or card), torch, and this app's code."""
    import torch

    card = torch.cuda.get_device_name(torch.device(device)) if device.startswith("cuda") else ""
    return dict(format=FORMAT, cpu=_cpu(), cores=os.cpu_count(), card=card, torch=torch.__version__, code=_code())


@functools.cache
def _code() -> str:
    """A digest of this app's source (its Python and the kernel's C++): a change to either may change costs."""
    h = hashlib.sha256()
    for path in sorted(p for p in APP.rglob("*") if p.suffix in (".py", ".cpp")):
        h.update(str(path.relative_to(APP)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _cpu() -> str:
    """The CPU's model name and a digest of its feature flags (Linux's /proc/cpuinfo: a virtual machine
    may name two generations alike); elsewhere what platform says."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    info: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        info.setdefault(name.strip(), value.strip())
    if "model name" not in info:
        return platform.processor() or platform.machine()
    return f"{info['model name']} {hashlib.sha256(info.get('flags', '').encode()).hexdigest()[:8]}"
