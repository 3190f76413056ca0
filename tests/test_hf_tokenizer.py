"""Byte-level BPE tokenizer.json files made by Hugging Face `tokenizers` (GPT-2, SmolLM2 and
Llama 3 layouts, built here with `tokenizers` itself): our `Tokenizer.load` reads them and
encodes exactly as `tokenizers` does; what it cannot reproduce is refused in one line."""

import json
import random
from pathlib import Path

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanoeuler_core.text.base_tokenizer import TokenizerError
from nanoeuler_core.text.hf_tokenizer import HFTokenizer
from nanoeuler_core.text.tokenizer import Tokenizer

tokenizers = pytest.importorskip("tokenizers")
from tokenizers import Regex, decoders, models, trainers  # noqa: E402
from tokenizers import pre_tokenizers as pre  # noqa: E402

CORPUS = (Path(__file__).parents[1] / "data" / "tinyshakespeare.txt").read_text(encoding="utf-8")[:150_000]
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = {
    "gpt2": ["<|endoftext|>"],
    "smollm2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|im"],  # one special extends another
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>"],
    "mixed": ["</s>"],
}


def _extra_text(seed: int) -> str:
    rng = random.Random(seed)
    words = ["Ωμέγα", "naïve", "東京都", "1234567", "3.14159", "don't", "I'LL", "  ", "\t\n", "x²½", "٣٤", "😀😀"]
    return " ".join(rng.choice(words) for _ in range(4000))


def build(kind: str) -> "tokenizers.Tokenizer":
    """A small byte-level BPE tokenizer in the layout of a known family, trained by `tokenizers`."""
    hf = tokenizers.Tokenizer(models.BPE(ignore_merges=kind == "llama3"))
    hf.pre_tokenizer = {
        "gpt2": pre.ByteLevel(add_prefix_space=False),
        "smollm2": pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)]),
        "llama3": pre.Sequence([pre.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
                                pre.ByteLevel(add_prefix_space=False, use_regex=False)]),
        "mixed": pre.Sequence([pre.Digits(individual_digits=False), pre.Split("--", behavior="isolated"),
                               pre.ByteLevel(add_prefix_space=False)]),
    }[kind]
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=SPECIALS[kind], show_progress=False,
                                  initial_alphabet=pre.ByteLevel.alphabet())
    hf.train_from_iterator([CORPUS, _extra_text(0)], trainer)
    if kind in ("llama3", "mixed"):  # added tokens that are not special: always split out
        hf.add_tokens([tokenizers.AddedToken("<plain>", normalized=True), tokenizers.AddedToken("[raw]", normalized=False)])
    return hf


KINDS = list(SPECIALS)


@pytest.fixture(scope="module")
def pairs():
    """kind -> (Hugging Face tokenizer, ours read from its JSON)."""
    built = {kind: build(kind) for kind in KINDS}
    return {kind: (hf, Tokenizer.from_hf_json(json.loads(hf.to_str()))) for kind, hf in built.items()}


ADDED = sorted({s for specials in SPECIALS.values() for s in specials} | {"<plain>", "[raw]"})
TRICKY = " \t\n\r\x0b\x0c\x1c\x85\xa0\u2028\u3000'sStTdDmMlLrRvVeE0123456789²½Ⅻ٣.,!?…-\u0301é한ſ"
texts = st.lists(
    st.one_of(st.text(st.sampled_from(TRICKY), max_size=8), st.sampled_from(ADDED), st.sampled_from(["--", "---"]),
              st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=8)),
    max_size=10,
).map("".join)


@pytest.mark.parametrize("kind", KINDS)
def test_reads_the_family_and_encodes_the_corpus_identically(pairs, kind):
    hf, ours = pairs[kind]
    assert isinstance(ours, HFTokenizer) and ours.vocab_size == hf.get_vocab_size()
    text = CORPUS + _extra_text(1) + "".join(SPECIALS[kind])
    assert ours.encode(text, allowed_special="all") == hf.encode(text, add_special_tokens=False).ids
    assert ours.decode(ours.encode(text)) == text
    assert ours.eos_id == hf.token_to_id(SPECIALS[kind][-1] if kind == "llama3" else SPECIALS[kind][0])


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=texts)
@pytest.mark.parametrize("kind", KINDS)
def test_same_ids_as_hugging_face_on_random_text(pairs, kind, text):
    hf, ours = pairs[kind]
    assert ours.encode(text, allowed_special="all") == hf.encode(text, add_special_tokens=False).ids


