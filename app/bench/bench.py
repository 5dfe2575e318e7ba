"""Benchmarks: our engine (autoregressive, adaptive k, fixed k 1..8, prompt lookup) against
transformers' own generate (plain; assisted and prompt lookup, each with its defaults and
with a truly constant k), repeated and interleaved. `--card` (card.py), `--rules`
(rules.py), `--passes` (pass_costs.py) and `--threads-check` (threads_check.py) are its other modes.

Every contender is warmed up, then each prompt takes its own calibration (calibrate.py, which
"predicted for this machine" and adaptive k read) and runs every contender `--reps` times in
rotating order, so drift on a shared machine falls on all alike; medians and spreads are
reported, the calibrations' too, and every greedy output is checked against plain decoding token
for token.

    python -m app bench [--suite code|prose|all] [--draft ...] [--k 4] [--reps 3] [--out runs/bench]
    python -m app bench --card       # acceptance and cost of every bundled draft (card.py)
    python -m app bench --rules      # acceptance of each sampling rule (rules.py)
    python -m app bench --passes     # ms per target pass by width and dtype, and the bandwidth (pass_costs.py)
    python -m app bench --threads-check   # 1 thread, every core and auto, idle and busy (threads_check.py)
"""

from __future__ import annotations

import functools
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch

from app import calibrate, category_runner, kept_costs, models
from app.args import settings, with_chat
from app.bench import progress, specbench
from app.bench.bench_args import parser
from app.bench.contenders import CONSTANT, SWEEP, TREE, TREE_AUTO, Contender, adaptive_k, fixed_k, hf, llama_cpp, ours
from app.bench.report import fixed3, html_report, prompt_row, ratio_x, summarize_rows, summary_table  # noqa: F401
from app.core import divergence, engine, metrics
from app.core.config import settings_dict
from app.data.prompts import suite
from app.kv import direct_pass
from app.kv.cache import DynamicRollbackCache
from app.models import threads


def contenders(args, pair, lookup_pair, s, sp, r, costs, lookup_costs, tree_costs=None) -> list[Contender]:
    """Everything timed: ours first, then transformers' generate with the same models. tree_costs:
    the calibration with trees (--tree auto), which the tree shaped by the cost model reads."""
    out = _ours_field(args, pair, lookup_pair, s, sp, r, costs, lookup_costs, tree_costs)
    if s.greedy and getattr(args, "llama_cpp", None) is not None:
        out.append(args.llama_cpp)
    if not (args.hf and s.greedy):  # transformers' outputs are only comparable under greedy decoding
        return out
    return out + _hf_field(pair, lookup_pair, sp)


def _ours_field(args, pair, lookup_pair, s, sp, r, costs, lookup_costs, tree_costs=None) -> list[Contender]:
    k = sp.k
    out = [
        Contender("autoregressive", "ours: plain autoregressive", ours(pair, s, sp, r, False, None)),
        Contender("adaptive", f"ours: {pair.draft_name}, adaptive k", ours(pair, s, adaptive_k(sp), r, True, costs)),
    ]
    # Ours at --k is always run where it is transformers' like-for-like partner, swept or not.
    fixed = set(SWEEP) if args.sweep else set()
    fixed_tree = sp.tree and not sp.tree_auto
    if (args.hf and s.greedy and pair.draft.assistant is not None) or fixed_tree:
        fixed.add(k)  # transformers' like-for-like partner, or the chain a tree is set beside
    out += [
        Contender(f"k={j}", f"ours: {pair.draft_name}, fixed k = {j}", ours(pair, s, fixed_k(sp, j), r, True, costs))
        for j in sorted(fixed)
    ]
    if sp.tree_auto:  # beside adaptive k's chain, on the same draft
        auto = _auto_spec(sp)
        label = f"ours: {pair.draft_name}, each round's shape by the cost model (trees up to {sp.tree} nodes)"
        out.append(Contender(TREE_AUTO, label, ours(pair, s, auto, r, True, tree_costs)))
    elif sp.tree:
        tree = replace(fixed_k(sp, k), tree=sp.tree)
        out.append(
            Contender(
                TREE,
                f"ours: {pair.draft_name}, a tree of {sp.tree} nodes, k = {k} deep",
                ours(pair, s, tree, r, True, None),
            )
        )
    if lookup_pair is not None:
        out += [
            Contender(
                "lookup_adaptive",
                "ours: prompt lookup, adaptive k",
                ours(lookup_pair, s, adaptive_k(sp), r, True, lookup_costs),
            ),
            Contender(
                f"lookup_k={k}",
                f"ours: prompt lookup, fixed k = {k}",
                ours(lookup_pair, s, fixed_k(sp, k), r, True, lookup_costs),
            ),
        ]
    return out


