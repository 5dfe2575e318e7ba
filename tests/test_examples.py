"""The app's examples tell the truth: code is easier to speculate on than open-ended English,
and no example loops under its own settings on the default pair (instructions through the chat template),
at the app's default adaptive k."""

import json
from collections import Counter

import pytest

from app import models
from app.core import engine, metrics
from app.core.config import RunConfig, SamplingConfig, SpecConfig
from app.kv.cache import DynamicRollbackCache

pytestmark = pytest.mark.slow  # every example on the bundled pair

EXAMPLES = json.loads((models.ROOT / "assets" / "prompts.json").read_text())


def loops(ids: list[int], n: int = 8, times: int = 3) -> bool:
    """The repetition rule of the model card: some n-gram occurs `times` or more times."""
    grams = Counter(tuple(ids[i : i + n]) for i in range(len(ids) - n + 1))
    return bool(grams) and max(grams.values()) >= times


def sampling_of(example: dict) -> SamplingConfig:
    s = example["settings"]
    greedy = s["decoding"] == "greedy"
    return SamplingConfig(
        0.0 if greedy else s["temperature"],
        s["top_k"],
        s["top_p"],
        s.get("seed", 0),
        s["repetition_penalty"],
        s["no_repeat_ngram_size"],
    )


@pytest.fixture(scope="module")
def results():
    pair = models.load_pair(models.DEFAULT_TARGET, models.DEFAULT_DRAFT)
    out = []
    for e in EXAMPLES:
        s = sampling_of(e)
        run = RunConfig(e["settings"]["max_new_tokens"])
        ids = pair.encode(e["prompt"], e["settings"].get("chat", False))
        steps = list(
            engine.generate(
                pair.target,
                pair.tokenizer,
                ids,
                pair.proposer(),
                sampling_cfg=s,
                spec=SpecConfig(),  # the app's default: adaptive k
                run=run,
                target_cache=DynamicRollbackCache,
            )
        )
        stats = metrics.summarize(steps)
        out.append((e, [t for st in steps for t in st.emitted], stats["alpha"]))
    return out


def test_code_examples_accept_more_than_open_ended_ones(results):
    def mean_alpha(kind):
        alphas = [a for e, _, a in results if e["kind"] == kind]
        return sum(alphas) / len(alphas)

    assert mean_alpha("code") > mean_alpha("open-ended")


def test_no_example_loops_under_its_own_settings(results):
    looping = [e["label"] for e, ids, _ in results if loops(ids)]
    assert not looping, looping


def test_every_example_carries_valid_settings():
    kinds = {e["kind"] for e in EXAMPLES}
    assert {"code", "open-ended"} <= kinds
    for e in EXAMPLES:
        sampling_of(e).validate()
        assert (e["settings"]["decoding"] == "greedy") == (e["kind"] != "open-ended"), e["label"]


def test_loop_rule_detects_a_loop():
    assert loops([1, 2, 3, 4, 5, 6, 7, 8] * 3) and not loops(list(range(40)))
