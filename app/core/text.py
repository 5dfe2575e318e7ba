"""Prompt to ids (chat template, checks) and ids back to text, streamed piece by piece."""

from __future__ import annotations

from transformers.tokenization_utils_tokenizers import TokenizersBackend

from app.core.config import UserError


def prompt_ids(tokenizer, prompt: str, chat: bool, context: int) -> list[int]:
    """Token ids of the prompt, through the chat template when asked; checked against the context."""
    if not prompt or not prompt.strip():
        raise UserError("prompt is empty: type some text to continue")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("this model has no chat template: turn chat formatting off")
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        ids = tokenizer(prompt)["input_ids"]
    if len(ids) >= context:
        raise UserError(f"prompt is {len(ids)} tokens but the model's context is {context}: shorten the prompt")
    return ids


class Detokenizer:
    """Incremental decoding that never splits a multi-byte character or drops a space.

    Decodes a short window of recent ids twice (with and without the newest) and emits
    the difference, holding text back while it ends in an incomplete character.
    """

    def __init__(self, tokenizer, context: list[int]):
        self.tokenizer = tokenizer
        # A fast tokenizer's decode without clean-up is its Rust backend's decode; called directly it
        # skips the wrapper's per-id conversion, which is two thirds of a round's decoding time.
        # Only where the class decodes as transformers' base class does: a subclass may add its own steps.
        kind = type(tokenizer)
        plain = getattr(kind, "_decode", None) is TokenizersBackend._decode and kind.decode is TokenizersBackend.decode
        self.backend = getattr(tokenizer, "backend_tokenizer", None) if plain else None
        self.ids = list(context[-4:])
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # ids before this are already emitted

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def push(self, token: int) -> str:
        """Add one id; return the text it completes (possibly empty)."""
        self.ids.append(token)
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return after[len(before) :]
        return ""

    def window(self) -> list[int]:
        """The ids the next piece of text is decoded after: what peek reads of the current state."""
        return self.ids[self.prefix :]

    def peek(
        self, drafts: list[int], accepted: int, token: int, window: list[int] | None = None
    ) -> tuple[list[str], str]:
        """Each draft's text if it followed the current ids (or a `window` taken earlier), and the text
        of `token` after the first `accepted` drafts; nothing is committed. One decode per prefix: each
        draft's "before" is the previous one's "after"."""
        ids = self.window() if window is None else window
        texts = [self._decode(ids)]
        for i in range(len(drafts)):
            texts.append(self._decode(ids + drafts[: i + 1]))
        after = self._decode(ids + drafts[:accepted] + [token])
        return [texts[i + 1][len(texts[i]) :] for i in range(len(drafts))], after[len(texts[accepted]) :]
