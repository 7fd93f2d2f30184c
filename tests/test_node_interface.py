"""Saved workflows keep loading: the nodes keep the interface recorded in tools/node_interface.json
(nothing removed, renamed, retyped or reordered; new inputs optional and after the recorded widgets), and
additions are recorded so that they are kept too (tools/node_interface.py)."""

import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import node_interface  # noqa: E402


@pytest.fixture(scope="module")
def current():
    return node_interface.interface(node_interface.node_schemas())


def test_the_nodes_keep_the_recorded_interface(current):
    problems = node_interface.breaks(node_interface.load_record(), current)
    assert not problems, "these changes break saved workflows:\n" + "\n".join(problems)


def test_additions_are_recorded(current):
    assert current == node_interface.load_record(), "run: python tools/node_interface.py --update"


def _with(current, change):
    changed = copy.deepcopy(current)
    change(changed)
    return node_interface.breaks(current, changed)


def test_each_kind_of_break_is_found(current):
    sampler = current["H3Sampler"]
    seed_at = sampler["widgets"].index("seed")
    choice_input = next(name for name, facts in current["H3ModelLoader"]["inputs"].items() if "choices" in facts)
    ranged = next(name for name, facts in sampler["inputs"].items() if "max" in facts and "min" in facts)
    optional = next(name for name, facts in current["H3ModelLoader"]["inputs"].items() if facts["optional"])
    references = current["H3Conditioning"]["inputs"]["references"]
    assert references["min"] == 0 and references["each_optional"]  # a prompt may have no references
    cases = {
        "the node is gone": lambda c: c.pop("H3VAEDecode"),
        "the input is gone": lambda c: c["H3Sampler"]["inputs"].pop("seed"),
        "became FLOAT": lambda c: c["H3Sampler"]["inputs"]["seed"].update(type="FLOAT"),
        "optional became required": lambda c: c["H3ModelLoader"]["inputs"][optional].update(optional=False),
        "choices": lambda c: c["H3ModelLoader"]["inputs"][choice_input]["choices"].pop(0),
        "rose to": lambda c: c["H3Sampler"]["inputs"][ranged].update(min=c["H3Sampler"]["inputs"][ranged]["min"] + 1),
        "fell to": lambda c: c["H3Sampler"]["inputs"][ranged].update(max=c["H3Sampler"]["inputs"][ranged]["max"] - 1),
        "the inputs it grows became required": lambda c: c["H3Conditioning"]["inputs"]["references"].update(
            each_optional=False),
        "min 0 rose to 1": lambda c: c["H3Conditioning"]["inputs"]["references"].update(min=1),
        "must be optional": lambda c: c["H3Sampler"]["inputs"].update(extra={"type": "INT", "optional": False}),
        "new widgets go after": lambda c: c["H3Sampler"]["widgets"].insert(seed_at, "extra"),
        "new outputs go after": lambda c: c["H3Sampler"]["outputs"].insert(0, "IMAGE"),
        "no longer an output node": lambda c: c["H3AVSave"].update(output_node=False),
        "output 0 is no longer a list": lambda c: c["H3Sampler"]["list_outputs"].__setitem__(0, False),
        "output 1 became a list": lambda c: c["H3VAEDecode"]["list_outputs"].__setitem__(1, True),
    }
    for said, change in cases.items():
        problems = _with(current, change)
        assert len(problems) == 1 and said in problems[0], (said, problems)


def test_additions_at_the_end_break_nothing(current):
    def add(c):
        sampler = c["H3Sampler"]
        sampler["inputs"]["extra"] = {"type": "INT", "optional": True, "min": 0, "max": 4}
        sampler["widgets"].append("extra")
        sampler["outputs"].append("IMAGE")
        loader = c["H3ModelLoader"]["inputs"]
        next(facts for facts in loader.values() if "choices" in facts)["choices"].append("new")
        ranged = next(facts for facts in loader.values() if "max" in facts)
        ranged["max"] += 1
        c["H3Extra"] = {"inputs": {}, "widgets": [], "outputs": []}

    assert _with(current, add) == []
