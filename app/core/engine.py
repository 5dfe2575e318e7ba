"""The round loop: draft, verify with one target pass, commit or roll back; yields Steps.

Plain autoregressive decoding is the same loop with a source that drafts nothing, so
both share loading, sampling, stopping and timing code and compare fairly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from app.core import sampling, teaching, verify
from app.core.config import RunConfig, SamplingConfig, SpecConfig
from app.core.contracts import KVCache, Proposal, Proposer
from app.core.events import BONUS, CORRECTED, TARGET, Decision, Step
from app.core.policy import KPolicy, make_policy
from app.core.text import Detokenizer

# What the teaching view reads of a round: (tokenizer, proposal, p_logits, p, verdict) -> rows.
TeachHook = Callable[..., list]


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


def _decisions(drafts, texts, v: verify.Verdict) -> list[Decision]:
    return [
        Decision(drafts[i], texts[i], v.p_x[i], v.q_x[i], v.accept_prob[i], v.u[i], i < v.accepted)
        for i in range(len(v.p_x))
    ]


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
    teach: TeachHook | None = None,
    before_round: Callable[[], None] | None = None,
    display: bool = True,
) -> Iterator[Step]:
    """Speculative decoding with `proposer`, or autoregressive decoding when it is None.

    target_cache builds the target's per-request cache (kv/). teach fills each Step's `top` table,
    which only the teaching view reads; before_round runs ahead of every round (the thread governor).
    display=False leaves each draft's and the target token's own text empty (Step.draft_text,
    token_text), which only a view reads: a benchmark then times no detokenising beyond the output's.
    """
    for cfg in (sampling_cfg, spec, run):
        cfg.validate()
    loop = _Loop(target, tokenizer, proposer, sampling_cfg, run, policy or make_policy(spec), teach)
    loop.display = display
    loop.start(prompt_ids)
    loop.lm = target_cache(target)
    if proposer is not None:
        proposer.begin(loop.ids, target.get_output_embeddings().weight.shape[0])
    busy = 0.0  # this run's own clock: it stops while the consumer holds a yielded Step
    try:
        for rnd in range(1, run.max_new_tokens + 1):
            if before_round is not None:
                before_round()
            t0 = time.perf_counter()
            step = loop.round(rnd)
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

    def __init__(self, target, tokenizer, proposer, sampling_cfg, run, policy, teach):
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.cfg, self.run, self.policy, self.teach = sampling_cfg, run, policy, teach
        self.gen = torch.Generator().manual_seed(sampling_cfg.seed)
        # The target's window ends the run, as it ends plain decoding; a draft with a shorter window
        # only drafts less (down to plain steps), so the text stays the target's own.
        self.limit = getattr(target.config, "max_position_embeddings", None) or 1 << 20
        own = proposer.context_limit if proposer is not None else None
        self.draft_limit = min(self.limit, own or self.limit)  # what drafting may fill
        self.eos = {tokenizer.eos_token_id, *_as_list(target.generation_config.eos_token_id)} - {None}
        self.lm: KVCache | None = None
        self.ids: list[int] = []
        self.display = True

    def start(self, prompt_ids: list[int]) -> None:
        self.out = _Output(self.tokenizer, prompt_ids, self.run, self.eos)
        self.ids = list(prompt_ids)

    def _k(self) -> int:
        """Never draft more than can be emitted or than fits in the target's context or the draft's."""
        if self.proposer is None:
            return 0
        room = self.draft_limit - len(self.ids) - 1
        return max(0, min(self.policy.next_k(), self.run.max_new_tokens - len(self.out.ids) - 1, room))

    def _verify(self, proposal: Proposal) -> tuple[verify.Verdict, torch.Tensor, torch.Tensor | None, int]:
        """One target pass over the uncached ids and the drafts; roll back what it rejected."""
        drafts, lm, base = proposal.tokens, self.lm, len(self.ids)
        fed = self.ids[lm.length :] + drafts
        if self.proposer is not None and self.proposer.wants_features:
            p_logits, features = lm.extend_with_features(fed, keep=len(drafts) + 1)
        else:
            p_logits, features = lm.extend(fed, keep=len(drafts) + 1), None
        p_logits = sampling.penalise(p_logits, self.ids, drafts, self.cfg)
        p = None
        if self.cfg.greedy:
            v = verify.greedy(drafts, p_logits, self.teach is not None)
        elif self.cfg.shared_noise:  # the race at absolute positions base.., read by the drafts too
            p = sampling.probs(p_logits, self.cfg)
            v = verify.shared_noise(drafts, p, proposal.q, self.cfg.seed, base)
        else:
            p = sampling.probs(p_logits, self.cfg)
            q = proposal.q if proposal.q is not None else verify.one_hot_q(drafts, p.shape[-1], p.device)
            v = verify.speculative_sampling(drafts, p, q, self.gen)
        lm.rollback(base + v.accepted)
        if self.proposer is not None:
            # The target's features of the positions it kept: the fed committed ones plus accepted drafts.
            kept = None if features is None else features[: len(fed) - len(drafts) + v.accepted]
            self.proposer.commit(v.accepted, v.token, kept)
        return v, p_logits, p, base

    def round(self, rnd: int) -> Step:
        """Draft, verify, commit: one Step."""
        k = self._k()
        t0 = time.perf_counter()
        proposal = Proposal([], None) if self.proposer is None else self.proposer.propose(k, self.cfg, self.gen)
        sync(self.lm.device)
        t1 = time.perf_counter()
        v, p_logits, p, base = self._verify(proposal)
        sync(self.lm.device)
        t2 = time.perf_counter()
        drafts, n = proposal.tokens, v.accepted
        self.policy.update(len(drafts), n, context=base + n + 1)
        texts, token_text = self.out.detok.peek(drafts, n, v.token) if self.display else ([""] * len(drafts), "")
        kept = drafts[:n] + [v.token]
        emitted, new_text = self.out.push(kept)
        self.ids += kept
        if not self.out.stop_reason and len(self.ids) >= self.limit:
            self.out.stop_reason = "context_full"
        top, race = [], []
        if self.teach is not None and self.proposer is not None:
            top = self.teach(self.tokenizer, proposal, p_logits, p, v)
            if v.noise is not None:
                race = teaching.race_table(self.tokenizer, proposal, p, v)
        return Step(
            round=rnd,
            k=k,
            drafted=drafts,
            draft_text=texts,
            accepted=n,
            token=v.token,
            token_kind=TARGET if not drafts else (BONUS if n == len(drafts) else CORRECTED),
            token_text=token_text,
            rejected=drafts[n:],
            emitted=emitted,
            text=new_text,
            draft_time=t1 - t0,
            verify_time=t2 - t1,
            elapsed=0.0,
            decisions=_decisions(drafts, texts, v),
            top=top,
            stop_reason=self.out.stop_reason,
            feature_position=proposal.feature_position,
            context=base,
            race=race,
        )


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple, set)) else [x]
