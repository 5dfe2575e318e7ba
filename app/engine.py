"""The round loop: draft, verify with one target pass, commit or roll back; yields Steps.

Plain autoregressive decoding is the same loop with a source that drafts nothing, so
both share loading, sampling, stopping and timing code and compare fairly.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch
from transformers import PreTrainedModel

from app import sampling, threads, verify
from app.cache import CachedModel
from app.config import RunConfig, SamplingConfig, SpecConfig
from app.events import BONUS, CORRECTED, TARGET, Decision, Step
from app.models import context_length
from app.policy import KPolicy, make_policy
from app.proposers import Proposal, Proposer
from app.text import Detokenizer

TOP_N = 8  # tokens kept per round for the teaching view


class NoDraft:
    """The draft source of plain autoregressive decoding: it never proposes."""

    name = "none"
    wants_features = False

    def begin(self, prompt_ids, vocab_size):
        pass

    def propose(self, k, cfg, gen):
        return Proposal([], None)

    def commit(self, accepted, token, features=None):
        pass


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


def _top(tokenizer, proposal: Proposal, p_logits, p, v: verify.Verdict, size: int = TOP_N) -> list[tuple]:
    """(id, text, p, q, residual) for the few tokens that matter where the target chose its token.

    p is None under greedy decoding; then softmax(logits) is shown so there is something to see.
    """
    n, drafts, residual = v.accepted, proposal.tokens, v.residual
    if n == len(drafts):
        q_row = torch.zeros(1, device=p_logits.device)
    elif proposal.q is not None:
        q_row = proposal.q[n]
    else:
        q_row = verify.one_hot_q(drafts[n : n + 1], p_logits.shape[-1], p_logits.device)[0]
    p_row = p_logits[n].float().softmax(-1) if p is None else p[n]
    width = max(len(p_row), len(q_row), len(residual))
    p_row, q_row, residual = (
        torch.nn.functional.pad(t.float().to(p_row.device), (0, width - len(t))) for t in (p_row, q_row, residual)
    )
    size = min(size, width)
    ids = torch.unique(torch.cat([p_row.topk(size).indices, residual.topk(size).indices]))
    ids = ids[p_row[ids].argsort(descending=True)][:size]
    if int(v.token) not in ids.tolist():  # the token the target drew is always plotted
        ids = torch.cat([ids[: size - 1], torch.tensor([int(v.token)], device=ids.device)])
    return [
        (int(i), tokenizer.decode([int(i)]), float(p_row[i]), float(q_row[i]), float(residual[i]))
        for i in ids
    ]


def generate(
    target: PreTrainedModel,
    tokenizer,
    prompt_ids: list[int],
    proposer: Proposer | None = None,
    sampling_cfg: SamplingConfig = SamplingConfig(),
    spec: SpecConfig = SpecConfig(),
    run: RunConfig = RunConfig(),
    policy: KPolicy | None = None,
    target_cache: Callable[[PreTrainedModel], CachedModel] = CachedModel,
    teach: bool = False,
) -> Iterator[Step]:
    """Speculative decoding with `proposer`, or autoregressive decoding when it is None.

    teach=True also fills each Step's `top` table (top-p/q/residual at the decision point),
    which only the teaching view reads; the hot loop skips it otherwise.

    target_cache builds the target's per-request cache (static_cache.py: the GPU fast path).
    """
    for cfg in (sampling_cfg, spec, run):
        cfg.validate()
    autoregressive = proposer is None
    proposer = proposer or NoDraft()
    policy = policy or make_policy(spec)
    gen = torch.Generator().manual_seed(sampling_cfg.seed)
    lm = target_cache(target)
    limit = context_length(target, *([proposer.model] if hasattr(proposer, "model") else []))
    eos = {tokenizer.eos_token_id, *_as_list(target.generation_config.eos_token_id)} - {None}
    out = _Output(tokenizer, prompt_ids, run, eos)
    ids = list(prompt_ids)
    proposer.begin(ids, target.get_output_embeddings().weight.shape[0])
    busy = 0.0  # this run's own clock: it stops while the consumer holds a yielded Step
    for rnd in range(1, run.max_new_tokens + 1):
        # Never draft more than can be emitted or than fits in the context.
        threads.follow()  # auto threads: the cores other processes left free, read at most every 0.2 s
        k = 0 if autoregressive else min(policy.next_k(), run.max_new_tokens - len(out.ids) - 1, limit - len(ids) - 1)
        t0 = time.perf_counter()
        proposal = proposer.propose(k, sampling_cfg, gen)
        sync(lm.device)
        t1 = time.perf_counter()
        drafts = proposal.tokens
        base = len(ids)
        fed = ids[lm.length :] + drafts
        if proposer.wants_features:
            p_logits, features = lm.extend_with_features(fed, keep=len(drafts) + 1)
        else:
            p_logits, features = lm.extend(fed, keep=len(drafts) + 1), None
        p_logits = sampling.penalise(p_logits, ids, drafts, sampling_cfg)
        p = None
        if sampling_cfg.greedy:
            v = verify.greedy(drafts, p_logits, teach)
        else:
            p = sampling.probs(p_logits, sampling_cfg)
            q = proposal.q if proposal.q is not None else verify.one_hot_q(drafts, p.shape[-1], p.device)
            v = verify.speculative_sampling(drafts, p, q, gen)
        lm.rollback(base + v.accepted)
        # The target's features of the positions it kept: the fed committed ones plus accepted drafts.
        kept_features = None if features is None else features[: len(fed) - len(drafts) + v.accepted]
        proposer.commit(v.accepted, v.token, kept_features)
        sync(lm.device)
        t2 = time.perf_counter()
        policy.update(len(drafts), v.accepted, t1 - t0, t2 - t1, context=base + v.accepted + 1)

        texts, token_text = out.detok.peek(drafts, v.accepted, v.token)
        kept = drafts[: v.accepted] + [v.token]
        emitted, new_text = out.push(kept)
        ids += kept
        if not out.stop_reason and len(ids) >= limit:
            out.stop_reason = "context_full"
        n = v.accepted
        busy += time.perf_counter() - t0
        yield Step(
            round=rnd, k=k, drafted=drafts, draft_text=texts, accepted=n, token=v.token,
            token_kind=TARGET if not drafts else (BONUS if n == len(drafts) else CORRECTED),
            token_text=token_text, rejected=drafts[n:], emitted=emitted, text=new_text,
            draft_time=t1 - t0, verify_time=t2 - t1, elapsed=busy,
            decisions=_decisions(drafts, texts, v),
            top=_top(tokenizer, proposal, p_logits, p, v) if teach and not autoregressive else [],
            stop_reason=out.stop_reason, feature_position=proposal.feature_position, context=base,
        )
        if out.stop_reason:
            return


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple, set)) else [x]
