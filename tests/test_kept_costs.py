"""Calibrations kept on disk: a later process plans with the one measured before, bit for bit, while passes
timed now agree with those timed around it. Passes off either way, a burst during the measurement, another
machine, code or model shape, a drifted run or a bad file measure again; an unusable folder breaks nothing,
and nothing is read, kept or dropped where keeping is off."""

import json
import logging
import os
import time

import pytest
from conftest import ADD_PROMPT, TINY_TARGET, form_fields, pair_of

from app import calibrate, cli, kept_costs, models, request
from app.core.config import Settings, SpecConfig
from app.core.costs import Costs
from app.core.policy import AdaptiveK

SPEC = SpecConfig(k_policy="adaptive", k_max=3)
FAKE = Costs(
    verify_s=(0.004, 0.005, 0.006, 0.007),
    draft_round_s=0.001,
    draft_token_s=0.0005,
    overhead_s=0.0002,
    plain_round_s=0.0045,
)


@pytest.fixture
def kept(tmp_path, monkeypatch):
    """A folder of kept calibrations of its own, the in-process cache empty (a fresh process), the
    measurements counted, and a machine whose checked passes take machine["passes"] seconds (real
    timings of a tiny model are noise on a busy machine)."""
    monkeypatch.setenv("SPECDEC_KEEP_COSTS", "1")
    monkeypatch.setattr(kept_costs, "_keep", True)  # a benchmark run earlier in this worker turned it off
    monkeypatch.setattr(kept_costs, "folder", lambda: tmp_path)
    for held in ("_cache", "_origins", "_files"):
        monkeypatch.setattr(kept_costs, held, {})
    machine = {"passes": [0.004, 0.007], "measured": [], "measure": calibrate.measure}

    def measure(*args, **kwargs):
        machine["measured"].append(args[1])
        return machine["measure"](*args, **kwargs)

    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(calibrate, "check_passes", lambda *a, **kw: list(machine["passes"]))
    return tmp_path, machine


def as_a_new_process():
    kept_costs._cache.clear()
    kept_costs._origins.clear()
    kept_costs._files.clear()


def kept_once(machine, pair) -> list[float]:
    """Keep a stand-in calibration of `pair`, then start as a new process; the passes kept beside it."""
    machine["measure"] = lambda *a, **kw: FAKE
    kept_costs.costs_for(pair, SPEC)
    as_a_new_process()
    return list(machine["passes"])


def test_the_check_times_a_one_token_and_the_widest_pass(target, near_draft, tokenizer):
    pair = pair_of(target, tokenizer, "tiny-check", near_draft)
    seconds = calibrate.check_passes(pair, 3)
    assert len(seconds) == 2 and all(s > 0 for s in seconds)


def test_a_later_process_plans_with_the_kept_calibration(kept, target, near_draft, tokenizer):
    folder, machine = kept
    pair = pair_of(target, tokenizer, "tiny-kept", near_draft)
    first = kept_costs.costs_for(pair, SPEC)  # a real measurement
    assert machine["measured"] == [3] and kept_costs.origin(first) is None
    (path,) = folder.glob("*.json")
    assert json.loads(path.read_text())["reference_s"] == machine["passes"]
    as_a_new_process()
    again = kept_costs.costs_for(pair, SPEC)
    assert machine["measured"] == [3], "the kept calibration was measured again"
    assert again == first and again is not first  # the same numbers, read back from the file
    assert kept_costs.origin(again).startswith("round costs measured here 0 min ago; passes timed now take 1.00x")
    policy = request.start(pair, pair.encode("def f"), Settings(spec=SPEC)).policy()
    assert isinstance(policy, AdaptiveK) and policy.costs is again
    # Another kind of request is a calibration of its own.
    kept_costs.costs_for(pair, SpecConfig(k_policy="adaptive", k_max=2))
    assert machine["measured"] == [3, 2] and len(list(folder.glob("*.json"))) == 2


