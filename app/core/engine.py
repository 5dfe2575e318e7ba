"""The round loop: draft, verify with one target pass, commit or roll back; yields Steps.

Plain autoregressive decoding is the same loop with a source that drafts nothing, so
both share loading, sampling, stopping and timing code and compare fairly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from app.core import sampling, transfer, verify
from app.core.config import RunConfig, SamplingConfig, SpecConfig, UserError
from app.core.contracts import KVCache, Proposal, Proposer
from app.core.events import Step
from app.core.policy import KPolicy, make_policy
from app.core.record import Recorder, Round
from app.core.text import Detokenizer


def sync(device: torch.device) -> None:
    """Wait for queued device work, so a timer reads real time on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Output:
    """Accumulates emitted tokens and applies the stop rules: EOS, stop strings, length."""

    def __init__(self, tokenizer, prompt_ids: list[int], run: RunConfig, eos: set[int]):
        self.detok = Detokenizer(tokenizer, prompt_ids)
        self.run, self.eos = run, eos
        self.ids: list[int] = []
        self.text = ""
        self.stop_reason: str | None = None

    def push(self, tokens: list[int]) -> tuple[list[int], str]:
        """Emit tokens in order until a stop rule fires; return what was emitted."""
        emitted, start = [], len(self.text)
        for t in tokens:
            emitted.append(t)
            self.ids.append(t)
            self.text += self.detok.push(t)
            if t in self.eos:
                self.stop_reason = "eos"
            elif hit := self._stop_string(len(self.text) - start):
                self.text = self.text[:hit]
                self.stop_reason = "stop_string"
            elif len(self.ids) >= self.run.max_new_tokens:
                self.stop_reason = "max_new_tokens"
            if self.stop_reason:
                break
        return emitted, self.text[start:]

    def _stop_string(self, new_chars: int) -> int | None:
        """End offset of the first stop string that the new text completes."""
        for s in self.run.stop:
            i = self.text.find(s, max(0, len(self.text) - new_chars - len(s) + 1))
            if i >= 0:
                return i + len(s)
        return None


def generate(
    target: PreTrainedModel,
    tokenizer,
    prompt_ids: list[int],
    proposer: Proposer | None = None,
    *,
    target_cache: Callable[[PreTrainedModel], KVCache],
    sampling_cfg: SamplingConfig = SamplingConfig(),
    spec: SpecConfig = SpecConfig(),
    run: RunConfig = RunConfig(),
    policy: KPolicy | None = None,
    recorder: Recorder | None = None,
    before_round: Callable[[], None] | None = None,
) -> Iterator[Step]:
    """Speculative decoding with `proposer`, or autoregressive decoding when it is None.

    target_cache builds the target's per-request cache (kv/). recorder turns each round into the Step
    yielded (record.py; by default with the drafts' text and no teaching tables); before_round runs
    ahead of every round (the thread governor). A Step's recording counts in its run's busy time.
    """
    for cfg in (sampling_cfg, spec, run):
        cfg.validate()
    _check_prompt(target, prompt_ids)
    recorder = recorder or Recorder(tokenizer)
    # p(x) of greedy drafts is teaching data: computed only when the recorder reads it
    loop = _Loop(target, tokenizer, proposer, sampling_cfg, run, policy or make_policy(spec), recorder.teach)
    loop.start(prompt_ids)
    loop.lm = target_cache(target)
    if proposer is not None and proposer.wants_features:  # which of the target's states the draft reads
        loop.lm.feature_layers = getattr(proposer, "feature_layers", ())
    if proposer is not None:
        proposer.begin(loop.ids, target.get_output_embeddings().weight.shape[0])
        if hasattr(proposer, "picks_on_device"):  # a model draft or a head: its picks may stay there
            proposer.picks_on_device = loop.takes_picks_on_device()
            if proposer.picks_on_device:  # a chain's draws are then made where its picks stay
                same = loop.lm.device == loop.gen.device
                loop.chain_gen = (
                    loop.gen if same else torch.Generator(device=loop.lm.device).manual_seed(sampling_cfg.seed)
                )
    busy = 0.0  # this run's own clock: it stops while the consumer holds a yielded Step
    try:
        for rnd in range(1, run.max_new_tokens + 1):
            if before_round is not None:
                before_round()
            t0 = time.perf_counter()
            step = recorder.step(loop.round(rnd))
            busy += time.perf_counter() - t0
            step.elapsed = busy
            yield step
            if step.stop_reason:
                return
    finally:
        loop.lm.close()
        if proposer is not None:
            proposer.end()


