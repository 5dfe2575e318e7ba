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
from app.core.config import RunConfig, SamplingConfig, SpecConfig, UserError
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


def _decisions(drafts, texts, v, judged: list[int], tree: bool) -> list[Decision]:
    """One record per judged draft, in the order judged; judged[j] is its index in drafts."""
    return [
        Decision(drafts[i], texts[i], v.p_x[j], v.q_x[j], v.accept_prob[j], v.u[j], i < v.accepted, i if tree else None)
        for j, i in enumerate(judged)
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
    _check_prompt(target, prompt_ids)
    loop = _Loop(target, tokenizer, proposer, sampling_cfg, run, policy or make_policy(spec), teach)
    loop.display = display
    loop.start(prompt_ids)
    loop.lm = target_cache(target)
    if proposer is not None and proposer.wants_features:  # which of the target's states the draft reads
        loop.lm.feature_layers = getattr(proposer, "feature_layers", ())
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

    def __init__(self, target, tokenizer, proposer, sampling_cfg, run, policy, teach) -> None:
        self.target, self.tokenizer, self.proposer = target, tokenizer, proposer
        self.cfg, self.run, self.policy, self.teach = sampling_cfg, run, policy, teach
        self.gen = torch.Generator().manual_seed(sampling_cfg.seed)
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

    def _verify(self, proposal: Proposal, tree: bool):
        """One target pass over the uncached ids and every draft (a tree's nodes each seeing their
        ancestors only); the kept path then moves into place and the rest is rolled back.

        tree: the round asked for a tree, so the proposer learns its kept path. Returns (verdict,
        p_logits, p, base)."""
        tokens, lm, base = proposal.tokens, self.lm, len(self.ids)
        # Told once: a chain's parents go as None, to the plain pass and the vectorised rules.
        parents = proposal.parents if proposal.is_tree else None
        assert lm is not None, "generate() sets the target's cache before the first round"
        fed = self.ids[lm.length :]
        if self.proposer is not None and self.proposer.wants_features:
            p_logits, features = lm.extend_with_features(fed + tokens, len(tokens) + 1, parents)
        else:
            p_logits, features = lm.extend(fed + tokens, len(tokens) + 1, parents), None
        p_logits = self._penalise(p_logits, tokens, parents)
        p = None
        if self.cfg.greedy:
            v = verify.greedy(tokens, p_logits, self.teach is not None, parents)
        elif self.cfg.shared_noise:  # the race at absolute positions base.., read by the drafts too
            p = sampling.probs(p_logits, self.cfg)
            v = verify.shared_noise(tokens, p, proposal.q, self.cfg.seed, base, parents)
        else:
            p = sampling.probs(p_logits, self.cfg)
            q = proposal.q if proposal.q is not None else verify.one_hot_q(tokens, p.shape[-1], p.device)
            v = verify.speculative_sampling(tokens, p, q, self.gen, parents)
        lm.rollback(base, v.path)
        if self.proposer is not None:
            # The target's features of the positions it kept: the fed committed ones, then the kept path.
            kept = None if features is None else _kept(features, len(fed), v.path)
            if tree:
                self.proposer.commit(v.accepted, v.token, kept, path=v.path)
            else:  # a chain's path is its first `accepted` drafts
                self.proposer.commit(v.accepted, v.token, kept)
        return v, p_logits, p, base

    def _penalise(self, p_logits: torch.Tensor, tokens: list[int], parents: list[int] | None) -> torch.Tensor:
        """The repetition rules on each row of p, after its own branch's history (parents None: a chain)."""
        if parents is None:
            return sampling.penalise(p_logits, self.ids, tokens, self.cfg)
        if not self.cfg.penalised:
            return p_logits
        branch: list[list[int]] = []
        for i, parent in enumerate(parents):
            branch.append((branch[parent] if parent >= 0 else []) + [tokens[i]])
        histories = [self.ids, *(self.ids + b for b in branch)]
        return torch.cat([sampling.penalise(p_logits[r : r + 1], h, [], self.cfg) for r, h in enumerate(histories)])

    def round(self, rnd: int) -> Step:
        """Draft, verify, commit: one Step."""
        k = self._k()
        t0 = time.perf_counter()
        nodes = 0
        if self.proposer is not None and k:
            nodes = self.policy.next_nodes()
            if nodes and not self.branches:  # drafting a chain instead would be an option silently ignored
                raise UserError(f"the {self.proposer.name} draft cannot branch: run it as a chain (tree 0)")
            if nodes != self.proposer.tree:  # a shape chosen round by round (policy.TreeShape)
                self.proposer.tree = nodes
        proposal = Proposal([], None) if self.proposer is None else self.proposer.propose(k, self.cfg, self.gen)
        _check_drafts(proposal.tokens, self.vocab)
        assert self.lm is not None, "generate() sets the target's cache before the first round"
        sync(self.lm.device)
        t1 = time.perf_counter()
        # A round asked for a tree is one, whatever shape it took (its branches may be empty).
        tree = nodes > 0 and bool(proposal.tokens)
        v, p_logits, p, base = self._verify(proposal, tree)
        sync(self.lm.device)
        t2 = time.perf_counter()
        n = v.accepted
        if not tree:
            drafts, parents, judged = proposal.tokens, None, v.judged
            texts, token_text = self.out.detok.peek(drafts, n, v.token) if self.display else ([""] * len(drafts), "")
            bonus = n == len(drafts)
        else:  # a tree's record lists its kept path first, so drafts[:n] are the accepted drafts
            drafts, parents, judged, texts, token_text = self._tree_record(proposal, v, v.path)
            bonus = not any(parent == (v.path[-1] if v.path else -1) for parent in proposal.parents)
        self.policy.update(len(drafts), n, context=base + n + 1, parents=proposal.parents, path=v.path)
        kept = drafts[:n] + [v.token]
        emitted, new_text = self.out.push(kept)
        self.ids += kept
        if not self.out.stop_reason and len(self.ids) >= self.limit:
            self.out.stop_reason = "context_full"
        top, race = [], []
        if self.teach is not None and self.proposer is not None:
            top = self.teach(self.tokenizer, proposal, p_logits, p, v)
            if v.noise is not None:
                assert p is not None  # shared noise verifies on the processed p
                race = teaching.race_table(self.tokenizer, proposal, p, v)
        return Step(
            round=rnd,
            k=k,
            drafted=drafts,
            draft_text=texts,
            accepted=n,
            token=v.token,
            token_kind=TARGET if not drafts else (BONUS if bonus else CORRECTED),
            token_text=token_text,
            rejected=drafts[n:],
            emitted=emitted,
            text=new_text,
            draft_time=t1 - t0,
            verify_time=t2 - t1,
            elapsed=0.0,
            decisions=_decisions(drafts, texts, v, judged, parents is not None),
            top=top,
            stop_reason=self.out.stop_reason,
            feature_position=proposal.feature_position,
            context=base,
            race=race,
            parents=parents,
            nodes=nodes,
        )

    def _tree_record(self, proposal: Proposal, v, path: list[int]):
        """A tree round as its Step lists it: nodes reordered with the kept path first, their parents
        in that order, the judged nodes by their new index, and each node's text after its own branch."""
        tokens, parents = proposal.tokens, proposal.parents or []
        order = path + [i for i in range(len(tokens)) if i not in path]
        where = {node: j for j, node in enumerate(order)}
        shown_parents = [where[parents[i]] if parents[i] >= 0 else -1 for i in order]
        judged = [where[i] for i in v.judged]
        if not self.display:
            return [tokens[i] for i in order], shown_parents, judged, [""] * len(tokens), ""
        chain = [tokens[i] for i in path]
        texts_by_node: dict[int, str] = {}
        path_texts, token_text = self.out.detok.peek(chain, len(chain), v.token)
        texts_by_node.update(zip(path, path_texts, strict=True))
        for i in order[len(path) :]:
            branch: list[int] = []
            at = i
            while at >= 0:
                branch.insert(0, tokens[at])
                at = parents[at]
            texts_by_node[i] = self.out.detok.peek(branch, 0, branch[0])[0][-1]
        return [tokens[i] for i in order], shown_parents, judged, [texts_by_node[i] for i in order], token_text


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
    return features[torch.tensor(keep, device=features.device)]


def _as_list(x) -> list:
    return [] if x is None else list(x) if isinstance(x, (list, tuple, set)) else [x]
