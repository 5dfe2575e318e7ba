"""The target's optional unlikelihood phase pushes down exactly the tokens of repeated n-grams."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from app.training import train


def test_repeated_ngrams_marks_every_later_occurrence_and_nothing_else():
    rows = torch.tensor(
        [[1, 2, 3, 4, 9, 1, 2, 3, 4, 5], [1, 2, 3, 5, 1, 2, 3, 6, 7, 8], [7, 1, 2, 3, 4, 1, 2, 3, 4, 1]]
    )
    mask = train.repeated_ngrams(rows, n=4)
    assert mask[0].tolist() == [False] * 5 + [True] * 4 + [False]  # the second 1 2 3 4 only
    assert not mask[1].any()  # 3-grams repeat, no 4-gram does
    assert mask[2].tolist() == [False] * 5 + [True] * 5  # overlapping repeats, up to the last token


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits are one leaf tensor, so the loss's gradient shows which positions it reads."""

    def __init__(self, logits):
        super().__init__()
        self.logits = torch.nn.Parameter(logits)

    def forward(self, input_ids):
        return type("Out", (), {"logits": self.logits[:, : input_ids.shape[1]]})()


def test_unlikelihood_loss_reads_exactly_the_predictions_of_repeated_tokens():
    start, cont = 3, [5, 6, 7, 8, 5, 6, 7, 8, 9]
    rows = torch.tensor([[1, 2, 3] + cont])
    mask = train.repeated_ngrams(rows[:, start:])[0]
    model = FixedLogits(torch.randn(1, rows.shape[1], 12))
    model.logits.data[0, start - 1 + 7, 8] = 30.0  # a token the model is sure of, as in a loop
    loss, _ = train.unlikelihood_loss(model, rows, start)
    loss.backward()
    touched = model.logits.grad[0].abs().sum(-1) > 0
    # Position start - 1 + j predicts continuation token j: only repeated tokens' predictions get a gradient.
    assert touched.tolist() == [False] * (start - 1) + mask.tolist() + [False]
    assert torch.isfinite(loss) and model.logits.grad[0, start - 1 + 7].abs().sum() > 1e-6  # sure, yet pushed


def test_unlikelihood_loss_pushes_down_the_repeated_tokens():
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
        )
    )
    prefix = [20, 21, 22, 23]
    cont = [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 10, 11, 12, 13]
    rows = torch.tensor([prefix + cont])
    mask = train.repeated_ngrams(rows[:, len(prefix) :])[0]

    def probs():
        with torch.no_grad():
            logits = model(input_ids=rows[:, :-1]).logits[0, len(prefix) - 1 :]
        return logits.softmax(-1).gather(-1, rows[0, len(prefix) :, None])[:, 0]

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
