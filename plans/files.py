"""Reading the files a user hands autopar (hints, plans, presets, model files) with limits.

A loader is handed whatever the user typed: a pickle renamed ``.json``, 50 MB of logs, a
YAML "billion laughs", 100,000 nested brackets. Each of those must end in one message that
names the file and says what to change, quickly, never a traceback or a hang. So every file
is read the same way:

1. ``read_bytes``: the path exists, is a regular file (a pipe would block) and is readable;
   its size is checked against the kind's cap *before* it is read;
2. ``decode_text``: strict UTF-8, naming the offset of the first bad byte (and what the file
   looks like, when its first bytes say: a pickle, a zip archive, ...);
3. ``parse_json`` / ``parse_yaml``: nesting depth, the number of values (for YAML, counted as
   if every alias were written out, and checked while composing, before memory grows) and
   the digits of an integer (Python refuses over 4,300) are limited.

Each failure is the kind's ``AutoparError`` subclass, so the CLI exits with its usage code.

>>> parse_yaml("a: [1, 2]", "h.yaml", HINT_FILE)
{'a': [1, 2]}
>>> parse_yaml("a: &x [1, *x]", "h.yaml", HINT_FILE)
Traceback (most recent call last):
...
autopar_plans.errors.HintError: h.yaml:1: alias *x sits inside the value it names...
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from autopar_plans.errors import AutoparError, HintError, PlanFileError, PresetError, UsageError

MiB = 2**20


@dataclass(frozen=True, kw_only=True, slots=True)
class FileKind:
    """One kind of file a loader reads: its limits, its error and the words of its messages."""

    what: str
    """Its name in messages: ``"hint file"``."""
    error: type[AutoparError]
    """Raised for every problem, so the CLI maps it to one exit code."""
    expected: str
    """What such a file is, for the advice that ends a message."""
    max_bytes: int
    """The largest file read: checked before reading, so a huge file is refused at once."""
    max_depth: int = 32
    """The deepest nesting of lists and mappings."""
    max_values: int = 100_000
    """The most values (scalars, lists, mappings), YAML aliases counted as written out."""
    max_digits: int = 100
    """The longest integer; Python refuses to convert more than 4,300 digits."""


# PyYAML in Python reads about 0.6 MB/s: hint and preset files (a few kB in practice) are
# capped at 1 MiB so that the worst of them is refused or read within two seconds.
HINT_FILE = FileKind(
    what="hint file",
    error=HintError,
    expected="a hint file is a few lines of YAML (docs/hints.md)",
    max_bytes=1 * MiB,
)
# A plan of Llama 3 70B on 16x8 devices is 2.8 MB of JSON, 114,000 values, 5 levels deep:
# the caps leave room for models many times larger.
PLAN_FILE = FileKind(
    what="plan file",
    error=PlanFileError,
    expected="a plan file is the JSON or YAML that `autopar plan -o` writes",
    max_bytes=128 * MiB,
    max_depth=64,
    max_values=8_000_000,
)
PRESET_FILE = FileKind(
    what="preset file",
    error=PresetError,
    expected="a preset file is a YAML mapping of a device's fields "
    "(`autopar devices --format json` shows them; `autopar calibrate` writes one)",
    max_bytes=1 * MiB,
)
MODEL_FILE = FileKind(
    what="model file",
    error=UsageError,
    expected="a model file is Python source that defines the factory",
    max_bytes=16 * MiB,
)

# first bytes that say what a file that is not text is, to make the message concrete
_SIGNATURES: tuple[tuple[bytes, str], ...] = (
    (b"\x80", "a Python pickle"),
    (b"PK\x03\x04", "a zip archive, such as a torch checkpoint"),
    (b"\x1f\x8b", "gzip-compressed"),
    (b"\x89PNG", "a PNG image"),
    (b"\x7fELF", "a program"),
    (b"\xff\xfe", "UTF-16 text; save it as UTF-8"),
    (b"\xfe\xff", "UTF-16 text; save it as UTF-8"),
)
_BOM = b"\xef\xbb\xbf"


# ---- reading ------------------------------------------------------------------------------


def require_file(path: str | Path, kind: FileKind) -> Path:
    """``path`` if it names a regular file; else the kind's error saying what it is instead."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise kind.error(f"{path}: no such {kind.what}; check the path") from None
    except OSError as error:
        raise kind.error(_unreadable(path, kind, error)) from None
    if stat.S_ISDIR(mode):
        raise kind.error(f"{path}: a directory, not a {kind.what}; pass the file inside it")
    if not stat.S_ISREG(mode):
        raise kind.error(
            f"{path}: not a regular file (a pipe, socket or device); {kind.expected}: "
            "save it to a file and pass that"
        )
    return path