def _hf_field(pair, lookup_pair, sp) -> list[Contender]:
    k = sp.k
    out = [Contender("hf_plain", "transformers: plain generate", hf(pair.target), ours=False)]
    if pair.draft.assistant is not None:
        out += [
            Contender(
                "hf_assisted_default",
                "transformers: assisted generation, its defaults (up to 20 "
                "drafts, stops drafting below 0.4 confidence)",
                hf(pair.target, pair.draft.assistant, {}),
                ours=False,
            ),
            Contender(
                f"hf_assisted_k={k}",
                f"transformers: assisted, constant k = {k}, no confidence stop",
                hf(pair.target, pair.draft.assistant, CONSTANT | dict(num_assistant_tokens=k)),
                ours=False,
            ),
        ]
    if lookup_pair is not None:
        out += [
            Contender(
                "hf_lookup_default",
                "transformers: prompt lookup, 10 tokens (its usual setting)",
                hf(pair.target, lookup=dict(prompt_lookup_num_tokens=10)),
                ours=False,
            ),
            Contender(
                f"hf_lookup_k={k}",
                f"transformers: prompt lookup, k = {k}, n-grams up to {sp.ngram_max}",
                hf(pair.target, lookup=dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=sp.ngram_max)),
                ours=False,
            ),
        ]
    return out


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

    @contextmanager
    def clock():
        if depth[0] == 0:
            engine.sync(device)
            start[0] = time.perf_counter()
        depth[0] += 1
        try:
            yield
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                engine.sync(device)
                total[0] += time.perf_counter() - start[0]

    def timed(fn):
        @functools.wraps(fn)  # transformers reads forward's signature (logits_to_keep, position_ids)
        def run(*args, **kwargs):
            with clock():
                return fn(*args, **kwargs)

        return run

    device = modules[0].get_input_embeddings().weight.device
    wrapped = {id(m): m for m in modules if m is not None}.values()
    # An instance may carry its own forward already (accelerate's hooks put one there): keep it.
    own = {id(m): m.__dict__["forward"] for m in wrapped if "forward" in m.__dict__}
    for m in wrapped:
        m.forward = timed(m.forward)
    try:
        with direct_pass.clocked(clock):
            yield total
    finally:
        for m in wrapped:
            if id(m) in own:
                m.forward = own[id(m)]
            else:
                del m.forward


def outside_forward(pair, ids: list[int], s, sp, r, costs) -> dict:
    """One extra adaptive run on the pass clock: the busy time per round outside model passes."""
    with forward_clock(
        pair.target, *pair.draft.modules(), pair.target.get_input_embeddings(), pair.target.get_output_embeddings()
    ) as inside:
        _, _, steps = ours(pair, s, adaptive_k(sp), r, True, costs)(ids, r.max_new_tokens)
    busy = steps[-1].elapsed
    return dict(ms_per_round=1000 * (busy - inside[0]) / len(steps), share=(busy - inside[0]) / busy)


def hf_passes_share(pair, assisted: Contender, ids: list[int], n: int) -> dict:
    """One extra run of transformers' assisted generation at constant k: the share of its
    time inside model passes. Both engines make the same passes, so total / inside is the most any
    engine could run faster than it like for like (its `ceiling`)."""
    with forward_clock(pair.target, pair.draft.assistant) as inside:
        _, seconds, _ = assisted.run(ids, n)
    return dict(share=inside[0] / seconds, ceiling=seconds / inside[0])


def _auto_spec(sp):
    """--tree auto as the bench times it: adaptive k's spec, its rounds shaped by the cost model."""
    return replace(adaptive_k(sp), tree=sp.tree, tree_auto=True)


