"""--dtype auto where no precision is exact at every width (the width probe is mocked to say so;
tests/test_exact.py has the exact one): bf16 where this machine runs the model's passes clearly
faster in it, fp32 where it does not, measured once per model and kept; the timing probe is mocked
here, so both outcomes are seen."""

from __future__ import annotations

import pytest
import torch

from app import models
from app.models import loading, precision
from app.models.presets import TINY_TARGET


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(precision, "_choice", {})
    monkeypatch.setattr(loading, "_cache", {})
    monkeypatch.setattr(precision, "native_bf16", lambda: True)
    monkeypatch.setattr(precision, "invariant", lambda model: False)


@pytest.mark.parametrize(("bf16_share", "want"), [(0.5, torch.bfloat16), (0.95, torch.float32)])
def test_auto_keeps_bf16_only_where_its_passes_are_clearly_faster(fresh, monkeypatch, bf16_share, want):
    timed = []

    def seconds(model, *a, **kw):
        timed.append(model.dtype)
        return bf16_share if model.dtype == torch.bfloat16 else 1.0

    monkeypatch.setattr(precision, "pass_seconds", seconds)
    model, _ = models.load(TINY_TARGET, "cpu", "auto")
    assert model.dtype == want and sorted(map(str, timed)) == ["torch.bfloat16", "torch.float32"], "int8 untimed"
    again, _ = models.load(TINY_TARGET, "cpu", "auto")
    assert again is model and len(timed) == 2, "measured once per model and machine"


def test_without_native_bf16_auto_stays_fp32_untimed(fresh, monkeypatch):
    monkeypatch.setattr(precision, "native_bf16", lambda: False)
    monkeypatch.setattr(precision, "pass_seconds", lambda *a, **kw: pytest.fail("nothing to time"))
    model, _ = models.load(TINY_TARGET, "cpu", "auto")
    assert model.dtype == torch.float32


def test_the_real_probe_times_both_dtypes(fresh):
    model, _ = models.load(TINY_TARGET, "cpu", "fp32")
    assert precision.pass_seconds(model, widths=(1, 3), reps=1) > 0


def test_auto_is_the_default_unless_specdec_dtype_names_another(fresh, monkeypatch):
    monkeypatch.setattr(precision, "pass_seconds", lambda model, *a, **kw: 0.5 if model.dtype == torch.bfloat16 else 1)
    monkeypatch.delenv(loading.DTYPE_ENV, raising=False)
    assert models.load(TINY_TARGET, "cpu")[0].dtype == torch.bfloat16, "auto, with no dtype given"
    pair = models.load_pair(TINY_TARGET, "small draft (bundled)", "cpu")
    assert pair.target.dtype == pair.draft.model.dtype == torch.bfloat16, "the draft runs in the target's dtype"
    monkeypatch.setenv(loading.DTYPE_ENV, "fp32")  # what the tests run in (conftest.py)
    assert models.load(TINY_TARGET, "cpu")[0].dtype == torch.float32
