"""Phase 1: text in, text out.

`Tokenizer` wraps a Hugging Face `tokenizer.json` (a byte-level BPE for Qwen3) through the
`tokenizers` library, renders the checkpoint's own chat template with jinja2 the way
`transformers` does, and knows which ids end a generation. `IncrementalDetokenizer`
turns a stream of generated ids into a stream of text pieces that never split a
UTF-8 character.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, ClassVar

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _read_json(file: Path, required: bool) -> dict[str, Any]:
    """Parse a JSON file, naming it in every error. A missing optional file reads as {}."""
    if not file.is_file():
        if required:
            raise FileNotFoundError(f"{file} not found: the tokenizer needs it")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        # A corrupt file, not a caller's type error: ValueError like the other cases.
        raise ValueError(  # noqa: TRY004
            f"{file} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_content(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, Mapping):
        return value.get("content")
    return value if isinstance(value, str) else None


# --8<-- [start:jinja_env]
class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (used by some templates to mark the
    assistant's tokens for training masks) renders its body unchanged."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's built-in tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template in the environment `transformers` renders them in.

    The sandbox stops a template (which comes with a downloaded checkpoint) from
    reaching Python internals or mutating its inputs; `trim_blocks` / `lstrip_blocks`
    drop the newline and indentation around `{% ... %}` tags so templates can be laid
    out readably.
    """
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
# --8<-- [end:jinja_env]


