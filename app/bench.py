"""Benchmarks: our engine (autoregressive, adaptive k, fixed k 1..8, prompt lookup) against
transformers' own generate (plain; assisted and prompt lookup, each with its defaults and
with a truly constant k), repeated and interleaved. `--card` (card.py) and `--threads-check`
(threads_check.py) are its two other modes.

Every contender is warmed up, then each prompt takes its own calibration (calibrate.py, which
"predicted for this machine" and adaptive k read) and runs every contender `--reps` times in
rotating order, so drift on a shared machine falls on all alike; medians and spreads are
reported, the calibrations' too, and every greedy output is checked against plain decoding token
for token.

    python -m app bench [--suite code|prose|all] [--draft ...] [--k 4] [--reps 3] [--out runs/bench]
    python -m app bench --card       # acceptance and cost of every bundled draft (card.py)
    python -m app bench --threads-check   # 1 thread, every core and auto, idle and busy (threads_check.py)
"""

from __future__ import annotations

import argparse
import functools
import html
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from app import calibrate, direct_pass, draft_spec, engine, metrics, models, plots, threads
from app.args import add_generation_args, configs
from app.config import RunConfig, SamplingConfig, SpecConfig, settings_dict
from app.corpus import HELD_OUT, stdlib_files
from app.costs import Costs
from app.policy import make_policy

PROMPTS_FILE = models.ROOT / "assets" / "prompts.json"


