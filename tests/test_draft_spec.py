"""DraftSpec: a draft's text is parsed once into a kind and its parameters."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from app import models
from app.core.config import UserError
from app.drafts import feature, kinds
from app.drafts import lookup as lookup_kind
from app.drafts import model as model_kind
from app.drafts.draft_spec import DraftSpec


@pytest.mark.parametrize(
    "text, kind, source, layers, canonical",
    [
        ("prompt-lookup", "prompt_lookup", "", 0, "prompt-lookup"),
        (" Prompt lookup ", "prompt_lookup", "", 0, "prompt-lookup"),
        ("early-exit:2", "early_exit", "", 2, "early-exit:2"),
        (
            "eagle:yuhuili/EAGLE-LLaMA3-Instruct-8B",
            "feature_head",
            "yuhuili/EAGLE-LLaMA3-Instruct-8B",
            0,
            "eagle:yuhuili/EAGLE-LLaMA3-Instruct-8B",
        ),
        ("Qwen/Qwen2.5-0.5B-Instruct", "model", "Qwen/Qwen2.5-0.5B-Instruct", 0, "Qwen/Qwen2.5-0.5B-Instruct"),
    ],
)
def test_parse_and_canonical_text(text, kind, source, layers, canonical):
    spec = kinds.parse(text)
    assert (spec.kind.name, spec.source, spec.layers) == (kind, source, layers)
    assert str(spec) == canonical and kinds.parse(str(spec)) == spec
    assert spec.loads_model == (kind in ("model", "feature_head"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("early-exit:two", "early exit needs a layer count, like early-exit:2"),
        ("early-exit:0", "early exit needs at least one layer"),
        ("", "no draft model given"),
        ("eagle:", "no draft model given"),
    ],
)
def test_bad_text_is_refused_with_what_to_type(text, message):
    with pytest.raises(UserError, match=message):
        kinds.parse(text)


def test_a_directory_is_a_feature_head_only_when_it_holds_one(tmp_path):
    head, model = tmp_path / "head", tmp_path / "model"
    head.mkdir(), model.mkdir()
    save_file({"fc.weight": torch.zeros(2, 4)}, str(head / "model.safetensors"))
    save_file({"lm_head.weight": torch.zeros(2, 4)}, str(model / "model.safetensors"))
    assert kinds.parse(str(head)) == DraftSpec(feature.KIND, source=str(head))
    assert str(kinds.parse(str(head))) == str(head)
    assert kinds.parse(str(model)).kind is model_kind.KIND


def test_pairs_read_the_spec_not_the_string():
    pair = models.load_pair(models.TINY_TARGET, "early-exit:3")
    assert pair.draft_spec == DraftSpec(model_kind.EARLY_EXIT, layers=3)
    assert pair.proposer().name == "early-exit:3"
    lookup = models.load_pair(models.TINY_TARGET, "prompt-lookup")
    assert lookup.draft_spec.kind is lookup_kind.KIND
    with pytest.raises(UserError, match="early exit needs a layer count"):
        models.load_pair(models.TINY_TARGET, "early-exit:x")
