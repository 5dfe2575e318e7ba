"""The target's optional unlikelihood phase pushes down exactly the tokens of repeated n-grams."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app import train


def test_repeated_ngrams_marks_every_later_occurrence_and_nothing_else():
    rows = torch.tensor([[1, 2, 3, 4, 9, 1, 2, 3, 4, 5], [1, 2, 3, 5, 1, 2, 3, 6, 7, 8]])
    mask = train.repeated_ngrams(rows, n=4)
    assert mask[0].tolist() == [False] * 5 + [True] * 4 + [False]  # the second 1 2 3 4 only
    assert not mask[1].any()  # 3-grams repeat, no 4-gram does


def test_unlikelihood_loss_pushes_down_the_repeated_tokens():
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
    prefix = [20, 21, 22, 23]
    cont = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 10, 11, 12, 13]
    rows = torch.tensor([prefix + cont])
    mask = train.repeated_ngrams(rows[:, len(prefix):])[0]

    def probs():
        with torch.no_grad():
            logits = model(input_ids=rows[:, :-1]).logits[0, len(prefix) - 1 :]
        return logits.softmax(-1).gather(-1, rows[0, len(prefix):, None])[:, 0]

    before = probs()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(20):
        loss, share = train.unlikelihood_loss(model, rows, len(prefix))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = probs()
    assert share == mask.float().mean().item() == 8 / 16
    assert after[mask].mean() < 0.2 * before[mask].mean()
    # The loop's first occurrence and the tokens after it are not targets.
    assert not mask[:4].any() and not mask[12:].any()
