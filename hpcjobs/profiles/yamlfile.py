"""Reading a small YAML file a user wrote (a cluster profile, a sweep file) so that whatever it holds ends in data or
in one UsageError line: refused by size before it is read, UTF-8 text without NUL, a key given twice refused (plain
YAML keeps the last, silently), colon-separated numbers (Slurm times) kept as the text they were written as, a
numeral too long for int() kept as text, nesting too deep for the parser refused."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from hpcjobs.protocol.errors import UsageError, shown

MAX_FILE_BYTES = 256 * 1024
"""The largest file read: real profiles and sweep files are a few hundred bytes, and a 50 MB one took PyYAML 23 s."""
MAX_NUMERAL = 100
"""The longest number a file may write as a number (a profile's largest valid one has 6 digits); longer is text."""


@dataclass(frozen=True)
class Kind:
    """What the file is to the user, for its error lines."""

    label: str
    """What it is called: "profile", "sweep file"."""
    flag: str
    """The flag that named it."""
    shape: str
    """What it holds, for a file nested too deeply: "keys, lists and one level of mappings"."""
    error: type[UsageError] = UsageError


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Hashable, first: int, again: int) -> None:
        super().__init__(f"duplicate key {key!r}")
        self.key, self.first, self.again = key, first, again


class _NulInText(yaml.YAMLError):
    def __init__(self, line: int) -> None:
        super().__init__(f"a NUL character on line {line}")
        self.line = line


def _text_or_number(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
    # YAML 1.1 reads an unquoted 30:00 as the base-60 number 1800, which would become 1800 minutes. A numeral longer
    # than any profile's number stays text too, which its key's check then refuses: Python's int() refuses a decimal
    # one of over 4300 digits (a ValueError, not a YAML error), and a long hex one could not even be printed.
    if ":" in node.value or len(node.value) > MAX_NUMERAL:
        return loader.construct_scalar(node)
    return loader.construct_yaml_float(node) if node.tag.endswith(":float") else loader.construct_yaml_int(node)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping and a NUL character in text, and keeps
    colon-separated and over-long numbers as text."""

    def construct_scalar(self, node: yaml.ScalarNode | yaml.MappingNode) -> str:
        # The file holds no NUL byte (read_text), but a quoted "\0" makes one, which no path, argument or environment
        # value can hold: the run folder's mkdir and the local ranks' Popen raised ValueError on it.
        value = super().construct_scalar(node)
        if "\x00" in value:
            raise _NulInText(node.start_mark.line + 1)
        return value

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Hashable, Any]:
        seen: dict[Hashable, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *anchor` entries may be overridden: that is what they are for
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise _DuplicateKey(key, seen[key], line)
                seen[key] = line
            except TypeError:  # an unhashable key: the base class refuses it with its line
                pass
        return super().construct_mapping(node, deep)


StrictLoader.add_constructor("tag:yaml.org,2002:int", _text_or_number)
StrictLoader.add_constructor("tag:yaml.org,2002:float", _text_or_number)


def _names_it(kind: Kind) -> str:
    return f"check that {kind.flag} names the {kind.label}'s .yaml file"


def _too_big(kind: Kind, path: Path, size: int) -> UsageError:
    return kind.error(f"{kind.label} {path} is {size} bytes; valid: at most {MAX_FILE_BYTES} bytes "
                      f"({MAX_FILE_BYTES // 1024} KiB).", f"a {kind.label} is a few dozen lines: {_names_it(kind)}.")


def _read_bytes(kind: Kind, path: Path) -> bytes:
    """The file's bytes, refused by size before it is read."""
    try:
        size = path.stat().st_size
        if size > MAX_FILE_BYTES:
            raise _too_big(kind, path, size)
        with path.open("rb") as f:
            raw = f.read(MAX_FILE_BYTES + 1)  # the file may have grown since stat: never read more than the limit
    except OSError as e:
        raise kind.error(f"{kind.label} {path} cannot be read ({e.strerror or e}).",
                         f"check that it is a file you may read: ls -l {path}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise _too_big(kind, path, len(raw))
    return raw


def read_text(kind: Kind, path: Path) -> str:
    raw = _read_bytes(kind, path)
    hint = f"{_names_it(kind)}, and save it as UTF-8 text."
    try:
        text = raw.decode("utf-8-sig")  # a BOM some editors write is not part of the YAML
    except UnicodeDecodeError as e:
        raise kind.error(f"{kind.label} {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                         "valid: a UTF-8 YAML file.", hint) from None
    if "\x00" in text:
        raise kind.error(f"{kind.label} {path} is a binary file (a NUL byte at offset {text.index(chr(0))}); "
                         "valid: a UTF-8 YAML file.", hint)
    return text


def parse(kind: Kind, path: Path, text: str) -> Any:
    try:
        return yaml.load(text, Loader=StrictLoader)
    except _NulInText as e:
        raise kind.error(f"{kind.label} {path}: line {e.line} holds a NUL character (an escape such as \\0 or "
                         "\\x00); valid: text without NUL (no path, argument or environment value can hold one).",
                         "delete the escape.") from None
    except _DuplicateKey as e:
        raise kind.error(f"{kind.label} {path}: key {shown(e.key)} is given twice (line {e.first} and line "
                         f"{e.again}); valid: each key once per mapping.",
                         "delete one of them (YAML would silently keep the last).") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise kind.error(f"{kind.label} {path}:{where} is not valid YAML ({getattr(e, 'problem', e)}).",
                         "check indentation and quoting; values with ':' or '#' need quotes.") from None
    except RecursionError:
        raise kind.error(f"{kind.label} {path} nests too deeply to be a {kind.label}; valid: {kind.shape}.",
                         f"{_names_it(kind)}.") from None


def load(kind: Kind, path: Path) -> Any:
    """The file's data, or the one-line error of `kind` saying why not."""
    return parse(kind, path, read_text(kind, path))
