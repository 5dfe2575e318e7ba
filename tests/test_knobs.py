"""Every setting is declared once (core/knobs.py): the CLI, the form, the boundary and the page follow."""

import argparse

import pytest
from conftest import form_fields

from app import args
from app.core import config, knobs
from app.core.config import K_POLICIES, SpecConfig, UserError
from app.core.knobs import Knob
from app.serve import knob_widgets
from app.serve.knob_widgets import Widget

TOY = Knob("toy_level", int, "toy level", default=3, lo=0, hi=9, help="how loud the toy is (0: silent)")
TOY_WIDGET = Widget("slider", "Toy level (0 = silent)", lo=0, hi=9, step=1, elem_id="toy-level")


@pytest.fixture
def toy(monkeypatch):
    """A new setting: its Knob in core, and the page's widget for it in serve."""
    monkeypatch.setattr(knobs, "KNOBS", [*knobs.KNOBS, TOY])
    monkeypatch.setattr(knob_widgets, "WIDGETS", {**knob_widgets.WIDGETS, TOY.name: TOY_WIDGET})
    return TOY


def test_the_core_declares_what_a_setting_means_and_serve_how_the_page_shows_it():
    """Names, ranges and meaning in core/knobs.py; the words, widget kinds and element ids in serve/."""
    import dataclasses

    assert not {"ui", "label", "widget", "elem_id"} & {f.name for f in dataclasses.fields(Knob)}
    assert not hasattr(knobs, "Widget")
    names = [k.name for k in knobs.KNOBS]
    assert set(knob_widgets.WIDGETS) <= set(names), "every widget shows a declared setting"
    assert [k.name for k in knob_widgets.shown()] == [n for n in names if n in knob_widgets.WIDGETS], "KNOBS' order"


def test_a_toy_setting_is_one_declaration_in_the_cli_the_form_and_the_boundary(toy):
    from app.serve import boundary, controls, form

    ap = argparse.ArgumentParser()
    args.add_generation_args(ap)
    assert "--toy-level" in ap.format_help() and "how loud the toy is" in ap.format_help()
    assert ap.parse_args([]).toy_level == 3 and ap.parse_args(["--toy-level", "5"]).toy_level == 5

    assert form.names()[-1] == "toy_level" and dict(form.fields())["toy_level"] == 3, "after the fields before it"
    assert form.names()[: len(form.NAMES)] == form.NAMES, "the API's order for earlier fields stays"

    check = boundary.fields()["toy_level"]
    check(7)
    with pytest.raises(UserError, match="toy level must be a whole number from 0 to 9, got 12"):
        check(12)
    with pytest.raises(UserError, match="toy level must be a whole number from 0 to 9"):
        boundary.check_fields(lambda toy_level: None, (12,), {})

    slider = controls.component(toy)
    assert slider.label == "Toy level (0 = silent)" and slider.value == 3 and slider.maximum == 9


def test_the_page_builds_a_control_for_a_new_setting_and_wires_it(toy):
    from app.serve import ui

    demo = ui.build_ui()
    ours = [c for c in demo.config["components"] if c["props"].get("elem_id") == "toy-level"]
    assert len(ours) == 1 and ours[0]["props"]["label"] == "Toy level (0 = silent)"
    generate = next(d for d in demo.config["dependencies"] if d["api_name"] == "generate")
    assert ours[0]["id"] in generate["inputs"], "the new control is one of Generate's inputs"


def test_the_cli_and_the_form_map_to_the_same_settings():
    from app.serve import form

    ap = argparse.ArgumentParser()
    args.add_generation_args(ap)
    cli = args.settings(ap.parse_args(["--temperature", "0.7", "--top-k", "5", "--k", "3", "--k-policy", "heuristic"]))
    fields = form_fields(prompt="x", target="t", draft="d", decoding="sampling", temperature=0.7, top_k=5)
    page = form.parse(fields | dict(k_policy="heuristic", k=3)).settings
    assert cli == page


@pytest.mark.parametrize("policy", K_POLICIES)
def test_k_raises_k_max_unless_adaptive_by_one_rule_on_the_cli_the_page_and_the_bench(policy):
    """A k above k max is fixed k's length or heuristic's start, so it raises their cap; adaptive keeps its own."""
    from app.bench import contenders
    from app.serve import form

    ap = argparse.ArgumentParser()
    args.add_generation_args(ap)
    cli = args.settings(ap.parse_args(["--k", "12", "--k-policy", policy]))
    page = form.parse(form_fields(prompt="x", target="t", draft="d", k_policy=policy, k=12)).settings
    cap = config.k_cap(policy, 12, SpecConfig.k_max)
    assert cli.spec.k_max == page.spec.k_max == cap == (SpecConfig.k_max if policy == "adaptive" else 12)
    assert contenders.fixed_k(SpecConfig(), 12).k_max == config.k_cap("fixed", 12, SpecConfig.k_max) == 12


@pytest.mark.parametrize(
    ("policy", "tree", "shaped"),
    [("fixed", 8, False), ("adaptive", 8, True), ("adaptive", 0, False), ("fixed", 0, False)],
)
def test_tree_means_one_thing_on_the_page_the_cli_and_the_command_the_page_prints(policy, tree, shaped):
    """Tree N is up to N nodes a round: a fixed tree under fixed k, the cost model's shaping under adaptive k."""
    from app.serve import form

    ap = argparse.ArgumentParser()
    args.add_generation_args(ap)
    fields = form_fields(prompt="x", target="t", draft="d", max_new_tokens=64)
    page = form.parse(fields | dict(k_policy=policy, k=3, tree=tree)).settings
    assert (page.spec.tree, page.spec.tree_auto) == (tree, shaped)
    given = ["--max-new-tokens", "64", "--k-policy", policy, "--k", "3", "--no-chat"]
    cli = args.settings(ap.parse_args(given + (["--tree", str(tree)] if tree else [])))
    assert cli.spec == page.spec
    # the command the page prints for its settings gives back the very same settings
    assert args.settings(ap.parse_args(args.flags(page))) == page


def test_the_printed_command_runs_the_pages_settings_as_typed():
    import shlex

    page = knobs.settings(
        dict(temperature=0.7, seed=5, rule="shared-noise", k_policy="adaptive", tree=16, stop=("\n\n",))
    )
    line = args.command_line(
        "def f(x):\n    return 'a'", "SmolLM2-135M-Instruct", "prompt lookup (n-grams)", page, "int8"
    )
    words = shlex.split(line)
    assert words[:4] == ["python", "-m", "app", "generate"]
    assert words[words.index("--prompt") + 1] == "def f(x):\n    return 'a'" and "--dtype" in words
    ap = argparse.ArgumentParser()
    args.add_generation_args(ap)
    ap.add_argument("--prompt")
    parsed = ap.parse_args(words[4:])
    assert args.settings(parsed) == page and parsed.draft == "prompt lookup (n-grams)"
