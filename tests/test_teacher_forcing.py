"""Teacher-forced shards hold what the target computes on the text: fused features and its top-k."""

import itertools
import json

import pytest
import torch

from app.core.config import UserError
from app.core.decoder_layers import fused_layers
from app.models import TINY_TARGET, load
from app.training import teacher_forcing
from app.training.target_text import TOP_K


def test_teacher_forced_shards_hold_the_targets_fused_features_and_top_k_and_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(teacher_forcing, "ROW", 32)
    monkeypatch.setattr(teacher_forcing, "SHARD_ROWS", 3)
    target, tokenizer = load(TINY_TARGET, dtype="fp32")
    logged: list[dict] = []
    chats = [torch.arange(3, 3 + n) for n in (20, 30, 25)]  # the target's answers, as build_rows gives them
    build = dict(tokens=5 * 32, seed=0, log=logged.append, chats=chats)
    manifest = teacher_forcing.build(target, tokenizer, tmp_path, **build)
    shards = teacher_forcing.shards(tmp_path, "text")
    assert len(shards) == 2 and manifest["rows"] == 5 and manifest["layers"] == list(fused_layers(8))
    # The chats, packed end to end into rows, are shards of their own, labelled first.
    assert manifest["chat"] == dict(chats=3, rows=2, tokens=64) and len(teacher_forcing.shards(tmp_path, "chat")) == 1
    assert teacher_forcing.shards(tmp_path) == teacher_forcing.shards(tmp_path, "chat") + shards
    assert teacher_forcing.built(tmp_path) == dict(chat=64, text=5 * 32)  # what a training record reads
    talk = teacher_forcing.read(teacher_forcing.shards(tmp_path, "chat")[0])["ids"].long()
    orders = [torch.cat(o)[:64].tolist() for o in itertools.permutations(chats)]
    assert talk.reshape(-1).tolist() in orders  # each chat whole, one after another
    # Every source names its version and licence; the standard library is one of them.
    assert all(s["licence"] and s["version"] and s["tokens"] > 0 for s in manifest["sources"].values())
    assert json.loads((tmp_path / "manifest.json").read_text())["tokens"] == 5 * 32

    shard = teacher_forcing.read(shards[0])
    ids = shard["ids"].long()
    with torch.inference_mode():
        out = target(input_ids=ids, output_hidden_states=True)
    want = torch.cat([out.hidden_states[i] for i in fused_layers(8)], -1)
    torch.testing.assert_close(shard["fused"].float(), want, atol=1e-2, rtol=1e-3)  # kept in fp16
    assert torch.equal(shard["top_ids"].long(), out.logits.topk(TOP_K, dim=-1).indices)
    assert shard["top_logp"].float().exp().sum(-1).sub(1).abs().max() < 1e-2  # renormalised over the k

    # A second run keeps the finished shards: a stopped build resumes at the next one.
    before = [p.stat().st_mtime_ns for p in shards]
    shards[1].unlink()
    teacher_forcing.build(target, tokenizer, tmp_path, **build)
    assert shards[0].stat().st_mtime_ns == before[0] and shards[1].is_file()
    assert [r.get("text_rows", r.get("chat_rows")) for r in logged] == [2, 3, 5, 5]  # only the lost one again

    # No text (--text-tokens 0): the chats alone, with no source read.
    alone = teacher_forcing.build(target, tokenizer, tmp_path / "alone", **(build | dict(tokens=0)))
    assert alone["rows"] == 0 and alone["sources"] == {} and alone["chat"]["rows"] == 2
    assert teacher_forcing.built(tmp_path / "alone") == dict(chat=64)
    # A build planned otherwise is refused, not mixed with the shards already written.
    with pytest.raises(UserError, match="planned otherwise.*rows 5 -> 0"):
        teacher_forcing.build(target, tokenizer, tmp_path, **(build | dict(tokens=0)))
    assert teacher_forcing.shards(tmp_path, "text") == shards