@pytest.mark.parametrize("factor, reused", [(10, False), (0.1, False), (1.35, False), (1 / 1.35, False), (1.25, True)])
def test_passes_off_either_way_measure_again(kept, target, near_draft, tokenizer, factor, reused):
    folder, machine = kept
    then = kept_once(machine, pair_of(target, tokenizer, "tiny-kept-off-by", near_draft))
    machine["passes"] = [factor * s for s in then]  # a busier machine, or one that was busy then
    costs = kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-off-by", near_draft), SPEC)
    assert len(machine["measured"]) == (1 if reused else 2)
    assert (kept_costs.origin(costs) is not None) == reused
    (path,) = folder.glob("*.json")  # a new measurement replaces the old one, with the passes timed now
    assert json.loads(path.read_text())["reference_s"] == (then if reused else machine["passes"])


def test_a_slow_first_check_is_timed_once_more(kept, target, near_draft, tokenizer, monkeypatch):
    """A process's first passes can run slow for a moment (a new thread's pool, memory first touched):
    one more check before measuring again."""
    _, machine = kept
    pair = pair_of(target, tokenizer, "tiny-kept-slow-start", near_draft)
    then = kept_once(machine, pair)
    timed = [[2 * s for s in then], then]
    monkeypatch.setattr(calibrate, "check_passes", lambda *a, **kw: timed.pop(0))
    costs = kept_costs.costs_for(pair, SPEC)
    assert len(machine["measured"]) == 1 and not timed and kept_costs.origin(costs) is not None


def test_kept_with_the_passes_timed_before_the_measurement(kept, target, near_draft, tokenizer, monkeypatch):
    """The reference is the check a later process repeats: the one soon after loading, before measuring
    (after a kept file disagreed twice, the second of those)."""
    folder, machine = kept
    machine["measure"] = lambda *a, **kw: FAKE
    x = [0.004, 0.007]
    timed = [x, [1.2 * s for s in x]]  # before, then after the measurement: within DRIFT
    monkeypatch.setattr(calibrate, "check_passes", lambda *a, **kw: timed.pop(0))
    pair = pair_of(target, tokenizer, "tiny-kept-before", near_draft)
    kept_costs.costs_for(pair, SPEC)
    (path,) = folder.glob("*.json")
    assert not timed and json.loads(path.read_text())["reference_s"] == x
    as_a_new_process()
    timed += [[3 * s for s in x], [2 * s for s in x], [2.2 * s for s in x]]  # twice off, then after
    kept_costs.costs_for(pair, SPEC)
    assert not timed and json.loads(path.read_text())["reference_s"] == [2 * s for s in x]


def test_a_burst_during_the_measurement_keeps_nothing(kept, target, near_draft, tokenizer):
    folder, machine = kept

    def busy(*args, **kwargs):
        machine["passes"] = [2 * s for s in machine["passes"]]  # the passes after it take twice as long
        return FAKE

    machine["measure"] = busy
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-burst", near_draft), SPEC)
    assert len(machine["measured"]) == 1 and not list(folder.iterdir())


def test_another_machine_code_or_model_never_reads_it(kept, target, near_draft, draft, tokenizer, monkeypatch):
    folder, machine = kept
    machine["measure"] = lambda *a, **kw: FAKE
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-cpu", near_draft), SPEC)
    as_a_new_process()
    monkeypatch.setattr(kept_costs, "_cpu", lambda: "another CPU")
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-cpu", near_draft), SPEC)
    as_a_new_process()
    monkeypatch.setattr(kept_costs, "_code", lambda: "another version of the app")
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-cpu", near_draft), SPEC)
    as_a_new_process()
    # The int8 kernel on a narrower instruction set than this CPU's widest.
    monkeypatch.setenv("SPECDEC_KERNEL_ISA", "avx2")
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-cpu", near_draft), SPEC)
    as_a_new_process()
    monkeypatch.delenv("SPECDEC_KERNEL_ISA")
    # A draft of another size under the same name (a local folder retrained, say).
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-cpu", draft), SPEC)
    assert len(machine["measured"]) == 5 and len(list(folder.glob("*.json"))) == 5
    # A file unused for longer than STALE_S goes when another is written; one read since stays.
    long_ago = time.time() - kept_costs.STALE_S - 60
    for path in folder.glob("*.json"):
        os.utime(path, (long_ago, long_ago))
    as_a_new_process()
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-cpu", draft), SPEC)  # read: in use
    assert len(machine["measured"]) == 5
    kept_costs.costs_for(pair_of(target, tokenizer, "tiny-kept-cpu", draft), SpecConfig(k_max=2))
    assert len(list(folder.glob("*.json"))) == 2  # the one read and the one written


