"""Chat templates: how a conversation becomes the prompt a model continues, and where its reply ends.

A conversation is a list of messages {"role": "system" | "user" | "assistant", "content": text}.
A run's template (`ChatTemplate.for_run`) is, first match wins:

1. the one asked for (`--template`): "alpaca", or a Jinja file;
2. Alpaca, for runs that nanoeuler fine-tuned with it (config.json: training.template = "alpaca");
3. the Jinja `chat_template` of the run's tokenizer_config.json (or of a chat_template.jinja beside
   it, which transformers prefers): imported instruct models and runs fine-tuned in such a template;
4. none: a pretrained run, which `chat` asks to continue text instead.

One object serves chat, SFT, DPO and the server:

    template = ChatTemplate.for_run(run_dir)            # or ChatTemplate.for_run(run_dir, "alpaca" | "t.jinja")
    prompt = template.render(messages, add_generation_prompt=True)     # a str, ending where the reply begins
    chat_tok = template.tokenizer(tok)                  # tok for such prompts: encode() recognises the special
    ids = chat_tok.encode(prompt)                       #   tokens the prompt holds; eos_id is the end of a reply
    template.stop_tokens(tok)                           # ["<|im_end|>", "<|endoftext|>"]: the first ends a reply

Jinja templates render as transformers' `apply_chat_template` renders them: a sandboxed Jinja
environment with trim_blocks and lstrip_blocks, the `raise_exception` and `strftime_now` globals,
the `tojson` filter (no HTML escaping), loop controls, the `{% generation %}` tag; the variables
`messages`, `add_generation_prompt`, `tools` and `documents` (None) and the named special tokens of
tokenizer_config.json (`bos_token`, `eos_token`, `unk_token`, `pad_token`, ...). A template that
fails or refuses the conversation (`raise_exception`) raises TemplateError, one line.

A reply ends at the template's end-of-turn token: the first of the usual markers (`<|im_end|>`,
`<|eot_id|>`, ...) written in the template that the tokenizer has, else the end-of-text token.

Alpaca is nanoeuler's own template, rendered here in Python; `AlpacaTemplate.source` is the same
template in Jinja, which `export` writes so that transformers renders the same prompt, byte for byte.
Its conversations alternate user and assistant, starting and ending with the user's (no system
role); a single turn renders exactly as an SFT example without input:

    Below is an instruction that describes a task. Write a response ...\\n\\n
    ### Instruction:\\n<user 1>\\n\\n### Response:\\n<assistant 1>\\n\\n
    ### Instruction:\\n<user 2>\\n\\n### Response:\\n                      <- the reply starts here
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Mapping

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox

from nanoeuler_core.engine import checkpoint
from nanoeuler_core.engine.checkpoint import CheckpointError
from nanoeuler_core.errors import unreadable
from nanoeuler_core.text.base_tokenizer import EOS


class TemplateError(ValueError):
    """A chat template that cannot be read or compiled, or that refuses a conversation."""


# ------------------------------------------------------------------------------------------------
# Alpaca

TEMPLATE = "alpaca"  # its name in config.json's training section and for --template
PREAMBLE = ("Below is an instruction that describes a task. "
            "Write a response that appropriately completes the request.\n\n")
PREAMBLE_WITH_INPUT = ("Below is an instruction that describes a task, paired with an input that provides further "
                       "context. Write a response that appropriately completes the request.\n\n")
INSTRUCTION = "### Instruction:\n{}\n\n"
INPUT = "### Input:\n{}\n\n"
RESPONSE = "### Response:\n"
ROLES = ("user", "assistant")


def render_prompt(instruction: str, input: str = "") -> str:
    """The Alpaca prompt of one example, ending where the response begins."""
    if input:
        return PREAMBLE_WITH_INPUT + INSTRUCTION.format(instruction) + INPUT.format(input) + RESPONSE
    return PREAMBLE + INSTRUCTION.format(instruction) + RESPONSE


def check_messages(messages: list[dict]) -> None:
    """Raise ValueError unless messages alternate user/assistant, start and end with the user's."""
    _check_shape(messages)
    for i, message in enumerate(messages):
        expected = ROLES[i % 2]
        if message["role"] == "system":
            raise ValueError(f"message {i} has role 'system': the Alpaca template has none (roles alternate user, "
                             f"assistant, ...); pass --template with a template that takes one")
        if message["role"] != expected:
            raise ValueError(f"message {i} has role {message['role']!r}, expected {expected!r}: "
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


def alpaca_jinja() -> str:
    """The Alpaca template in Jinja: with add_generation_prompt=True it renders a conversation exactly
    as `render` does (the response header the reply follows comes last)."""
    instruction_head, instruction_tail = INSTRUCTION.split("{}")  # a reply ends as an instruction does

    def literal(text: str) -> str:
        return json.dumps(text)  # a JSON string is a valid Jinja string literal

    return (
        "{%- for message in messages -%}"
        "{%- if message['role'] != ['user', 'assistant'][loop.index0 % 2] -%}"
        "{{ raise_exception('roles must alternate user, assistant, user, ... starting with the user') }}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{{{ {literal(PREAMBLE)} }}}}"
        "{%- for message in messages -%}"
        "{%- if message['role'] == 'user' -%}"
        f"{{{{ {literal(instruction_head)} + message['content'] + {literal(instruction_tail)} }}}}"
        "{%- else -%}"
        f"{{{{ {literal(RESPONSE)} + message['content'] + {literal(instruction_tail)} }}}}"
        "{%- endif -%}"
        "{%- endfor -%}"
        f"{{%- if add_generation_prompt -%}}{{{{ {literal(RESPONSE)} }}}}{{%- endif -%}}"
    )


# ------------------------------------------------------------------------------------------------
# Jinja, as transformers runs chat templates

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|end_of_turn|>", "<|eot|>")
CONFIG_FILE = "tokenizer_config.json"
JINJA_FILE = "chat_template.jinja"


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    return datetime.now().strftime(format)


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the text itself."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@functools.lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    return environment.from_string(source)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _check_shape(messages) -> None:
    if not isinstance(messages, list):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"not {type(messages).__name__}")
    if not messages:
        raise ValueError("messages is empty: pass at least one {'role': 'user', 'content': ...}")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("content"), str):
            raise ValueError(f"message {i} must be a dict with a string 'content'")
        if not isinstance(message.get("role"), str):
            raise ValueError(f"message {i} must have a string 'role' (system, user or assistant)")


