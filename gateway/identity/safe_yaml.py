"""``yaml.safe_load`` for small operator files, without aliases and with a depth bound.

``safe_load`` builds no arbitrary objects, but an alias bomb (a few lines of anchors that
expand to billions of nodes when walked) or a deeply nested document (the composer
recurses per level) can still cost a lot. Key files need neither, so aliases are refused
and nesting is capped.
"""

from __future__ import annotations

from typing import Any, Final

import yaml
from yaml.error import Mark
from yaml.nodes import Node

MAX_DEPTH: Final = 16


# (The ignores: the compiled build type-checks this module, imported by the data plane,
# without types-PyYAML, where SafeLoader is Any; with the stubs there is nothing to ignore.)
class _BoundedLoader(yaml.SafeLoader):  # type: ignore[misc,unused-ignore]
    def __init__(self, stream: bytes | str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Node | None, index: int) -> Node | None:
        if self.check_event(yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None, None, "aliases (*name) are not allowed", self._next_mark()
            )
        if self._depth >= MAX_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_DEPTH} levels", self._next_mark()
            )
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def _next_mark(self) -> Mark:
        event = self.peek_event()  # type: ignore[no-untyped-call,unused-ignore]  # untyped stubs
        mark: Mark = event.start_mark
        return mark


def load(data: bytes | str) -> Any:
    """The document, as ``yaml.safe_load`` would build it; ``yaml.YAMLError`` if it is
    not valid YAML, uses an alias or nests too deep."""
    loader = _BoundedLoader(data)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def compose(data: bytes | str) -> Node | None:
    """The node tree (with positions), under the same bounds as ``load``."""
    loader = _BoundedLoader(data)
    try:
        return loader.get_single_node()
    finally:
        loader.dispose()


def describe_error(exc: yaml.YAMLError) -> str:
    """Where and what, without PyYAML's snippet of the offending line: the line could
    hold a secret pasted by mistake (a key where its hash belongs), and this message is
    logged."""
    if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
        mark = exc.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {exc.problem}"
    return type(exc).__name__