def test_the_cpu_is_named_by_its_model_and_flags():
    one = kept_costs._cpu("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx512f\n")
    assert one.startswith("AMD EPYC ") and one != kept_costs._cpu("model name\t: AMD EPYC\nflags\t\t: fpu\n")
    assert kept_costs._cpu("") and kept_costs._cpu()  # no /proc/cpuinfo: what platform says


def test_a_drifted_run_drops_the_kept_file(kept, target, near_draft, tokenizer):
    folder, machine = kept
    machine["measure"] = lambda *a, **kw: FAKE
    pair = pair_of(target, tokenizer, "tiny-kept-drift", near_draft)
    costs = kept_costs.costs_for(pair, SPEC)
    assert kept_costs.forget(costs) == 1 and not list(folder.glob("*.json"))
    kept_costs.costs_for(pair, SPEC)
    assert len(machine["measured"]) == 2 and len(list(folder.glob("*.json"))) == 1
    as_a_new_process()  # a later process that read the file drops it too
    read = kept_costs.costs_for(pair, SPEC)
    assert len(machine["measured"]) == 2 and kept_costs.origin(read) is not None
    assert kept_costs.forget(read) == 1 and not list(folder.glob("*.json"))


def curve(verify_s: str, plain: str = "0.005") -> str:
    """A file's text whose calibration has this pass curve and plain round (SPEC's k_max: 4 widths)."""
    return (
        f'{{"costs": {{"verify_s": {verify_s}, "draft_round_s": 0, "draft_token_s": 0, "overhead_s": 0, '
        f'"plain_round_s": {plain}}}, "reference_s": [0.004, 0.007], "saved": 0}}'
    )


BAD = [
    "not json",
    '{"costs": []}',
    curve("[0.0, 0.005, 0.006, 0.007]"),  # a pass of no time: a division by it later
    curve("[0.004, 0.005, 0.006]"),  # a curve short of k_max + 1 widths
    curve("[0.004, 0.009, 0.006, 0.007]"),  # a wider pass cheaper than a narrower one
    curve("[0.004, 0.005, 0.006, 0.007]", plain="-1"),
    '{"costs": {"verify_s": "fast"}, "reference_s": [0.004, 0.007], "saved": 0}',
    '{"costs": {"verify_s": [NaN], "draft_round_s": 0, "draft_token_s": 0, "overhead_s": 0, "plain_round_s": 0}, '
    '"reference_s": [0.004, 0.007], "saved": 0}',
    '{"costs": {"verify_s": [0.1], "draft_round_s": 0, "draft_token_s": 0, "overhead_s": 0, "plain_round_s": 0}, '
    '"reference_s": [0.004, 0.007, 0.009], "saved": 0}',
]


