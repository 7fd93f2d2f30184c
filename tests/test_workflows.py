"""Every workflow file against the node schemas, without ComfyUI: the API prompts (workflows/api, the
real-file graphs in workflows/templates) and the canvas workflows ComfyUI offers as templates
(example_workflows). Only our node ids and a few core ids; inputs that exist; required inputs present;
values in range; links to outputs of the right type; canvas widgets in the order the frontend reads them."""

import json
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import fake_comfy  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import node_interface  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
API = sorted((ROOT / "workflows" / "api").glob("*.json")) + sorted((ROOT / "workflows" / "templates").glob("*.json"))
CANVAS = sorted((ROOT / "example_workflows").glob("*.json"))
# The core nodes our graphs use (ComfyUI 0.33): input names and output types. The real-server test
# checks them against a live /object_info.
CORE = {
    "EmptyImage": ({"width", "height", "batch_size", "color"}, ["IMAGE"]),
    "EmptyAudio": ({"duration", "sample_rate", "channels"}, ["AUDIO"]),
    "CreateVideo": ({"images", "fps", "audio"}, ["VIDEO"]),
    "LoadImage": ({"image", "upload"}, ["IMAGE", "MASK"]),
    "LoadAudio": ({"audio", "upload", "audioUI"}, ["AUDIO"]),
    "LoadVideo": ({"file", "upload"}, ["VIDEO"]),
    "ManualSigmas": ({"sigmas"}, ["SIGMAS"]),
}
FRONTEND_ONLY = {"MarkdownNote", "Note"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}


@pytest.fixture(scope="module")
def schemas(tmp_path_factory):
    with fake_comfy.installed(tmp_path_factory.mktemp("comfy")):
        import nodes

        return {cls.define_schema().node_id: fake_comfy.schema_of(cls) for cls in nodes.node_list()}


def _port(schema: dict, name: str):
    """The schema port an input name refers to ("references.ref3" -> the growing list's template)."""
    if name in schema["inputs"]:
        return schema["inputs"][name]
    group, _, slot = name.partition(".")
    port = schema["inputs"].get(group)
    if port is None or port.type != "COMFY_AUTOGROW_V3":
        return None
    template = port.options["template"]
    index = slot.removeprefix(template.prefix)
    return template.input if index.isdigit() and int(index) < template.max else None


