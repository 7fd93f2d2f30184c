"""Node translations (locales/<lang>/nodeDefs.json, served by ComfyUI to its frontend): each covers every node,
input and output the schemas have and nothing else, and keeps the English text's numbers (tools/node_locales.py)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import node_locales  # noqa: E402

TRANSLATIONS = sorted((ROOT / "locales").glob("*/nodeDefs.json"))


@pytest.fixture(scope="module")
def english():
    return node_locales.english()


def test_there_is_a_chinese_translation():
    assert [path.parent.name for path in TRANSLATIONS] == ["zh"]


@pytest.mark.parametrize("path", TRANSLATIONS, ids=lambda path: path.parent.name)
def test_a_translation_matches_the_schemas(path, english):
    assert node_locales.problems(json.loads(path.read_text(encoding="utf-8")), english) == []


def test_the_checker_finds_what_a_stale_translation_gets_wrong(english):
    """A renamed input, a new one, a node that is gone and a number changed in English are each reported."""
    stale = json.loads(json.dumps(english))
    sampler = stale["H3Sampler"]["inputs"]
    sampler["seed_value"] = sampler.pop("seed")
    stale["H3Gone"] = {"display_name": "x"}
    stale["H3EmptyAVLatent"]["inputs"]["num_frames"]["tooltip"] = "frames"
    found = node_locales.problems(stale, english)
    assert "H3Sampler.inputs.seed_value: no such input" in found
    assert "H3Sampler.inputs.seed.name: not translated" in found
    assert "H3Gone: no such node" in found
    assert any(line.startswith("H3EmptyAVLatent.inputs.num_frames.tooltip: the English says") for line in found)
    assert node_locales.problems(english, english) == []
