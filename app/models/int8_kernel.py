"""The exact int8 linear layer as one compiled call (int8_kernel.cpp), built at first use.

The build takes torch's extension tools (a C++ compiler and ninja) about a minute once per machine and
torch version; the library is kept on disk beside the converted GGUF, named by its source's digest, and
a fresh build removes other sources' builds for the same torch. It runs on AVX-512 VNNI (recent Xeons,
AMD since Zen 4) and on AVX2 (nearly every other x86-64 CPU, laptops among them), the same bits on
either. Where it cannot be built or the CPU has neither, the int8 precision keeps its pure-torch path,
which gives the same bits too, and says why once on stderr.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import torch

SOURCE = Path(__file__).with_name("int8_kernel.cpp")
OFF = "SPECDEC_NO_KERNEL"  # set (to anything but 0) to keep the pure-torch int8 path
# set to avx2 to run the AVX2 path on a CPU that has AVX-512 VNNI too: what a CPU without it runs
ISA_ENV = "SPECDEC_KERNEL_ISA"
# at::parallel_for runs on torch's OpenMP threads only in code built with OpenMP (Linux's gcc);
# elsewhere the kernel runs on one thread
OPENMP = ["-fopenmp"] if sys.platform.startswith("linux") else []
BUILDING = "building the int8 kernel (once per machine and torch version, under a minute)"

_lock = threading.Lock()
_state: dict[str, object] = {}  # "module": the loaded extension or None; "why": why not; "seconds": the build's


def build_dir() -> Path:
    """Where the built library lives: the app's cache, one folder per source digest and torch version."""
    from app.models.gguf_target import cache_root

    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:12]
    return cache_root() / "kernels" / f"int8-{digest}-torch{torch.__version__.replace('+', '-')}"


def prune_others(path: Path) -> list[Path]:
    """Remove the builds of other sources for this torch version beside `path` (an updated checkout's
    old kernels, a few MB each, which nothing loads again); other torch versions' builds stay, since
    another environment may share the cache. Returns what was removed."""
    import shutil

    suffix = path.name[path.name.index("-torch") :]
    gone = [p for p in path.parent.glob(f"int8-*{suffix}") if p != path and p.is_dir()]
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return gone


def built() -> bool:
    """Whether the library is on disk already (a first start would not build)."""
    return any(build_dir().glob("specdec_int8*.so"))


def pending() -> bool:
    """Whether the next int8 conversion here would build the kernel first (on a CPU-only machine,
    where the auto precision may pick int8)."""
    if "module" in _state or _refused() is not None:
        return False
    return not torch.cuda.is_available() and not built()


def build_beside() -> None:
    """Where the next int8 conversion would build the kernel first, start that build now on a thread of
    its own: the compiler then runs on the other core while the model converts and loads (a fresh
    start's other long step), and module() waits for it. A build under way (module() holds the lock)
    gets no second thread."""
    if pending() and not _lock.locked():
        threading.Thread(target=module, name="specdec-int8-build", daemon=True).start()


def module() -> ModuleType | None:
    """The loaded kernel, building it on first use; None where it cannot run here (why() says why)."""
    if "module" in _state:  # every layer of every pass asks: no lock once the answer is known
        return _state["module"]  # type: ignore[return-value]
    with _lock:
        if "module" not in _state:
            _state["module"] = _load()
        return _state["module"]  # type: ignore[return-value]


def why() -> str | None:
    """Why the pure-torch path runs, or None while the kernel runs (or before it was asked for)."""
    return _state.get("why")  # type: ignore[return-value]


def _refused() -> str | None:
    """Why the kernel is not even built here, or None."""
    if os.environ.get(OFF, "0") not in ("", "0"):
        return f"{OFF} is set"
    if sys.platform == "win32":
        return "the kernel is built for Linux and macOS"
    return None


def _load() -> ModuleType | None:
    refused = _refused()
    if refused is not None:
        _state["why"] = refused
        return None
    from torch.utils import cpp_extension

    path = build_dir()
    path.mkdir(parents=True, exist_ok=True)
    fresh = not built()
    if fresh:
        print(f"specdec: {BUILDING}", file=sys.stderr, flush=True)
    began = time.perf_counter()
    try:
        mod = cpp_extension.load(
            name="specdec_int8",
            sources=[str(SOURCE)],
            extra_cflags=["-O3", "-ffp-contract=off", "-fno-fast-math", *OPENMP],
            extra_ldflags=OPENMP,
            build_directory=str(path),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch path gives the same bits
        _state["why"] = f"it could not be built here ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"
        print(f"specdec: the int8 precision runs its pure-torch path: {_state['why']}", file=sys.stderr)
        return None
    if fresh:
        _state["seconds"] = time.perf_counter() - began
        print(f"specdec: built the int8 kernel in {_state['seconds']:.0f} s", file=sys.stderr, flush=True)
        prune_others(path)
    if not mod.available():
        _state["why"] = "this CPU has neither AVX-512 VNNI nor AVX2"
        return None
    choose_isa(mod)
    return mod


def choose_isa(mod: ModuleType) -> None:
    """Run the loaded kernel on the instruction set ISA_ENV names, else on the widest this CPU has."""
    chosen = os.environ.get(ISA_ENV, "").strip().lower()
    mod.use(mod.isas()[0])
    if chosen:
        try:
            mod.use(chosen)
        except RuntimeError as exc:  # the owner's setting: said once, and the widest path runs
            print(f"specdec: {ISA_ENV}={chosen} ignored: {str(exc).splitlines()[0]}", file=sys.stderr)


def isa() -> str | None:
    """The instruction set the kernel runs on ("avx512-vnni" or "avx2"), or None where it does not run."""
    mod = module()
    return mod.isa() if mod is not None else None
