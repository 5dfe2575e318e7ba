"""How many threads torch uses inside one operation (intra-op), chosen for a shared machine.

Measured on this project's 2-core CPU with the bundled pair (docs/threads.md): with another
process busy, every core's worth of threads collapses to a third of one thread's speed or less
(OpenMP workers wait on a core that is taken), while one thread keeps going; with the machine
idle, every core is up to a fifth faster for speculation, whose verify passes multiply several
rows at once. So the default, "auto", follows the load: before a generation and then at most
every INTERVAL seconds between its rounds, it reads the kernel's CPU counters and uses the cores
that other processes left free (at least one, at most torch's own default). `--threads N` or
SPECDEC_THREADS=N fixes the count instead; SPECDEC_THREADS=auto is the default spelled out.

Thread counts change speed, not rounding, where torch multiplies with MKL (MKL_CBWR below). The
adaptive k policy's cost model is measured once per pair under "auto" (calibrate.py), so k never
follows the load either.
"""

from __future__ import annotations

import argparse
import functools
import os
import threading
import time

from app.core.config import UserError

# MKL's strict conditional numerical reproducibility: matrix products round the same at any thread
# count, so auto threads change no logit (without it a cached pass of the bundled target differed by
# up to 1e-5 between 1 and 2 threads), and on this project's CPU its 2-thread path multiplies the
# few rows of a verify pass about twice as fast. MKL reads it at its first product, so setting it on
# import is early enough even after `import torch`; a value the user set is kept.
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

ENV = "SPECDEC_THREADS"
AUTO = "auto"
DEFAULT = AUTO  # the best worst case and, within a tenth, the best idle speed (docs/threads.md)
INTERVAL = 0.2  # seconds between two readings of the load: a neighbour that starts costs at most this
HEADROOM = 0.25  # a core counts as free when others use at most this much of it


def parse(raw: str, source: str) -> int | str:
    """A thread setting from text: "auto" or a whole number >= 1."""
    raw = raw.strip().lower()
    if raw == AUTO:
        return AUTO
    try:
        n = int(raw)
    except ValueError:
        raise UserError(f"{source} must be a whole number of threads or 'auto', got {raw!r}") from None
    if n < 1:
        raise UserError(f"{source} must be at least 1, got {n}")
    return n


def choose(requested: int | str | None = None) -> int | str:
    """The setting in force: `requested` (a --threads flag) if given, else SPECDEC_THREADS, else DEFAULT."""
    if requested is not None:
        return parse(str(requested), "--threads")
    if os.environ.get(ENV, "").strip():
        return parse(os.environ[ENV], ENV)
    return DEFAULT


def cli_value(raw: str) -> int | str:
    """argparse type for --threads."""
    try:
        return parse(raw, "--threads")
    except UserError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


class Load:
    """Cores that other processes used since the previous reading, from the kernel's counters.

    Under a CPU quota (cgroup v2 `cpu.max` of this process's cgroup or a parent, v1
    `cpu.cfs_quota_us`), the cgroup's own usage against its quota, since other tenants of the host
    do not share that quota; otherwise /proc/stat's busy time of the CPUs this process may run on.
    This process's own CPU time (all its threads, the web server's included) is taken out, so a
    generation never counts itself as a neighbour.
    """

    def __init__(self):
        cpus = _cpus()
        quota = _quota_usage()
        if quota:
            self.capacity, self._usage = min(quota[0], float(len(cpus))), quota[1]
        else:  # the CPU names are looked up once, not at every reading
            self.capacity, self._usage = float(len(cpus)), functools.partial(_host_usage, {f"cpu{i}" for i in cpus})
        self._last = self._read()

    def _read(self) -> tuple[float, float | None, float]:
        try:
            busy = self._usage()
        except (OSError, ValueError, IndexError, KeyError):
            busy = None  # a counter in a shape this code does not know: no reading, never an error
        return time.monotonic(), busy, time.process_time()

    def others(self) -> float | None:
        """Cores busy with other processes since the last call (None if the counters cannot be read)."""
        now = self._read()
        (t0, busy0, own0), (t1, busy1, own1) = self._last, now
        self._last = now
        if t1 - t0 <= 0 or busy0 is None or busy1 is None or own1 < own0:
            return None  # unreadable, or a forked child whose own clock restarted
        return max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def _quota_usage():
    """(cores of quota, usage reader in CPU seconds) where a cgroup quota limits this process, else None."""
    try:
        return _v2_quota() or _v1_quota()
    except (ValueError, IndexError):
        return None  # a quota file in a shape this code does not know: count the host's CPUs instead


