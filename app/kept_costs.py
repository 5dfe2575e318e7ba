"""This machine's calibrations, kept: each measured once per kind of request in a process, and kept on
disk so that a later process on the CPU starts from one instead of measuring.

A calibration takes seconds (calibrate.measure), and a CLI command or a restarted server would otherwise
pay them on its first request for each pair. A kept one is filed under what the costs depend on (the key:
pair, precision, k_max, threads, cache kind, cost class), the models' shapes, and the machine and code that
measured them, so another CPU, torch, model or version of this app never reads it. It is kept only where
the passes timed before and after the measurement agree (a burst of load during it would otherwise stay
on disk), and used only where the same passes, timed now, agree with those. A run that drifts from its
costs (drift) drops them from both. On CUDA every process measures: measuring captures each width's graph.
SPECDEC_KEEP_COSTS=0 keeps nothing on disk; the benchmarks keep nothing (keep_none).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from app import calibrate
from app.core.config import SamplingConfig, SpecConfig
from app.core.costs import Costs
from app.kv.cache import DynamicRollbackCache
from app.models import threads
from app.models.gguf_target import cache_root
from app.models.int8_kernel import ISA_ENV
from app.models.loading import precision_of

log = logging.getLogger(__name__)

MAX_CACHED = 16
DRIFT = 1.3  # passes this many times slower or faster than measured: measure again
DRIFT_ROUNDS = 8  # the fewest one-token passes a run's drift check reads
FORMAT = 1  # bumped when what a file holds changes meaning
STALE_S = 30 * 86400  # a kept file unused this long goes when another is written
APP = Path(__file__).resolve().parent

_cache: dict[tuple, Costs] = {}  # key -> this process's costs, least recently used first
_lock = threading.Lock()  # held through a measurement: one per key
_origins: dict[int, tuple[Costs, str]] = {}  # id(costs) -> (costs, where they came from), when read from disk
_origins_lock = threading.Lock()  # a run's summary reads an origin while another request measures
_files: dict[tuple, Path] = {}  # key -> the file this process read its costs from or wrote them to
_keep = True  # False: this process keeps nothing on disk (keep_none)


def costs_for(
    pair,
    spec: SpecConfig,
    target_cache: Callable = DynamicRollbackCache,
    sampling: SamplingConfig | None = None,
    report: Callable[[float], None] | None = None,
) -> Costs:
    """This machine's costs for `pair`, measured once per pair, draft, k_max, threads, cache kind and
    cost class of the sampling settings (`calibrate.cost_class`; default greedy), under the first
    request's, or read from disk where an earlier process kept them; `report` hears a measurement's
    progress (calibrate.measure)."""
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
                _unnote(_cache.pop(next(iter(_cache))))
            _cache[key] = _kept_or_measured(pair, spec.k_max, target_cache, sampling, tree, key, report)
        _cache[key] = _cache.pop(key)  # now the most recently used
        return _cache[key]


def _kept_or_measured(
    pair, k_max: int, target_cache: Callable, sampling: SamplingConfig, tree: int, key: tuple, report
) -> Costs:
    """The calibration kept on disk for `key` where passes timed now agree with those kept beside it,
    else a new measurement, kept for the next process where the passes before and after it agree."""

    def measure() -> Costs:
        return calibrate.measure(pair, k_max, target_cache, sampling=sampling, tree=tree, report=report)

    def check() -> list[float]:
        return calibrate.check_passes(pair, k_max, target_cache)

    if not (enabled() and str(pair.target.device) == "cpu"):
        return measure()
    try:
        name = _name(key, pair)
    except Exception as e:  # noqa: BLE001 - a model that cannot describe itself: measured, not kept
        log.warning("calibration not kept: %s", e)
        return measure()
    before = check()
    kept = _load(key, name, widths=max(k_max, tree) + 1)
    if kept is not None:
        times = _agree(before, kept.reference_s)
        if times is None:  # a process's first passes can run slow for a moment: time them once more
            before = check()
            times = _agree(before, kept.reference_s)
        if times is not None:
            _touch(key)
            note = f"round costs measured here {_ago(time.time() - kept.saved)}; passes timed now take {times}"
            with _origins_lock:
                _origins[id(kept.costs)] = (kept.costs, note + " their time then")
            return kept.costs
    costs = measure()
    # Kept with the passes timed before it, as a later process times them: soon after its load.
    if _agree(check(), before) is not None:
        _save(key, name, costs, before)
    return costs


def origin(costs: Costs) -> str | None:
    """Where `costs` came from when an earlier process measured them (kept on disk), else None."""
    with _origins_lock:
        held = _origins.get(id(costs))
    return held[1] if held is not None and held[0] is costs else None


def provenance(costs: Costs) -> str:
    """What a run's JSON says of where its costs came from: origin, or a measurement in this process."""
    return origin(costs) or "measured in this process"