def test_special_tokens_only_when_allowed_but_plain_added_tokens_always(pairs):
    hf, ours = pairs["llama3"]
    text = "a<|end_of_text|>b<plain>c[raw]"
    ids = ours.encode(text)
    assert hf.token_to_id("<|end_of_text|>") not in ids
    assert hf.token_to_id("<plain>") in ids and hf.token_to_id("[raw]") in ids
    assert ours.decode(ids) == text


def unordered_merges_document(missing: tuple[int, ...] = (), unk: str | None = None, fuse_unk: bool = False,
                               use_regex: bool = True) -> dict:
    """Merges that use a token before the merge making it ("ab a" before "a b") and make one
    token twice ("abc" from "ab c" and "a bc"), which trained merge lists never do: Hugging
    Face's queue then departs from a strict rank order, and its answer is the one to reproduce.
    The bytes in `missing` get no vocabulary entry (ids stay contiguous); `unk` names an unknown token;
    without `use_regex` the whole text is one pretoken."""
    from nanoeuler_core.text.hf_json import BYTE_TO_CHAR

    vocab = {char: i for i, char in enumerate(c for b, c in enumerate(BYTE_TO_CHAR) if b not in missing)}
    merges = ["ab a", "b c", "a b", "bc a", "c ab", "ab c", "a bc", "ca b", "aba b", "c a", "abc abc", "a a",
              "aa a", "a aa", "b ca"]
    for merge in merges:
        vocab.setdefault(merge.replace(" ", ""), len(vocab))
    if unk is not None:
        vocab[unk] = len(vocab)
    vocab["</s>"] = len(vocab)
    return {"version": "1.0", "truncation": None, "padding": None, "normalizer": None, "post_processor": None,
            "added_tokens": [{"id": vocab["</s>"], "content": "</s>", "special": True, "normalized": False,
                              "single_word": False, "lstrip": False, "rstrip": False}],
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                              "use_regex": use_regex},
            "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": fuse_unk, "byte_fallback": False,
                      "ignore_merges": False, "vocab": vocab, "merges": merges}}


@pytest.fixture(scope="module")
def unordered_merges():
    document = unordered_merges_document()
    return tokenizers.Tokenizer.from_str(json.dumps(document)), Tokenizer.from_hf_json(document)


def test_unordered_merges_follow_hugging_face_not_rank_order(unordered_merges):
    hf, ours = unordered_merges
    # The queue joins "ab" with the next "a" before the second "a b" (then "aba b"); a strict
    # rank order makes "ab" twice, which no merge joins: ["ab", "ab"].
    assert ours.encode("abab") == hf.encode("abab").ids == [hf.token_to_id("abab")]


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.sampled_from("abc"), min_size=1, max_size=24))
def test_unordered_merges_same_ids_as_hugging_face(unordered_merges, text):
    hf, ours = unordered_merges
    assert ours.encode(text) == hf.encode(text).ids