def _v2_quota():
    """The tightest cpu.max of this process's cgroup and its parents (systemd slices, nested containers)."""
    own = next(
        (line[3:].strip() for line in (_read("/proc/self/cgroup") or "").splitlines() if line.startswith("0::")), None
    )
    if own is None:
        return None
    best, path = None, own.rstrip("/")
    while True:
        text = _read(f"/sys/fs/cgroup{path}/cpu.max")
        if text and text.split()[0] != "max":
            quota, period = text.split()[:2]
            cores = int(quota) / int(period)
            if best is None or cores < best[0]:
                best = (cores, f"/sys/fs/cgroup{path}/cpu.stat")
        if not path:
            break
        path = path.rsplit("/", 1)[0]
    if best is None:
        return None
    cores, stat = best

    def usage():
        fields = dict(line.split() for line in (_read(stat) or "").splitlines() if len(line.split()) == 2)
        return int(fields["usage_usec"]) / 1e6 if "usage_usec" in fields else None

    return cores, usage


def _v1_quota():
    v1 = "/sys/fs/cgroup/cpu/cpu.cfs_"
    quota, period = _read(v1 + "quota_us"), _read(v1 + "period_us")
    if not (quota and period and int(quota) > 0):
        return None

    def usage():
        text = _read("/sys/fs/cgroup/cpuacct/cpuacct.usage") or _read("/sys/fs/cgroup/cpu/cpuacct.usage")
        return int(text) / 1e9 if text else None

    return int(quota) / int(period), usage


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _host_usage(names: set[str]) -> float | None:
    """Busy CPU seconds of the named CPUs ("cpu0", ...), from /proc/stat."""
    text = _read("/proc/stat")
    if text is None:
        return None
    busy = 0
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] in names:  # user nice system idle iowait irq softirq steal: all but idle, iowait
            values = [int(v) for v in fields[1:9]]
            busy += sum(values) - values[3] - values[4]
    return busy / _TICK


class _Auto:
    """The load-following choice, shared by every generation in this process."""

    def __init__(self, share: int = 1):
        self.share = share  # generations that may run at once in this process (the app's concurrency)
        self.n = 1
        self._load: Load | None = None
        self._due = 0.0
        self._lock = threading.Lock()

    def choose(self) -> int:
        """Re-read the load if INTERVAL has passed; return the thread count for now."""
        now = time.monotonic()
        if now < self._due:
            return self.n
        with self._lock:
            if now >= self._due:
                if self._load is None:
                    self._load = Load()
                    time.sleep(0.05)  # a first reading needs a short window; later ones span the gap
                others = self._load.others()
                if others is not None:
                    self.n = self._fit(self._load.capacity - others)
                self._due = now + INTERVAL
        return self.n

    def _fit(self, spare: float) -> int:
        cap = max(1, min(ceiling(), int(self._load.capacity + HEADROOM)) // self.share)
        n = int(spare / self.share + HEADROOM)
        if n < self.n and int(spare / self.share + 0.5) >= self.n:
            n = self.n  # hysteresis: keep a count while each thread still has half a core free
        return max(1, min(cap, n))


_auto: _Auto | None = None
_default: int | None = None


def ceiling() -> int:
    """torch's own default count (its physical cores), read before this module first sets it."""
    global _default
    if _default is None:
        import torch

        _default = torch.get_num_threads()
    return _default


def apply(requested: int | str | None = None, share: int = 1) -> int | str:
    """Put the setting in force for this process and return it ("auto" or the fixed count).

    `share`: how many generations may run at once here (the app's concurrency), so that auto
    threads divide the free cores among them.
    """
    import torch  # here, not at the top: argparse's --help reads this module and stays fast

    global _auto
    ceiling()
    setting = choose(requested)
    if setting == AUTO:
        if _auto is None or _auto.share != share:  # already auto: keep its reading and its count
            _auto = _Auto(share)
        match_load()
    else:
        _auto = None
        if torch.get_num_threads() != setting:
            torch.set_num_threads(setting)
    return setting


def match_load() -> int | None:
    """Called by the engine before each round: under "auto", match the threads to the load now.

    Cheap between readings. torch keeps the count per OS thread for OpenMP, and a web server runs a
    generator's steps on whichever worker thread is free, so the count is set where the work runs.
    Returns the count set, or None under a fixed count (set once by `apply`).
    """
    auto = _auto  # read once: an apply() on another thread may replace it meanwhile
    if auto is None:
        return None
    import torch

    n = auto.choose()
    if torch.get_num_threads() != n:
        torch.set_num_threads(n)
    return n


def key() -> int | str:
    """What a measured cost depends on: "auto" under auto threads (one measurement, so one seed keeps
    one output under any load), else the fixed count."""
    import torch

    return AUTO if _auto is not None else torch.get_num_threads()
