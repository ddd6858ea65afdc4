"""Write docs/configuration.md, the configuration reference, from workflow/schemas/config.schema.yaml.

    .venv/bin/python docs/gen_config_reference.py           # regenerate docs/configuration.md
    .venv/bin/python docs/gen_config_reference.py --check   # exit 1 if the committed file is stale

Every key of the schema gets a row: its type, default, valid values or range, and description; every object gets a
table of its own, headed by its dotted path. yaml.safe_load resolves the schema's anchors, aliases and merge keys
(`<<: *trainer`), so a shared block appears in full under each key that uses it. tests/test_docs.py checks that the
committed file is what this script writes.
"""
import json
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
SCHEMA = REPO / "workflow/schemas/config.schema.yaml"
OUTPUT = REPO / "docs/configuration.md"
REGENERATE = ".venv/bin/python docs/gen_config_reference.py"
HEADER = "| key | type and range | default | description |"


def escape(text: str) -> str:
    """Text for a Markdown table cell: no line breaks, no pipes, no HTML."""
    text = " ".join(str(text).split())
    return text.replace("|", "\\|").replace("<", "&lt;").replace(">", "&gt;")


def code(value) -> str:
    """A value as YAML/JSON in a code span (JSON is YAML)."""
    return "`" + json.dumps(value, ensure_ascii=False).replace("|", "\\|") + "`"


def type_of(node: dict) -> str:
    """The key's type in words: string, integer or null, one of an enum, a list of ..., a mapping of ..."""
    if "anyOf" in node:
        return " or ".join(type_of(alternative) for alternative in node["anyOf"])
    if "const" in node:
        return code(node["const"])
    if "enum" in node:
        return "one of " + ", ".join(code(value) for value in node["enum"])
    types = node.get("type", "any")
    types = types if isinstance(types, list) else [types]
    words = []
    for name in types:
        if name == "array" and "items" in node:
            words.append(f"list of {type_of(node['items'])}")
        elif name == "object" and isinstance(node.get("additionalProperties"), dict) and "properties" not in node:
            words.append(f"mapping of names to {type_of(node['additionalProperties'])}")
        elif name == "object" and "properties" in node:
            words.append("mapping (below)")
        else:
            words.append(name)
    return " or ".join(words)


def limits(node: dict) -> str:
    """The key's range and other constraints, e.g. `>= 1`, `<= 0.5`, a pattern."""
    parts = []
    for key, sign in (("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")):
        if key in node:
            parts.append(f"{sign} {node[key]}")
    if "minLength" in node:
        parts.append(f"at least {node['minLength']} character(s)")
    if "minItems" in node:
        parts.append(f"at least {node['minItems']} item(s)")
    if node.get("uniqueItems"):
        parts.append("no repeats")
    if "pattern" in node:
        parts.append(f"matches `{node['pattern']}`")
    for alternative in node.get("anyOf", []):
        if limits(alternative):
            parts.append(f"{type_of(alternative)}: {limits(alternative)}")
    if "items" in node and limits(node["items"]):
        parts.append(f"each {limits(node['items'])}")
    if "propertyNames" in node:
        names = node["propertyNames"]
        if "pattern" in names:
            parts.append(f"names match `{names['pattern']}`")
        if "not" in names and "enum" in names["not"]:
            parts.append("names not " + ", ".join(code(v) for v in names["not"]["enum"]))
    return "; ".join(parts)


def type_and_limits(node: dict) -> str:
    """The type column: the type, then its range and constraints."""
    return escape(type_of(node)) + (f"; {limits(node)}" if limits(node) else "")


def default_of(node: dict, name: str, required: list) -> str:
    if name in required:
        return "required"
    return code(node["default"]) if "default" in node else "unset"


def has_table(node: dict) -> bool:
    """An object with keys of its own, or whose entries (any name) have keys: rl.variants, benchmarks."""
    extra = node.get("additionalProperties")
    return "properties" in node or (isinstance(extra, dict) and "properties" in extra)


