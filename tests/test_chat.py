"""Chat: the conversation templates (Alpaca, and Jinja ones from a run or a file), dropping the
oldest turns to fit, `chat` (also as exported by nanoeuler_core), and the `chat` command with piped input, for fine-tuned
and plain pretrained runs. (tests/test_interop.py checks Jinja rendering against transformers.)"""

import json

import pytest
from typer.testing import CliRunner

import nanoeuler_core
from nanoeuler_core.inference.chat import Conversation, chat, check_messages, fit_context, render
from nanoeuler_core.inference.chat import render_prompt
from nanoeuler_core.inference.generate import generate
from nanoeuler_core.inference.loading import load_model
from nanoeuler_core.inference.template import AlpacaTemplate, ChatTemplate, TemplateError
from nanoeuler_core.text.tokenizer import Tokenizer
from finetune_helpers import cli, make_base_run

# A ChatML-like template that takes a system message (written over several lines: trim_blocks and
# lstrip_blocks make them vanish, as in transformers).
CHATML = """{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


@pytest.fixture
def chat_run(tmp_path, tok):  # noqa: F811
    """A tiny run marked as fine-tuned with the Alpaca template."""
    run = make_base_run(tmp_path / "chat", tok, seed=3)
    config = (run / "config.json").read_text().replace('"preset": "small"', '"preset": "small", "template": "alpaca"')
    (run / "config.json").write_text(config)
    return run


def test_one_turn_renders_as_an_sft_prompt():
    assert render([user("Reverse the word: night")]) == render_prompt("Reverse the word: night")


def test_turns_render_in_order():
    text = render([user("Hi"), assistant("hello"), user("Add 2 and 3")])
    assert text == render_prompt("Hi") + "hello\n\n### Instruction:\nAdd 2 and 3\n\n### Response:\n"


@pytest.mark.parametrize("messages, message", [
    ([], "empty"),
    ([assistant("hi")], "role 'assistant', expected 'user'"),
    ([user("a"), user("b")], "role 'user', expected 'assistant'"),
    ([user("a"), assistant("b")], "last message must be the user's"),
    ([{"role": "user", "content": 3}], "string 'content'"),
])
def test_bad_messages(messages, message):
    with pytest.raises(ValueError, match=message):
        check_messages(messages)


def test_oldest_turns_are_dropped_first(tok):  # noqa: F811
    messages = [user("first question"), assistant("first answer"), user("second question"),
                assistant("second answer"), user("third question")]
    n_tokens = lambda m: len(tok.encode(render(m)))  # noqa: E731
    assert fit_context(tok, messages, n_tokens(messages) + 10, 10) == messages  # fits: all kept
    assert fit_context(tok, messages, n_tokens(messages) + 9, 10) == messages[2:]  # one token short: oldest turn out
    assert fit_context(tok, messages, n_tokens(messages[2:]) - 1, 0) == messages[4:]
    assert fit_context(tok, messages, 5, 0) == messages[4:]  # the latest message always stays


def test_chat_replies_with_the_model_greedy_continuation(chat_run):
    model, tok = load_model(chat_run)
    messages = [user("Reverse the word: night")]
    reply = chat(model, tok, messages, max_new_tokens=8, temperature=0.0)
    assert reply == generate(model, tok, render(messages), max_new_tokens=8, temperature=0.0)
    pieces = []
    assert chat(model, tok, messages, max_new_tokens=8, temperature=0.0, on_text=pieces.append) == "".join(pieces)
    assert nanoeuler_core.chat(model, tok, messages, max_new_tokens=8, temperature=0.0) == reply


def test_conversation_keeps_turns_until_reset(chat_run):
    model, tok = load_model(chat_run)
    conversation = Conversation()
    first = conversation.say(model, tok, "Hi", max_new_tokens=4, temperature=0.0)
    conversation.say(model, tok, "Again", max_new_tokens=4, temperature=0.0)
    assert [m["role"] for m in conversation.messages] == ["user", "assistant", "user", "assistant"]
    assert conversation.messages[1]["content"] == first
    conversation.reset()
    assert conversation.messages == []


def test_chat_command_with_piped_input(chat_run):
    model, tok = load_model(chat_run)
    args = ["chat", str(chat_run), "--temperature", "0", "--max-new-tokens", "6"]
    result = CliRunner().invoke(cli(), args, input="Hi\n\n/reset\nAgain\n/quit\nnever read\n")
    assert result.exit_code == 0, result.output
    expected = [chat(model, tok, [user(text)], max_new_tokens=6, temperature=0.0) for text in ("Hi", "Again")]
    assert "(conversation cleared)" in result.output  # so "Again" is asked without the first turn
    assert result.stdout == "".join(reply + "\n" for reply in expected)


def test_chat_command_continues_text_for_a_pretrained_run(tmp_path, tok):  # noqa: F811
    run = make_base_run(tmp_path / "plain", tok, seed=4)
    model, loaded = load_model(run)
    result = CliRunner().invoke(cli(), ["chat", str(run), "--temperature", "0", "--max-new-tokens", "5"],
                                input="It was\n")
    assert result.exit_code == 0, result.output
    assert result.stdout == "It was" + generate(model, loaded, "It was", max_new_tokens=5, temperature=0.0) + "\n"


def test_chat_command_bad_input(tmp_path, chat_run):
    result = CliRunner().invoke(cli(), ["chat", str(tmp_path / "nowhere")], input="hi\n")
    assert result.exit_code != 0 and isinstance(result.exception, (ValueError, OSError))  # the CLI prints one line
    result = CliRunner().invoke(cli(), ["chat", str(chat_run), "--temperature", "-1"], input="hi\n")
    assert result.exit_code != 0 and "temperature" in str(result.exception)


# ------------------------------------------------------------------------------------------------
# templates: which one a run uses, Jinja rendering, system messages, where a reply ends


def system(text):
    return {"role": "system", "content": text}


def test_a_run_template_is_its_own_or_the_one_asked_for(chat_run, tmp_path, tok):  # noqa: F811
    plain = make_base_run(tmp_path / "plain", tok)
    assert isinstance(ChatTemplate.for_run(chat_run), AlpacaTemplate)
    assert ChatTemplate.for_run(plain) is None  # a pretrained run: chat continues text
    assert isinstance(ChatTemplate.for_run(plain, "alpaca"), AlpacaTemplate)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    from_file = ChatTemplate.for_run(chat_run, tmp_path / "chatml.jinja")
    assert from_file.source == CHATML and from_file.special_tokens == {"eos_token": "</s>"}
    # a run's tokenizer_config.json chat_template, with its special tokens (an imported instruct model)
    (plain / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>", "bos_token": "<s>",
                                                             "chat_template": "{{ bos_token }}" + CHATML}))
    own = ChatTemplate.for_run(plain)
    assert own.special_tokens == {"eos_token": "</s>", "bos_token": "<s>"}
    assert own.render([user("Hi")]) == "<s><|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert isinstance(ChatTemplate.for_run(plain, "alpaca"), AlpacaTemplate)  # --template wins
    with pytest.raises(TemplateError, match="not found"):
        ChatTemplate.for_run(plain, tmp_path / "nowhere.jinja")


def test_jinja_templates_render_roles_and_the_generation_prompt():
    template = ChatTemplate(CHATML)
    messages = [system("Be brief."), user("Hi"), assistant("Hello."), user("Bye")]
    assert template.render(messages) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                         "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
                                         "<|im_start|>assistant\n")
    finished = template.render(messages, add_generation_prompt=False)
    assert finished + "<|im_start|>assistant\n" == template.render(messages)
    assert template.instruction_prompt("Add.", "2 3") == template.render([user("Add.\n\n2 3")])
    with pytest.raises(TemplateError, match="refused the conversation: Unknown role: tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(ValueError, match="string 'content'"):
        template.render([{"role": "user", "content": None}])
    with pytest.raises(TemplateError, match=r"is not a valid Jinja template \(line 1: "):
        ChatTemplate("{% if %}")
    # the Alpaca template: its own rules, and its Jinja twin for the finished conversation
    alpaca = ChatTemplate.alpaca()
    assert alpaca.render([user("Hi")]) == render([user("Hi")]) and alpaca.instruction_prompt("Add.", "2 3") == \
        render_prompt("Add.", "2 3")
    assert alpaca.render([user("Hi"), assistant("Hello.")], add_generation_prompt=False) == \
        render([user("Hi")]) + "Hello.\n\n"
    with pytest.raises(ValueError, match="the Alpaca template has none"):
        alpaca.render([system("Be brief."), user("Hi")])


def test_system_messages_stay_when_old_turns_are_dropped(tok):  # noqa: F811
    template = ChatTemplate(CHATML)
    messages = [system("Be brief."), user("first question"), assistant("first answer"), user("second question")]
    n_tokens = lambda m: len(tok.encode(template.render(m), allowed_special="all"))  # noqa: E731
    assert fit_context(tok, messages, n_tokens(messages), 0, template) == messages
    assert fit_context(tok, messages, n_tokens(messages) - 1, 0, template) == [messages[0], messages[3]]
    assert fit_context(tok, messages, 5, 0, template) == [messages[0], messages[3]]  # the latest message stays


def test_a_reply_ends_at_the_end_of_turn_token_the_template_writes(tok):  # noqa: F811
    chatml = ChatTemplate(CHATML)
    assert chatml.stop_tokens(tok) == ["</s>"]  # this tokenizer has no <|im_end|>: its end-of-text token
    specials = ["</s>", "<|im_start|>", "<|im_end|>"]
    chatml_tok = Tokenizer.train("".join(render_prompt(f"Say {i}.") for i in range(50)), 300, special_tokens=specials)
    assert chatml.stop_tokens(chatml_tok) == ["<|im_end|>", "</s>"]
    chat_tok = chatml.tokenizer(chatml_tok)
    assert chat_tok.eos_id == chatml_tok.token_id("<|im_end|>") and chat_tok.vocab_size == chatml_tok.vocab_size
    prompt = chatml.render([user("Hi")])
    assert chat_tok.encode(prompt) == chatml_tok.encode(prompt, allowed_special="all")  # the markers are tokens
    assert chat_tok.encode(prompt)[0] == chatml_tok.token_id("<|im_start|>")
    assert ChatTemplate.alpaca().stop_tokens(chatml_tok) == ["</s>"]


def test_chat_in_a_jinja_template_with_a_system_message(chat_run):
    model, tok = load_model(chat_run)
    template = ChatTemplate(CHATML, {"eos_token": "</s>"})
    conversation = Conversation(template, system="Be brief.")
    reply = conversation.say(model, tok, "Hi", max_new_tokens=6, temperature=0.0)
    prompt = template.render([system("Be brief."), user("Hi")])
    assert reply == generate(model, template.tokenizer(tok), prompt, max_new_tokens=6, temperature=0.0)
    assert [m["role"] for m in conversation.messages] == ["system", "user", "assistant"]
    conversation.reset()
    assert conversation.messages == [system("Be brief.")]
    with pytest.raises(ValueError, match="last message must be the user's"):
        chat(model, tok, [system("Be brief.")], template=template)


def test_chat_command_with_a_template_file_and_a_system_message(chat_run, tmp_path):
    model, tok = load_model(chat_run)
    (tmp_path / "chatml.jinja").write_text(CHATML)
    args = ["chat", str(chat_run), "--temperature", "0", "--max-new-tokens", "6", "--template",
            str(tmp_path / "chatml.jinja"), "--system", "Be brief."]
    result = CliRunner().invoke(cli(), args, input="Hi\n")
    assert result.exit_code == 0, result.output
    template = ChatTemplate.from_file(tmp_path / "chatml.jinja", {"eos_token": "</s>"})
    expected = chat(model, tok, [system("Be brief."), user("Hi")], max_new_tokens=6, temperature=0.0, template=template)
    assert result.stdout == expected + "\n"
    assert f"a conversation in {tmp_path / 'chatml.jinja'}" in result.stderr
