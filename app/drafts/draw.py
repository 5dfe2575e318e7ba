"""The step every model-backed draft repeats: process the logits exactly as the target's will be, then
take the argmax (greedy), draw from q, or race q against the shared noise."""

from __future__ import annotations

import torch

from app.core import sampling
from app.core.config import SamplingConfig
from app.core.contracts import Proposal, Proposer
from app.core.tree_shape import siblings_per_depth

__all__ = ["Proposal", "Proposer", "draw"]


def draw(
    logits: torch.Tensor,
    history: list[int] | None,
    cfg: SamplingConfig,
    gen: torch.Generator | None,
    position: int | None = None,
) -> tuple[int, torch.Tensor | None]:
    """(token, q) from (V,) logits: q is None under greedy (one-hot on the argmax).

    gen is only read by a sampled draw (None will do under greedy or shared noise).
    history is the context the repetition controls read; None when the caller already applied them.
    position is the absolute position of the token drawn (default len(history)): under the
    shared-noise rule the draft races the noise the target will race there, so it proposes the
    target's own pick whenever q leads it there.
    """
    if history is not None and cfg.penalised:
        logits = sampling.penalise(logits[None], history, [], cfg)[0]
    if cfg.greedy:
        return int(logits.argmax()), None
    q = sampling.probs(logits, cfg)
    if cfg.shared_noise:
        if position is not None:
            at = position
        elif history is not None:
            at = len(history)
        else:
            raise ValueError("a shared-noise draw needs the token's position, or the history it follows")
        return int(sampling.race(q, sampling.race_noise(cfg.seed, at, q.shape[-1], q.device))), q
    assert gen is not None, "a sampled draw needs the run's generator"
    return sampling.sample(q, gen), q


