"""runtime.tokenizer against a real tokenizer trained on the fly, with transformers as the reference."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from runtime.tokenizer import IncrementalDetokenizer, StopChecker, Tokenizer, TokenizerError

SPECIAL = ["<|bos|>", "<|eos|>", "<|pad|>", "<|system|>", "<|user|>", "<|assistant|>"]
CORPUS = [
    "def greet(name):\n    return f'hello {name}'\n",
    "The quick brown fox jumps over the lazy dog.\n",
    "for i in range(10):\n    print(i, i * i)\n",
    "Grüße aus Köln, naïve café, señor.",
    "你好世界。今天天气很好。",
    "emoji: 🙂 🚀 ✨",
]
# Exercises what real templates use: bos/eos variables, tools, tojson (non-ASCII and HTML kept as is,
# indent), namespace, loop controls, {% generation %}, trim_blocks/lstrip_blocks whitespace handling.
CHAT_TEMPLATE = """{{ bos_token }}
{% if tools %}
<|system|>
Tools: {{ tools | tojson(indent=2) }}
{% endif %}
{% set ns = namespace(turns=0) %}
{% for m in messages %}
    {% if m['role'] == 'system' and not loop.first %}
        {{ raise_exception('the system message must come first') }}
    {% endif %}
    {% if m['role'] == 'note' %}{% continue %}{% endif %}
    {% set ns.turns = ns.turns + 1 %}