def _unnote(costs: Costs) -> None:
    with _origins_lock:
        _origins.pop(id(costs), None)


def forget(costs: Costs | None = None) -> int:
    """Drop the measurement `costs` came from (None: every measurement here), on disk too, so that the
    next request of its kind measures this machine again; how many were dropped."""
    with _lock:
        gone = [key for key, held in _cache.items() if costs is None or held is costs]
        for key in gone:
            _unnote(_cache.pop(key))
            _drop(key)
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


def _agree(now: list[float], then: list[float] | tuple[float, ...]) -> str | None:
    """The ratios of passes timed now to those timed then, as "1.02x and 0.97x", where each is within
    DRIFT either way; None where any is not (or the two do not pair up)."""
    if len(now) != len(then) or not all(t > 0 for t in then):
        return None
    ratios = [a / b for a, b in zip(now, then, strict=True)]
    if not all(1 / DRIFT <= r <= DRIFT for r in ratios):
        return None
    return " and ".join(f"{r:.2f}x" for r in ratios)


def _ago(seconds: float) -> str:
    if seconds < 3600:
        return f"{max(seconds, 0) / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago" if seconds < 2 * 86400 else f"{seconds / 86400:.0f} days ago"


# On disk. Nothing here may fail a request: a folder that cannot be read or written, or a file cut short
# or written by anything else, logs one line and the machine is measured as if nothing were kept.


def enabled() -> bool:
    """Whether this process keeps calibrations on disk (SPECDEC_KEEP_COSTS: 0, false, no or off: not)."""
    return _keep and os.environ.get("SPECDEC_KEEP_COSTS", "1").strip().lower() not in ("0", "false", "no", "off")


def keep_none() -> None:
    """This process reads and writes no kept calibration: a benchmark measures the machine it times."""
    global _keep
    _keep = False


def folder() -> Path:
    """Where kept calibrations live: costs/ under the app's cache folder (SPECDEC_CACHE)."""
    return cache_root() / "costs"


@dataclass(frozen=True)
class Kept:
    costs: Costs
    reference_s: tuple[float, ...]  # calibrate.check_passes's seconds just before the measurement
    saved: float  # when, as time.time()


def _load(key: tuple, name: str, widths: int) -> Kept | None:
    """The calibration kept for `key` under `name`, its pass curve `widths` long, or None (none kept, or
    unreadable)."""
    try:
        path = folder() / name
        if not path.is_file():
            return None
        doc = json.loads(path.read_text())
        kept = Kept(_costs(doc["costs"], widths), tuple(_seconds(doc["reference_s"])), float(doc["saved"]))
        if len(kept.reference_s) != 2 or not all(s > 0 for s in kept.reference_s):
            raise ValueError("two reference passes expected")
    except Exception as e:  # noqa: BLE001 - anything a bad file or folder raises: measure instead
        log.warning("kept calibration %s unreadable (%s): measuring again", name, e)
        return None
    _files[key] = path
    return kept


def _costs(held, widths: int) -> Costs:
    """A Costs from a file's mapping, checked as the cost model reads it: a pass curve of `widths` positive,
    non-decreasing seconds, a positive plain round, and finite, non-negative numbers elsewhere."""
    names = {f.name: f.default for f in fields(Costs)}
    if not isinstance(held, dict) or not set(held) <= set(names):
        raise ValueError("not a calibration")
    values = {k: tuple(_seconds(v)) if isinstance(names[k], tuple) or k == "verify_s" else v for k, v in held.items()}
    for k, v in values.items():
        if not isinstance(v, tuple) and (
            isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) or v < 0
        ):
            raise ValueError(f"{k} is not a non-negative number")
    curve = values.get("verify_s", ())
    if len(curve) != widths or not all(0 < a <= b for a, b in zip(curve, curve[1:] + curve[-1:], strict=True)):
        raise ValueError(f"the pass curve is not {widths} increasing times")
    if not values.get("plain_round_s", 0) > 0 or not isinstance(values.get("context", 0), int):
        raise ValueError("no plain round, or a context that is not a count")
    return Costs(**values)


