"""Node help pages: `web/docs/<node id>.md`, which ComfyUI's frontend shows in a node's help panel (it
fetches `/extensions/<pack folder>/docs/<node id>.md`). Each page is prose written by hand around a part
this tool writes from the node's schema: the inputs (kind, range or choices, default, tooltip) and the
outputs. The tooltips stay the one source of what an input does.

Run: python tools/node_docs.py   (after changing a node's inputs; tests/test_node_docs.py fails until then)
The schemas are read through the test suite's stand-in for ComfyUI's API (tests/fake_comfy.py), so no
ComfyUI is needed.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "web" / "docs"
BEGIN = "<!-- inputs and outputs: written by tools/node_docs.py from the node's schema -->"
END = "<!-- end of the generated part -->"
KINDS = {"INT": "integer", "FLOAT": "number", "STRING": "text", "BOOLEAN": "on / off"}


def node_schemas() -> list:
    """Every node's `define_schema()`, in menu order, with ComfyUI's API faked (empty model folders) for
    the call only: the modules it puts in place are taken out again."""
    for path in (ROOT, ROOT / "tests"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    import fake_comfy

    with tempfile.TemporaryDirectory(prefix="h3-node-docs-") as folder, fake_comfy.installed(Path(folder)):
        from nodes import node_list

        return [node.define_schema() for node in node_list()]


def _kind(port) -> str:
    options = port.options
    if port.type == "COMBO":
        choices = options.get("options", [])
        if len(choices) < 2:  # filled from a model folder at run time
            return "a file name"
        return "one of " + ", ".join(f"`{choice}`" for choice in choices)
    if port.type == "COMFY_AUTOGROW_V3":
        template = options["template"]
        return (f"a growing list `{template.prefix}0`, `{template.prefix}1`, ... of "
                f"{template.input.type.replace(',', ' / ')}, up to {template.max}")
    kind = KINDS.get(port.type, port.type)
    if port.type in ("INT", "FLOAT") and "min" in options:
        kind += f" {options['min']}..{options['max']}"
        if options.get("step", 1) != 1:
            kind += f", step {options['step']}"
    return kind + (" (multiline)" if options.get("multiline") else "")


def _default(port) -> str:
    if "default" not in port.options:
        return ""
    default = port.options["default"]
    return "(empty)" if default == "" else f"`{default}`"


def render(schema) -> str:
    """The generated part of a node's page, between the markers: lists, which read well in the narrow
    help panel (a table there squeezes every row tall)."""
    lines = [BEGIN, "", "## Inputs", ""]
    for port in schema.inputs:
        optional = " (optional)" if port.options.get("optional") else ""
        default = _default(port)
        facts = _kind(port) + (f", default {default}" if default else "")
        lines.append(f"- **`{port.id}`**{optional}: {facts}. {port.options.get('tooltip', '')}".rstrip())
    lines += ["", "## Outputs", ""]
    for port in schema.outputs:
        listed = ", a list: the nodes after it run once per item" if port.options.get("is_output_list") else ""
        lines.append(f"- **`{port.options.get('display_name', port.id)}`**: {port.type}{listed}. "
                     f"{port.options.get('tooltip', '')}".rstrip())
    return "\n".join(lines + ["", END])


def page_path(schema) -> Path:
    return DOCS / f"{schema.node_id}.md"


def updated(text: str, schema) -> str:
    """`text` (a page) with its generated part rewritten; a page without both markers is refused."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{page_path(schema).relative_to(ROOT)} needs the two marker lines:\n{BEGIN}\n{END}")
    return text[:start] + render(schema) + text[end + len(END):]


def main() -> None:
    for schema in node_schemas():
        path = page_path(schema)
        if not path.is_file():
            raise SystemExit(f"{path.relative_to(ROOT)} is missing: write the node's prose with the markers\n"
                             f"{BEGIN}\n{END}\nwhere its inputs and outputs go, then run this again.")
        text = path.read_text()
        new = updated(text, schema)
        if new != text:
            path.write_text(new)
            print(f"updated {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
