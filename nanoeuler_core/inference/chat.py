"""Chatting with a fine-tuned model: the conversation rendered in a chat template
(nanoeuler_core/inference/template.py: Alpaca by default, a run's own with
`ChatTemplate.for_run`), the reply generated up to the template's end-of-turn token.

    template = ChatTemplate.for_run("runs/smol")        # an imported instruct model: its ChatML template
    chat(model, tok, [{"role": "user", "content": "Hi"}], template=template)

A conversation is a list of messages {"role": ..., "content": text} ending with the user's; the
template says which roles it takes, in which order (Alpaca: user and assistant alternating). When
the conversation does not fit the context with room left for the reply, the oldest turns (a user
message and what follows it up to the next) are dropped first; leading system messages and the
latest message always stay (if they alone do not fit the context, `chat` raises ValueError).
"""

from __future__ import annotations

from nanoeuler_core.inference.generate import generate
from nanoeuler_core.inference.template import ChatTemplate
# The Alpaca template's functions, also importable from here (where they used to live).
from nanoeuler_core.inference.template import check_messages, render, render_prompt  # noqa: F401


def fit_context(tok, messages: list[dict], ctx_len: int, reply_room: int, template: ChatTemplate | None = None
                ) -> list[dict]:
    """The most recent messages whose rendering in `template` (default Alpaca) plus `reply_room`
    tokens fits `ctx_len`, dropping whole turns, oldest first; leading system messages and the last
    message always stay."""
    template = template or ChatTemplate.alpaca()
    chat_tok = template.tokenizer(tok)
    n_system = next((i for i, m in enumerate(messages) if m["role"] != "system"), len(messages))
    system, kept = list(messages[:n_system]), list(messages[n_system:])
    while len(kept) > 1 and len(chat_tok.encode(template.render(system + kept))) + reply_room > ctx_len:
        next_user = next((i for i in range(1, len(kept)) if kept[i]["role"] == "user"), len(kept) - 1)
        kept = kept[next_user:]
    return system + kept


def chat(model, tok, messages: list[dict], max_new_tokens: int = 200, temperature: float = 0.8,
         top_k: int | None = None, top_p: float | None = None, seed: int | None = None, on_text=None,
         speculative: bool | None = None, stats=None, template: ChatTemplate | None = None,
         weights: str | None = None) -> str:
    """The model's reply to the conversation `messages` in `template` (default Alpaca; see the
    module docstring), up to the template's end-of-turn token.

    `on_text(piece)` receives the reply as it is produced. The reply is not appended to `messages`.
    `speculative`, `stats` and `weights` are generate's (nanoeuler_core.inference.generate).
    """
    template = template or ChatTemplate.alpaca()
    template.check(messages)
    if messages[-1]["role"] != "user":
        raise ValueError("the last message must be the user's: the model replies to it")
    reply_room = min(max_new_tokens, model.cfg.ctx_len // 4)
    chat_tok = template.tokenizer(tok)
    prompt = template.render(fit_context(chat_tok, messages, model.cfg.ctx_len, reply_room, template))
    return generate(model, chat_tok, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                    top_p=top_p, seed=seed, on_text=on_text, speculative=speculative, stats=stats,
                    weights=weights)


class Conversation:
    """The messages of one chat, growing a turn at a time: `say` asks and records the reply.
    `system`, if given, opens every conversation (also after `reset`)."""

    def __init__(self, template: ChatTemplate | None = None, system: str | None = None) -> None:
        self.template = template
        self.opening = [{"role": "system", "content": system}] if system is not None else []
        self.messages: list[dict] = list(self.opening)

    def say(self, model, tok, text: str, **sampling) -> str:
        """Send `text` as the user's next message; returns the reply (also kept in `messages`)."""
        asked = self.messages + [{"role": "user", "content": text}]
        reply = chat(model, tok, asked, template=self.template, **sampling)
        self.messages = asked + [{"role": "assistant", "content": reply}]
        return reply

    def reset(self) -> None:
        self.messages = list(self.opening)
