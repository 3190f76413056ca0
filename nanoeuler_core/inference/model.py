"""The model as users meet it (`from nanoeuler_core import Model`): the engine's Model
(nanoeuler_core.engine.model: forward, loss, gradients, files) with generation and chat, the
SPEC.md section 6 API. The engine knows nothing of decoding; this room adds it."""

from __future__ import annotations

from nanoeuler_core.engine import model as engine
from nanoeuler_core.inference import chat, generate


class Model(engine.Model):
    def generate(self, tok, prompt: str, *args, **sampling) -> str:
        """Continue `prompt`; returns the new text. See nanoeuler_core.inference.generate.generate."""
        return generate.generate(self, tok, prompt, *args, **sampling)

    def generate_batch(self, tok, prompts: list[str], *args, **sampling) -> list[str]:
        """Continue every prompt at once. See nanoeuler_core.inference.generate.generate_batch."""
        return generate.generate_batch(self, tok, prompts, *args, **sampling)

    def chat(self, tok, messages: list[dict], **sampling) -> str:
        """Reply to a conversation of {"role", "content"} messages. See nanoeuler_core.inference.chat.chat."""
        return chat.chat(self, tok, messages, **sampling)