<|{{ m['role'] }}|>
    {% if m['role'] == 'assistant' %}
{% generation %}{{ m['content'] | trim }}{{ eos_token }}{% endgeneration %}
    {% else %}
{{ m['content'] | trim }} {{ {'turn': ns.turns, 'text': m['content']} | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|assistant|>
{% endif %}"""
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo <b>wörld</b> & 你好 🙂"},
    {"role": "note", "content": "skipped by the template"},
    {"role": "assistant", "content": "  Hi \"there\"  "},
    {"role": "user", "content": "Again?"},
]
MULTIBYTE_TEXT = "Grüße aus Köln 🙂🚀 你好世界, naïve café ✨ señor! 日本語 Ωμέγα"
PYSTDLIB = Path(__file__).resolve().parents[2] / "models" / "pystdlib-llama"


def train_backend(post_processor: bool) -> Backend:
    """A small byte-level BPE: multi-byte characters end up split over several tokens."""
    tok = Backend(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    if post_processor:
        bos = tok.token_to_id("<|bos|>")
        tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", pair="<|bos|> $A <|bos|> $B",
                                                           special_tokens=[("<|bos|>", bos)])
    return tok


def write_tokenizer(path: Path, *, post_processor: bool = True, **config) -> Path:
    """Save tokenizer.json and tokenizer_config.json (entries in ``config`` override the defaults)."""
    path.mkdir(parents=True, exist_ok=True)
    train_backend(post_processor).save(str(path / "tokenizer.json"))
    full = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>",
            "eos_token": {"__type": "AddedToken", "content": "<|eos|>", "special": True}, "pad_token": "<|pad|>",
            "chat_template": CHAT_TEMPLATE, "model_max_length": 512, **config}
    (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in full.items() if v is not None}))
    return path


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def tok(tok_dir) -> Tokenizer:
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf_tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


# --- loading, encode, decode ------------------------------------------------------------------------
def test_special_ids_and_vocab_size(tok, hf_tok):
    assert tok.bos_token_id == hf_tok.bos_token_id == SPECIAL.index("<|bos|>")
    assert tok.eos_token_ids == [hf_tok.eos_token_id] == [SPECIAL.index("<|eos|>")]
    assert tok.vocab_size == len(hf_tok)


def test_round_trip_and_matches_reference_ids(tok, hf_tok):
    for text in CORPUS + [MULTIBYTE_TEXT, "unseen wörds ∑ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]:
        ids = tok.encode(text)
        assert ids == hf_tok.encode(text)
        assert ids[0] == tok.bos_token_id
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=False) == "<|bos|>" + text
        assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_bos_prepended_when_config_asks_and_post_processor_does_not(tmp_path):
    plain = Tokenizer.from_dir(write_tokenizer(tmp_path / "plain", post_processor=False))
    asks = Tokenizer.from_dir(write_tokenizer(tmp_path / "asks", post_processor=False, add_bos_token=True))
    both = Tokenizer.from_dir(write_tokenizer(tmp_path / "both", add_bos_token=True))
    text = "hello world"
    body = plain.encode(text)
    assert body[0] != plain.bos_token_id  # no post-processor, no add_bos_token: nothing added
    assert asks.encode(text) == [asks.bos_token_id] + body
    assert asks.encode(text, add_special_tokens=False) == body
    assert both.encode(text) == [both.bos_token_id] + body  # added once, not twice


def test_generation_config_extends_eos_ids(tmp_path):
    path = write_tokenizer(tmp_path / "t")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5, 7]}))
    assert Tokenizer.from_dir(path).eos_token_ids == [1, 5, 7]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 4}))
    assert Tokenizer.from_dir(path).eos_token_ids == [1, 4]


def test_eos_ids_outside_the_vocabulary_are_refused_at_load(tmp_path, caplog):
    """An eos_token_id past the vocabulary (or negative), alone or in a list of such ids only, is refused when the
    tokenizer loads, naming the file, the field (the list's index) and the allowed range: it was accepted, and
    generation never stopped at it. In a list beside ids the model can sample it is left out with a warning naming
    it. With the model's vocab_size given, that is the range, and the tokenizer's eos_token is held to it."""
    path = write_tokenizer(tmp_path / "t")
    vocab = Tokenizer.from_dir(path).vocab_size
    for value, key, bad in ((10**12, "eos_token_id", 10**12), (-1, "eos_token_id", -1),
                            ([vocab, -3], r"eos_token_id\[0\]", vocab)):
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": value}))
        with pytest.raises(TokenizerError, match=rf"generation_config\.json: {key} is {bad}; allowed: token ids "
                                                 rf"0\.\.{vocab - 1} \(the tokenizer's vocabulary\)"):
            Tokenizer.from_dir(path)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5, vocab, -3]}))
    with caplog.at_level("WARNING", logger="runtime.tokenizer"):
        assert Tokenizer.from_dir(path).eos_token_ids == [1, 5]
    assert f"eos_token_id [2] = {vocab}, [3] = -3 outside token ids 0..{vocab - 1}" in caplog.text
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, vocab - 1]}))
    assert Tokenizer.from_dir(path).eos_token_ids == [1, vocab - 1]  # the last id is a token
    assert Tokenizer.from_dir(path, vocab_size=vocab + 8).eos_token_ids == [1, vocab - 1]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab + 8}))
    with pytest.raises(TokenizerError, match=rf"eos_token_id is {vocab + 8}; allowed: token ids 0\.\.{vocab + 7} "
                                             r"\(the model's vocab_size\)"):
        Tokenizer.from_dir(path, vocab_size=vocab + 8)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": True}))
    with pytest.raises(TokenizerError, match=r"eos_token_id must be a token id \(an int\) or a list of them, got True"):
        Tokenizer.from_dir(path)
    (path / "generation_config.json").unlink()
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: eos_token '<\|eos\|>' is token id 1; allowed: "
                                             r"token ids 0\.\.0 \(the model's vocab_size\)"):
        Tokenizer.from_dir(path, vocab_size=1)


def test_eos_ids_are_held_to_one_past_the_largest_id_of_a_vocabulary_with_gaps(tmp_path):
    """Without the model's vocab_size, the range is one past the tokenizer's largest id, not its count of tokens:
    ids may skip numbers (a converted vocabulary), and its own eos_token at id 10 of 4 tokens is a token."""
    backend = Backend(models.WordLevel({"a": 0, "b": 1, "<unk>": 2, "<|eos|>": 10}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path / "gaps"
    path.mkdir()
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|eos|>"}))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [10]}))
    assert Tokenizer.from_dir(path).eos_token_ids == [10]
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 11}))
    with pytest.raises(TokenizerError, match=r"eos_token_id is 11; allowed: token ids 0\.\.10"):
        Tokenizer.from_dir(path)


def test_missing_or_corrupt_files_are_named(tmp_path):
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
    path = write_tokenizer(tmp_path / "t")
    (path / "tokenizer_config.json").write_text("[oops")
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json"):
        Tokenizer.from_dir(path)


def test_config_is_optional(tmp_path):
    path = write_tokenizer(tmp_path / "t")
    (path / "tokenizer_config.json").unlink()
    tok = Tokenizer.from_dir(path)
    assert tok.bos_token_id is None and tok.eos_token_ids == []
    assert tok.decode(tok.encode("hello")) == "hello"
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# --- chat templates ---------------------------------------------------------------------------------
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_reference(tok, hf_tok, add_generation_prompt):
    ours = tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt)
    ref = hf_tok.apply_chat_template(MESSAGES, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert ours == ref
    assert "<b>wörld</b> & 你好 🙂" in ours.split("{")[1]  # tojson kept HTML and non-ASCII as is
    assert ours.endswith("<|assistant|>\n") == add_generation_prompt


def test_chat_template_with_tools_matches_reference(tok, hf_tok):
    tools = [{"type": "function", "function": {"name": "wetter", "description": "Temperatur in °C <jetzt>",
                                               "parameters": {"type": "object", "properties": {}}}}]
    ours = tok.apply_chat_template(MESSAGES[:2], tools=tools)
    assert ours == hf_tok.apply_chat_template(MESSAGES[:2], tools=tools, tokenize=False,
                                              add_generation_prompt=True)
    assert json.dumps(tools, indent=2, ensure_ascii=False) in ours


def test_chat_template_list_form_uses_default(tmp_path):
    templates = [{"name": "tool_use", "template": "TOOLS"}, {"name": "default", "template": "DEFAULT"}]
    tok = Tokenizer.from_dir(write_tokenizer(tmp_path / "t", chat_template=templates))
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "DEFAULT"


def test_chat_template_file_takes_priority(tmp_path):
    path = write_tokenizer(tmp_path / "t")
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}]) == "x!"


@pytest.mark.parametrize("where", ["chat_template.jinja", "tokenizer_config.json"])
@pytest.mark.parametrize("template, says", [
    ("{% for m in messages %}\n{{ m['content'] }}\n{% endfro %}", r"Jinja error at line 3: Encountered unknown tag "
                                                                   r"'endfro'"),
    ("{{ bos_token }}\n{{ messages[0]['content'] | no_such_filter }}", r"Jinja error at line 2: No filter named "
                                                                       r"'no_such_filter'"),
    ("{{ " + "(" * 100_000 + "1" + ")" * 100_000 + " }}", r"RecursionError: its expressions or blocks are nested"),
], ids=["unknown-tag", "unknown-filter", "nested-100000-deep"])
def test_a_chat_template_that_does_not_compile_stops_the_load(tmp_path, where, template, says):
    """A chat template with a Jinja syntax error is refused when the tokenizer loads, naming the file it came from
    and the error's line; it loaded before, and every chat request then failed."""
    path = write_tokenizer(tmp_path / "t", chat_template=template if where == "tokenizer_config.json" else None)
    if where == "chat_template.jinja":
        (path / where).write_text(template)
    named = {"chat_template.jinja": r"chat_template\.jinja",
             "tokenizer_config.json": r"tokenizer_config\.json \(its chat_template\)"}[where]
    with pytest.raises(TokenizerError, match=rf"{named}: the chat template does not compile \(.*{says}"):
        Tokenizer.from_dir(path)
    bare = Tokenizer.from_dir(path, files={"tokenizer.json"})  # without the template: plain completions only
    assert bare.chat_template is None and bare.decode(bare.encode("hello")) == "hello"


def test_unreadable_tokenizer_files_are_named(tmp_path):
    """A chat template that is not UTF-8, and a tokenizer_config.json nested past the recursion limit: errors
    naming the file (a bare codec error, or a RecursionError traceback, before)."""
    path = write_tokenizer(tmp_path / "t")
    (path / "chat_template.jinja").write_bytes(b"\xff\xfe{{ x }}")
    with pytest.raises(TokenizerError, match=r"chat_template\.jinja: cannot read the chat template \('utf-8' codec"):
        Tokenizer.from_dir(path)
    (path / "chat_template.jinja").unlink()
    (path / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(TokenizerError, match=r"tokenizer_config\.json: cannot read it as JSON \(RecursionError"):
        Tokenizer.from_dir(path)


def test_only_the_allowed_files_are_read(tmp_path):
    """From an artifact, files not in ``files`` (its manifest's list) are ignored as if absent."""
    path = write_tokenizer(tmp_path / "t")
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 5]}))
    (path / "special_tokens_map.json").write_text(json.dumps({"sep_token": "<|user|>"}))
    everything = Tokenizer.from_dir(path)
    assert everything.eos_token_ids == [1, 5] and everything.special_tokens["sep_token"] == "<|user|>"
    listed = Tokenizer.from_dir(path, files={"tokenizer.json", "tokenizer_config.json"})
    assert listed.chat_template == CHAT_TEMPLATE and not listed.apply_chat_template(MESSAGES[:2]).endswith("!")
    assert listed.eos_token_ids == [1] and "sep_token" not in listed.special_tokens
    bare = Tokenizer.from_dir(path, files={"tokenizer.json"})
    assert bare.chat_template is None and bare.eos_token_ids == [] and bare.special_tokens == {}
    with pytest.raises(TokenizerError, match="tokenizer.json: no such file listed"):
        Tokenizer.from_dir(path, files={"tokenizer_config.json"})