def _tree_costs(pair, sp, s, cached: bool = True):
    """The calibration a tree shaped by the cost model reads (None without --tree auto)."""
    if not sp.tree_auto:
        return None
    spec = _auto_spec(sp)
    if cached:
        return kept_costs.costs_for(pair, spec, sampling=s)
    return calibrate.measure(pair, spec.k_max, sampling=s, tree=sp.tree)


def bench(args) -> dict:
    """Warm every contender up, then per prompt run each `reps` times in rotating order."""
    progress.say("bench", f"loading {args.target or models.DEFAULT_TARGET} and its draft")
    pair = models.load_pair(args.target, args.draft, args.device, args.dtype)
    st = with_chat(settings(args), args, pair.tokenizer)
    s, sp, r = st.sampling, st.spec, st.run
    lookup_pair = None
    if args.lookup and pair.draft_name != models.PROMPT_LOOKUP:
        lookup_pair = models.load_pair(args.target, models.PROMPT_LOOKUP, args.device, args.dtype)
    # The pair's calibration, as the app and the CLI keep it: here only the warm-up runs on it.
    progress.say("bench", "measuring this machine (each prompt measures it again before its runs)")
    costs = kept_costs.costs_for(pair, adaptive_k(sp), sampling=s)
    lookup_costs = kept_costs.costs_for(lookup_pair, adaptive_k(sp), sampling=s) if lookup_pair else None
    tree_costs = _tree_costs(pair, sp, s)
    prompts = suite(args.suite, st.run.chat)[: args.limit or None]
    llama_note = ""
    if args.with_llama_cpp and s.greedy:  # loaded once; its runs are timed like every contender's
        args.llama_cpp, llama_note = llama_cpp(pair.target_name, pair.tokenizer.eos_token_id)
        if llama_note:
            progress.say("bench", llama_note)
    field = contenders(args, pair, lookup_pair, s, sp, r, costs, lookup_costs, tree_costs)
    warm = pair.encode(prompts[0], r.chat)
    progress.say("bench", f"warm-up: {len(field)} contenders once each")
    for c in field:  # warm-up, discarded: first calls allocate and pick kernels
        c.run(warm, 16)
    rows = [
        _prompt(args, pair, lookup_pair, st, i, prompt, len(prompts))
        for i, prompt in progress.counted(enumerate(prompts), "prompt", len(prompts))
    ]
    field = contenders(args, pair, lookup_pair, s, sp, r, costs, lookup_costs, tree_costs)
    return dict(
        target=pair.target_name,
        draft=pair.draft_name,
        suite=args.suite,
        reps=args.reps,
        settings=settings_dict("bench", s, sp, r),
        threads=threads.key(),
        contenders={c.name: c.label for c in field},
        labels=metrics.LABELS,
        costs=costs.to_dict(),
        lookup_costs=lookup_costs.to_dict() if lookup_costs else None,
        summary=summarize_rows(rows, [c.name for c in field], sp.k),
        prompts=rows,
        device=str(pair.target.device),
        dtype=str(pair.target.dtype),
        precision=models.precision_of(pair.target),
        llama_cpp=llama_note or None,  # why llama.cpp was not timed, when it was asked for and was not
        torch=torch.__version__,
    )


