"""Chatting with a fine-tuned model: the conversation rendered in the Alpaca template it was
fine-tuned with, the reply generated up to `</s>`.

A conversation is a list of messages `{"role": "user" | "assistant", "content": text}`,
alternating and ending with the user's. It is rendered as the template's preamble followed by
one instruction/response section per turn:

    Below is an instruction that describes a task. Write a response ...\n\n
    ### Instruction:\n<user 1>\n\n### Response:\n<assistant 1>\n\n
    ### Instruction:\n<user 2>\n\n### Response:\n                      <- the reply starts here

A single turn renders exactly as an SFT example without input. When the conversation does not
fit the context with room left for the reply, the oldest turns are dropped first; the latest
message always stays (if it alone does not fit the context, `chat` raises ValueError).
"""

from __future__ import annotations

TEMPLATE = "alpaca"
PREAMBLE = ("Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n")
PREAMBLE_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                       "context. Write a response that appropriately completes the request.\n\n")
INSTRUCTION = "### Instruction:\n{}\n\n"
INPUT = "### Input:\n{}\n\n"
RESPONSE = "### Response:\n"


def render_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt of one example, ending where the response begins."""
    if input:
        return PREAMBLE_WITH_INPUT + INSTRUCTION.format(instruction) + INPUT.format(input) + RESPONSE
    return PREAMBLE + INSTRUCTION.format(instruction) + RESPONSE


ROLES = ("user", "assistant")


def check_messages(messages: list[dict]) -> None:
    """Raise ValueError unless messages alternate user/assistant, start and end with the user's."""
    if not messages:
        raise ValueError("messages is empty: pass at least one {'role': 'user', 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} must be a dict with a string 'content'")
        expected = ROLES[i % 2]
        if message.get("role") != expected:
            raise ValueError(f"message {i} has role {message.get('role')!r}, expected {expected!r}: "
                             f"roles alternate user, assistant, ..., and the last is the user's")
    if len(messages) % 2 == 0:
        raise ValueError("the last message must be the user's: the model replies to it")


def render(messages: list[dict]) -> str:
    """The conversation as a prompt in the Alpaca template, ending where the reply begins."""
    sections = []
    for i in range(0, len(messages) - 1, 2):
        sections.append(INSTRUCTION.format(messages[i]["content"]) + RESPONSE + messages[i + 1]["content"] + "\n\n")
    sections.append(INSTRUCTION.format(messages[-1]["content"]) + RESPONSE)
    return PREAMBLE + "".join(sections)


def fit_context(tok, messages: list[dict], ctx_len: int, reply_room: int) -> list[dict]:
    """The most recent messages whose rendering plus `reply_room` tokens fits `ctx_len`, dropping
    whole turns (a user message and its reply), oldest first; the last message always stays."""
    kept = list(messages)
    while len(kept) > 1 and len(tok.encode(render(kept))) + reply_room > ctx_len:
        kept = kept[2:]
    return kept


def chat(model, tok, messages: list[dict], max_new_tokens: int = 200, temperature: float = 0.8,
         top_k: int | None = None, top_p: float | None = None, seed: int | None = None, on_text=None,
         speculative: bool | None = None, stats=None) -> str:
    """The model's reply to the conversation `messages` (see the module docstring), up to `</s>`.

    `on_text(piece)` receives the reply as it is produced. The reply is not appended to `messages`.
    `speculative` and `stats` are generate's (nanoeuler_core.inference.generate).
    """
    check_messages(messages)
    reply_room = min(max_new_tokens, model.cfg.ctx_len // 4)
    prompt = render(fit_context(tok, messages, model.cfg.ctx_len, reply_room))
    return model.generate(tok, prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                          top_p=top_p, seed=seed, on_text=on_text, speculative=speculative, stats=stats)


class Conversation:
    """The messages of one chat, growing a turn at a time: `say` asks and records the reply."""

    def __init__(self) -> None:
        self.messages: list[dict] = []

    def say(self, model, tok, text: str, **sampling) -> str:
        """Send `text` as the user's next message; returns the reply (also kept in `messages`)."""
        asked = self.messages + [{"role": "user", "content": text}]
        reply = chat(model, tok, asked, **sampling)
        self.messages = asked + [{"role": "assistant", "content": reply}]
        return reply

    def reset(self) -> None:
        self.messages = []
