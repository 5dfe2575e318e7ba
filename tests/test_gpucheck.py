"""gpucheck runs end to end on CPU with tiny shapes, so the GPU check cannot rot unseen."""

import json

from app import cli


def test_gpucheck_reports_every_figure_on_cpu(capsys):
    assert cli.main(["gpucheck", "--shapes", "tiny", "--device", "cpu", "--steps", "2", "--context", "48",
                     "--new-tokens", "20", "--k", "1,4"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compiled"].startswith("skipped")  # CUDA only unless forced
    for kind in ("eager", "static_eager"):
        times = doc[kind]
        assert times["target"]["step_ms"] > 0 and set(times["target"]["verify_ms"]) == {"1", "4"}
        assert times["draft_step_ms"] > 0
        assert times["engine_autoregressive"]["tokens_per_round"] == 1.0
        for k in ("1", "4"):
            run = times["engine_self_draft"][k]
            # The target drafting for itself is always right: every round keeps all k plus one.
            assert run["alpha"] == 1.0
            assert run["tokens_per_round"] > 1.5
            assert {"round_ms", "model_ms", "overhead_ms", "overhead_share"} <= set(run)