def _normalize_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A plain-dict copy of an OpenAI-style message the template can render.

    Content given as a list of parts (`[{"type": "text", "text": ...}, ...]`) is joined
    with newlines; `reasoning` is accepted as an alias of `reasoning_content`.
    """
    if not isinstance(message, Mapping) or "role" not in message:
        raise ValueError(f"a chat message must be a mapping with a 'role', got {message!r}")
    out = dict(message)
    content = out.get("content")
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, str):
                texts.append(part)
            elif isinstance(part, Mapping) and part.get("type", "text") == "text":
                texts.append(str(part.get("text", "")))
            else:
                kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
                raise ValueError(f"unsupported content part of type {kind!r}: only text is supported")
        out["content"] = "\n".join(texts)
    if out.get("reasoning_content") is None and isinstance(out.get("reasoning"), str):
        out["reasoning_content"] = out["reasoning"]
    return out


# --8<-- [start:no_template]
class NoChatTemplateError(ValueError):
    """A conversation was to be rendered, and the model has no chat template."""


def load_chat_template(value: str | Path) -> str:
    """A `--chat-template` argument as template text: the file it names, or the
    template itself when it is one (it holds a `{` or a newline), as vLLM reads it.

    Raises:
        ValueError: naming the argument when it looks like a path that cannot be read.
    """
    text = str(value)
    path = Path(text).expanduser()
    try:
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except OSError:  # a name too long to be a path: a template given inline
        pass
    if any(c in text for c in "{\n"):
        return text
    raise ValueError(f"chat_template: {text!r} is neither a readable file nor a template")
# --8<-- [end:no_template]


class Tokenizer:
    """A checkpoint's tokenizer (Qwen3's byte-level BPE, Llama 3's, GPT-2's, ...),
    read from a Hugging Face checkpoint directory.

    Attributes:
        path: the directory it was read from.
        chat_template: the jinja source of the chat template, or None.
        eos_token_ids: ids that end a generation: `generation_config.json`'s
            `eos_token_id` (int or list) followed by the tokenizer's eos token.
        bos_token_id, pad_token_id, eos_token_id: the tokenizer's tokens (None if unset;
            Qwen3 has no BOS token).
    """

    def __init__(self, backend: HFTokenizer, tokenizer_config: Mapping[str, Any],
                 generation_config: Mapping[str, Any], chat_template: str | None,
                 path: Path | None = None) -> None:
        self._tok = backend
        self.path = path
        self.chat_template = chat_template
        self._template = compile_chat_template(chat_template) if chat_template else None
        self._special_tokens = {
            name: _token_content(tokenizer_config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        self.bos_token_id = self._id_of(self._special_tokens["bos_token"])
        self.eos_token_id = self._id_of(self._special_tokens["eos_token"])
        self.pad_token_id = self._id_of(self._special_tokens["pad_token"])
        if self.pad_token_id is None:
            self.pad_token_id = generation_config.get("pad_token_id")
        eos = generation_config.get("eos_token_id")
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        if self.eos_token_id is not None:
            ids.append(self.eos_token_id)
        self.eos_token_ids: list[int] = list(dict.fromkeys(ids))  # union, order kept
        self.model_max_length: int | None = tokenizer_config.get("model_max_length")

    # --8<-- [start:from_pretrained]
    @classmethod
    def from_pretrained(cls, path: str | Path, chat_template: str | None = None) -> Tokenizer:
        """Read `tokenizer.json`, `tokenizer_config.json` and `generation_config.json`.

        The chat template is `chat_template` when given (the text of a template:
        `--chat-template`, see `load_chat_template`); else `chat_template.jinja`
        when the directory has one (newer `transformers` saves it there), else
        `tokenizer_config.json`'s, else there is none (GPT-2).

        Raises:
            FileNotFoundError: when the directory or its `tokenizer.json` is missing.
            ValueError: naming the file when one is corrupt.
        """
        path = Path(path).expanduser()
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer directory {path} not found")
        file = path / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: the checkpoint has no tokenizer")
        try:
            backend = HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 (the Rust parser raises a bare Exception)
            raise ValueError(f"{file} is not a valid tokenizer file: {e}") from None
        config = _read_json(path / "tokenizer_config.json", required=False)
        generation = _read_json(path / "generation_config.json", required=False)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text(encoding="utf-8")
        if chat_template is not None:
            template = chat_template
        return cls(backend, config, generation, template, path)
    # --8<-- [end:from_pretrained]

    @property
    def backend(self) -> HFTokenizer:
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Number of tokens, added tokens included (the model's embedding may be larger)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def special_token_ids(self) -> set[int]:
        """Ids of the added tokens marked special (dropped by `skip_special_tokens`)."""
        return {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string (e.g. `"<|im_end|>"`), or None if it is not in the vocab."""
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry of an id (in byte-level form: a space shows as `Ġ`),
        or None for ids outside the tokenizer."""
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids of `text`. Special-token strings in the text (`<|im_start|>`) map to
        their ids. `add_special_tokens` applies the tokenizer's post-processor: Llama 3
        and Mistral prepend their BOS; Qwen3 and GPT-2 add nothing."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False
                     ) -> list[list[int]]:
        """`encode` for many texts at once (parallel in the Rust library)."""
        return [e.ids for e in self._tok.encode_batch(list(texts),
                                                      add_special_tokens=add_special_tokens)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`. Ids outside the tokenizer are dropped; bytes that are not valid
        UTF-8 (a character cut off at the end) become U+FFFD."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --8<-- [start:apply_chat_template]
    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                            add_generation_prompt: bool = False, tokenize: bool = False,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            **template_kwargs: Any) -> str | list[int]:
        """Render a conversation with the checkpoint's chat template.

        Args:
            messages: OpenAI-style messages (`role`, `content` as a string or a list of
                text parts, optional `reasoning_content` / `tool_calls`).
            add_generation_prompt: end with the opening of an assistant turn.
            tokenize: return token ids instead of text.
            tools: JSON schemas of callable tools, if any.
            **template_kwargs: extra template variables, e.g. `enable_thinking=False`.

        Raises:
            NoChatTemplateError: when the checkpoint has no chat template and none was given.
            ValueError: when a message is malformed or the template rejects the conversation.
        """
        if self._template is None:
            raise NoChatTemplateError(
                f"the model's tokenizer ({self.path}) has no chat template: give one with "
                "--chat-template FILE (chat_template= in LLM), or send a completion instead")
        context = {
            **{k: v for k, v in self._special_tokens.items() if v is not None},
            **template_kwargs,
            "messages": [_normalize_message(m) for m in messages],
            "tools": list(tools) if tools is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            text = self._template.render(**context)
        except jinja2.exceptions.TemplateError as e:
            raise ValueError(f"chat template: {e}") from None
        return self.encode(text) if tokenize else text
    # --8<-- [end:apply_chat_template]


# --8<-- [start:incremental]
class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text pieces for streaming.

    A byte-level BPE token is a run of *bytes*, and a UTF-8 character may be split over
    several tokens. Each `add_token` returns only text that is final: a character whose
    bytes have not all arrived is held back (`""` is returned) until they have. So no
    piece holds a broken character, and the pieces join to `decode(output_ids)`; call
    `flush()` when the sequence ends to release bytes that never formed a character
    (they decode to U+FFFD, as in the full decode).

    The work is done by `tokenizers.decoders.DecodeStream`, which decodes a short window
    of recent ids and emits the difference from the previous window. A byte-level
    decode does not depend on the text to the left, so the prompt is not needed as
    context (prefilling it would even make the output depend on a prompt that ends
    mid-character).

    Args:
        tokenizer: the model's tokenizer.
        prompt_token_ids: the request's prompt (kept for reference; see above).
        skip_special_tokens: drop special tokens (`<|im_end|>` ...) from the text.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.output_token_ids: list[int] = []
        self._pieces: list[str] = []  # every piece returned so far (joined when asked)
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._backend = tokenizer.backend

    @property
    def text(self) -> str:
        """Every piece returned so far, joined."""
        return "".join(self._pieces)

    def add_token(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" if none yet).

        Ids outside the tokenizer (the embedding can be larger) add no text.
        """
        self.output_token_ids.append(token_id)
        piece = self._stream.step(self._backend, token_id)
        if piece is None:  # an unfinished character, or no text
            return ""
        self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """Text still held back at the end of the sequence (an unfinished character,
        rendered as U+FFFD); after it, `text == decode(output_token_ids)`."""
        full = self.tokenizer.decode(self.output_token_ids, self.skip_special_tokens)
        text = self.text
        rest = full[len(text):] if full.startswith(text) else ""
        self._pieces.append(rest)
        return rest
