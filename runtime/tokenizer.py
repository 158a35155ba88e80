"""Text <-> token ids for the runtime: encoding, decoding, chat templates and streaming detokenization.

Built directly on the ``tokenizers`` library and ``jinja2`` so a production install needs nothing else.
The files read are the ones a checkpoint ships with:

    tokenizer.json           required: the vocabulary, normalizer, pre-tokenizer, post-processor, decoder
    tokenizer_config.json    optional: special tokens, chat_template, add_bos_token
    special_tokens_map.json  optional: special tokens, when tokenizer_config.json does not name them
    chat_template.jinja      optional: the chat template; takes priority over tokenizer_config.json's
    generation_config.json   optional: eos_token_id (int or list), extra ids that end generation

From an artifact, only the files its manifest lists are read (``from_dir(..., files=...)``); any other
file in the directory is ignored, as if absent.

The chat template is compiled when the tokenizer is loaded: one that does not compile (a Jinja syntax error, an
unknown filter) stops the load with a TokenizerError naming its file and the Jinja error's line, instead of failing
every chat request later. A build refuses such a checkpoint the same way; to serve plain completions only, remove
the template (chat_template.jinja, or tokenizer_config.json's chat_template) and rebuild.
"""

from __future__ import annotations

import codecs
import json
import logging
import re
import threading
from datetime import datetime
from collections.abc import Collection
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _Backend
from tokenizers import decoders as _decoders

log = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
GENERATION_CONFIG_FILE = "generation_config.json"

# Named special tokens a chat template may refer to (``{{ bos_token }}`` and so on).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")

REPLACEMENT_CHAR = "\ufffd"  # what decoding yields for an incomplete UTF-8 sequence
# Prompt tokens decoded in front of the first generated tokens, so that a leading space the decoder
# strips at the start of a text (SentencePiece-style) is kept when it continues the prompt.
DETOK_CONTEXT_TOKENS = 5


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's): the character each byte is written as in the vocabulary -> the byte.
    Printable Latin-1 bytes stand for themselves; the other 68 (controls, space, 0x7f-0xa0, 0xad) take the
    characters from U+0100 on, in byte order."""
    own = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in own]
    return {**{chr(b): b for b in own}, **{chr(0x100 + i): b for i, b in enumerate(others)}}


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded, or input it cannot handle (bad chat messages, no chat template)."""