def _prompt(args, pair, lookup_pair, st, i: int, prompt: str, of: int) -> dict:
    """One prompt: its own calibration, then every contender `reps` times in rotating order."""
    s, sp, r = st.sampling, st.spec, st.run
    # A calibration is one draw of this host's speed, which drifts over minutes and not evenly across
    # pass widths, so one taken at the start predicted whole runs fast at large k. Each prompt's runs and
    # prediction read a draw taken just before them, and every draw is in the JSON, so a run shows how far
    # its host's speed moved.
    own = calibrate.measure(pair, adaptive_k(sp).k_max, sampling=s)
    lookup_own = calibrate.measure(lookup_pair, adaptive_k(sp).k_max, sampling=s) if lookup_pair else None
    field = contenders(args, pair, lookup_pair, s, sp, r, own, lookup_own, _tree_costs(pair, sp, s, cached=False))
    # transformers' assisted run at constant k is timed once more, on the pass clock
    assisted = next((c for c in field if c.name == f"hf_assisted_k={sp.k}"), None)
    ids = pair.encode(prompt, r.chat)
    times = {c.name: [] for c in field}
    outputs, steps = {}, {}
    for rep in range(args.reps):
        shift = rep % len(field)
        for c in field[shift:] + field[:shift]:
            out, seconds, got = c.run(ids, r.max_new_tokens)
            times[c.name].append(seconds)
            outputs[c.name], steps[c.name] = out, got
    row = prompt_row(i, ids, field, times, outputs, steps, own, lookup_own, sp.k)
    row["costs"] = own.to_dict()
    if lookup_own is not None:
        row["lookup_costs"] = lookup_own.to_dict()
    row["outside_forward"] = outside_forward(pair, ids, s, sp, r, own)
    if s.greedy:
        row["divergences"] = _divergences(pair, ids, field, outputs, steps, own, s)
    if assisted is not None:
        row["hf_passes"] = hf_passes_share(pair, assisted, ids, r.max_new_tokens)
    versus_hf = row["ours_over_hf"].get("fixed_k")  # only where transformers' assisted run was timed
    progress.say(
        "bench",
        f"prompt {i + 1}/{of}: adaptive {ratio_x(row['speedup'])}, "
        f"alpha {fixed3(row['adaptive']['alpha'])}, predicted {ratio_x(row['adaptive']['predicted_speedup'])}"
        + (f", ours/HF at k = {sp.k} {ratio_x(versus_hf)}" if versus_hf is not None else ""),
    )
    return row


def _divergences(pair, ids, field, outputs, steps, costs, s) -> dict:
    """For each of our speculative contenders whose greedy output differs from plain decoding's:
    whether it is a near-tie within this dtype's rounding or a mismatch (core/divergence.py), held
    to the scores the run picked from (its repetition controls applied)."""
    plain, out = outputs["autoregressive"], {}
    for c in field:
        if not c.ours or c.name == "autoregressive" or outputs[c.name] == plain:
            continue
        d = divergence.explain_run(pair.target, DynamicRollbackCache, ids, steps[c.name], plain, costs.logit_noise, s)
        out[c.name] = d.to_dict()
    return out


def main(argv: list[str]) -> int:
    ap = parser(__doc__.split("\n\n")[0])
    args = ap.parse_args(argv)
    threads.apply(args.threads)
    kept_costs.keep_none()  # every calibration here is of the machine as the benchmark finds it
    if args.fast_path is not None:
        print(
            "--fast-path: the benchmark times the dynamic cache; python -m app gpucheck times the fast path",
            file=sys.stderr,
        )
    from app.bench import sizes
    from app.bench.card import card  # the model card's figures, timed with this module's prompts
    from app.bench.pass_costs import passes
    from app.bench.rules import rules
    from app.bench.threads_check import threads_check  # it times this module's contenders

    from_file = specbench.is_file_suite(args.suite)
    if not from_file and args.suite not in ("code", "code-40", "prose", "all"):
        ap.error(f"--suite takes code, code-40, prose, all or a question file (.jsonl or .txt), got {args.suite!r}")
    modes = [
        (args.card, card),
        (args.rules, rules),
        (args.passes, passes),
        (args.sizes, sizes.sizes),
        (args.threads_check, threads_check),
    ]
    # Several drafts are one interleaved run of the questions, a file's or a built-in suite's.
    mode = next((fn for chosen, fn in modes if chosen), specbench.specbench if from_file or args.drafts else bench)
    if from_file and mode is specbench.specbench:  # the file is read and checked before anything loads
        category_runner.select(category_runner.read_questions(Path(args.suite)), args.categories, args.per_category)
    doc = mode(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    written = [args.out.with_suffix(".json")]
    written[0].write_text(json.dumps(doc, indent=1) + "\n")
    reports = {bench: html_report, specbench.specbench: specbench.html_report, sizes.sizes: sizes.html_report}
    if mode in reports:
        written.append(args.out.with_suffix(".html"))
        written[1].write_text(reports[mode](doc))
    if mode is specbench.specbench:
        print(specbench.table(doc), file=sys.stderr)
    if mode is sizes.sizes:
        print(sizes.table(doc), file=sys.stderr)
    if mode is bench and not args.json:
        print(summary_table(doc, args.target or models.DEFAULT_TARGET))
    else:
        json.dump(doc.get("summary", doc), sys.stdout, indent=1)
        print()
    print("wrote " + " and ".join(str(w) for w in written), file=sys.stderr)
    return 0
