"""The draft list follows the target: a preset target is offered only the drafts it can run, its own
default selected, and chat formatting as its template says; a typed target is offered every draft."""

import pytest
from conftest import ADD_PROMPT, form_fields

from app.models import presets
from app.serve import handlers

TINY = "stdlib-code target (bundled)"
SMOLLM2 = "SmolLM2-135M-Instruct (offline)"


def test_each_preset_target_gets_its_own_head_first_and_no_other_targets_head():
    for target in presets.TARGET_PRESETS:
        offered = presets.drafts_for_target(target)
        assert offered[0] == presets.default_draft(target) and len(set(offered)) == len(offered)
        heads = {presets.draft_label(d) for d in presets.DEFAULT_DRAFTS.values()} - {offered[0]}
        assert not heads & set(offered), f"{target} is offered a head trained on another target's features"
        assert "prompt lookup (n-grams)" in offered and set(offered) <= set(presets.DRAFT_PRESETS)
    # the case a newcomer met: the tiny family's head with SmolLM2 fails on the features' width
    assert "feature draft (EAGLE-style, bundled)" not in presets.drafts_for_target(SMOLLM2)
    assert "feature draft for SmolLM2 (EAGLE-style, trained here)" not in presets.drafts_for_target(TINY)
    assert len(presets.drafts_for_target("someone/else")) == len(presets.DRAFT_PRESETS)


def test_changing_the_target_selects_its_draft_and_its_chat_setting():
    draft, chat = handlers.drafts_for_target(TINY)
    assert draft.value == "feature draft (EAGLE-style, bundled)" and chat.value is False
    assert [label for _, label in draft.choices] == presets.drafts_for_target(TINY)
    draft, chat = handlers.drafts_for_target(SMOLLM2)
    assert draft.value == "feature draft for SmolLM2 (EAGLE-style, trained here)" and chat.value is True
    typed = handlers.drafts_for_custom_target("someone/else")
    assert len(typed.choices) == len(presets.DRAFT_PRESETS)
    assert "value" not in typed.constructor_args, "the update sends no value: the chosen draft is kept"


@pytest.mark.parametrize("draft", presets.drafts_for_target(TINY))
def test_every_draft_offered_with_the_tiny_target_runs(draft):
    from app.serve import ui

    _, chat = handlers.drafts_for_target(TINY)
    fields = form_fields(prompt=ADD_PROMPT, target=TINY, draft=draft, chat=chat.value, max_new_tokens=12)
    *_, doc = list(ui.generate_both(**fields | dict(k_policy="fixed", k=3), control={"stop": False}))[-1]
    spec, plain = doc["speculative"], doc["autoregressive"]
    assert spec["token_ids"] == plain["token_ids"] and spec["draft"] in (draft, presets.id_of(draft))


def test_the_page_lists_the_default_targets_drafts_and_rewires_them_on_a_change():
    from app.serve.ui import build_ui

    demo = build_ui()
    fns = {f.fn.__name__: f for f in demo.fns.values() if f.fn is not None}
    changed = fns["drafts_for_target"]
    (target,), (draft, chat) = changed.inputs, changed.outputs
    assert target.label == "Target" and draft.label == "Draft" and chat.label.startswith("Chat formatting")
    assert [label for _, label in draft.choices] == presets.drafts_for_target(target.value)
    assert draft.value == presets.default_draft(target.value)