# --- loading helpers ------------------------------------------------------------------------------
def _read_json(path: Path | None) -> dict[str, Any] | None:
    """Read an optional JSON object file; None when absent, TokenizerError naming the file when corrupt."""
    if path is None:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:  # UnicodeDecodeError, JSONDecodeError, 5,000-digit ints
        raise TokenizerError(f"{path}: cannot read it as JSON ({type(e).__name__}: {str(e)[:200]})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as written in config files: a plain string or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_chat_template(value: Any) -> str | None:
    """tokenizer_config's chat_template: a string, or a list of {name, template} of which we use "default"."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        template = named.get("default")
        return template if isinstance(template, str) else None
    return None


def _eos_ids_from_generation_config(path: Path | None, vocab_size: int, vocab_of: str) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list of ints); [] when absent. A token id must fall in
    0..vocab_size - 1 (``vocab_of`` says whose vocabulary): an id past it is never sampled, so generation would never
    stop at it (and grammar masks index by it). Refused when none does; in a list where others do, such ids are left
    out with a warning."""
    config = _read_json(path)
    if not config or config.get("eos_token_id") is None:
        return []
    value = config["eos_token_id"]
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise TokenizerError(f"{path}: eos_token_id must be a token id (an int) or a list of them, got {shown}")
    outside = [(j, token_id) for j, token_id in enumerate(ids) if not 0 <= token_id < vocab_size]
    if outside and len(outside) == len(ids):  # no stop the model can sample: refused
        j, token_id = outside[0]
        key = f"eos_token_id[{j}]" if isinstance(value, list) else "eos_token_id"
        raise TokenizerError(f"{path}: {key} is {token_id}; allowed: token ids 0..{vocab_size - 1} ({vocab_of})")
    if outside:  # a list with others the model can sample: those stop generation, these never could
        log.warning("%s: eos_token_id %s outside token ids 0..%d (%s) left out; the others stop generation", path,
                    ", ".join(f"[{j}] = {token_id}" for j, token_id in outside), vocab_size - 1, vocab_of)
    return [token_id for token_id in ids if 0 <= token_id < vocab_size]


# --- chat template environment ----------------------------------------------------------------------
class _GenerationTag(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` (used by templates to mark assistant text) and
    renders its body unchanged, so such templates compile here too."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace()`` for templates, refusing underscore-prefixed names so templates cannot reach internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja2's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates may not set {name!r} on a namespace")


def _raise_exception(message: str) -> None:
    """Templates call ``raise_exception(msg)`` to reject conversations they cannot format."""
    raise TokenizerError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    """Templates call ``strftime_now(fmt)`` to put today's date in a system prompt."""
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """JSON without HTML escaping (jinja2's own ``tojson`` escapes ``<``, ``>``, ``&``, ``'``)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# What one render of an (untrusted) chat template may spend: iterations of range() loops, over all its loops
# (nested ones multiply), and characters or items a * or ** may build. A template that loops 99,999 x 99,999 times
# froze the server; 'x' * 10**11 asked for 100 GB.
TEMPLATE_MAX_ITERATIONS = 1_000_000
TEMPLATE_MAX_SIZE = 10_000_000
_render_budget = threading.local()


class _TemplateBudgetError(Exception):
    """A render ran past TEMPLATE_MAX_ITERATIONS or TEMPLATE_MAX_SIZE."""


def _budget_range(*args: Any) -> Any:
    """range() for templates, each of its items taken from the render's iteration budget."""
    items = range(*args)
    if len(items) > getattr(_render_budget, "left", TEMPLATE_MAX_ITERATIONS):
        raise _TemplateBudgetError(f"its loops run past {TEMPLATE_MAX_ITERATIONS:,} iterations")
    _render_budget.left = getattr(_render_budget, "left", TEMPLATE_MAX_ITERATIONS) - len(items)
    return items


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox with a bounded range() and bounded * / ** results (see TEMPLATE_MAX_ITERATIONS)."""

    intercepted_binops = frozenset({"*", "**"})

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "**":
            if isinstance(right, (int, float)) and abs(right) > 64:
                raise _TemplateBudgetError(f"it raises a number to the power {right}")
        elif isinstance(left, (str, list, tuple)) or isinstance(right, (str, list, tuple)):
            seq, times = (left, right) if isinstance(left, (str, list, tuple)) else (right, left)
            if isinstance(times, int) and len(seq) * times > TEMPLATE_MAX_SIZE:
                raise _TemplateBudgetError(f"it builds a sequence of {len(seq) * times:,} items "
                                           f"(at most {TEMPLATE_MAX_SIZE:,})")
        return super().call_binop(context, operator, left, right)


def _compile_chat_template(source: str, origin: str = "the chat template") -> jinja2.Template:
    """Compile an (untrusted) chat template in a sandbox with the globals and filters templates expect; a template
    that does not compile raises TokenizerError naming ``origin`` (the file it came from) and the Jinja error's line."""
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                          extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.globals["range"] = _budget_range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:  # also TemplateAssertionError: an unknown filter or test
        raise TokenizerError(f"{origin}: the chat template does not compile (Jinja error at line {e.lineno}: "
                             f"{e.message}); fix the template, or remove it to serve plain completions only") from None
    except jinja2.TemplateError as e:
        raise TokenizerError(f"{origin}: the chat template does not compile ({e}); fix the template, or remove it "
                             f"to serve plain completions only") from None
    except (RecursionError, MemoryError) as e:  # brackets or blocks nested past the parser's recursion limit
        raise TokenizerError(f"{origin}: the chat template does not compile ({type(e).__name__}: its expressions "
                             f"or blocks are nested too deeply); fix the template, or remove it to serve plain "
                             f"completions only") from None


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    """Messages must be a list of dicts with str ``role`` and ``content``; returns copies without None values
    (templates test ``'key' in message`` rather than for None)."""
    if not isinstance(messages, (list, tuple)):
        raise TokenizerError(f"messages must be a list of dicts, got {type(messages).__name__}")
    clean = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise TokenizerError(f"messages[{i}] must be a dict with 'role' and 'content', "
                                 f"got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise TokenizerError(f"messages[{i}] needs a string {key!r}, got {message.get(key)!r}")
        clean.append({k: v for k, v in message.items() if v is not None})
    return clean


# --- the tokenizer ----------------------------------------------------------------------------------
class Tokenizer:
    """A checkpoint's tokenizer: encode/decode through ``tokenizers``, chat templates through ``jinja2``."""

    def __init__(self, backend: _Backend, *, special_tokens: dict[str, str] | None = None,
                 chat_template: str | None = None, add_bos_token: bool = False,
                 extra_eos_token_ids: list[int] | None = None) -> None:
        self._backend = backend
        self.special_tokens = dict(special_tokens or {})  # e.g. {"bos_token": "<s>", "eos_token": "</s>"}
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self.bos_token: str | None = self.special_tokens.get("bos_token")
        self.eos_token: str | None = self.special_tokens.get("eos_token")
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.bos_token_id: int | None = self._id_of(self.bos_token)
        self.pad_token_id: int | None = self._id_of(self.special_tokens.get("pad_token"))
        eos = [self._id_of(self.eos_token)] + list(extra_eos_token_ids or [])
        self.eos_token_ids: list[int] = list(dict.fromkeys(i for i in eos if i is not None))
        self._template: jinja2.Template | None = None
        # (each id's bytes, each id's text where its bytes are whole characters) or None; False: not built yet
        self._token_bytes: tuple[list[bytes], list[str | None]] | None | bool = False
        self._special_ids: frozenset[int] | None = None
        self._table_lock = threading.Lock()

    @classmethod
    def from_dir(cls, path: str | Path, files: Collection[str] | None = None,
                 vocab_size: int | None = None) -> "Tokenizer":
        """Load the tokenizer files of a directory; see the module docstring. ``files``: the names in it that
        may be read (an artifact's listed files), others count as absent; None: any (a checkpoint). ``vocab_size``:
        the model's vocabulary (its logits' width), which every EOS id must fall in (None: the tokenizer's own,
        added tokens included)."""
        path = Path(path)

        def find(name: str) -> Path | None:
            file = path / name
            return file if (files is None or name in files) and file.is_file() else None

        if (tokenizer_file := find(TOKENIZER_FILE)) is None:
            listed = "" if files is None else " listed in the artifact's manifest"
            raise TokenizerError(f"{path / TOKENIZER_FILE}: no such file{listed}; a tokenizer directory needs "
                                 f"{TOKENIZER_FILE}")
        backend = cls._load_backend(tokenizer_file)
        vocab_of = "the model's vocab_size" if vocab_size is not None else "the tokenizer's vocabulary"
        if vocab_size is None:  # one past the largest id (ids may have gaps: the count can be smaller)
            vocab_size = max(backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        config = _read_json(find(CONFIG_FILE)) or {}
        special_map = _read_json(find(SPECIAL_TOKENS_MAP_FILE)) or {}
        special = {}
        for name in SPECIAL_TOKEN_NAMES:
            token = _token_content(config.get(name)) or _token_content(special_map.get(name))
            if token is not None:
                special[name] = token
        if (template_file := find(CHAT_TEMPLATE_FILE)) is not None:
            try:
                chat_template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as e:
                raise TokenizerError(f"{template_file}: cannot read the chat template ({e})") from None
            origin = str(template_file)
        else:
            chat_template = _pick_chat_template(config.get("chat_template"))
            origin = f"{path / CONFIG_FILE} (its chat_template)"
        extra_eos = _eos_ids_from_generation_config(find(GENERATION_CONFIG_FILE), vocab_size, vocab_of)
        tokenizer = cls(backend, special_tokens=special, chat_template=chat_template,
                        add_bos_token=config.get("add_bos_token") is True, extra_eos_token_ids=extra_eos)
        eos = tokenizer._id_of(tokenizer.eos_token)
        if eos is not None and not 0 <= eos < vocab_size:  # a tokenizer larger than the model's embedding
            where = CONFIG_FILE if _token_content(config.get("eos_token")) is not None else SPECIAL_TOKENS_MAP_FILE
            raise TokenizerError(f"{path / where}: eos_token {tokenizer.eos_token!r} is token id {eos}; allowed: "
                                 f"token ids 0..{vocab_size - 1} ({vocab_of})")
        if chat_template is not None:  # compiled now: a template that does not compile stops the load, not a request
            tokenizer._template = _compile_chat_template(chat_template, origin)
        return tokenizer

    @staticmethod
    def _load_backend(file: Path) -> _Backend:
        try:
            return _Backend.from_file(str(file))
        except Exception as e:  # the tokenizers library raises a bare Exception on bad files
            raise TokenizerError(f"{file}: not a valid tokenizer file ({e})") from e

    def _id_of(self, token: str | None) -> int | None:
        """The id of a special token string; None when unset or not in the vocabulary."""
        return None if token is None else self._backend.token_to_id(token)

    # --- ids ------------------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. With special tokens, the post-processor adds them (BOS for most models);
        if the config asks for BOS and the post-processor did not add it, it is prepended here."""
        try:
            ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        except TypeError:  # the backend takes str only, and only valid Unicode
            if not isinstance(text, str):
                raise TokenizerError(f"the text to encode must be a str, got {type(text).__name__}") from None
            at = next((i for i, c in enumerate(text) if "\ud800" <= c <= "\udfff"), None)
            if at is None:
                raise
            raise TokenizerError(f"the text is not valid Unicode: a lone surrogate at character {at} (input bytes "
                                 f"that are not UTF-8?)") from None
        except BaseException as e:  # tokenizers' Rust panics are BaseExceptions (pyo3's PanicException)
            if type(e).__name__ != "PanicException":
                raise
            raise TokenizerError(f"the tokenizer failed on this text ({str(e).splitlines()[0][:200]}); its "
                                 f"pre-tokenizer's pattern gave up on it") from None
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens (BOS, EOS, chat markers) are left out unless asked for."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self) -> list[bytes] | None:
        """For a byte-level BPE tokenizer (decoder ByteLevel, as GPT-2's, Llama 3's, Qwen's), each id's bytes: the
        text of any ids is then their bytes joined and decoded as UTF-8 (invalid sequences replaced), as
        ``decode(ids, skip_special_tokens=False)`` gives it. Built once (the engine does it when it loads: ~0.6 s at
        a 150k vocabulary) and checked against the tokenizer's own decode: every id alone, and each added token
        between the halves of a character split over tokens, with specials skipped and not. None for other
        decoders, or when any check disagrees (logged; ``IncrementalDetokenizer`` then decodes through the
        tokenizer)."""
        if self._token_bytes is False:
            with self._table_lock:
                if self._token_bytes is False:
                    self._token_bytes = self._build_token_bytes()
        return None if self._token_bytes is None else self._token_bytes[0]

    def token_texts(self) -> list[str | None] | None:
        """With ``token_bytes``: each id's text where its bytes are whole UTF-8 characters (most ids), else None."""
        return None if self.token_bytes() is None else self._token_bytes[1]

    def _build_token_bytes(self) -> tuple[list[bytes], list[str | None]] | None:
        if not isinstance(self._backend.decoder, _decoders.ByteLevel):
            return None
        alphabet = _byte_level_alphabet()
        ids = range(self.vocab_size)
        decoded = self._backend.decode_batch([[i] for i in ids], skip_special_tokens=False)
        table, texts = [], []
        for i, text in zip(ids, decoded):
            token = self._backend.id_to_token(i)
            if token is None:  # a hole in the ids: decodes to nothing
                raw = b""
            elif all(c in alphabet for c in token):
                raw = bytes(alphabet[c] for c in token)
            else:  # an added token written as plain text (it is not byte-level encoded)
                raw = text.encode("utf-8")
            if raw.decode("utf-8", errors="replace") != text:
                log.info("tokenizer: id %d decodes to %r, not to its bytes %r: streams decode through the tokenizer",
                         i, text, raw)
                return None
            table.append(raw)
            try:
                texts.append(raw.decode("utf-8"))
            except UnicodeDecodeError:  # part of a character: through the incremental decoder
                texts.append(None)
        # an added token between the bytes of one character: its decode joins the bytes around it (or not) as the
        # table does, skipped (a special) and not
        lead = next((i for i in ids if len(table[i]) == 1 and 0xE0 <= table[i][0] < 0xF0), None)
        cont = next((i for i in ids if len(table[i]) == 1 and 0x80 <= table[i][0] < 0xC0), None)
        added = sorted(self._backend.get_added_tokens_decoder())
        if lead is not None and cont is not None and added:
            special = self.special_token_ids()
            for skip in (True, False):
                seqs = [[lead, a, cont, cont] for a in added]
                for seq, text in zip(seqs, self._backend.decode_batch(seqs, skip_special_tokens=skip)):
                    raw = b"".join(table[i] for i in seq if not (skip and i in special))
                    if raw.decode("utf-8", errors="replace") != text:
                        log.info("tokenizer: ids %s decode to %r, not to their bytes %r: streams decode through the "
                                 "tokenizer", seq, text, raw)
                        return None
        return table, texts

    def special_token_ids(self) -> frozenset[int]:
        """The ids ``decode(..., skip_special_tokens=True)`` leaves out: the added tokens marked special."""
        if self._special_ids is None:
            self._special_ids = frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)
        return self._special_ids

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of one id (the raw token, e.g. ``Ġworld``), for debugging and reports."""
        return self._backend.id_to_token(token_id)

    def to_json(self) -> str:
        """The whole tokenizer as tokenizer.json text (what structured output's grammar engine reads the
        vocabulary from)."""
        return self._backend.to_str()

    # --- chat -----------------------------------------------------------------------------------------
    def chat_template_uses(self, name: str) -> bool:
        """Whether the chat template refers to the variable or key ``name`` (e.g. ``tools``, ``tool_calls``): a
        template that does not mention tools cannot render them."""
        return self.chat_template is not None and re.search(rf"\b{re.escape(name)}\b", self.chat_template) is not None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **extra: Any) -> str:
        """Render ``messages`` with the checkpoint's chat template into the prompt text the model was tuned on.

        ``extra`` is passed to the template as variables (e.g. ``tools=[...]``) and overrides the defaults.
        The result already holds the template's special tokens, so encode it with ``add_special_tokens=False``.
        """
        if self.chat_template is None:
            raise TokenizerError("this checkpoint has no chat template (neither tokenizer_config.json's "
                                 "chat_template nor chat_template.jinja); send a plain prompt instead")
        clean = _validate_messages(messages)
        if self._template is None:
            self._template = _compile_chat_template(self.chat_template)
        variables = {**self.special_tokens, "tools": None, "documents": None, **extra,
                     "messages": clean, "add_generation_prompt": add_generation_prompt}
        _render_budget.left = TEMPLATE_MAX_ITERATIONS
        try:
            text = self._template.render(**variables)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template failed to render: {e}") from e
        except _TemplateBudgetError as e:
            raise TokenizerError(f"the chat template failed to render: {e}; the artifact's template is not one "
                                 f"a model ships (rebuild from the checkpoint's own)") from None
        except (RecursionError, OverflowError, MemoryError, ValueError) as e:  # a macro that calls itself, ...
            raise TokenizerError(f"the chat template failed to render ({type(e).__name__}: {str(e)[:200]})") from None
        if len(text) > TEMPLATE_MAX_SIZE:
            raise TokenizerError(f"the chat template rendered {len(text):,} characters (at most "
                                 f"{TEMPLATE_MAX_SIZE:,})")
        return text


# --- streaming ----------------------------------------------------------------------------------------
class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces; never emits a broken UTF-8 character, and the
    concatenation of all pieces equals ``tokenizer.decode(all generated ids)``.

    Decoding ids one at a time is wrong in two ways: byte-level BPE splits one character over several
    tokens (each alone decodes to U+FFFD), and SentencePiece-style decoders drop the leading space of
    the first token of a text. So we keep two offsets into the ids: ``prefix`` (start of a window of
    already-emitted tokens decoded for context) and ``read`` (end of what was emitted). Each push
    decodes ``ids[prefix:read]`` and ``ids[prefix:]`` and emits the difference, holding it back while it
    ends with U+FFFD (a character still incomplete).

    With ``prompt_ids``, the last few prompt tokens are the first context window, so a leading space
    of the first generated token is kept: it separates the continuation from the prompt. (That is the
    one place where the pieces can differ from ``decode(generated)``, which strips it.)

    A byte-level BPE tokenizer (``Tokenizer.token_bytes``) strips nothing and decodes each token to fixed bytes, so
    its stream is the tokens' bytes through an incremental UTF-8 decoder: no call into the tokenizer per token (two
    before), which at hundreds of sequences a step was most of the engine's host time per token. Invalid bytes come
    out as U+FFFD as ``decode`` writes them; an incomplete character waits for its next bytes, or ``flush``.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._table = tokenizer.token_bytes()
        if self._table is not None:  # byte level: no context needed, nothing is stripped
            self._texts = tokenizer.token_texts()
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
            self._skip = tokenizer.special_token_ids() if skip_special_tokens else frozenset()
            self._ids = []
            self._num_context = 0
            self._emitted = []
            return
        context = list(prompt_ids or [])[-DETOK_CONTEXT_TOKENS:]
        if self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []  # the prompt ends mid-character: its text is no clean prefix to diff against
        self._ids: list[int] = context  # context tokens, then generated ones
        self._num_context = len(context)
        self._prefix = 0  # start of the decode window
        self._read = len(context)  # ids[:read] are emitted
        self._prefix_len: int | None = None  # len(decode(ids[prefix:read])), cached until the window moves
        self._emitted: list[str] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens) if ids else ""

    def _pending(self) -> str:
        """Text of the not yet emitted ids, decoded in the context of the last emitted window."""
        if self._prefix_len is None:  # the window's text changes only when it moves (``_advance``)
            self._prefix_len = len(self._decode(self._ids[self._prefix:self._read]))
        return self._decode(self._ids[self._prefix:])[self._prefix_len:]

    def _advance(self, piece: str) -> str:
        self._emitted.append(piece)
        self._prefix, self._read = self._read, len(self._ids)
        self._prefix_len = None
        return piece

    @property
    def token_ids(self) -> list[int]:
        """The generated ids pushed so far (not the prompt)."""
        return self._ids[self._num_context:]

    @property
    def text(self) -> str:
        """All text emitted so far plus what is pending (which may end in an incomplete character)."""
        if self._table is not None:
            return "".join(self._emitted) + self._utf8.getstate()[0].decode("utf-8", errors="replace")
        return "".join(self._emitted) + self._pending()

    def push(self, token_id: int) -> str:
        """Add one generated id; returns the text it made stable (often "", e.g. mid-character)."""
        token_id = int(token_id)
        self._ids.append(token_id)
        if self._table is not None:
            if token_id in self._skip or not 0 <= token_id < len(self._table):
                return ""
            piece = self._texts[token_id]  # whole characters after whole characters: the token's own text
            if piece is None or self._utf8.buffer:
                piece = self._utf8.decode(self._table[token_id])
            if piece:
                self._emitted.append(piece)
            return piece
        piece = self._pending()
        if not piece or piece.endswith(REPLACEMENT_CHAR):
            return ""
        return self._advance(piece)

    def flush(self) -> str:
        """The held-back remainder at the end of generation (as decode() would render it)."""
        if self._table is not None:
            piece = self._utf8.decode(b"", final=True)
            if piece:
                self._emitted.append(piece)
            return piece
        piece = self._pending()
        return self._advance(piece) if piece else ""


class StopChecker:
    """Finds stop strings in generated text across token boundaries.

    The caller appends each new piece of text and asks ``check``; text that might be the start of a stop
    string is not yet safe to show, since the next token may complete the stop string. Each call searches only
    where a match not seen before can start (the new text and the stop strings' longest length less one before
    it), so a request's checks cost the length of its text in all, not its square."""

    def __init__(self, stop: list[str]) -> None:
        self.stop = [s for s in dict.fromkeys(stop) if s]  # empty strings would match everywhere
        self._reach = max((len(s) for s in self.stop), default=1) - 1  # a match reaches this far before new text
        self._searched = ""  # the text the last call searched without a match

    def check(self, text: str) -> tuple[int | None, int]:
        """Returns (where the earliest stop string starts in ``text`` or None, how many leading characters
        of ``text`` are safe to emit). Without a match, the safe count is ``len(text)`` minus the longest
        suffix of ``text`` that is a proper prefix of some stop string; with one, it is the match index.
        ``text``: all the text so far; one that does not extend the last one searched is searched from its start
        (a prefix comparison, far cheaper than the search)."""
        if not self.stop:
            return None, len(text)
        start = max(0, len(self._searched) - self._reach) if text.startswith(self._searched) else 0
        hits = [i for i in (text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            cut = min(hits)
            return cut, cut
        self._searched = text
        return None, len(text) - self._held_back(text)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), longest, -1):
                if text.endswith(s[:k]):
                    longest = k
                    break
        return longest
