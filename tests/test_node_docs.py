"""Node help pages (web/docs/<node id>.md, shown in ComfyUI's node help panel): one per node, titled with
its display name, and the generated inputs/outputs part up to date with the schema (tools/node_docs.py)."""

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import node_docs  # noqa: E402


@pytest.fixture(scope="module")
def schemas():
    return node_docs.node_schemas()


def test_every_node_has_a_page_and_every_page_a_node(schemas):
    ids = {schema.node_id for schema in schemas}
    pages = {path.stem for path in node_docs.DOCS.glob("*.md")}
    assert ids == pages, f"nodes without a page: {sorted(ids - pages)}; pages without a node: {sorted(pages - ids)}"


def test_pages_are_titled_and_their_inputs_up_to_date(schemas):
    stale = []
    for schema in schemas:
        text = node_docs.page_path(schema).read_text()
        assert text.startswith(f"# {schema.display_name}\n"), schema.node_id
        body = text[: text.index(node_docs.BEGIN)]
        assert len(body.split()) > 40, f"{schema.node_id}: the hand-written part is missing"
        if node_docs.updated(text, schema) != text:
            stale.append(schema.node_id)
    assert not stale, f"run `python tools/node_docs.py`: out of date for {stale}"


def test_the_generated_part_lists_each_input_with_its_tooltip_and_each_output(schemas):
    sampler = next(schema for schema in schemas if schema.node_id == "H3Sampler")
    part = node_docs.render(sampler)
    items = [line for line in part.splitlines() if line.startswith("- **`")]
    assert [item.split("`")[1] for item in items] == [p.id for p in sampler.inputs] + ["latent"]
    seed = next(item for item in items if item.startswith("- **`seed`**"))
    assert "integer 0..18446744073709551615, default `0`." in seed and "same seed draws the same noise" in seed
    assert items[-1].startswith("- **`latent`**: H3_LATENT, a list: the nodes after it run once per item. The sampled")
    loader = node_docs.render(next(schema for schema in schemas if schema.node_id == "H3ModelLoader"))
    assert "- **`checkpoint`**: a file name, default `tiny-random`. A file from" in loader  # folder lists: run time
    assert "one of `fl2va`, `ref2va`" in loader
    assert "- **`gpu_memory_gb`** (optional): number 0.0..4096.0, step 0.5, default `0.0`." in loader


def test_a_page_without_markers_is_refused(schemas):
    with pytest.raises(ValueError, match="needs the two marker lines"):
        node_docs.updated("# H3 Sampler\nprose only\n", schemas[0])


def test_every_output_says_what_it_is_and_where_it_goes(schemas):
    missing = [f"{schema.node_id}.{port.options.get('display_name', port.id)}" for schema in schemas
               for port in schema.outputs if not (port.options.get("tooltip") or "").strip()]
    assert not missing, missing
