"""The nodes' public interface, kept so that saved workflows go on loading: `tools/node_interface.json`
records every node's inputs, its canvas widgets in the order a saved workflow stores their values, and
its outputs. Users share workflow files and queue API prompts from scripts; a later version of the pack
must run them. So, against the record:

- a node, an input or an output is never removed or renamed, and no type changes;
- a new input is optional (an API prompt saved before it does not name it);
- a new canvas widget comes after the recorded ones (a canvas workflow stores widget values by position);
- a new output comes after the recorded ones (canvas links name output slots by position);
- an output node stays one (ComfyUI runs a prompt from its output nodes: one ending in a node that no
  longer is has nothing to run), and a list output stays a list and a single one single (the nodes after
  a list output run once per item);
- a choice list keeps its choices, and a number range only widens.

Run: python tools/node_interface.py            says whether the nodes keep the record
     python tools/node_interface.py --update   records additions (refused while anything breaks it)
tests/test_node_interface.py fails on a break, and until additions are recorded. A deliberate break (a
release whose notes say which workflows must be redone) is recorded by editing the record by hand.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from node_docs import node_schemas  # noqa: E402

RECORD = Path(__file__).resolve().parent / "node_interface.json"
WIDGETS = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}


def widget_order(ports) -> list[str]:
    """The canvas widgets in the order ComfyUI's frontend stores their values (required inputs, then
    optional ones, each in schema order), with the extra control value after a seed."""
    names = []
    for port in [p for p in ports if not p.optional] + [p for p in ports if p.optional]:
        if port.type in WIDGETS and not port.options.get("force_input"):
            names.append(port.id)
            if port.options.get("control_after_generate"):
                names.append(f"{port.id}:control")
    return names


def _input(port) -> dict:
    options = port.options
    entry = {"type": port.type, "optional": port.optional}
    if port.type == "COMFY_AUTOGROW_V3":
        template = options["template"]
        entry.update(type=f"{template.prefix}* of {template.input.type}", min=template.min, max=template.max,
                     each_optional=template.input.optional)
    elif port.type == "COMBO" and len(options.get("options", [])) > 1:  # a fixed list, not a model folder's
        entry["choices"] = list(options["options"])
    elif port.type in ("INT", "FLOAT"):
        entry.update({key: options[key] for key in ("min", "max") if key in options})
    return entry


def interface(schemas) -> dict:
    """{node id: {"inputs": {name: facts}, "widgets": [names], "outputs": [types], "list_outputs": [bools],
    "output_node": bool}}."""
    return {schema.node_id: {"inputs": {port.id: _input(port) for port in schema.inputs},
                             "widgets": widget_order(schema.inputs),
                             "outputs": [port.type for port in schema.outputs],
                             "list_outputs": [bool(port.options.get("is_output_list")) for port in schema.outputs],
                             "output_node": bool(schema.is_output_node)}
            for schema in schemas}


def breaks(recorded: dict, current: dict) -> list[str]:
    """What in `current` would stop a workflow made against `recorded` from loading or running."""
    problems = []
    for node_id, old in recorded.items():
        new = current.get(node_id)
        if new is None:
            problems.append(f"{node_id}: the node is gone")
            continue
        for name, was in old["inputs"].items():
            now = new["inputs"].get(name)
            if now is None:
                problems.append(f"{node_id}.{name}: the input is gone")
                continue
            if now["type"] != was["type"]:
                problems.append(f"{node_id}.{name}: type {was['type']} became {now['type']}")
            if was["optional"] and not now["optional"]:
                problems.append(f"{node_id}.{name}: optional became required")
            if was.get("each_optional") and not now.get("each_optional"):
                problems.append(f"{node_id}.{name}: the inputs it grows became required")
            lost = [choice for choice in was.get("choices", []) if choice not in now.get("choices", [])]
            if lost:
                problems.append(f"{node_id}.{name}: choices {lost} are gone")
            if "min" in was and now.get("min", was["min"]) > was["min"]:
                problems.append(f"{node_id}.{name}: min {was['min']} rose to {now['min']}")
            if "max" in was and now.get("max", was["max"]) < was["max"]:
                problems.append(f"{node_id}.{name}: max {was['max']} fell to {now['max']}")
        for name in new["inputs"].keys() - old["inputs"].keys():
            if not new["inputs"][name]["optional"]:
                problems.append(f"{node_id}.{name}: a new input must be optional (older API prompts lack it)")
        if new["widgets"][: len(old["widgets"])] != old["widgets"]:
            problems.append(f"{node_id}: canvas widgets {old['widgets']} became {new['widgets']} "
                            "(new widgets go after the recorded ones)")
        if new["outputs"][: len(old["outputs"])] != old["outputs"]:
            problems.append(f"{node_id}: outputs {old['outputs']} became {new['outputs']} "
                            "(new outputs go after the recorded ones)")
        for slot, (was, now) in enumerate(zip(old["list_outputs"], new["list_outputs"])):
            if was != now:
                problems.append(f"{node_id}: output {slot} {'is no longer' if was else 'became'} a list (the "
                                "nodes after a list output run once per item)")
        if old["output_node"] and not new["output_node"]:
            problems.append(f"{node_id}: no longer an output node (a prompt ending in it would have nothing to run)")
    return problems


def load_record() -> dict:
    return json.loads(RECORD.read_text())


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="record additions to the interface")
    args = parser.parse_args(argv)
    current = interface(node_schemas())
    recorded = load_record() if RECORD.is_file() else {}
    problems = breaks(recorded, current)
    if problems:
        print("these changes break saved workflows:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    if current == recorded:
        print(f"the nodes keep {RECORD.name}")
    elif args.update:
        RECORD.write_text(json.dumps(current, indent=1) + "\n")
        print(f"recorded the additions in {RECORD.name}")
    else:
        print(f"the nodes add to {RECORD.name}: run with --update to record them", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
