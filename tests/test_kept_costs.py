"""Calibrations kept on disk: a later process plans with the one measured before, bit for bit, while passes
timed now agree with those timed beside it; another machine, a drifted run, a slower machine or an unreadable
file measures again, and nothing is kept where SPECDEC_KEEP_COSTS=0."""

import json
import logging
import os
import time

import pytest
from conftest import pair_of

from app import calibrate, cli, kept_costs, models, request
from app.core.config import Settings, SpecConfig
from app.core.policy import AdaptiveK


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A folder of kept calibrations of its own, the in-process cache empty (a fresh process), and the
    real measurement counted."""
    monkeypatch.setenv("SPECDEC_KEEP_COSTS", "1")
    monkeypatch.setattr(kept_costs, "folder", lambda: tmp_path)
    monkeypatch.setattr(kept_costs, "_cache", {})
    monkeypatch.setattr(kept_costs, "_origins", {})
    measured, real = [], calibrate.measure
    monkeypatch.setattr(calibrate, "measure", lambda *a, **kw: measured.append(a[1]) or real(*a, **kw))
    return tmp_path, measured


def as_a_new_process(monkeypatch=None, folder=None):
    """Nothing measured in memory; with a folder, passes timed from now on take the seconds kept beside
    its calibration (a machine as quick as when it was measured: real timings of a tiny model are noise)."""
    kept_costs._cache.clear()
    kept_costs._origins.clear()
    if folder is not None:
        (path,) = folder.glob("*.json")
        then = json.loads(path.read_text())["reference_s"]
        monkeypatch.setattr(calibrate, "check_passes", lambda *a, **kw: list(then))


def test_a_later_process_plans_with_the_kept_calibration(kept, target, near_draft, tokenizer, monkeypatch):
    folder, measured = kept
    pair = pair_of(target, tokenizer, "tiny-kept", near_draft)
    spec = SpecConfig(k_policy="adaptive", k_max=3)
    first = kept_costs.costs_for(pair, spec)
    assert measured == [3] and kept_costs.origin(first) is None
    (path,) = folder.glob("*.json")
    doc = json.loads(path.read_text())
    assert len(doc["reference_s"]) == 2 and all(s > 0 for s in doc["reference_s"])  # one token, k_max + 1
    as_a_new_process(monkeypatch, folder)
    again = kept_costs.costs_for(pair, spec)
    assert measured == [3], "the kept calibration was measured again"
    assert again == first and again is not first  # the same numbers, read back from the file
    assert "round costs measured here" in kept_costs.origin(again)
    policy = request.start(pair, pair.encode("def f"), Settings(spec=spec)).policy()
    assert isinstance(policy, AdaptiveK) and policy.costs is again
    # Another kind of request is a calibration of its own.
    kept_costs.costs_for(pair, SpecConfig(k_policy="adaptive", k_max=2))
    assert measured == [3, 2] and len(list(folder.glob("*.json"))) == 2


def test_a_machine_whose_passes_disagree_measures_again(kept, target, near_draft, tokenizer, monkeypatch):
    folder, measured = kept
    pair = pair_of(target, tokenizer, "tiny-kept-slow", near_draft)
    spec = SpecConfig(k_policy="adaptive", k_max=3)
    kept_costs.costs_for(pair, spec)
    as_a_new_process()
    # Passes timed now take ten times the seconds kept beside the calibration: a busier machine.
    then = json.loads(next(folder.glob("*.json")).read_text())["reference_s"]
    monkeypatch.setattr(calibrate, "check_passes", lambda *a, **kw: [10 * s for s in then])
    fresh = kept_costs.costs_for(pair, spec)
    assert len(measured) == 2 and kept_costs.origin(fresh) is None
    (path,) = folder.glob("*.json")  # the new measurement replaced the old one, with the seconds timed now
    assert json.loads(path.read_text())["reference_s"] == [10 * s for s in then]


def test_another_machine_or_code_never_reads_it(kept, target, near_draft, tokenizer, monkeypatch):
    folder, measured = kept
    pair = pair_of(target, tokenizer, "tiny-kept-cpu", near_draft)
    spec = SpecConfig(k_policy="adaptive", k_max=2)
    kept_costs.costs_for(pair, spec)
    as_a_new_process()
    monkeypatch.setattr(kept_costs, "_cpu", lambda: "another CPU")
    kept_costs.costs_for(pair, spec)
    as_a_new_process()
    monkeypatch.setattr(kept_costs, "_code", lambda: "another version of the app")
    kept_costs.costs_for(pair, spec)
    assert len(measured) == 3 and len(list(folder.glob("*.json"))) == 3
    # A file unused for longer than STALE_S goes when another is written.
    stale = sorted(folder.glob("*.json"))[0]
    long_ago = time.time() - kept_costs.STALE_S - 60
    os.utime(stale, (long_ago, long_ago))
    kept_costs.costs_for(pair, SpecConfig(k_policy="adaptive", k_max=3))
    assert not stale.exists() and len(list(folder.glob("*.json"))) == 3


def test_a_drifted_run_drops_the_kept_file_and_a_bad_file_is_measured_again(
    kept, target, near_draft, tokenizer, caplog
):
    folder, measured = kept
    pair = pair_of(target, tokenizer, "tiny-kept-drift", near_draft)
    spec = SpecConfig(k_policy="adaptive", k_max=2)
    costs = kept_costs.costs_for(pair, spec)
    assert kept_costs.forget(costs) == 1 and not list(folder.glob("*.json"))
    kept_costs.costs_for(pair, spec)
    (path,) = folder.glob("*.json")
    path.write_text('{"costs": {"verify_s": "not a list"}')  # cut short mid-write by some other program
    as_a_new_process()
    with caplog.at_level(logging.WARNING, logger="app.kept_costs"):
        kept_costs.costs_for(pair, spec)
    assert len(measured) == 3
    said = [r for r in caplog.records if "unreadable" in r.getMessage()]
    assert len(said) == 1 and not said[0].exc_info  # one line, no traceback
    json.loads(path.read_text())  # rewritten whole by the new measurement


def test_nothing_is_kept_when_switched_off(kept, target, near_draft, tokenizer, monkeypatch):
    folder, measured = kept
    monkeypatch.setenv("SPECDEC_KEEP_COSTS", "0")
    pair = pair_of(target, tokenizer, "tiny-kept-off", near_draft)
    spec = SpecConfig(k_policy="adaptive", k_max=2)
    kept_costs.costs_for(pair, spec)
    as_a_new_process()
    kept_costs.costs_for(pair, spec)
    assert len(measured) == 2 and not list(folder.iterdir())


def test_the_cli_says_where_its_costs_came_from(kept, capsys, monkeypatch):
    folder, measured = kept
    argv = ["generate", "--target", models.TINY_TARGET, "--prompt", "import os\n", "--max-new-tokens", "12", "--json"]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert json.loads(first.out)["calibration"] == "measured now" and "measuring this machine" in first.err
    as_a_new_process(monkeypatch, folder)
    assert cli.main(argv) == 0
    second = capsys.readouterr()
    said = json.loads(second.out)["calibration"]
    assert said.startswith("round costs measured here") and "measuring this machine" not in second.err
    assert f"generate: {said}" in second.err and len(measured) == 1