def _seconds(values) -> list[float]:
    if not isinstance(values, list) or not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values
    ):
        raise ValueError("not a list of seconds")
    return [float(v) for v in values]


def _save(key: tuple, name: str, costs: Costs, reference_s: list[float]) -> None:
    """Keep `costs` for `key` under `name`, with the passes timed just before the measurement."""
    doc = dict(key=repr(key), costs=asdict(costs), reference_s=reference_s, saved=time.time())
    try:
        path = folder() / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")  # processes writing at once each rename a whole file
        tmp.write_text(json.dumps(doc))
        tmp.replace(path)
    except Exception as e:  # noqa: BLE001 - a folder that cannot be written: nothing kept, nothing broken
        log.warning("could not keep the calibration (%s)", e)
        return
    _files[key] = path
    try:
        for old in [*path.parent.glob("*.json"), *path.parent.glob("*.tmp")]:
            # unused that long: another version of the app wrote it, its settings went out of use, or a
            # process stopped mid-write
            try:
                if time.time() - old.stat().st_mtime > STALE_S:
                    old.unlink()
            except OSError:
                pass  # another process took it first
    except OSError:
        pass  # the folder cannot be listed now: the next write sweeps


def _touch(key: tuple) -> None:
    """Mark the kept file in use (not stale), without creating it where another process dropped it."""
    try:
        os.utime(_files[key])
    except (OSError, KeyError):
        pass


def _drop(key: tuple) -> None:
    """Remove the file this process read or wrote for `key` (a run drifted from it)."""
    path = _files.pop(key, None)
    try:
        if path is not None and enabled():
            path.unlink(missing_ok=True)
    except OSError as e:
        log.warning("could not drop the kept calibration (%s)", e)


def _name(key: tuple, pair) -> str:
    """The file name of `key`'s calibration on this machine, with this code and these models' shapes."""
    # the kernel's instruction set, where the owner names a narrower one than the CPU's widest
    kernel = os.environ.get(ISA_ENV, "").strip().lower()
    parts = (FORMAT, key, _cpu(), os.cpu_count(), _torch(), _code(), _shapes(pair), kernel)
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24] + ".json"


def _shapes(pair) -> tuple:
    """What of the pair's models sets a pass's cost beyond their names (a local folder retrained at
    another size, a new revision): each model's class, configuration and parameter count."""
    models = [pair.target, *(pair.draft.modules() if pair.draft is not None else [])]
    described = []
    for m in models:
        config = getattr(m, "config", None)
        text = config.to_json_string(use_diff=False) if hasattr(config, "to_json_string") else ""
        described.append((type(m).__name__, text, sum(p.numel() for p in m.parameters())))
    return tuple(described)


def _torch() -> str:
    import torch

    return torch.__version__


@functools.cache
def _code() -> str:
    """A digest of this app's source (its Python and the kernel's C++): a change to either may change costs."""
    h = hashlib.sha256()
    try:
        for path in sorted(p for p in APP.rglob("*") if p.suffix in (".py", ".cpp")):
            h.update(str(path.relative_to(APP)).encode() + b"\0" + path.read_bytes())
    except OSError:
        h.update(str(time.time()).encode())  # unreadable: a digest no later process shares
    return h.hexdigest()[:16]


def _cpu(cpuinfo: str | None = None) -> str:
    """The CPU's model name and a digest of its feature flags (Linux's /proc/cpuinfo: a virtual machine
    may name two generations alike); elsewhere what platform says."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    info: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        info.setdefault(name.strip(), value.strip())
    if "model name" not in info:
        return platform.processor() or platform.machine()
    return f"{info['model name']} {hashlib.sha256(info.get('flags', '').encode()).hexdigest()[:8]}"