def _value_problem(port, value) -> str | None:
    o = port.options
    if port.type in ("INT", "FLOAT"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (port.type == "INT" and value != int(value)):
            return f"{value!r} is not {port.type}"
        if ("min" in o and value < o["min"]) or ("max" in o and value > o["max"]):
            return f"{value} outside {o.get('min')}..{o.get('max')}"
    elif port.type == "STRING" and not isinstance(value, str):
        return f"{value!r} is not a string"
    elif port.type == "BOOLEAN" and not isinstance(value, bool):
        return f"{value!r} is not a boolean"
    elif port.type == "COMBO":
        options = list(o.get("options", []))
        from_files = not options or options[0] == "tiny-random"  # a model folder's list: anything it may hold
        if from_files:
            if not (value == "tiny-random" or str(value).endswith(".safetensors")):
                return f"{value!r} is not tiny-random or a .safetensors file"
        elif value not in options:
            return f"{value!r} not in {options}"
    return None


def _types_meet(sent: str, accepted: str) -> bool:
    return "*" in (sent, accepted) or bool(set(sent.split(",")) & set(accepted.split(",")))


def _outputs(schemas, class_type):
    return schemas[class_type]["outputs"] if class_type in schemas else CORE[class_type][1]


@pytest.mark.parametrize("path", API, ids=[f"{p.parent.name}/{p.stem}" for p in API])
def test_api_prompt_matches_the_schemas(schemas, path):
    graph = json.loads(path.read_text())
    problems = []
    for node_id, node in graph.items():
        kind, inputs = node["class_type"], node["inputs"]
        if kind in CORE:
            problems += [f"{node_id} {kind}: no input {name}" for name in inputs if name not in CORE[kind][0]]
        elif kind not in schemas:
            problems.append(f"{node_id}: {kind} is neither ours nor a known core node")
            continue
        schema = schemas.get(kind)
        for name, value in inputs.items():
            port = _port(schema, name) if schema else None
            if schema and port is None:
                problems.append(f"{node_id} {kind}: no input {name}")
                continue
            if isinstance(value, list):  # a link [node id, output index]
                source = graph.get(value[0])
                if source is None or value[1] >= len(_outputs(schemas, source["class_type"])):
                    problems.append(f"{node_id}.{name}: link {value} to nothing")
                elif port is not None and not _types_meet(_outputs(schemas, source["class_type"])[value[1]], port.type):
                    problems.append(f"{node_id}.{name}: {source['class_type']} output {value[1]} is not {port.type}")
            elif port is not None:
                problem = _value_problem(port, value)
                if problem:
                    problems.append(f"{node_id} {kind}.{name}: {problem}")
        if schema:
            problems += [f"{node_id} {kind}: required {name} missing" for name, port in schema["inputs"].items()
                         if not port.optional and name not in inputs]
    assert not problems, "\n".join(problems)


def _widget_names(schema: dict) -> list[str]:
    return node_interface.widget_order([schema["inputs"][n] for n in schema["order"]])


@pytest.mark.parametrize("path", CANVAS, ids=[p.stem for p in CANVAS])
def test_canvas_workflow_matches_the_schemas_and_its_api_graph(schemas, path):
    workflow = json.loads(path.read_text())
    nodes = {node["id"]: node for node in workflow["nodes"]}
    template = json.loads((ROOT / "workflows" / "templates" / path.name).read_text())
    problems = []
    for node in nodes.values():
        kind = node["type"]
        if kind in FRONTEND_ONLY or kind in CORE:
            continue
        if kind not in schemas:
            problems.append(f"{node['id']}: {kind} is neither ours nor a known core node")
            continue
        schema, values = schemas[kind], node.get("widgets_values") or []
        names = _widget_names(schema)
        if len(values) != len(names):
            problems.append(f"{node['id']} {kind}: {len(values)} widget values for widgets {names}")
            continue
        api_inputs = template[str(node["id"])]["inputs"]
        for name, value in zip(names, values):
            if name.endswith(":control"):
                if value not in CONTROL_VALUES:
                    problems.append(f"{node['id']} {kind}.{name}: {value!r}")
                continue
            problem = _value_problem(schema["inputs"][name], value)
            if problem:
                problems.append(f"{node['id']} {kind}.{name}: {problem}")
            if name in api_inputs and not isinstance(api_inputs[name], list) and api_inputs[name] != value:
                problems.append(f"{node['id']} {kind}.{name}: canvas {value!r}, API graph {api_inputs[name]!r}")
        for slot in node.get("inputs", []):
            if slot.get("link") is not None and _port(schema, slot["name"]) is None:
                problems.append(f"{node['id']} {kind}: linked input {slot['name']} not in the schema")
        # the frontend shows a canvas node's saved inputs: one saved before an input was added would lack it
        saved = {slot["name"].partition(".")[0] for slot in node.get("inputs", [])}
        missing = [name for name in schema["order"] if name not in saved and name not in names]
        if missing:
            problems.append(f"{node['id']} {kind}: no input slot for {', '.join(missing)}")
    for link_id, source, out_slot, target, in_slot, kind in workflow["links"]:
        src, dst = nodes.get(source), nodes.get(target)
        if src is None or dst is None:
            problems.append(f"link {link_id}: node missing")
            continue
        if link_id not in (src["outputs"][out_slot].get("links") or []) or dst["inputs"][in_slot].get("link") != link_id:
            problems.append(f"link {link_id}: the nodes do not list it")
        if kind != _outputs(schemas, src["type"])[out_slot]:
            problems.append(f"link {link_id}: type {kind}, but {src['type']} output {out_slot} is "
                            f"{_outputs(schemas, src['type'])[out_slot]}")
    ours = sorted(n["type"] for n in nodes.values() if n["type"] not in FRONTEND_ONLY)
    assert ours == sorted(node["class_type"] for node in template.values()), "canvas and API graph differ"
    assert not problems, "\n".join(problems)


def _in_order_within(part: list, whole: list) -> bool:
    rest = iter(whole)
    return all(any(value == other for other in rest) for value in part)


@pytest.mark.parametrize("path", CANVAS, ids=[p.stem for p in CANVAS])
def test_canvas_named_widget_values_agree(path):
    """The frontend saves each widget's value twice, by position and by name (`widgets_values_named`), and a
    setting restores a node from the names: a canvas edited by position only would open with stale values there
    (session 51 found old file names, another template's prompt and file prefix)."""
    workflow = json.loads(path.read_text())
    template = json.loads((ROOT / "workflows" / "templates" / path.name).read_text())
    problems = []
    for node in workflow["nodes"]:
        named = node.get("widgets_values_named")
        if named is None:
            problems.append(f"{node['id']} {node['type']}: no widgets_values_named")
            continue
        if not _in_order_within(list(named.values()), node.get("widgets_values") or []):
            problems.append(f"{node['id']} {node['type']}: by name {named}, by position {node['widgets_values']}")
        api_inputs = template.get(str(node["id"]), {}).get("inputs", {})
        for name, value in named.items():
            if name in api_inputs and not isinstance(api_inputs[name], list) and api_inputs[name] != value:
                problems.append(f"{node['id']} {node['type']}.{name}: by name {value!r}, API graph {api_inputs[name]!r}")
    assert not problems, "\n".join(problems)


def test_every_task_has_an_api_prompt_and_a_template():
    names = {p.stem for p in (ROOT / "workflows" / "api").glob("*.json")}
    canvas = {p.stem for p in CANVAS}
    wanted = {"t2va", "t2va_turbo", "fl2va_first", "fl2va_last", "fl2va_first_last", "ref2va_images",
              "ref2va_image_audio", "ref2va_video", "t2va_guides", "long_video", "long_video_guides", "extend_video",
              "extend_my_video", "sound_for_my_video", "video_for_my_sound"}
    assert wanted <= names and wanted == canvas


def test_every_input_says_what_it_is_for(schemas):
    missing = [f"{node_id}.{name}" for node_id, schema in schemas.items() for name, port in schema["inputs"].items()
               if not port.options.get("tooltip")]
    assert not missing, missing


# the folder each loader lists its files from (nodes/loaders.py, nodes/sampler.py)
LOADER_FOLDERS = {"H3ModelLoader": "diffusion_models", "H3TextEncoderLoader": "text_encoders", "H3VAELoader": "vae",
                  "H3LoRAApply": "loras"}


@pytest.mark.parametrize("path", CANVAS, ids=[p.stem for p in CANVAS])
def test_canvas_loaders_carry_download_links_for_their_files(path):
    """Each loader of a canvas workflow names the files it selects in `properties.models` (what ComfyUI's frontend
    offers to download when they are missing), in the folder it lists them from, each a Hugging Face link to that
    file; the note names them too; the files are as tools/workflows.py links them."""
    import workflows

    canvas = json.loads(path.read_text())
    note = next(node["widgets_values"][0] for node in canvas["nodes"] if node["type"] == "MarkdownNote")
    loaders = [node for node in canvas["nodes"] if node["type"] in LOADER_FOLDERS]
    assert {node["type"] for node in loaders} >= {"H3ModelLoader", "H3TextEncoderLoader", "H3VAELoader"}
    for node in loaders:
        files = [value for value in node["widgets_values"] if isinstance(value, str) and value.endswith(".safetensors")]
        assert files and all(name in workflows.DOWNLOADS for name in files), (node["type"], files)
        models = node["properties"]["models"]
        assert [model["name"] for model in models] == files
        for model in models:
            assert model["directory"] == LOADER_FOLDERS[node["type"]]
            assert re.fullmatch(r"https://huggingface\.co/[\w.-]+/[\w.-]+/resolve/main/([\w.-]+/)?" + re.escape(model["name"]),
                                model["url"]), model["url"]
            assert model["name"].removesuffix(".safetensors") in note
    assert workflows.link_models(json.loads(path.read_text())) == canvas


@pytest.mark.parametrize("path", CANVAS, ids=lambda p: p.stem)
def test_each_template_has_its_thumbnail(path):
    """ComfyUI's template browser asks for example_workflows/NAME.jpg (a .jpg: the frontend names no other kind for
    a pack's templates) and shows a broken card without it; tools/thumbnails.mjs and .py make them."""
    from PIL import Image

    thumbnail = path.with_suffix(".jpg")
    assert thumbnail.is_file(), f"{thumbnail.name} is missing: make it with tools/thumbnails.mjs and .py"
    with Image.open(thumbnail) as image:
        assert image.format == "JPEG" and image.width == 512 and 200 <= image.height <= 384
    assert thumbnail.stat().st_size < 80 * 1024
    assert {p.stem for p in path.parent.glob("*.jpg")} == {p.stem for p in CANVAS}  # none left of a removed template