def read_bytes(path: str | Path, kind: FileKind) -> bytes:
    """The file's bytes, refused by size before a byte is read (a 50 MB hint file is a
    mistake, and reading and parsing it would take minutes)."""
    path = require_file(path, kind)
    try:
        with path.open("rb") as stream:
            _check_size(path, kind, os.fstat(stream.fileno()).st_size)
            data = stream.read(kind.max_bytes + 1)  # a file that grew since is caught too
    except OSError as error:
        raise kind.error(_unreadable(path, kind, error)) from None
    _check_size(path, kind, len(data))
    return data


def read_text(path: str | Path, kind: FileKind) -> str:
    """The file as UTF-8 text, within the kind's size cap."""
    return decode_text(read_bytes(path, kind), str(path), kind)


def decode_text(data: bytes, source: str, kind: FileKind, encoding: str = "utf-8") -> str:
    """``data`` decoded strictly; the message names the offset of the first bad byte.

    >>> decode_text(b"ok\\xff", "h.yaml", HINT_FILE)
    Traceback (most recent call last):
    ...
    autopar_plans.errors.HintError: h.yaml: not UTF-8 text: byte 0xff at offset 2 ...
    """
    skipped = len(_BOM) if encoding == "utf-8" and data.startswith(_BOM) else 0
    try:
        return data[skipped:].decode(encoding)
    except UnicodeDecodeError as error:
        offset = skipped + error.start
        looks = next(
            (f" (it looks like {name})" for sig, name in _SIGNATURES if data.startswith(sig)), ""
        )
        raise kind.error(
            f"{source}: not {encoding.upper()} text: byte 0x{data[offset]:02x} at offset "
            f"{offset} cannot be decoded{looks}; {kind.expected}"
        ) from None
    except LookupError:
        raise kind.error(
            f"{source}: unknown text encoding {encoding!r}; save it as UTF-8"
        ) from None


def check_text_size(text: str, source: str, kind: FileKind) -> None:
    """Refuse text longer than the kind's cap (text handed over directly, not from a file).

    Characters are counted, not bytes: no more than the bytes, so the cap is never tighter.
    """
    if len(text) > kind.max_bytes:
        raise kind.error(
            f"{source}: {len(text):,} characters, more than a {kind.what} may have "
            f"({_size(kind.max_bytes)}); {kind.expected}"
        )


def _check_size(path: Path, kind: FileKind, size: int) -> None:
    if size > kind.max_bytes:
        raise kind.error(
            f"{path}: {size:,} bytes, more than a {kind.what} may have ({_size(kind.max_bytes)}); "
            f"{kind.expected}: is this the right file?"
        )


def _unreadable(path: Path, kind: FileKind, error: OSError) -> str:
    reason = error.strerror or type(error).__name__
    advice = (
        "make it readable (chmod u+r) or pass another"
        if isinstance(error, PermissionError)
        else "check the path"
    )
    return f"{path}: cannot read the {kind.what}: {reason}; {advice}"


def _size(count: int) -> str:
    return f"{count // MiB} MiB" if count >= MiB else f"{count:,} bytes"


# ---- JSON ---------------------------------------------------------------------------------


def parse_json(text: str, source: str, kind: FileKind) -> Any:
    """JSON text as Python values, within the kind's limits.

    >>> parse_json('{"a": [1, 2]}', "p.json", PLAN_FILE)
    {'a': [1, 2]}
    """
    check_text_size(text, source, kind)
    try:
        data = json.loads(text, parse_int=_int_reader(source, kind))
    except json.JSONDecodeError as error:
        raise kind.error(f"{source}: not valid JSON: {error}; {kind.expected}") from None
    except RecursionError:
        raise kind.error(_too_deep(source, kind)) from None
    except ValueError as error:  # a number Python will not convert
        raise kind.error(f"{source}: a value cannot be read: {error}; {kind.expected}") from None
    _check_shape(data, source, kind)
    return data


def _int_reader(source: str, kind: FileKind) -> Callable[[str], int]:
    def read(digits: str) -> int:
        _check_digits(digits, source, kind)
        return int(digits)

    return read


def _check_digits(digits: str, where: str, kind: FileKind) -> None:
    if len(digits) > kind.max_digits:
        raise kind.error(
            f"{where}: an integer of {len(digits):,} digits; no field of a {kind.what} holds "
            f"more than {kind.max_digits}: is the file damaged? {kind.expected}"
        )


def _check_shape(data: Any, source: str, kind: FileKind) -> None:
    """Walk parsed JSON without recursion: its depth and its count of values."""
    stack: list[tuple[Any, int]] = [(data, 1)]
    count = 0
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > kind.max_values:
            raise kind.error(_too_many(source, kind))
        if isinstance(value, dict | list):
            if depth > kind.max_depth:
                raise kind.error(_too_deep(source, kind))
            items = value.values() if isinstance(value, dict) else value
            stack.extend((item, depth + 1) for item in items)


def _too_deep(where: str, kind: FileKind) -> str:
    depth = kind.max_depth
    return f"{where}: lists and mappings nested more than {depth} levels deep; {kind.expected}"