def test_save_load_round_trip_and_eos_from_tokenizer_config(pairs, tmp_path):
    hf, ours = pairs["smollm2"]
    ours.save(tmp_path / "tokenizer.json")
    assert tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json")).encode(CORPUS[:3000]).ids == \
        hf.encode(CORPUS[:3000]).ids
    loaded = Tokenizer.load(tmp_path / "tokenizer.json")
    assert loaded.hash == ours.hash and loaded.eos_id == hf.token_to_id("<|endoftext|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))
    chat_tuned = Tokenizer.load(tmp_path / "tokenizer.json")
    assert chat_tuned.eos_id == hf.token_to_id("<|im_end|>") and chat_tuned.hash != ours.hash
    (tmp_path / "copy").mkdir()
    chat_tuned.save(tmp_path / "copy" / "tokenizer.json")  # the end-of-text token goes along
    assert Tokenizer.load(tmp_path / "copy" / "tokenizer.json").eos_id == hf.token_to_id("<|im_end|>")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|nope|>"}))
    with pytest.raises(TokenizerError, match="no end-of-text token '<|nope|>'"):
        Tokenizer.load(tmp_path / "tokenizer.json").eos_id


def test_own_tokenizers_keep_their_fast_path(tmp_path):
    own = Tokenizer.train(CORPUS, 400)
    own.save(tmp_path / "tokenizer.json")
    assert type(Tokenizer.load(tmp_path / "tokenizer.json")) is Tokenizer


def test_encode_batch_in_worker_processes(pairs):
    _, ours = pairs["llama3"]
    documents = [CORPUS[i : i + 30_000] + "<|end_of_text|>" for i in range(0, len(CORPUS), 30_000)] * 8
    expected = [ours.encode(d, allowed_special="all") for d in documents]
    assert ours.encode_batch(documents, allowed_special="all", n_workers=2) == expected


def _tampered(document: dict, change: str) -> dict:
    if change == "wordpiece":
        document["model"]["type"] = "WordPiece"
    elif change == "metaspace":
        document["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always"}
    elif change == "normalizer":
        document["normalizer"] = {"type": "NFC"}
    elif change == "prefix space":
        document["pre_tokenizer"]["add_prefix_space"] = True
    elif change == "removed":
        document["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": "x"}, "behavior": "Removed", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}]}
    elif change == "word escape":
        document["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"\w+"}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}]}
    elif change == "lstrip":
        document["added_tokens"][0]["lstrip"] = True
    elif change == "byte fallback":
        document["model"]["byte_fallback"] = True
    elif change == "gap in ids":
        document["added_tokens"][0]["id"] = len(document["model"]["vocab"]) + 5
    elif change == "unknown unk":
        document["model"]["vocab"]["<nul>"] = document["model"]["vocab"].pop("Ā")  # byte 0 has no entry
        document["model"]["unk_token"] = "<nope>"
    return document


@pytest.mark.parametrize("change, message", [
    ("wordpiece", "holds a 'WordPiece' model, not BPE"),
    ("metaspace", "uses the 'Metaspace' pre-tokenizer"),
    ("normalizer", "has a normalizer ('NFC')"),
    ("prefix space", "sets add_prefix_space"),
    ("removed", "splits with behavior 'Removed'"),
    ("word escape", r"unsupported escape \w"),
    ("lstrip", "sets lstrip on added token '</s>'"),
    ("byte fallback", "sets model.byte_fallback"),
    ("gap in ids", "has no token with id"),
    ("unknown unk", "names unk_token '<nope>', which is not in its vocabulary"),
])
def test_unsupported_files_are_refused_in_one_line(change, message, tmp_path):
    path = tmp_path / "tokenizer.json"
    path.write_bytes(orjson.dumps(_tampered(unordered_merges_document(), change)))
    with pytest.raises(TokenizerError) as error:
        Tokenizer.load(path)
    assert message in str(error.value) and "\n" not in str(error.value)


# ------------------------------------------------------------------------------------------------
# Vocabularies without some byte tokens (a real 135M instruct model's tokenizer lacks these bytes,
# which never or hardly ever occur in UTF-8 text): `tokenizers` drops them when encoding, and so must we.

MISSING = (4, 6, 19, 20, 22, 29, 192, 193, *range(241, 256))
# Characters whose UTF-8 holds a missing byte: control characters, and code points from U+40000 on
# (their lead byte is F1-F4): unassigned planes, tags, variation selectors, private use.
MISSING_CHARS = "\x04\x06\x13\x14\x16\x1d\U00040000\U00080000\U000e0001\U000e0100\U000f0000\U00100000\U0010fffd"


@pytest.fixture(scope="module")
def gappy():
    """(Hugging Face tokenizer, ours) of a SmolLM2-like vocabulary trained by `tokenizers` without those bytes."""
    from nanoeuler_core.text.hf_json import BYTE_TO_CHAR

    hf = tokenizers.Tokenizer(models.BPE())
    hf.pre_tokenizer = pre.Sequence([pre.Digits(individual_digits=True), pre.ByteLevel(add_prefix_space=False)])
    hf.decoder = decoders.ByteLevel()
    alphabet = [BYTE_TO_CHAR[b] for b in range(256) if b not in MISSING]
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False, initial_alphabet=alphabet)
    hf.train_from_iterator([CORPUS, _extra_text(0)], trainer)
    assert sorted(c for c in alphabet if c not in hf.get_vocab()) == []
    return hf, Tokenizer.from_hf_json(json.loads(hf.to_str()))