def held_out_prompts(n_chars: int = 700) -> list[str]:
    """One prompt per held-out stdlib file: the code up to and including a `def` line."""
    prompts = []
    for path in stdlib_files():
        if path.name not in HELD_OUT or not path.parent.name.startswith("python"):
            continue
        src = path.read_text(encoding="utf-8")
        defs = [m.end() for m in re.finditer(r"^ *def [^\n]*:\n", src, re.M) if m.start() > 1500]
        if defs:
            end = defs[len(defs) // 2]
            prompts.append(src[max(0, end - n_chars) : end])
    return prompts


def suite(name: str) -> list[str]:
    """Prompts of a suite: held-out code, the example prose, or both."""
    examples = json.loads(PROMPTS_FILE.read_text())
    if name == "code":
        return held_out_prompts()
    if name == "prose":
        return [e["prompt"] for e in examples if e["kind"] == "open-ended"]
    return held_out_prompts() + [e["prompt"] for e in examples if e["kind"] == "open-ended"]


SWEEP = range(1, 9)  # fixed k values timed beside adaptive
# transformers' assisted generation held to exactly k drafts a round: by default it also stops
# drafting early when the assistant's confidence drops below a threshold it tunes as it goes.
CONSTANT = dict(num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0)


@dataclass
class Contender:
    name: str  # short key in the JSON
    label: str  # what it is, for the report
    run: Callable[[list[int], int], tuple[list[int], float, list | None]]  # (prompt ids, n) -> ids, s, Steps
    ours: bool = True


def ours(pair, s: SamplingConfig, sp: SpecConfig, r: RunConfig, speculative: bool, costs: Costs | None):
    """Our engine as a contender; the wall clock covers everything from prompt ids to the last token."""
    def run(ids: list[int], n: int):
        proposer = pair.proposer(sp) if speculative else None
        policy = make_policy(sp, costs) if speculative else None
        start = time.perf_counter()
        steps = list(engine.generate(pair.target, pair.tokenizer, ids, proposer, s, sp,
                                     RunConfig(n, r.stop, r.chat), policy))
        engine.sync(pair.target.device)
        return [t for x in steps for t in x.emitted], time.perf_counter() - start, steps
    return run


def hf(target, assistant=None, assistant_settings: dict | None = None, lookup: dict | None = None):
    """transformers' greedy generate: plain, assisted (settings on the assistant's generation
    config, where transformers reads them, restored afterwards) or prompt lookup."""
    def run(ids: list[int], n: int):
        x = torch.tensor([ids], device=target.get_input_embeddings().weight.device)
        kw = dict(max_new_tokens=n, do_sample=False, pad_token_id=target.generation_config.pad_token_id,
                  stopping_criteria=StoppingCriteriaList([_FollowThreads()]))
        saved = {}
        if assistant is not None:
            cfg = assistant.generation_config
            saved = {key: getattr(cfg, key, None) for key in assistant_settings or {}}
            for key, value in (assistant_settings or {}).items():
                setattr(cfg, key, value)
            kw["assistant_model"] = assistant
        kw |= lookup or {}
        threads.follow()  # its prefill too runs at the threads of now; _FollowThreads covers its rounds
        try:
            with torch.inference_mode():
                engine.sync(target.device)
                start = time.perf_counter()
                out = target.generate(x, **kw)
                engine.sync(target.device)
                seconds = time.perf_counter() - start
        finally:
            for key, value in saved.items():
                setattr(assistant.generation_config, key, value)
        return out[0, len(ids):].tolist(), seconds, None
    return run


class _FollowThreads(StoppingCriteria):
    """Never stops generate(); it gives transformers' rounds the same auto threads as ours (engine.py)."""

    def __call__(self, input_ids, scores, **kwargs):
        threads.follow()
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def contenders(args, pair, lookup_pair, s, sp, r, costs, lookup_costs) -> list[Contender]:
    """Everything timed: ours first, then transformers' generate with the same models."""
    k = sp.k
    out = [Contender("autoregressive", "ours: plain autoregressive", ours(pair, s, sp, r, False, None)),
           Contender("adaptive", f"ours: {pair.draft_name}, adaptive k", ours(pair, s, _adaptive(sp), r, True, costs))]
    # Ours at --k is always run where it is transformers' like-for-like partner, swept or not.
    fixed = set(SWEEP) if args.sweep else set()
    if args.hf and s.greedy and pair.draft_model is not None:
        fixed.add(k)
    out += [Contender(f"k={j}", f"ours: {pair.draft_name}, fixed k = {j}",
                      ours(pair, s, _fixed(sp, j), r, True, costs))
            for j in sorted(fixed)]
    if lookup_pair is not None:
        out += [Contender("lookup_adaptive", "ours: prompt lookup, adaptive k",
                          ours(lookup_pair, s, _adaptive(sp), r, True, lookup_costs)),
                Contender(f"lookup_k={k}", f"ours: prompt lookup, fixed k = {k}",
                          ours(lookup_pair, s, _fixed(sp, k), r, True, lookup_costs))]
    if not (args.hf and s.greedy):  # transformers' outputs are only comparable under greedy decoding
        return out
    out.append(Contender("hf_plain", "transformers: plain generate", hf(pair.target), ours=False))
    if pair.draft_model is not None:
        out += [Contender("hf_assisted_default", "transformers: assisted generation, its defaults (up to 20 "
                          "drafts, stops drafting below 0.4 confidence)",
                          hf(pair.target, pair.draft_model, {}), ours=False),
                Contender(f"hf_assisted_k={k}", f"transformers: assisted, constant k = {k}, no confidence stop",
                          hf(pair.target, pair.draft_model, CONSTANT | dict(num_assistant_tokens=k)), ours=False)]
    if lookup_pair is not None:
        out += [Contender("hf_lookup_default", "transformers: prompt lookup, 10 tokens (its usual setting)",
                          hf(pair.target, lookup=dict(prompt_lookup_num_tokens=10)), ours=False),
                Contender(f"hf_lookup_k={k}", f"transformers: prompt lookup, k = {k}, n-grams up to {sp.ngram_max}",
                          hf(pair.target, lookup=dict(prompt_lookup_num_tokens=k,
                                                      max_matching_ngram_size=sp.ngram_max)),
                          ours=False)]
    return out


def _adaptive(sp: SpecConfig) -> SpecConfig:
    return SpecConfig(k=sp.k, k_policy="adaptive", k_max=max(sp.k_max, max(SWEEP)), ngram_max=sp.ngram_max,
                      ngram_min=sp.ngram_min)


def _fixed(sp: SpecConfig, k: int) -> SpecConfig:
    return SpecConfig(k=k, k_policy="fixed", k_max=max(sp.k_max, k), ngram_max=sp.ngram_max, ngram_min=sp.ngram_min)


@contextmanager
def forward_clock(*modules):
    """Seconds spent inside the modules' forward calls and in direct passes (direct_pass.py, which
    run a model's modules without its forward), device-synchronised, as a one-item list.

    A call inside another timed call is not counted twice: the target's embedding and LM head are
    timed too, because a feature head's drafting runs them on their own. Each module's `forward`
    is wrapped for the run rather than hooked: a hook sends every call of the module down torch's
    slow call path, and that extra work would land in the time outside the passes that the clock
    splits off. Direct passes are timed as whole calls, not per layer, for the same reason.
    """
    total, start, depth = [0.0], [0.0], [0]

    def timed(fn):
        @functools.wraps(fn)  # transformers reads forward's signature (logits_to_keep, position_ids)
        def run(*args, **kwargs):
            if depth[0] == 0:
                engine.sync(device)
                start[0] = time.perf_counter()
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
                if depth[0] == 0:
                    engine.sync(device)
                    total[0] += time.perf_counter() - start[0]
        return run

    device = modules[0].get_input_embeddings().weight.device
    wrapped = {id(m): m for m in modules if m is not None}.values()
    # An instance may carry its own forward already (accelerate's hooks put one there): keep it.
    own = {id(m): m.__dict__["forward"] for m in wrapped if "forward" in m.__dict__}
    for m in wrapped:
        m.forward = timed(m.forward)
    real = direct_pass.forward, direct_pass.step
    direct_pass.forward, direct_pass.step = map(timed, real)
    try:
        yield total
    finally:
        direct_pass.forward, direct_pass.step = real
        for m in wrapped:
            if id(m) in own:
                m.forward = own[id(m)]
            else:
                del m.forward


def outside_forward(pair, ids: list[int], s, sp, r, costs) -> dict:
    """One extra adaptive run on the pass clock: the busy time per round outside model passes."""
    with forward_clock(pair.target, pair.draft_model, pair.head, pair.target.get_input_embeddings(),
                       pair.target.get_output_embeddings()) as inside:
        _, _, steps = ours(pair, s, _adaptive(sp), r, True, costs)(ids, r.max_new_tokens)
    busy = steps[-1].elapsed
    return dict(ms_per_round=1000 * (busy - inside[0]) / len(steps), share=(busy - inside[0]) / busy)


def hf_passes_share(pair, assisted: Contender, ids: list[int], n: int) -> dict:
    """One extra run of transformers' assisted generation at constant k: the share of its
    time inside model passes. Both engines make the same passes, so total / inside is the most any
    engine could run faster than it like for like (its `ceiling`)."""
    with forward_clock(pair.target, pair.draft_model) as inside:
        _, seconds, _ = assisted.run(ids, n)
    return dict(share=inside[0] / seconds, ceiling=seconds / inside[0])


def bench(args) -> dict:
    """Warm every contender up, then per prompt run each `reps` times in rotating order."""
    s, sp, r = configs(args)
    pair = models.load_pair(args.target, args.draft, args.device, args.dtype)
    lookup_pair = None
    if args.lookup and pair.draft_spec.kind != draft_spec.PROMPT_LOOKUP:
        lookup_pair = models.load_pair(args.target, models.PROMPT_LOOKUP, args.device, args.dtype)
    # The pair's calibration, as the app and the CLI keep it: here only the warm-up runs on it.
    costs = calibrate.costs_for(pair, _adaptive(sp), sampling=s)
    lookup_costs = calibrate.costs_for(lookup_pair, _adaptive(sp), sampling=s) if lookup_pair else None
    prompts = suite(args.suite)[: args.limit or None]
    field = contenders(args, pair, lookup_pair, s, sp, r, costs, lookup_costs)
    warm = pair.encode(prompts[0], r.chat)
    for c in field:  # warm-up, discarded: first calls allocate and pick kernels
        c.run(warm, 16)
    rows = []
    for i, prompt in enumerate(prompts):
        # A calibration is one draw of this host's speed, which drifts by a tenth over minutes and not
        # evenly across pass widths, so one taken at the start predicted a whole run 10-15% fast at
        # large k. Each prompt's runs and prediction read a draw taken just before them, and every
        # draw is in the JSON, so a run shows how far its host's speed moved.
        own = calibrate.measure(pair, _adaptive(sp).k_max, sampling=s)
        lookup_own = calibrate.measure(lookup_pair, _adaptive(sp).k_max, sampling=s) if lookup_pair else None
        field = contenders(args, pair, lookup_pair, s, sp, r, own, lookup_own)
        # transformers' assisted run at constant k is timed once more, on the pass clock
        assisted = next((c for c in field if c.name == f"hf_assisted_k={sp.k}"), None)
        ids = pair.encode(prompt, r.chat)
        times = {c.name: [] for c in field}
        outputs, steps = {}, {}
        for rep in range(args.reps):
            shift = rep % len(field)
            for c in field[shift:] + field[:shift]:
                out, seconds, st = c.run(ids, r.max_new_tokens)
                times[c.name].append(seconds)
                outputs[c.name], steps[c.name] = out, st
        row = prompt_row(i, ids, field, times, outputs, steps, own, lookup_own, sp.k)
        row["costs"] = own.to_dict()
        if lookup_own is not None:
            row["lookup_costs"] = lookup_own.to_dict()
        row["outside_forward"] = outside_forward(pair, ids, s, sp, r, own)
        if assisted is not None:
            row["hf_passes"] = hf_passes_share(pair, assisted, ids, r.max_new_tokens)
        rows.append(row)
        print(f"prompt {i}: adaptive {_x(row['speedup'])}, alpha {_f(row['adaptive']['alpha'])}, "
              f"predicted {_x(row['adaptive']['predicted_speedup'])}, "
              f"ours/HF at k = {sp.k} {_x(row['ours_over_hf'].get('fixed_k'))}", file=sys.stderr)
    return dict(target=pair.target_name, draft=pair.draft_name, suite=args.suite, reps=args.reps,
                settings=settings_dict("bench", s, sp, r), threads=threads.key(),
                contenders={c.name: c.label for c in field}, labels=metrics.LABELS,
                costs=costs.to_dict(), lookup_costs=lookup_costs.to_dict() if lookup_costs else None,
                summary=summarize_rows(rows, [c.name for c in field], sp.k), prompts=rows,
                device=str(pair.target.device), dtype=str(pair.target.dtype), torch=torch.__version__)


def prompt_row(i, ids, field, times, outputs, steps, costs, lookup_costs, k: int) -> dict:
    """One prompt: each contender's tokens/s (median, min, max over reps) and speedups."""
    row = dict(prompt=i, prompt_tokens=len(ids), contenders={})
    reference = outputs["autoregressive"]
    for c in field:
        rates = [len(outputs[c.name]) / t for t in times[c.name]]
        entry = dict(tokens=len(outputs[c.name]), tokens_per_s=statistics.median(rates), min=min(rates),
                     max=max(rates), spread=(max(rates) - min(rates)) / statistics.median(rates),
                     identical=outputs[c.name] == reference)
        if c.ours and c.name != "autoregressive":
            st = metrics.summarize(steps[c.name], lookup_costs if c.name.startswith("lookup") else costs)
            entry |= {key: st[key] for key in ("alpha", "mean_k", "tokens_per_pass", "theoretical_speedup",
                                               "predicted_speedup")}
        row["contenders"][c.name] = entry
    ar = row["contenders"]["autoregressive"]["tokens_per_s"]
    for entry in row["contenders"].values():
        entry["speedup"] = entry["tokens_per_s"] / ar
    row["speedup"] = row["contenders"]["adaptive"]["speedup"]
    row["adaptive"] = row["contenders"]["adaptive"]
    row["identical"] = all(e["identical"] for e in row["contenders"].values())
    got = row["contenders"]
    ratios = {}
    for ours_name, hf_name, key in (("adaptive", "hf_assisted_default", "defaults"),
                                    (f"k={k}", f"hf_assisted_k={k}", "fixed_k"),
                                    ("lookup_adaptive", "hf_lookup_default", "lookup_defaults"),
                                    (f"lookup_k={k}", f"hf_lookup_k={k}", "lookup_fixed_k")):
        if ours_name in got and hf_name in got:
            ratios[key] = got[ours_name]["tokens_per_s"] / got[hf_name]["tokens_per_s"]
    row["ours_over_hf"] = ratios
    if "hf_plain" in got and "hf_assisted_default" in got:  # what plots.bench_figure draws beside ours
        row["hf"] = dict(assisted_speedup=got["hf_assisted_default"]["tokens_per_s"] / got["hf_plain"]["tokens_per_s"])
    return row


def summarize_rows(rows: list[dict], names: list[str], k: int) -> dict:
    """Medians over prompts (with their min and max), and the targets this benchmark checks."""
    def med(values):
        values = [v for v in values if v is not None]
        return dict(median=statistics.median(values), min=min(values), max=max(values)) if values else None

    per = {n: dict(speedup=med([r["contenders"][n]["speedup"] for r in rows]),
                   tokens_per_s=med([r["contenders"][n]["tokens_per_s"] for r in rows]),
                   rep_spread=med([r["contenders"][n]["spread"] for r in rows]),
                   predicted_speedup=med([r["contenders"][n].get("predicted_speedup") for r in rows]),
                   identical=all(r["contenders"][n]["identical"] for r in rows)) for n in names}
    fixed = {n: v["speedup"]["median"] for n, v in per.items() if n.startswith("k=")}
    best = max(fixed, key=fixed.get) if len(fixed) > 1 else None  # one fixed k is no sweep to pick from
    adaptive = per["adaptive"]["speedup"]["median"]
    out = dict(prompts=len(rows), contenders=per, median_speedup=adaptive,
               all_identical=all(r["identical"] for r in rows),
               achieved_over_predicted=med([r["speedup"] / r["adaptive"]["predicted_speedup"] for r in rows
                                            if r["adaptive"].get("predicted_speedup")]),
               outside_forward_share=med([r["outside_forward"]["share"] for r in rows]),
               outside_forward_ms_per_round=med([r["outside_forward"]["ms_per_round"] for r in rows]))
    if best:
        # Paired per prompt, as every other comparison here: a ratio of two medians over prompts
        # compares whichever prompts land in the middle of each list (0.94 against a paired 0.99 in
        # one run of the code suite). Both are kept.
        paired = med([r["contenders"]["adaptive"]["tokens_per_s"] / r["contenders"][best]["tokens_per_s"]
                      for r in rows])
        out |= dict(best_fixed_k=best, best_fixed_speedup=fixed[best], adaptive_over_best_fixed=paired,
                    adaptive_over_best_fixed_of_medians=adaptive / fixed[best])
    if all("costs" in r for r in rows):
        out["calibrations"] = calibration_spread([Costs(**r["costs"]) for r in rows], med)
    if all("hf_passes" in r for r in rows):
        out |= dict(hf_assisted_passes_share=med([r["hf_passes"]["share"] for r in rows]),
                    ours_over_hf_ceiling=med([r["hf_passes"]["ceiling"] for r in rows]))
    for key in ("defaults", "fixed_k", "lookup_defaults", "lookup_fixed_k"):
        values = [r["ours_over_hf"].get(key) for r in rows]
        if any(v is not None for v in values):
            out[f"ours_over_hf_{key}"] = med(values)
    return out


def calibration_spread(draws: list[Costs], med) -> dict:
    """Milliseconds of the parts that drift moved in the prompts' calibrations, the widest pass most:
    a plain round, the narrowest and widest passes, and drafting k_max tokens."""
    k_max = len(draws[0].verify_s) - 1
    return dict(plain_round_ms=med([1000 * c.plain_round_s for c in draws]),
                verify_1_ms=med([1000 * c.verify_time(1) for c in draws]),
                verify_widest_ms=med([1000 * c.verify_time(k_max + 1) for c in draws]),
                draft_k_max_ms=med([1000 * c.draft_time(k_max) for c in draws]))


def _f(x):
    return "n/a" if x is None else f"{x:.3f}"


def _x(x):
    return "n/a" if x is None else f"{x:.2f}x"


def html_report(doc: dict) -> str:
    """A self-contained page: the summary, every contender's figures, the per-prompt chart."""
    sm = doc["summary"]
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{html.escape(doc['contenders'][name])}</td>"
        f"<td>{_x(v['speedup']['median'])}</td><td>{_x(v['speedup']['min'])} .. {_x(v['speedup']['max'])}</td>"
        f"<td>{v['tokens_per_s']['median']:.1f}</td><td>{100 * v['rep_spread']['median']:.1f}%</td>"
        f"<td>{_x((v['predicted_speedup'] or {}).get('median'))}</td><td>{'yes' if v['identical'] else 'NO'}</td></tr>"
        for name, v in sm["contenders"].items())
    facts = {k: v for k, v in sm.items() if k != "contenders"}
    figure = plots.bench_figure(doc).to_html(full_html=False, include_plotlyjs=True)  # opens offline
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>bench: {html.escape(doc['suite'])}</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:2px 8px;text-align:left}}
tr:nth-child(even){{background:#f4f4f4}}</style>
</head><body><h1>Benchmark: {html.escape(doc['target'])} + {html.escape(doc['draft'])}, {doc['suite']} suite</h1>
<p>{sm['prompts']} prompts x {doc['reps']} interleaved repetitions, {doc['threads']} thread(s), {doc['device']},
torch {doc['torch']}. Speedup is tokens/s over our plain autoregressive decoding on the same prompt (median of
repetitions, then median over prompts). Spread: (max - min) / median of a prompt's repetitions.</p>
<table><tr><th>contender</th><th>what</th><th>median speedup</th><th>range over prompts</th><th>tokens/s</th>
<th>rep spread</th><th>predicted for this machine</th><th>output = plain</th></tr>{rows}</table>
<h2>Summary</h2><pre>{html.escape(json.dumps(facts, indent=1))}</pre>
<h2>Labels</h2><pre>{html.escape(json.dumps(doc['labels'], indent=1))}</pre>
<h2>This machine's costs</h2><p>The pair's first calibration; each prompt's runs and prediction read their
own, taken just before them (each prompt's "costs" in the JSON; their spread is under "calibrations" above).</p>
<pre>{html.escape(json.dumps(doc['costs'], indent=1))}</pre>
{figure}</body></html>"""


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m app bench", description=__doc__.splitlines()[0])
    ap.add_argument("--suite", choices=["code", "prose", "all"], default="code")
    ap.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per prompt and contender (>= 1)")
    ap.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers' generate")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false",
                    help="skip the fixed-k sweep 1..8 (ours still runs at --k, the partner of "
                    "transformers' constant-k run)")
    ap.add_argument("--no-lookup", dest="lookup", action="store_false", help="skip the prompt lookup contenders")
    ap.add_argument("--card", action="store_true", help="model card figures for the bundled family")
    ap.add_argument("--threads-check", action="store_true",
                    help="tokens/s with 1 thread, every core and auto, idle and beside one busy process")
    ap.add_argument("--out", type=Path, default=Path("runs/bench"), help="writes OUT.json and OUT.html")
    add_generation_args(ap)
    args = ap.parse_args(argv)
    threads.apply(args.threads)
    if args.compile:
        print("--compile: the benchmark times the default path; see python -m app gpucheck for the fast path",
              file=sys.stderr)
    if args.threads_check:
        from app.threads_check import threads_check  # it times this module's contenders

        doc = threads_check(args)
    else:
        from app.card import card  # the model card's figures, timed with this module's prompts

        doc = card(args) if args.card else bench(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = [args.out.with_suffix(".json")]
    written[0].write_text(json.dumps(doc, indent=1) + "\n")
    if not (args.card or args.threads_check):
        written.append(args.out.with_suffix(".html"))
        written[1].write_text(html_report(doc))
    json.dump(doc.get("summary", doc), sys.stdout, indent=1)
    print()
    print("wrote " + " and ".join(str(w) for w in written), file=sys.stderr)
    return 0