def pick_on_device(
    logits: torch.Tensor, cfg: SamplingConfig, position: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """draw()'s (token, q) where cfg.picks_stay_on_device, the token a 0-d tensor left on the device.
    A sampled pick is the exponential race against fresh noise from `gen` (on the logits' device):
    a draw from q, as multinomial's one-sample path makes it, without its check that reads the host."""
    if cfg.greedy:
        return logits.argmax(), None
    q = sampling.probs(logits, cfg)
    if cfg.shared_noise:
        return sampling.race(q, sampling.race_noise(cfg.seed, position, q.shape[-1], q.device)), q
    return sampling.draw_unread(q, gen), q


def greedy_siblings(logits: torch.Tensor, first: int | torch.Tensor, extra: int) -> torch.Tensor:
    """The greedy children beside `first` (an id, or a pick still on the device), on the logits'
    device: the next best tokens in topk's order, `first` taken out, without reading either; `extra`
    of them, or one less than the vocabulary where that is smaller."""
    top = logits.topk(min(extra + 1, logits.shape[-1])).indices
    # a stable sort of "is first" puts the others ahead in their topk order, as the host's filter keeps them
    others_first = torch.argsort((top == first).to(torch.int8), stable=True)
    return top[others_first[: min(extra, logits.shape[-1] - 1)]]


def stacked(qs: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The drafts' q rows as one (n, V) tensor, or None (one-hot) unless every draft has one."""
    return torch.stack(qs) if qs and all(q is not None for q in qs) else None  # type: ignore[arg-type]


def draw_siblings(
    logits: torch.Tensor,
    history: list[int] | None,
    cfg: SamplingConfig,
    gen: torch.Generator | None,
    first: int,
    extra: int,
    position: int | None = None,
) -> tuple[list[int], list[torch.Tensor | None]]:
    """`extra` more children of one node beside `first`, the token draw() gave from the same logits,
    and each one's q: the next best tokens under greedy, the next race winners under shared noise,
    and under rejection sampling draws without replacement after `first` (their q renormalised
    without the tokens drawn before them, as verify.speculative_sampling judges a tree)."""
    if extra <= 0:
        return [], []
    if history is not None and cfg.penalised:
        logits = sampling.penalise(logits[None], history, [], cfg)[0]
    if cfg.greedy:
        tokens = greedy_siblings(logits, first, extra).tolist()
        return tokens, [None] * len(tokens)
    q = sampling.probs(logits, cfg)
    if cfg.shared_noise:
        at = (len(history) if history is not None else 0) if position is None else position
        score = q.double() / sampling.race_noise(cfg.seed, at, q.shape[-1], q.device).double()
        score[first] = -1.0
        n = min(extra, int((q > 0).sum()) - 1)
        tokens = score.topk(n).indices.tolist() if n > 0 else []
        return tokens, [q] * len(tokens)
    left = q.clone()
    left[first] = 0
    if not left.sum() > 0:
        return [], []
    assert gen is not None, "a sampled draw needs the run's generator"
    tokens, rows = sampling.draw_distinct(left / left.sum(), extra, gen)
    return tokens, list(rows)


def tree_paths(k: int, nodes: int) -> list[tuple[int, ...]]:
    """The chain-with-siblings shape as serving engines write a static tree: each node as the path of
    child ranks from the root ((0,) is the first child, (0, 1) its second child), parents first."""
    paths: list[tuple[int, ...]] = []
    for depth, extra in enumerate(siblings_per_depth(k, nodes)):
        paths += [(0,) * depth + (rank,) for rank in range(1 + extra)]
    return paths


class Branches:
    """One round's drafts as a chain with sibling leaves: the chain is drafted as ever, and at each
    depth `siblings_per_depth` more children of the same parent are drawn from the same logits. With
    no budget it is the chain itself."""

    def __init__(self, k: int, budget: int = 0):
        self.counts = siblings_per_depth(k, budget)  # all 0 without a budget past k
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.qs: list[torch.Tensor | None] = []
        self.main: list[int] = []  # the chain's nodes, by depth

    def add(self, x: int, q, logits, history, cfg: SamplingConfig, gen, position: int | None = None) -> None:
        """The chain's next token x (drawn from logits, with q), and its siblings."""
        parent = self.main[-1] if self.main else -1
        depth = len(self.main)
        self.main.append(len(self.tokens))
        self.tokens.append(x)
        self.parents.append(parent)
        self.qs.append(q)
        if self.counts[depth]:
            tokens, rows = draw_siblings(logits, history, cfg, gen, x, self.counts[depth], position)
            self.tokens += tokens
            self.parents += [parent] * len(tokens)
            self.qs += rows

    @classmethod
    def chain_of(cls, tokens: list[int]) -> Branches:
        """The chain of these drafts, as a round that drew them would hold it (picks read after the fact)."""
        return cls.read_after(tokens, [i - 1 for i in range(len(tokens))], list(range(len(tokens))))

    @classmethod
    def read_after(cls, tokens: list[int], parents: list[int], main: list[int]) -> Branches:
        """These drafts (`main`: the chain's nodes) as a round that drew them would hold them, read after
        the fact: a chain or a tree whose picks stayed on the device."""
        drafts = cls(len(main))
        drafts.main, drafts.tokens = list(main), list(tokens)
        drafts.parents, drafts.qs = list(parents), [None] * len(tokens)
        return drafts

    @property
    def chain(self) -> list[int]:
        return [self.tokens[i] for i in self.main]

    def proposal(self, feature_position: int | None = None) -> Proposal:
        return Proposal(list(self.tokens), stacked(self.qs), feature_position, list(self.parents))

    def kept(self, path: list[int]) -> tuple[list[int], int]:
        """(the accepted drafts, how many of them lead along the chain) after a verdict's kept path."""
        on_chain = 0
        while on_chain < len(path) and on_chain < len(self.main) and path[on_chain] == self.main[on_chain]:
            on_chain += 1
        return [self.tokens[i] for i in path], on_chain