def test_a_vocabulary_without_some_bytes_loads_and_drops_them_as_hugging_face_does(gappy, tmp_path):
    hf, ours = gappy
    assert isinstance(ours, HFTokenizer) and ours.missing_bytes == MISSING
    assert ours.encode("a\x04b") == hf.encode("a\x04b").ids == ours.encode("ab")[:1] + ours.encode("b")  # ["a", "b"]
    text = CORPUS[:20_000] + _extra_text(2) + MISSING_CHARS * 3
    ids = ours.encode(text)
    assert ids == hf.encode(text, add_special_tokens=False).ids
    kept = bytes(b for b in text.encode() if b not in MISSING)
    assert ours.decode_bytes(ids) == b"".join(map(ours.token_bytes, ids)) == kept
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False) == kept.decode("utf-8", "replace")
    assert ours.decode(ours.encode(CORPUS[:20_000])) == CORPUS[:20_000]  # text of bytes it has round-trips
    ours.save(tmp_path / "tokenizer.json")
    assert Tokenizer.load(tmp_path / "tokenizer.json").encode(text) == ids


gappy_texts = st.lists(
    st.one_of(st.text(st.sampled_from(MISSING_CHARS + TRICKY + "ab.,"), max_size=8),
              st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
              st.text(st.characters(exclude_categories=("Cs", "Cn")), max_size=8)),
    max_size=10,
).map("".join)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=gappy_texts)
def test_without_some_bytes_same_ids_as_hugging_face_on_random_text(gappy, text):
    hf, ours = gappy
    ids = ours.encode(text, allowed_special="all")
    assert ids == hf.encode(text, add_special_tokens=False).ids
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=False)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.binary(max_size=40))
def test_without_some_bytes_any_bytes_come_back_less_the_missing_ones(gappy, data):
    _, ours = gappy
    assert ours.decode_bytes(ours.encode_bytes(data)) == bytes(b for b in data if b not in MISSING)


@pytest.fixture(scope="module", params=[(None, False), ("<unk>", False), ("<unk>", True)],
                ids=["dropped", "unk", "fused unk"])
def gappy_merges(request):
    """Hand-made merges over a vocabulary lacking bytes 0x04 and 0x2e ("."), the whole text one pretoken:
    those bytes are dropped (merges join their neighbours), or become the unknown token."""
    unk, fuse = request.param
    document = unordered_merges_document(missing=(0x04, 0x2E), unk=unk, fuse_unk=fuse, use_regex=False)
    return tokenizers.Tokenizer.from_str(json.dumps(document)), Tokenizer.from_hf_json(document)


def test_merges_join_the_neighbours_of_a_dropped_byte(gappy_merges):
    hf, ours = gappy_merges
    for text in ("a.b", "a\x04b", ".", "x..\x04.y", "ab.\x04.ab"):
        assert ours.encode(text) == hf.encode(text).ids, text
    if "<unk>" not in hf.get_vocab():  # "." dropped: "a b" merges across it
        assert ours.encode("a.b") == [hf.token_to_id("ab")]


@settings(max_examples=300, deadline=None)
@given(text=st.text(st.sampled_from("abc.\x04!? "), max_size=24))
def test_gappy_merges_same_ids_as_hugging_face(gappy_merges, text):
    hf, ours = gappy_merges
    assert ours.encode(text) == hf.encode(text).ids
