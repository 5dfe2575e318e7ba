"""The answer writer's continuous batching: rows leave when their answer ends and new requests take
their place, and each request's text (and, in the exact int8 precision, its features) is what it
would be written alone, greedy and sampled with its own seed."""

import pytest
import torch

from app import models
from app.models import exact_model
from app.training import answer_writer

TEXTS = [
    "import os\n\ndef main(",
    "class Foo:\n    def __init__(self",
    "for i in range(",
    "def add(a, b):\n    return",
    "import sys\nimport json\n\n\ndef load(path",
    "x = [",
    "while True:\n    line = input(",
]


@pytest.fixture(scope="module")
def tiny():
    target, tokenizer = models.load(models.TINY_TARGET, None, "fp32")
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in TEXTS]
    # the newline as the end-of-turn token: answers end after a line or two, at different steps
    eos = tokenizer("\n", add_special_tokens=False)["input_ids"][-1]
    return exact_model.convert(target).eval(), prompts, eos


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_request_writes_the_same_in_a_shared_batch_as_alone(tiny, temperature):
    target, prompts, eos = tiny
    entries = []
    shared = answer_writer.write(target, prompts, eos, 24, temperature, seed=5, slots=3, log=entries.append)
    alone = answer_writer.write(target, prompts, eos, 24, temperature, seed=5, slots=1)
    lengths = {len(a.ids) - len(p) for a, p in zip(shared, prompts, strict=True)}
    assert len(lengths) > 2, "answers of different lengths: rows left and joined the batch at different steps"
    assert [e["done"] for e in entries] == sorted(e["done"] for e in entries) and entries[-1]["done"] == len(prompts)
    for a, b, prompt in zip(shared, alone, prompts, strict=True):
        assert a.ids == b.ids and a.ids[: len(prompt)] == prompt
        assert torch.equal(a.features, b.features), "the exact precision's rows do not depend on the batch"
        assert a.features.shape[0] == len(a.ids)
        ended = eos in a.ids[len(prompt) :]
        assert ended or len(a.ids) - len(prompt) == 24 - 1, "an answer ends at its end token or one short of the cap"
    other_seed = answer_writer.write(target, prompts, eos, 24, temperature, seed=6, slots=3)
    assert ([a.ids for a in other_seed] == [a.ids for a in shared]) == (temperature == 0.0)


def test_a_greedy_answer_is_the_targets_own_generation(tiny):
    target, prompts, eos = tiny
    (answer,) = answer_writer.write(target, prompts[:1], eos, 12)
    out = target.generate(
        torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )[0].tolist()
    assert answer.ids == out[: len(answer.ids)]
    assert len(out) - len(answer.ids) in (0, 1), "the cap's last token is written but never fed"


def test_a_shared_prefix_runs_once_and_each_request_reads_as_if_run_whole(tiny):
    target, prompts, eos = tiny
    system = prompts[4][:6]  # a shared beginning, as a chat template's system turn is
    shared = [system + p for p in prompts[:4]]
    assert answer_writer.shared_prefix(shared) == system
    fed = []
    hook = target.register_forward_pre_hook(lambda m, args, kw: fed.append(kw["input_ids"].numel()), with_kwargs=True)
    try:
        answers = answer_writer.write(target, shared, eos, 16, 0.0, slots=2)
    finally:
        hook.remove()
    prefills = [n for n in fed if n > 2]  # a step feeds one token a row, two rows here
    assert prefills[0] == len(system) and sum(prefills) == len(system) + sum(len(p) - len(system) - 1 for p in shared)
    norm = answer_writer.FinalNorm(target)
    try:
        for answer in answers:
            with torch.inference_mode():
                target(input_ids=torch.tensor([answer.ids]))
            assert torch.equal(norm.take()[0], answer.features), "a copied prefix reads as the whole prompt run at once"
    finally:
        norm.close()