def test_template_raise_exception_is_tokenizer_error(tok):
    bad_order = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(TokenizerError, match="system message must come first"):
        tok.apply_chat_template(bad_order)


@pytest.mark.parametrize("messages, index", [
    ([{"role": "user", "content": "ok"}, "not a dict"], 1),
    ([{"role": "user"}], 0),
    ([{"role": "user", "content": "ok"}, {"role": "user", "content": "ok"}, {"role": 3, "content": "x"}], 2),
    ([{"role": "user", "content": ["a", "list"]}], 0),
])
def test_bad_messages_name_the_index(tok, messages, index):
    with pytest.raises(TokenizerError, match=rf"messages\[{index}\]"):
        tok.apply_chat_template(messages)


def test_messages_must_be_a_list(tok):
    with pytest.raises(TokenizerError, match="list"):
        tok.apply_chat_template({"role": "user", "content": "hi"})


def test_template_cannot_escape_sandbox(tmp_path):
    path = write_tokenizer(tmp_path / "t", chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(TokenizerError):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("template, says", [
    ("{% for i in range(99999) %}{% for j in range(99999) %}x{% endfor %}{% endfor %}",  # froze a server
     r"its loops run past 1,000,000 iterations"),
    ("{% for i in range(10**9) %}{% endfor %}", r"its loops run past 1,000,000 iterations"),
    ("{{ 'x' * 100000000000 }}", r"it builds a sequence of 100,000,000,000 items \(at most 10,000,000\)"),
    ("{{ 2 ** 1000000 }}", r"it raises a number to the power 1000000"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", r"RecursionError"),
])
def test_a_template_that_would_run_for_ever_or_fill_memory_fails_its_render(tmp_path, template, says):
    """A crafted chat template fails its render at once, as a TokenizerError (the request's 400), instead of
    holding the server's event loop or allocating without bound; ordinary loops and repeats still render."""
    import time

    path = write_tokenizer(tmp_path / "t", chat_template=template)
    start = time.perf_counter()
    with pytest.raises(TokenizerError, match=says):
        Tokenizer.from_dir(path).apply_chat_template([{"role": "user", "content": "x"}])
    assert time.perf_counter() - start < 10
    fine = write_tokenizer(tmp_path / "u", chat_template="{% for i in range(3) %}{{ messages[0]['content'] * 2 }}"
                                                         "{% endfor %}{{ 2 ** 10 }}")
    assert Tokenizer.from_dir(fine).apply_chat_template([{"role": "user", "content": "ab"}]) == "abababababab1024"


def test_a_panic_in_the_tokenizer_backend_is_a_tokenizer_error(tok, monkeypatch):
    """tokenizers raises pyo3's PanicException, a BaseException, when a crafted pre-tokenizer pattern gives up
    (Onig's retry limit): a TokenizerError (the request's 400), not a traceback; other BaseExceptions pass."""
    class PanicException(BaseException):
        pass

    class Backend:
        def encode(self, text, add_special_tokens=True):
            raise PanicException("Onig: Regex search error: retry-limit-in-match over\nmore")

    monkeypatch.setattr(tok, "_backend", Backend())
    with pytest.raises(TokenizerError, match=r"the tokenizer failed on this text \(Onig: Regex search error: "
                                             r"retry-limit-in-match over\)"):
        tok.encode("a" * 40 + "b")
    monkeypatch.setattr(Backend, "encode", lambda self, text, add_special_tokens=True: (_ for _ in ()).throw(
        KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        tok.encode("x")


# --- incremental detokenization ---------------------------------------------------------------------
def stream(tok: Tokenizer, ids: list[int], prompt_ids: list[int] | None = None,
           skip_special_tokens: bool = True) -> tuple[list[str], str]:
    """Push ``ids`` one by one; returns the pieces from push() and what flush() returned."""
    detok = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    return pieces, detok.flush()


def test_multibyte_characters_split_over_tokens(tok):
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    # The test is only meaningful if some characters really span several tokens.
    assert sum("\ufffd" in tok.decode([i]) for i in ids) >= 5
    pieces, rest = stream(tok, ids)
    assert all("\ufffd" not in p for p in pieces)
    assert rest == ""  # the text ends with a complete character: nothing held back at the end
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE_TEXT
    assert sum(p != "" for p in pieces) > len(MULTIBYTE_TEXT) // 3  # streamed, not all at the end


def test_detokenizer_with_prompt_context_and_specials(tok):
    prompt = tok.encode("Grüße 🙂")
    generated = tok.encode(" aus 你好 ✨", add_special_tokens=False) + [tok.eos_token_ids[0]]
    detok = IncrementalDetokenizer(tok, prompt)
    pieces = [detok.push(i) for i in generated]
    assert "".join(pieces) + detok.flush() == tok.decode(generated) == " aus 你好 ✨"
    assert detok.token_ids == generated
    assert detok.text == " aus 你好 ✨"
    pieces, rest = stream(tok, generated, skip_special_tokens=False)
    assert "".join(pieces) + rest == " aus 你好 ✨<|eos|>"


def test_incomplete_character_is_held_until_flush(tok):
    ids = tok.encode("ok 🚀", add_special_tokens=False)
    cut = next(n for n in range(1, len(ids) + 1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tok)
    emitted = "".join(detok.push(i) for i in ids[:cut])
    # "ok" is out; the rest (the broken emoji, maybe with the space its token carries) is held back
    assert "\ufffd" not in emitted and emitted.startswith("ok") and tok.decode(ids[:cut]).startswith(emitted)
    assert detok.text == tok.decode(ids[:cut])  # pending text is visible, ending in U+FFFD
    assert emitted + detok.flush() == tok.decode(ids[:cut])  # flush gives what decode() gives


def _through_the_tokenizer(tok: Tokenizer) -> Tokenizer:
    """The same tokenizer with its byte table turned off: its streams decode through the tokenizer."""
    slow = Tokenizer(tok._backend, special_tokens=tok.special_tokens)
    slow._token_bytes = None
    return slow


@pytest.fixture(scope="module")
def added_tok(tok_dir) -> Tokenizer:
    """The byte-level tokenizer with added tokens that are not special: plain text (a space, CJK) and byte-level
    text (``Ġx``: a space and an x once decoded)."""
    backend = Backend.from_file(str(tok_dir / "tokenizer.json"))
    backend.add_tokens([" <tool call>", "你好吗", "Ġx"])
    return Tokenizer(backend)


def _byte_id(tok: Tokenizer, byte: int) -> int:
    """The id of the token of one byte (its byte-level character)."""
    from runtime.tokenizer import _byte_level_alphabet

    char = next(c for c, b in _byte_level_alphabet().items() if b == byte)
    return tok._backend.token_to_id(char)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_a_special_token_inside_a_character(tok, skip_special_tokens):
    """中 is E4 B8 AD: with a special token between its first byte and the rest, skipping it joins the character,
    keeping it leaves a replaced first byte, the special, then the rest replaced, as decode() has it."""
    ids = [_byte_id(tok, 0xE4), tok.eos_token_ids[0], _byte_id(tok, 0xB8), _byte_id(tok, 0xAD)]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
    pieces = [detok.push(i) for i in ids]
    expected = "中" if skip_special_tokens else "\ufffd<|eos|>\ufffd\ufffd"
    assert "".join(pieces) + detok.flush() == tok.decode(ids, skip_special_tokens=skip_special_tokens) == expected


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("which", ["specials", "added"])
def test_byte_level_streams_equal_decode_at_every_token(tok, added_tok, skip_special_tokens, which):
    """A byte-level tokenizer's streams run on its byte table (no tokenizer call per token): after every token the
    text equals decode() of the ids so far, and the pieces never split a character; the same streams through the
    tokenizer (the table off) emit the same text. Random ids: specials, the added tokens, ids past the vocabulary,
    characters cut anywhere (invalid UTF-8 included)."""
    import random

    tok = tok if which == "specials" else added_tok
    assert tok.token_bytes() is not None and len(tok.token_bytes()) == tok.vocab_size
    slow_tok = _through_the_tokenizer(tok)
    rng = random.Random(5)
    for trial in range(40):
        ids = [rng.randrange(tok.vocab_size + 3) for _ in range(rng.randrange(1, 40))]
        if trial % 4 == 0:  # real text, cut mid-character at the end
            ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)[:rng.randrange(1, 40)]
        fast = IncrementalDetokenizer(tok, skip_special_tokens=skip_special_tokens)
        slow = IncrementalDetokenizer(slow_tok, skip_special_tokens=skip_special_tokens)
        pieces = []
        for n, i in enumerate(ids, 1):
            pieces.append(fast.push(i))
            slow.push(i)
            assert fast.text == tok.decode(ids[:n], skip_special_tokens=skip_special_tokens), (ids[:n], trial)
        rest = fast.flush()
        whole = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert "".join(pieces) + rest == whole == "".join(slow._emitted) + slow.flush()
        assert fast.token_ids == ids
        # a piece ends on a character boundary: its text is the decode of whole tokens' bytes, with no replacement
        # character that the full text does not have at that place
        emitted = ""
        for p in pieces:
            emitted += p
            assert whole.startswith(emitted)


def test_byte_table_is_checked_against_the_tokenizer(tok_dir, monkeypatch):
    """An added token written as plain text (a space, CJK: not byte-level characters) takes its decoded text's
    bytes; a table that disagrees with the tokenizer's decode of an id alone, or of a special token inside a
    character with specials skipped, is not used, and streams then decode through the tokenizer; a tokenizer whose
    decoder is not byte-level has none."""
    import runtime.tokenizer as tokenizer_module

    backend = Backend.from_file(str(tok_dir / "tokenizer.json"))
    backend.add_tokens([" <tool call>", "你好吗"])
    added = Tokenizer(backend)
    table = added.token_bytes()
    assert table is not None
    for text in (" <tool call>", "你好吗"):
        ids = added.encode(f"x{text}y", add_special_tokens=False)
        assert table[backend.token_to_id(text)] == text.encode()
        detok = IncrementalDetokenizer(added)
        assert "".join(detok.push(i) for i in ids) + detok.flush() == added.decode(ids) == f"x{text}y"
    unskipped = Tokenizer(Backend.from_file(str(tok_dir / "tokenizer.json")))
    monkeypatch.setattr(unskipped, "special_token_ids", frozenset)  # as if no token were special: skip disagrees
    assert unskipped.token_bytes() is None
    wrong = {**tokenizer_module._byte_level_alphabet(), "!": ord("?")}
    monkeypatch.setattr(tokenizer_module, "_byte_level_alphabet", lambda: wrong)
    off = Tokenizer(Backend.from_file(str(tok_dir / "tokenizer.json")))
    assert off.token_bytes() is None
    ids = off.encode(MULTIBYTE_TEXT + "!", add_special_tokens=False)
    detok = IncrementalDetokenizer(off)
    assert "".join(detok.push(i) for i in ids) + detok.flush() == MULTIBYTE_TEXT + "!"
    assert sentencepiece_style().token_bytes() is None


def sentencepiece_style() -> Tokenizer:
    """A word-level tokenizer with Metaspace (``▁`` for space) pre-tokenizer and decoder, as SentencePiece
    models have: decoding drops the leading space of the first token of a text."""
    vocab = {"<unk>": 0, "<s>": 1, "▁Hello": 2, "▁world": 3, "▁again": 4, "!": 5}
    backend = Backend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return Tokenizer(backend, special_tokens={"bos_token": "<s>"})


def test_sentencepiece_leading_space_is_kept():
    tok = sentencepiece_style()
    assert tok.decode([3]) == "world"  # decoding one token alone loses its space
    assert tok.decode([2, 3, 4]) == "Hello world again"
    pieces, rest = stream(tok, [3, 4, 5], prompt_ids=[2])
    assert pieces == [" world", " again", "!"] and rest == ""
    pieces, rest = stream(tok, [2, 3, 4, 5])  # no prompt: equals decode() exactly
    assert "".join(pieces) + rest == tok.decode([2, 3, 4, 5]) == "Hello world again!"


@pytest.mark.skipif(not (PYSTDLIB / "tokenizer.json").is_file(), reason="bundled model not present")
def test_bundled_tokenizer_against_reference():
    from transformers import AutoTokenizer

    ours, ref = Tokenizer.from_dir(PYSTDLIB), AutoTokenizer.from_pretrained(str(PYSTDLIB))
    text = "import os\n\ndef main() -> None:\n    print('héllo ✨')\n"
    assert ours.encode(text) == ref.encode(text)
    ids = ours.encode(text, add_special_tokens=False)
    pieces, rest = stream(ours, ids)
    assert "".join(pieces) + rest == ours.decode(ids)
    if ours.chat_template is not None:
        msgs = [{"role": "user", "content": "Write hello world."}]
        assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False,
                                                                         add_generation_prompt=True)


# --- stop strings -----------------------------------------------------------------------------------
def test_stop_string_split_over_three_tokens():
    checker = StopChecker(["STOP"])
    text = ""
    results = []
    for piece in ["Hello ", "ST", "O", "P", " more"]:
        text += piece
        results.append(checker.check(text))
    assert results[0] == (None, 6)
    assert results[1] == (None, 6)  # "ST" could start "STOP": held back
    assert results[2] == (None, 6)  # "STO" too
    assert results[3] == (6, 6)  # complete: cut where it starts
    assert results[4] == (6, 6)


def test_partial_prefix_released_when_it_does_not_continue():
    checker = StopChecker(["STOP", "\n\n"])
    assert checker.check("a ST") == (None, 2)
    assert checker.check("a STX") == (None, 5)
    assert checker.check("a\n") == (None, 1)
    assert checker.check("S") == (None, 0)
    assert checker.check("") == (None, 0)


def test_earliest_stop_wins_and_longest_holdback():
    checker = StopChecker(["world", "lo w", ""])
    assert checker.check("hello world") == (3, 3)
    checker = StopChecker(["abcd", "bcX"])
    assert checker.check("xxabc") == (None, 2)  # "abc" (prefix of abcd) is longer than "bc"
    assert StopChecker([]).check("anything") == (None, 8)


def test_stop_checker_over_real_token_stream(tok):
    text = "print(i)\n### end\nmore"
    ids = tok.encode(text, add_special_tokens=False)
    checker, detok = StopChecker(["\n###"]), IncrementalDetokenizer(tok)
    out, emitted, cut = "", 0, None
    for i in ids:
        out += detok.push(i)
        cut, safe = checker.check(out)
        if cut is not None:
            break
        assert "\n#" not in out[emitted:safe] and out[:safe] == "print(i)"[:safe]
        emitted = max(emitted, safe)
    assert cut == len("print(i)") and out[:cut] == "print(i)"


def test_stop_checker_searches_only_new_text_and_agrees_with_a_fresh_one():
    """The checker searches from where a new match can start; over random appends (and a text that does not extend
    the last) it gives what a checker searching the whole text gives."""
    import random

    rng = random.Random(7)
    alphabet = "ab\nc"
    for trial in range(200):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        checker, text = StopChecker(stops), ""
        for _ in range(rng.randint(1, 30)):
            if rng.random() < 0.05:
                text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8)))  # not an extension
            else:
                text += "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 3)))
            got = checker.check(text)
            assert got == StopChecker(stops).check(text), (stops, text)
            if got[0] is not None:
                break