# --8<-- [end:incremental]

    # --8<-- [start:final_text]
    def final_text(self, token_ids: Sequence[int], drop_last: bool = False,
                   flush: bool = True) -> str:
        """What `add_token` for each of `token_ids`, then `flush()`, would have given,
        joined, from full decodes (usually one) instead of a decode step per token.

        `add_token` releases text whenever the decode of the ids so far does not end
        in U+FFFD (an unfinished character), so its pieces join to the decode of the
        longest such prefix of the ids, and `flush` adds the rest of the full decode.

        Args:
            token_ids: the generated ids, in order (this detokenizer's state is not
                used or changed: it is a replay).
            drop_last: the last id's piece is left out (a stop token whose text is
                not shown); what is still held back after it is flushed all the same.
            flush: release the held-back bytes at the end (False: an aborted or
                failed request, whose held-back bytes never appear).
        """
        full = self.tokenizer.decode(token_ids, self.skip_special_tokens)
        if full.endswith("\ufffd"):  # the last id released nothing: there is nothing to drop
            return full if flush else self._released(token_ids[:-1])
        # The last id released everything: nothing is held back.
        return self._released(token_ids[:-1]) if drop_last else full

    def _released(self, token_ids: Sequence[int]) -> str:
        """The pieces `add_token` returns for `token_ids`, joined (nothing flushed)."""
        for end in range(len(token_ids), 0, -1):
            text = self.tokenizer.decode(token_ids[:end], self.skip_special_tokens)
            if not text.endswith("\ufffd"):
                return text
        return ""
    # --8<-- [end:final_text]


__all__ = ["IncrementalDetokenizer", "NoChatTemplateError", "Tokenizer", "compile_chat_template",
           "load_chat_template"]
