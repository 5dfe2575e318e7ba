"""Frozen settings for sampling, speculation and one generation request."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

K_MAX = 16  # largest draft length any policy may choose
TREE_MAX = 64  # most nodes a draft tree may have: one target pass verifies them all
FAST_PATHS = ("auto", "graphs", "compile", "off")  # --fast-path: auto is graphs on CUDA, off elsewhere
MIN_TEMPERATURE, MAX_TEMPERATURE = 1e-3, 100.0  # outside, sampling is greedy or uniform noise in all but name

# Sampling rules. Rejection: Leviathan et al. and Chen et al.'s min(1, p/q) test, the optimal coupling
# of p and q. Shared noise: Daliri, Musco and Suresh's drafter-invariant rule, where the target and the
# draft race the same keyed noise and a draft is kept when both pick it.
K_POLICIES = ("adaptive", "heuristic", "fixed")  # how k is chosen each round (core/policy.py), the page's order
REJECTION, SHARED_NOISE = "rejection", "shared-noise"
RULES = (REJECTION, SHARED_NOISE)


class UserError(ValueError):
    """Bad input or an impossible setting; the message says what to change."""


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0 means greedy (argmax); > 0 samples from softmax(logits / T)
    top_k: int = 0  # keep only the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest set whose mass reaches top_p; 1 keeps all
    seed: int = 0  # seeds the one torch.Generator that all randomness of a run comes from
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the context (CTRL), as in generate()
    no_repeat_ngram_size: int = 0  # > 0 forbids repeating any n-gram of this size, as in generate()
    # How sampled drafts are judged (RULES); greedy decoding has one rule, the argmax.
    rule: str = REJECTION

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def shared_noise(self) -> bool:
        """Whether a sampled token at position i is the exponential race argmax(p_i / E_i), with E_i
        keyed by (seed, i) and read by the draft too: the same text for a seed whatever the draft or k."""
        return not self.greedy and self.rule == SHARED_NOISE

    @property
    def picks_stay_on_device(self) -> bool:
        """Whether a chain's picks may stay on the device until the verdict reads them: without
        repetition rules no pick needs the history before it (greedy takes the argmax, shared noise
        races its keyed noise, rejection sampling draws with the run's generator there)."""
        return not self.penalised

    @property
    def penalised(self) -> bool:
        """Whether logits depend on the context, so p and q need each position's history."""
        return self.repetition_penalty != 1.0 or self.no_repeat_ngram_size > 0

    def validate(self) -> None:
        if not self.temperature >= 0:  # also refuses NaN
            raise UserError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        # logits / T overflows below MIN_TEMPERATURE (NaN probabilities), and T = inf is uniform noise.
        if 0 < self.temperature < MIN_TEMPERATURE or self.temperature > MAX_TEMPERATURE:
            limits = f"{MIN_TEMPERATURE} to {MAX_TEMPERATURE:g}"
            raise UserError(f"temperature must be 0 (greedy) or from {limits}, got {self.temperature}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be a whole number from 0 to 2**63 - 1, got {self.seed!r}")
        if not self.repetition_penalty > 0 or self.repetition_penalty == float("inf"):
            raise UserError(
                f"repetition penalty must be a positive number (1 disables it), got {self.repetition_penalty}"
            )
        if self.no_repeat_ngram_size < 0:
            raise UserError(f"no-repeat n-gram size must be >= 0 (0 disables it), got {self.no_repeat_ngram_size}")
        if self.top_k < 0:
            raise UserError(f"top-k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:  # NaN fails too
            raise UserError(f"top-p must be in (0, 1], got {self.top_p}")
        if self.rule not in RULES:
            raise UserError(f"the sampling rule must be one of {', '.join(RULES)}, got {self.rule!r}")


def k_cap(k_policy: str, k: int, k_max: int) -> int:
    """k max as a run takes it: fixed k drafts k and heuristic k starts there, so k raises their cap;
    adaptive k picks its own k up to k max, so k never moves its cap."""
    return k_max if k_policy == "adaptive" else max(k_max, k)


@dataclass(frozen=True)
class SpecConfig:
    k: int = 4  # draft length: fixed k, the start value for heuristic, ignored by adaptive
    k_policy: str = "adaptive"  # fixed | heuristic | adaptive
    k_max: int = 8  # upper bound for heuristic and adaptive
    ngram_max: int = 3  # prompt lookup: longest n-gram tried first
    ngram_min: int = 1  # prompt lookup: shortest n-gram tried
    tree: int = 0  # a draft tree's node budget, k deep (0: a chain of k); with tree_auto, the most nodes
    tree_auto: bool = False  # the cost model picks each round's shape: a plain step, a chain or a tree

    def validate(self) -> None:
        for name in ("k", "k_max", "ngram_max", "ngram_min", "tree"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise UserError(f"{name} must be a whole number, got {value!r}")
        if self.k_policy not in K_POLICIES:
            raise UserError(f"k policy must be fixed, heuristic or adaptive, got {self.k_policy!r}")
        if self.k < 1:
            raise UserError(f"k must be at least 1, got {self.k}")
        if not 1 <= self.k_max <= K_MAX:
            raise UserError(f"k max must be between 1 and {K_MAX}, got {self.k_max}")
        if self.k_policy == "fixed" and self.k > K_MAX:
            raise UserError(f"k must be at most {K_MAX}, got {self.k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise UserError("n-gram sizes need 1 <= min <= max")
        if not isinstance(self.tree_auto, bool):
            raise UserError(f"tree auto must be true or false, got {self.tree_auto!r}")
        if self.tree_auto:
            if not 0 < self.tree <= TREE_MAX:
                raise UserError(f"a tree chosen by the cost model has up to 1 to {TREE_MAX} nodes, got {self.tree}")
            if self.k_policy != "adaptive":
                raise UserError("--tree auto chooses k and the tree together: leave k adaptive (no --k)")
        elif self.tree:
            if not 0 < self.tree <= TREE_MAX:
                raise UserError(f"a tree has 1 to {TREE_MAX} nodes, got {self.tree}")
            if self.k_policy != "fixed":
                raise UserError("a draft tree is k deep: give it a fixed k (--k), not adaptive or heuristic k")
            if self.k > self.tree:
                raise UserError(f"a tree of {self.tree} nodes is at most {self.tree} deep: k = {self.k} is deeper")


@dataclass(frozen=True)
class RunConfig:
    max_new_tokens: int = 128  # never emit more than this
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings; output ends after the first
    chat: bool = False  # format the prompt with the tokenizer's chat template

    def validate(self) -> None:
        # The longest a run may be is a host's policy (serve/ caps a visitor's); the context ends it anyway.
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise UserError(f"max new tokens must be a whole number, got {self.max_new_tokens!r}")
        if self.max_new_tokens < 1:
            raise UserError(f"max new tokens must be at least 1, got {self.max_new_tokens}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise UserError("a stop string must be non-empty text (an empty one would end the output at once)")


@dataclass(frozen=True)
class Settings:
    """Everything a request sets: sampling, speculation and the run's limits, validated when built."""

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    spec: SpecConfig = field(default_factory=SpecConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self):
        for cfg in (self.sampling, self.spec, self.run):
            cfg.validate()

    def with_chat(self) -> Settings:
        """The same settings with the prompt formatted through the chat template."""
        return replace(self, run=replace(self.run, chat=True))

    def as_dict(self, mode: str) -> dict:
        return settings_dict(mode, self.sampling, self.spec, self.run)


def chat_default(settings: Settings, tokenizer) -> Settings:
    """The default where a caller left chat formatting open: on when the target's tokenizer has a chat
    template (the CLI without --chat or --no-chat, an API request with auto_chat)."""
    return settings.with_chat() if getattr(tokenizer, "chat_template", None) else settings


def settings_dict(mode: str, s: SamplingConfig, sp: SpecConfig, r: RunConfig) -> dict:
    """The settings of a run as they appear in every JSON document."""
    return dict(mode=mode, sampling=asdict(s), speculation=asdict(sp), run=asdict(r))