def _read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    return checkpoint.read_json(path) if path.is_file() else {}


def _special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of a tokenizer_config.json (`{"content": ...}` entries of older files read too)."""
    tokens = {}
    for name in SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str) and value:
            tokens[name] = value
    return tokens


def _configured_template(folder: Path, config: dict) -> tuple[str, str] | None:
    """(source, where it was found) of a folder's chat template, as transformers looks for it:
    chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or a list of
    named templates, of which "default" is taken)."""
    if (folder / JINJA_FILE).is_file():
        return (folder / JINJA_FILE).read_text(encoding="utf-8"), str(folder / JINJA_FILE)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if source is None:
        return None
    if not isinstance(source, str):
        raise TemplateError(f"{folder / CONFIG_FILE}: chat_template must be a string (or a list of named "
                            f"templates with a 'default' one)")
    return source, f"{folder / CONFIG_FILE}"


class ChatTemplate:
    """A Jinja chat template and the special tokens it is rendered with (see the module docstring)."""

    training_name = "chat_template"  # what config.json's training section records for runs fine-tuned in it

    def __init__(self, source: str, special_tokens: Mapping[str, str] | None = None, name: str = "chat template"):
        """`source`: the Jinja text; `special_tokens`: bos_token, eos_token, ... as the template sees
        them; `name`: where it comes from, for messages. Raises TemplateError if it does not compile."""
        self.source, self.name = source, name
        self.special_tokens = dict(special_tokens or {})
        try:
            self._compiled = _compile(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateError(f"{name} is not a valid Jinja template (line {exc.lineno}: {_one_line(exc.message)})"
                                ) from None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    # --- where templates come from --------------------------------------------------------------

    @staticmethod
    def alpaca() -> AlpacaTemplate:
        return _alpaca()

    @classmethod
    def from_file(cls, path: str | Path, special_tokens: Mapping[str, str] | None = None) -> ChatTemplate:
        """The Jinja template in file `path`."""
        try:
            source = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            advice = "" if isinstance(exc, UnicodeDecodeError) else ": pass a Jinja file, or 'alpaca'"
            raise TemplateError(unreadable("chat template file", path, exc) + advice) from None
        return cls(source, special_tokens, name=str(path))

    @classmethod
    def from_folder(cls, folder: str | Path, default_tokens: Mapping[str, str] | None = None) -> ChatTemplate | None:
        """The chat template of a Hugging Face or run directory, with the special tokens of its
        tokenizer_config.json (`default_tokens` where it names none); None if it has none."""
        folder = Path(folder)
        config = _read_config(folder)
        found = _configured_template(folder, config)
        if found is None:
            return None
        tokens = {**(default_tokens or {}), **_special_tokens(config)}
        return cls(found[0], tokens, name=f"the chat template of {found[1]}")

    @classmethod
    def for_run(cls, run_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
        """The template a run chats and fine-tunes in: `override` ("alpaca" or a Jinja file path),
        else the run's own (see the module docstring); None for a pretrained run."""
        run_dir = Path(run_dir)
        if override is not None and str(override) == TEMPLATE:
            return cls.alpaca()
        config = _read_config(run_dir)
        if override is not None:
            return cls.from_file(override, {"eos_token": EOS, **_special_tokens(config)})
        kind = checkpoint.read_json(run_dir / "config.json").get("training", {}).get("template")
        if kind == TEMPLATE:
            return cls.alpaca()
        if kind not in (None, cls.training_name):
            raise CheckpointError(f"{run_dir} was fine-tuned with template {kind!r}, which this version does not "
                                  f"know (it knows {TEMPLATE!r} and a tokenizer_config.json chat_template)")
        template = cls.from_folder(run_dir, {"eos_token": EOS})
        if template is None and kind is not None:
            raise CheckpointError(f"{run_dir} was fine-tuned in its own chat template, but its {CONFIG_FILE} has no "
                                  f"chat_template: pass --template")
        return template

    def save(self, folder: str | Path) -> None:
        """Write the template and its special tokens into `folder`'s tokenizer_config.json (kept otherwise)."""
        folder = Path(folder)
        config = {**_read_config(folder), **self.special_tokens, "chat_template": self.source}
        checkpoint.write_json(folder / CONFIG_FILE, config)

    # --- rendering ------------------------------------------------------------------------------

    def check(self, messages: list[dict]) -> None:
        """Raise ValueError unless `messages` is a list of {"role": str, "content": str} dicts
        (which roles may come in which order is the template's to say, when it renders)."""
        _check_shape(messages)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """The conversation as the template writes it; with add_generation_prompt, ending with the
        header the assistant's reply follows."""
        self.check(messages)
        return self._render_jinja(messages, add_generation_prompt)

    def _render_jinja(self, messages: list[dict], add_generation_prompt: bool) -> str:
        messages = [{key: value for key, value in m.items() if value is not None} for m in messages]  # as transformers
        try:
            return self._compiled.render(messages=messages, tools=None, documents=None,
                                         add_generation_prompt=add_generation_prompt, **self.special_tokens)
        except Exception as exc:  # a template is a program from elsewhere: whatever fails in it is its error
            raise TemplateError(f"{self.name} refused the conversation: {_one_line(exc) or type(exc).__name__}"
                                ) from None

    def instruction_prompt(self, instruction: str, input: str = "") -> str:
        """The prompt of one instruction example (SFT, DPO): a user message holding the
        instruction, and the input after a blank line."""
        content = f"{instruction}\n\n{input}" if input else instruction
        return self.render([{"role": "user", "content": content}])

    # --- tokens ---------------------------------------------------------------------------------

    def stop_tokens(self, tok) -> list[str]:
        """The tokens that end a reply: the end-of-turn marker the template writes (if the tokenizer
        has it), then the end-of-text token; the first is what a reply is trained to end with."""
        eos = tok.token_bytes(tok.eos_id).decode("utf-8", "replace")
        return list(dict.fromkeys([*self._end_of_turn(tok), eos]))

    def tokenizer(self, tok) -> ChatTokenizer:
        """`tok` as rendered prompts need it (ChatTokenizer): its end of a reply is stop_tokens(tok)[0]."""
        marker = self._end_of_turn(tok)
        return ChatTokenizer(tok, tok.token_id(marker[0]) if marker else tok.eos_id)

    def _end_of_turn(self, tok) -> list[str]:
        """[the first usual end-of-turn marker written in the template that `tok` has], or []."""
        return [m for m in END_OF_TURN_MARKERS if m in self.source and tok.token_id(m) is not None][:1]