def _too_many(where: str, kind: FileKind) -> str:
    return (
        f"{where}: more than {kind.max_values:,} values (YAML aliases counted as written "
        f"out: an alias bomb?); {kind.expected}"
    )


# ---- YAML ---------------------------------------------------------------------------------


def parse_yaml(text: str, source: str, kind: FileKind) -> Any:
    """YAML text as Python values (``yaml.safe_load``'s), within the kind's limits.

    >>> parse_yaml("[" * 1000, "h.yaml", HINT_FILE)
    Traceback (most recent call last):
    ...
    autopar_plans.errors.HintError: h.yaml:1: lists and mappings nested more than 32 levels ...
    """
    return parse_yaml_tree(text, source, kind)[0]


def parse_yaml_tree(text: str, source: str, kind: FileKind) -> tuple[Any, yaml.Node | None]:
    """The values and the composed node tree (whose marks give each key's line)."""
    check_text_size(text, source, kind)
    try:
        return _compose_and_construct(_LimitedLoader(text, source, kind))
    except yaml.YAMLError as error:
        raise kind.error(_yaml_problem(error, source, kind)) from None
    except RecursionError:
        raise kind.error(_too_deep(source, kind)) from None


def _compose_and_construct(loader: _LimitedLoader) -> tuple[Any, yaml.Node | None]:
    try:
        node = loader.get_single_node()
        return (None if node is None else loader.construct_document(node)), node
    finally:
        loader.dispose()


def _yaml_problem(error: yaml.YAMLError, source: str, kind: FileKind) -> str:
    mark = getattr(error, "problem_mark", None)
    where = f"{source}:{mark.line + 1}" if mark is not None else source
    problem = getattr(error, "problem", None) or str(error)
    return f"{where}: not valid YAML: {problem}; {kind.expected}"


class _LimitedLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that counts while it composes, so a bomb is refused early.

    Composing is where an alias becomes a second reference to a node: cheap in itself, but
    everything after (construction, pydantic, a walk over the tree) pays for the tree as
    if written out. So each composed node records its written-out size, an alias adds the
    size of the node it names, and the sum is checked at every step, with the depth.
    """

    def __init__(self, text: str, source: str, kind: FileKind) -> None:
        super().__init__(text)
        self._source = source
        self._kind = kind
        self._depth = 0
        self._values = 0
        self._sizes: dict[int, int] = {}  # id(node) -> its size written out, once composed

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            return self._compose_alias(parent, index)
        event = self.peek_event()
        self._depth += 1
        if self._depth > self._kind.max_depth:
            raise self._kind.error(_too_deep(self._where(event.start_mark), self._kind))
        before = self._values
        self._count(1, event.start_mark)
        try:
            node = super().compose_node(parent, index)
        finally:
            self._depth -= 1
        self._sizes[id(node)] = self._values - before
        return node

    def _compose_alias(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        event = self.peek_event()
        node = super().compose_node(parent, index)  # raises for an undefined alias
        size = self._sizes.get(id(node))
        if size is None:  # the anchored node is still being composed: it contains itself
            raise self._kind.error(
                f"{self._where(event.start_mark)}: alias *{event.anchor} sits inside the "
                f"value it names, which would make it infinite; write the value out"
            )
        self._count(size, event.start_mark)
        return node

    def _count(self, values: int, mark: yaml.Mark) -> None:
        self._values += values
        if self._values > self._kind.max_values:
            raise self._kind.error(_too_many(self._where(mark), self._kind))

    def _where(self, mark: yaml.Mark | None) -> str:
        return self._source if mark is None else f"{self._source}:{mark.line + 1}"

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        """SafeLoader's, with a scalar its constructor fails on (``!!timestamp x``, a date
        with month 13, ``!!bool maybe``) reported as a YAML error at its line: PyYAML lets
        ``ValueError``, ``IndexError`` or even ``AttributeError`` out of those."""
        try:
            return super().construct_object(node, deep)
        except (ValueError, TypeError, LookupError, AttributeError, ArithmeticError) as error:
            tag = str(node.tag).rsplit(":", 1)[-1]
            value = node.value if isinstance(node.value, str) else "..."
            shown = value if len(value) <= 40 else value[:40] + "..."
            why = f" ({error})" if isinstance(error, ValueError | ArithmeticError) else ""
            raise yaml.constructor.ConstructorError(
                None, None, f"{tag} {shown!r} cannot be read{why}", node.start_mark
            ) from None

    def construct_limited_int(self, node: yaml.ScalarNode) -> int:
        """SafeLoader's integers, refusing a number too long to convert (or to mean much)."""
        digits = node.value.replace("_", "").lstrip("+-")
        _check_digits(digits, self._where(node.start_mark), self._kind)
        return int(self.construct_yaml_int(node))


_LimitedLoader.add_constructor("tag:yaml.org,2002:int", _LimitedLoader.construct_limited_int)
