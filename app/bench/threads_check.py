"""`python -m app bench --threads-check`: the measurement behind threads.DEFAULT.

Tokens/s of plain and speculative decoding with one thread, with every core and with "auto"
(threads that follow the load), each idle and beside one other busy process, as on a 2-vCPU
host that also runs the web server.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager, nullcontext

from app import models
from app.args import settings, with_chat
from app.bench.contenders import Contender, fixed_k, ours
from app.core.config import settings_dict
from app.data.prompts import suite
from app.models import threads


@contextmanager
def busy_neighbour():
    """One other process spinning on a core, as on a shared 2-vCPU host next to the web server."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)  # let it get scheduled before the clock starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


def threads_check(args) -> dict:
    """Tokens/s of plain and speculative decoding (fixed k) for 1 thread, every core and auto,
    idle and beside one busy process: the measurement behind threads.DEFAULT."""
    pair = models.load_pair(args.target, args.draft, args.device, args.dtype)
    st = with_chat(settings(args), args, pair.tokenizer)
    s, sp, r = st.sampling, st.spec, st.run
    prompts = [pair.encode(p, r.chat) for p in suite(args.suite, r.chat)[: args.limit or 3]]
    field = [
        Contender("autoregressive", "plain", ours(pair, s, sp, r, False, None)),
        Contender("speculative", f"{pair.draft_name}, k = {sp.k}", ours(pair, s, fixed_k(sp, sp.k), r, True, None)),
    ]
    counts, results = [*sorted({1, threads.ceiling()}), threads.AUTO], {}
    for n in counts:
        threads.apply(n)
        for c in field:
            c.run(prompts[0], 16)  # warm-up at this setting
    for busy in (False, True):
        rates = {(n, c.name): [] for n in counts for c in field}
        with busy_neighbour() if busy else nullcontext():
            # Settings interleaved within each repetition: a shared host's own drift hits all alike.
            for _ in range(args.reps):
                for ids in prompts:
                    for n in counts:
                        threads.apply(n)
                        for c in field:
                            out, seconds, _ = c.run(ids, r.max_new_tokens)
                            rates[n, c.name].append(len(out) / seconds)
        for n in counts:
            key = f"threads={n}, {'busy' if busy else 'idle'}"
            results[key] = {c.name: statistics.median(rates[n, c.name]) for c in field}
            print(key + ": " + ", ".join(f"{name} {v:.0f} tok/s" for name, v in results[key].items()), file=sys.stderr)
    threads.apply(args.threads)
    summary = {f"threads={n}": _ratios(results, n, counts) for n in counts}
    best = max(counts, key=lambda n: summary[f"threads={n}"]["worst_case_tokens_per_s"])
    return dict(
        target=pair.target_name,
        draft=pair.draft_name,
        cores=os.cpu_count(),
        reps=args.reps,
        threads_settings=counts,
        prompts=len(prompts),
        settings=settings_dict("bench", s, sp, r),
        tokens_per_s=results,
        neighbour="one process spinning on a core (python -c 'while True: pass')",
        summary=summary | dict(best_worst_case_threads=best, default_threads=threads.DEFAULT),
    )


def _ratios(results: dict, n: int | str, counts: list) -> dict:
    """For setting n: busy over idle and idle over the best idle setting, per mode, and the worst tokens/s."""
    idle, busy = results[f"threads={n}, idle"], results[f"threads={n}, busy"]
    best_idle = {mode: max(results[f"threads={m}, idle"][mode] for m in counts) for mode in idle}
    return {
        **{f"{mode}_busy_over_idle": busy[mode] / idle[mode] for mode in idle},
        **{f"{mode}_idle_over_best_idle": idle[mode] / best_idle[mode] for mode in idle},
        "worst_case_tokens_per_s": min(*idle.values(), *busy.values()),
    }