class _Loop:
    """One request's state: the committed ids, the output, the caches, the policy and the generator."""

    def __init__(self, target, tokenizer, proposer, sampling_cfg, run, policy, greedy_p: bool) -> None:
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.cfg, self.run, self.policy, self.greedy_p = sampling_cfg, run, policy, greedy_p
        self.gen = torch.Generator().manual_seed(sampling_cfg.seed)
        # Where a chain's picks stay on a GPU, rejection sampling draws them, and judges them, from a
        # generator there; every other draw (a tree, a plain step) stays on this one, whose draws each
        # read the host once, where a GPU generator's multinomial would read it three times.
        self.chain_gen: torch.Generator | None = None
        # The target's window ends the run, as it ends plain decoding; a draft with a shorter window
        # only drafts less (down to plain steps), so the text stays the target's own.
        self.limit = getattr(target.config, "max_position_embeddings", None) or 1 << 20
        own = proposer.context_limit if proposer is not None else None
        self.branches = bool(getattr(proposer, "branches", False))  # whether the source drafts trees at all
        self.draft_limit = min(self.limit, own or self.limit)  # what drafting may fill
        self.eos = {tokenizer.eos_token_id, *_as_list(target.generation_config.eos_token_id)} - {None}
        self.vocab = target.get_output_embeddings().weight.shape[0]
        self.lm: KVCache | None = None
        self.ids: list[int] = []

    def start(self, prompt_ids: list[int]) -> None:
        self.out = _Output(self.tokenizer, prompt_ids, self.run, self.eos)
        self.ids = list(prompt_ids)

    def _k(self) -> int:
        """Never draft more than can be emitted or than fits in the target's context or the draft's."""
        if self.proposer is None:
            return 0
        room = self.draft_limit - len(self.ids) - 1
        return max(0, min(self.policy.next_k(), self.run.max_new_tokens - len(self.out.ids) - 1, room))

    def takes_picks_on_device(self) -> bool:
        """Whether verify can feed a chain's picks to the target on the device and read them with its
        verdict: no repetition rules, no teaching p(x), on a cache that takes them."""
        assert self.lm is not None, "generate() sets the target's cache first"
        return self.lm.device_steps and self.cfg.picks_stay_on_device and not self.greedy_p

    def _verify(self, proposal: Proposal):
        """One target pass over the uncached ids and every draft (a tree's nodes each seeing their
        ancestors only; a chain is the tree [-1, 0, 1, ..]); the kept path then moves into place and the
        rest is rolled back. Returns (verdict, p_logits, p, base)."""
        tokens, parents, lm, base = proposal.tokens, proposal.parents, self.lm, len(self.ids)
        assert lm is not None, "generate() sets the target's cache before the first round"
        fed = self.ids[lm.length :]
        # A chain's picks may still be on the device (takes_picks_on_device): the pass takes them there,
        # and the verdict's one read brings them back with it.
        picks, proposal.pending = proposal.pending, None
        shown = fed + (tokens if picks is None else [0] * len(picks))  # stand-ins for the picks
        keep = len(shown) - len(fed) + 1
        if self.proposer is not None and self.proposer.wants_features:
            p_logits, features = lm.extend_with_features(shown, keep, parents, on_device=picks)
        else:
            p_logits, features = lm.extend(shown, keep, parents, on_device=picks), None
        p_logits = self._penalise(p_logits, tokens, parents)
        p = None
        if self.cfg.greedy:  # with picks on the device, the verdict fills tokens in place
            v = verify.greedy(tokens, parents, p_logits, self.greedy_p, pending=picks)
        elif self.cfg.shared_noise:  # the race at absolute positions base.., read by the drafts too
            p = sampling.probs(p_logits, self.cfg)
            v = verify.shared_noise(tokens, parents, p, proposal.q, self.cfg.seed, base, pending=picks)
        elif picks is not None:  # a drawn chain: its q rows are on the device with it
            p = sampling.probs(p_logits, self.cfg)
            assert proposal.q is not None, "a drawn chain has its q"
            assert self.chain_gen is not None, "picks on the device come with their generator"
            v = verify.speculative_sampling_on_device(tokens, p, proposal.q, picks, self.chain_gen)
        else:
            p = sampling.probs(p_logits, self.cfg)
            q = proposal.q if proposal.q is not None else verify.one_hot_q(tokens, p.shape[-1], p.device)
            v = verify.speculative_sampling(tokens, parents, p, q, self.gen)
        lm.rollback(base, v.path)
        if self.proposer is not None:
            # The target's features of the positions it kept: the fed committed ones, then the kept path.
            self.proposer.commit(v.path, v.token, None if features is None else _kept(features, len(fed), v.path))
        return v, p_logits, p, base

    def _penalise(self, p_logits: torch.Tensor, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """The repetition rules on each row of p, after its own branch's history."""
        return sampling.penalise(p_logits, self.ids, tokens, self.cfg, parents)

    def round(self, number: int) -> Round:
        """Draft, verify with one target pass, commit: what the round did."""
        k, nodes = self._k(), 0
        assert self.lm is not None, "generate() sets the target's cache before the first round"
        clock = _PhaseClock(self.lm.device)
        if self.proposer is not None and k:
            nodes = self.policy.next_nodes()
            if nodes and not self.branches:  # drafting a chain instead would be an option silently ignored
                raise UserError(f"the {self.proposer.name} draft cannot branch: run it as a chain (tree 0)")
        # nodes: the policy's budget for this round (policy.TreeShape may change it round by round)
        gen = self.chain_gen if self.chain_gen is not None and not nodes else self.gen
        proposal = Proposal([], None) if self.proposer is None else self.proposer.propose(k, self.cfg, gen, nodes)
        _check_drafts(proposal.tokens, self.vocab)
        clock.drafted()
        v, p_logits, p, base = self._verify(proposal)
        times = clock.verified()
        n, parents = v.accepted, proposal.parents
        self.policy.update(len(proposal.tokens), n, context=base + n + 1, parents=parents, path=v.path)
        kept = [proposal.tokens[i] for i in v.path] + [v.token]
        window = self.out.detok.window()  # before the push: the drafts' text follows it
        emitted, text = self.out.push(kept)
        self.ids += kept
        if not self.out.stop_reason and len(self.ids) >= self.limit:
            self.out.stop_reason = "context_full"
        stop, plain = self.out.stop_reason, self.proposer is None
        return Round(number, k, nodes, proposal, v, base, emitted, text, stop, *times, p_logits, p, plain, window)


class _PhaseClock:
    """A round's seconds drafting and verifying. On CUDA the boundary between the two is an event on
    the device, read once the verdict is in: the verdict's read waits for the device anyway, so the
    round makes no wait of its own for the clock."""

    def __init__(self, device: torch.device):
        self.events = device.type == "cuda"
        self.t0 = time.perf_counter()
        if self.events:
            self.stream = torch.cuda.current_stream(device)  # the model's GPU, which need not be the current one
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record(self.stream)

    def drafted(self) -> None:
        if self.events:
            self.end.record(self.stream)
        else:
            self.t1 = time.perf_counter()

    def verified(self) -> tuple[float, float]:
        """(drafting, verifying) in seconds; the two add up to the round's wall time so far."""
        total = time.perf_counter() - self.t0
        # The verdict was read after the boundary's event, so the event is done: this does not wait.
        drafting = self.start.elapsed_time(self.end) / 1000 if self.events else self.t1 - self.t0
        drafting = min(max(drafting, 0.0), total)
        return drafting, total - drafting


def _check_prompt(target: PreTrainedModel, prompt_ids: list[int]) -> None:
    """Refuse, in words, a prompt the target cannot read: the text route checks these, the engine too."""
    vocab = target.get_output_embeddings().weight.shape[0]
    window = getattr(target.config, "max_position_embeddings", None) or 1 << 20
    if not prompt_ids:
        raise UserError("the prompt has no tokens: give at least one")
    bad = [t for t in prompt_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise UserError(f"prompt ids must be whole numbers from 0 to {vocab - 1}, got {bad[0]!r}")
    if len(prompt_ids) >= window:
        raise UserError(f"prompt is {len(prompt_ids)} tokens but the model's context is {window}: shorten the prompt")


def _check_drafts(tokens: list[int], vocab: int) -> None:
    """A draft source must propose ids the target has: a bad one is a bug in the source, said at once."""
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise ValueError(f"the draft source proposed {t!r}, which is not an id from 0 to {vocab - 1}")


def _kept(features: torch.Tensor, committed: int, path: list[int]) -> torch.Tensor:
    """The rows of (committed + n, H) features that the target kept: the committed ones, then the path's."""
    if path == list(range(len(path))):  # a chain's path: a prefix
        return features[: committed + len(path)]
    keep = list(range(committed)) + [committed + i for i in path]
    return features[transfer.queued(torch.tensor(keep), features.device)]  # behind the pass, no wait


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple, set)) else [x]