def sub_objects(node: dict):
    """(suffix, schema) of each nested object that gets a table of its own."""
    for name, child in node.get("properties", {}).items():
        if has_table(child):
            yield name, child
    extra = node.get("additionalProperties")
    if isinstance(extra, dict) and "properties" in extra:
        yield "<name>", extra


def same_for_all(properties: dict) -> bool:
    """True where every property is the same object (launcher.stages: one alias per stage)."""
    values = list(properties.values())
    return len(values) > 1 and all(value is values[0] for value in values) and "properties" in values[0]


def table(path: str, node: dict, parent: dict | None) -> list[str]:
    """The section of one object: its description and a row per key, then the sections of its nested objects."""
    properties = node.get("properties", {})
    if not properties and not node.get("description") and path.count("."):  # rl.variants: straight to its entries
        return [line for suffix, child in sub_objects(node) for line in table(f"{path}.{suffix}", child, parent)]
    lines = [f"## `{path}`" if path.count(".") == 0 else f"### `{path}`", ""]
    if node.get("description"):
        lines += [escape(node["description"]), ""]
    if same_for_all(properties):
        child = next(iter(properties.values()))
        lines += ["One entry per stage, each optional: " + ", ".join(f"`{name}`" for name in properties)
                  + "; a key given there overrides the key of the same name above for that stage.", ""]
        return lines + table(f"{path}.<stage>", child, node)[2:]
    inherited = parent is not None and all(parent.get("properties", {}).get(k) == v for k, v in properties.items())
    if properties and inherited:
        keys = ", ".join(f"`{k}`" for k in parent["properties"] if k not in properties)
        lines += [f"Each entry takes the keys of `{path.rsplit('.', 2)[0]}` (above) but {keys}; "
                  "the entry's value overrides the block's for that run.", ""]
        return lines
    if properties:
        required = node.get("required", [])
        lines += [HEADER, "|---|---|---|---|"]
        for name, child in properties.items():
            lines.append(f"| `{path}.{name}` | {type_and_limits(child)} | {default_of(child, name, required)} "
                         f"| {escape(child.get('description', ''))} |")
        lines.append("")
    for suffix, child in sub_objects(node):  # (entries of rl.variants are compared with rl itself)
        lines += table(f"{path}.{suffix}", child, node if properties else parent)
    return lines


def schema_header() -> list[str]:
    """The schema file's leading comment block (what the DAG holds), as written."""
    header = []
    for line in SCHEMA.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[2:] if line.startswith("# ") else line[1:])
    return header


def render() -> str:
    schema = yaml.safe_load(SCHEMA.read_text())
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by docs/gen_config_reference.py from workflow/schemas/config.schema.yaml; do not edit. -->",
        "",
        f"Generated from `workflow/schemas/config.schema.yaml` by `docs/gen_config_reference.py`; regenerate with "
        f"`{REGENERATE}` after changing the schema. Every key is optional unless marked required: an experiment "
        "file gives only the keys it changes, over these defaults. A misspelt key, a key written twice in one file "
        "or a bad value stops the run before anything is queued, naming the key. The example experiments are in "
        "`config/` (`config/README.md` lists them).",
        "",
        "The schema file's header:",
        "",
        "```text",
        *schema_header(),
        "```",
        "",
        "## Top level",
        "",
        HEADER,
        "|---|---|---|---|",
    ]
    nested = []
    for name, child in schema["properties"].items():
        if has_table(child):
            nested.append((name, child))
            lines.append(f"| `{name}` | {type_and_limits(child)} | {default_of(child, name, [])} "
                         f"| see [`{name}`](#{name}) |")
        else:
            lines.append(f"| `{name}` | {type_and_limits(child)} | {default_of(child, name, [])} "
                         f"| {escape(child.get('description', ''))} |")
    lines.append("")
    for name, child in nested:
        lines += table(name, child, None)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv[1:]:
        if OUTPUT.read_text() != text:
            sys.exit(f"{OUTPUT.relative_to(REPO)} is stale: run {REGENERATE}")
    else:
        OUTPUT.write_text(text)