class AlpacaTemplate(ChatTemplate):
    """nanoeuler's own template, rendered by `render` above; `source` is its Jinja twin (for export)."""

    training_name = TEMPLATE

    def __init__(self):
        super().__init__(alpaca_jinja(), {}, name="the Alpaca template")

    def check(self, messages: list[dict]) -> None:
        check_messages(messages)

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not add_generation_prompt:  # a finished conversation: the Jinja twin writes it
            _check_shape(messages)
            return self._render_jinja(messages, add_generation_prompt)
        check_messages(messages)
        return render(messages)

    def instruction_prompt(self, instruction: str, input: str = "") -> str:
        return render_prompt(instruction, input)

    def save(self, folder: str | Path) -> None:
        """Nothing to write: config.json's training.template = "alpaca" names it."""


@functools.cache
def _alpaca() -> AlpacaTemplate:
    return AlpacaTemplate()


class ChatTokenizer:
    """A tokenizer as rendered prompts need it: `encode` recognises the special tokens in the text
    (as transformers' tokenizer does with a rendered chat template), and `eos_id` is the token a
    reply ends with (where generation stops). Everything else is the wrapped tokenizer's."""

    def __init__(self, tok, eos_id: int):
        self.tok, self.eos_id = tok, eos_id

    def encode(self, text: str, allowed_special="all") -> list[int]:
        return self.tok.encode(text, allowed_special)

    def __getattr__(self, name):
        return getattr(self.tok, name)
