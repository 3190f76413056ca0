"""Chat: the conversation template, dropping the oldest turns to fit, `chat`, `Model.chat`, and the
`chat` command with piped input, for fine-tuned and plain pretrained runs."""

import pytest
from typer.testing import CliRunner

from nanoeuler_core.inference.chat import Conversation, chat, check_messages, fit_context, render
from nanoeuler_core.inference.chat import render_prompt
from nanoeuler_core.inference.loading import load_model
from finetune_helpers import cli, make_base_run


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
    assert reply == model.generate(tok, render(messages), max_new_tokens=8, temperature=0.0)
    pieces = []
    assert chat(model, tok, messages, max_new_tokens=8, temperature=0.0, on_text=pieces.append) == "".join(pieces)
    assert model.chat(tok, messages, max_new_tokens=8, temperature=0.0) == reply


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
    assert result.stdout == "It was" + model.generate(loaded, "It was", max_new_tokens=5, temperature=0.0) + "\n"


def test_chat_command_bad_input(tmp_path, chat_run):
    result = CliRunner().invoke(cli(), ["chat", str(tmp_path / "nowhere")], input="hi\n")
    assert result.exit_code != 0 and isinstance(result.exception, (ValueError, OSError))  # the CLI prints one line
    result = CliRunner().invoke(cli(), ["chat", str(chat_run), "--temperature", "-1"], input="hi\n")
    assert result.exit_code != 0 and "temperature" in str(result.exception)
