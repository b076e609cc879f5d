"""YAML as the configuration (and the tenants file) is read: the safe loader, stricter.

No aliases, no key twice in one mapping, bounded nesting, and errors that say where without
reprinting the line (it may hold a password).
"""

from __future__ import annotations

from typing import Any

import yaml

from harvester.config_errors import ConfigError, clip

MAX_YAML_DEPTH = 20  # nesting of mappings and lists; the configuration itself needs 5


class _ConfigLoader(yaml.SafeLoader):
    """YAML as the configuration reads it: the safe loader, stricter. Aliases (`*name`) are refused:
    a few hundred bytes of them expand to billions of nodes, or to a value that contains itself.
    A key written twice in one mapping is refused (YAML would keep the last silently, dropping a whole
    section). Nesting is bounded, and a scalar Python cannot construct (an integer of more digits than
    it converts, a date that does not exist) is a YAML error with its place, not an exception."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(
                None,
                None,
                f"found an alias (*{clip(str(event.anchor), 40)}): aliases are not allowed in the configuration; "
                "write the value out",
                event.start_mark,
            )
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                raise yaml.composer.ComposerError(
                    None, None, f"nested more than {MAX_YAML_DEPTH} levels deep", event.start_mark
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node: Any, deep: bool = False) -> Any:
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError):  # the scalar's text is not repeated: it may be a secret
            what = {
                "tag:yaml.org,2002:int": "an integer with too many digits",
                "tag:yaml.org,2002:timestamp": "not a valid date or time (quote it to write text)",
            }.get(node.tag, f"a {node.tag.rpartition(':')[2]} value that cannot be read")
            raise yaml.constructor.ConstructorError(None, None, what, node.start_mark) from None

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, Any] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                name = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(name, key_node.start_mark)
                except TypeError:  # an unhashable key: the safe loader refuses it
                    break
                if first is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None,
                        None,
                        f"found key {clip(repr(name), 80)} twice in one mapping (first at line {first.line + 1})",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep)


def load_yaml(text: str, where: str) -> Any:
    """`text` read as YAML by the configuration's rules; a ConfigError naming `where` and the place
    (never the line: it may hold a password) when it cannot be."""
    loader = None
    try:
        loader = _ConfigLoader(text)  # (it checks the characters at once)
        return loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigError(where, f"not valid YAML: {yaml_problem(exc)}") from None
    except RecursionError:
        raise ConfigError(where, f"not valid YAML: nested more than {MAX_YAML_DEPTH} levels deep") from None
    finally:
        if loader is not None:
            loader.dispose()


def yaml_problem(exc: yaml.YAMLError) -> str:
    """What is wrong and where, without the offending line: it may hold a password."""
    if isinstance(exc, yaml.reader.ReaderError):
        code = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return f"character #x{code:04x} is not allowed in YAML (at character {exc.position + 1})"
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or type(exc).__name__
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem
