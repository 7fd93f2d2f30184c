"""Node translations: `locales/<lang>/nodeDefs.json`, which ComfyUI serves to its frontend (`/i18n`) to show a
node's name, description and its inputs' and outputs' labels and tooltips in the user's language; what a
translation leaves out falls back to the schema's English.

A translation must name only nodes, inputs and outputs the schemas have (a renamed input would silently lose
its text), cover every one of them (a new input shows up untranslated otherwise) but a growing list (ComfyUI names
its slots; its tooltip stays English), and keep every number of the English text (a tooltip whose numbers changed
in English but not in the translation is stale).

Run: python tools/node_locales.py            (checks every locales/<lang>/nodeDefs.json; tests/test_node_locales.py)
     python tools/node_locales.py --english  (prints the English strings a translation covers, as nodeDefs.json)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from node_docs import node_schemas

ROOT = Path(__file__).resolve().parents[1]
LOCALES = ROOT / "locales"
GROWING = "COMFY_AUTOGROW_V3"  # a growing list's slots are named by ComfyUI (ref0, ref1, ...): nothing to translate


def english() -> dict:
    """nodeDefs.json in English, from the schemas: what every translation covers."""
    defs = {}
    for schema in node_schemas():
        inputs = {port.id: {"name": port.options.get("display_name") or port.id,
                            "tooltip": port.options.get("tooltip", "")}
                  for port in schema.inputs if port.type != GROWING}
        outputs = {str(index): {"name": port.options.get("display_name") or port.type,
                                "tooltip": port.options.get("tooltip", "")}
                   for index, port in enumerate(schema.outputs)}
        defs[schema.node_id] = {"display_name": schema.display_name, "description": schema.description,
                                "inputs": inputs, "outputs": outputs}
    return defs


def _numbers(text: str) -> list[str]:
    return re.findall(r"\d+(?:\.\d+)?", text)


def _strings(entry: dict, where: str):
    """(where, text) of every string of a node's entry."""
    for key in ("display_name", "description"):
        yield f"{where}.{key}", entry.get(key)
    for group in ("inputs", "outputs"):
        for name, port in entry.get(group, {}).items():
            for key in ("name", "tooltip"):
                yield f"{where}.{group}.{name}.{key}", port.get(key)


def problems(translation: dict, source: dict) -> list[str]:
    """What is wrong with a translation against the English `source`: unknown or missing nodes, inputs,
    outputs and strings, and numbers of the English text it lost."""
    found = []
    for node in sorted(set(translation) - set(source)):
        found.append(f"{node}: no such node")
    for node, english_entry in source.items():
        entry = translation.get(node)
        if entry is None:
            found.append(f"{node}: not translated")
            continue
        for group in ("inputs", "outputs"):
            for name in sorted(set(entry.get(group, {})) - set(english_entry[group])):
                found.append(f"{node}.{group}.{name}: no such {group[:-1]}")
        ours = dict(_strings(entry, node))
        for where, text in _strings(english_entry, node):
            got = ours.get(where)
            if not text:
                continue
            if not isinstance(got, str) or not got.strip():
                found.append(f"{where}: not translated")
                continue
            lost = [number for number in _numbers(text) if number not in _numbers(got)]
            if lost:
                found.append(f"{where}: the English says {', '.join(lost)}; the translation does not")
    return found


def main(argv: list[str]) -> int:
    source = english()
    if argv[1:] == ["--english"]:
        print(json.dumps(source, indent=2, ensure_ascii=False))
        return 0
    failed = False
    for path in sorted(LOCALES.glob("*/nodeDefs.json")):
        found = problems(json.loads(path.read_text(encoding="utf-8")), source)
        for problem in found:
            print(f"{path.relative_to(ROOT)}: {problem}")
        failed |= bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