@pytest.mark.parametrize("text", BAD)
def test_a_bad_file_is_one_line_and_measured_again(kept, target, near_draft, tokenizer, caplog, text):
    folder, machine = kept
    machine["measure"] = lambda *a, **kw: FAKE
    pair = pair_of(target, tokenizer, "tiny-kept-bad", near_draft)
    kept_costs.costs_for(pair, SPEC)
    (path,) = folder.glob("*.json")
    path.write_text(text)  # cut short mid-write by some other program, or written by one
    as_a_new_process()
    with caplog.at_level(logging.WARNING, logger="app.kept_costs"):
        assert kept_costs.costs_for(pair, SPEC) == FAKE
    said = [r for r in caplog.records if r.name == "app.kept_costs"]
    assert len(said) == 1 and "unreadable" in said[0].getMessage() and not said[0].exc_info
    assert len(machine["measured"]) == 2 and json.loads(path.read_text())["costs"]["verify_s"] == list(FAKE.verify_s)


def test_an_unusable_folder_breaks_nothing(kept, target, near_draft, tokenizer, caplog, monkeypatch, tmp_path):
    _, machine = kept
    machine["measure"] = lambda *a, **kw: FAKE
    pair = pair_of(target, tokenizer, "tiny-kept-nowhere", near_draft)
    (tmp_path / "a file").write_text("")
    monkeypatch.setattr(kept_costs, "folder", lambda: tmp_path / "a file" / "costs")  # cannot be made

    def homeless():
        raise RuntimeError("Could not determine home directory.")  # no HOME and no passwd entry

    with caplog.at_level(logging.WARNING, logger="app.kept_costs"):
        assert kept_costs.costs_for(pair, SPEC) == FAKE
        as_a_new_process()
        monkeypatch.setattr(kept_costs, "folder", homeless)
        assert kept_costs.costs_for(pair, SPEC) == FAKE
    assert len(machine["measured"]) == 2
    assert all(not r.exc_info for r in caplog.records) and any(
        "could not keep" in r.getMessage() for r in caplog.records
    )


@pytest.mark.parametrize("off", ["0", "off", "False", "keep_none"])
def test_switched_off_reads_keeps_and_drops_nothing(kept, target, near_draft, tokenizer, monkeypatch, off):
    folder, machine = kept
    machine["measure"] = lambda *a, **kw: FAKE
    pair = pair_of(target, tokenizer, "tiny-kept-switched", near_draft)
    written = kept_costs.costs_for(pair, SPEC)
    (path,) = folder.glob("*.json")
    if off == "keep_none":
        kept_costs.keep_none()  # as the benchmark does (the fixture turns it back on)
    else:
        monkeypatch.setenv("SPECDEC_KEEP_COSTS", off)
    kept_costs.forget(written)  # the file this process wrote stays
    costs = kept_costs.costs_for(pair, SPEC)
    assert len(machine["measured"]) == 2 and kept_costs.origin(costs) is None  # measured, not read
    kept_costs.costs_for(pair, SpecConfig(k_max=2))
    assert path.exists() and list(folder.glob("*.json")) == [path]  # not dropped, nothing new kept


def test_the_cli_and_the_page_say_where_their_costs_came_from(kept, capsys):
    from app.serve import ui

    argv = ["generate", "--target", models.TINY_TARGET, "--prompt", "import os\n", "--max-new-tokens", "12", "--json"]
    assert cli.main(argv) == 0
    first = capsys.readouterr()
    assert json.loads(first.out)["calibration"] == "measured in this process" and "measuring this machine" in first.err
    as_a_new_process()
    assert cli.main(argv) == 0
    second = capsys.readouterr()
    said = json.loads(second.out)["calibration"]
    assert said.startswith("round costs measured here") and "measuring this machine" not in second.err
    assert f"generate: {said}" in second.err
    fields = form_fields(prompt=ADD_PROMPT, target=TINY_TARGET, draft="prompt lookup (n-grams)", max_new_tokens=8)
    *_, doc = list(ui.generate_both(**fields, control={"stop": False}))[-1]
    assert doc["calibration"] == "measured in this process"
    as_a_new_process()
    *_, doc = list(ui.generate_both(**fields, control={"stop": False}))[-1]
    assert doc["calibration"].startswith("round costs measured here")
