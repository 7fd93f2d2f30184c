"""web/h3_geometry.js (what the canvas shows under H3 Conditioning before queueing) against the engine:
its constants always; its formulas by running it with node, where node is installed."""

import itertools
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from PIL import Image

from h3_core import geometry
from h3_core.conditioning import MAX_SECONDS, MIN_SECONDS, Request, RequestError, validate
from h3_core.pipeline import TINY_CANVAS
from h3_core.references import RELEASE_CANVAS

JS = Path(__file__).resolve().parents[1] / "web" / "h3_geometry.js"
RULES = {"release": RELEASE_CANVAS, "tiny": TINY_CANVAS}
DURATIONS = [3.9, 4.0, 4.05, 4.0625, 5.0, 5.1875, 5.2, 7.3, 9.99, 14.9, 15.0, 15.1]  # 4.0625, 5.1875: x.5 frames
SIZES = [(0, 0), (256, 128), (1344, 768), (96, 32), (160, 32), (100, 64), (256, 0)]
ASPECTS = ["auto", *geometry.ASPECT_RATIOS]


def test_constants_match_the_engine():
    text = JS.read_text()

    def const(name):
        return re.search(rf"export const {name} = (.+?);", text).group(1)

    assert int(const("FPS")) == geometry.FPS
    assert int(const("FRAMES_PER_CHUNK")) == geometry.FRAMES_PER_CHUNK
    assert int(const("LATENTS_PER_CHUNK")) == geometry.LATENTS_PER_CHUNK
    assert int(const("CANVAS_MULTIPLE")) == geometry.CANVAS_MULTIPLE
    assert (float(const("MIN_SECONDS")), float(const("MAX_SECONDS"))) == (MIN_SECONDS, MAX_SECONDS)
    for name, rules in (("RELEASE_RULES", RELEASE_CANVAS), ("TINY_RULES", TINY_CANVAS)):
        short, side_a, side_b = map(int, re.fullmatch(r"\{ shortEdge: (\d+), maxPixels: (\d+) \* (\d+) \}",
                                                      const(name)).groups())
        assert (short, side_a * side_b) == (rules.short_edge, rules.max_pixels)
    ratios = dict(re.findall(r'"(\d+:\d+)": \[(\d+, \d+)\]', const("ASPECT_RATIOS")))
    assert {k: tuple(map(int, v.split(", "))) for k, v in ratios.items()} == geometry.ASPECT_RATIOS


def _python(case: dict) -> dict:
    """What H3 Conditioning resolves (t2va; ref2va and fl2va with a named or explicit canvas agree)."""
    width, height = case["width"], case["height"]
    explicit = bool(width) or bool(height)
    request = Request("t2va", "x", aspect_ratio=None if explicit or case["aspect_ratio"] == "auto" else case["aspect_ratio"],
                      width=width if explicit else None, height=height if explicit else None,
                      duration=case["duration"])
    try:
        plan = validate(request, RULES[case["rules"]])
    except RequestError:
        return {"error": True}
    return {"width": plan.width, "height": plan.height, "frames": plan.num_frames}


def _run_js(body: str, payload):
    """`body` run by node as a module after `import * as g from h3_geometry.js` and `const input = <payload>`
    (JSON through stdin); what it prints is read back as JSON."""
    script = (f"import * as g from {json.dumps(JS.as_uri())};"
              "const input = JSON.parse((await import('node:fs')).readFileSync(0, 'utf8'));" + body)
    run = subprocess.run(["node", "--input-type=module", "-e", script], input=json.dumps(payload), capture_output=True,
                         text=True, timeout=60, check=True)
    return json.loads(run.stdout)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the JS formulas are not run")
def test_js_resolves_like_the_engine():
    cases = [dict(task="t2va", aspect_ratio=a, width=w, height=h, duration=d, rules=r)
             for a, (w, h), d, r in itertools.product(ASPECTS, SIZES, DURATIONS, RULES)]
    cases += [dict(task="fl2va", aspect_ratio="auto", width=0, height=0, duration=5.0, rules="release")]
    results = _run_js("console.log(JSON.stringify(input.map(c => g.resolveRequest(c, c.rules === 'tiny' ? "
                      "g.TINY_RULES : g.RELEASE_RULES))));", cases)
    *grid, keyframe = results
    assert keyframe["width"] is None and keyframe["frames"] == 124  # fl2va auto: the keyframe decides
    for case, js in zip(cases, grid):
        py = _python(case)
        if "error" in py or "error" in js:
            assert ("error" in py) == ("error" in js), (case, py, js)
            continue
        assert (js["width"], js["height"], js["frames"]) == (py["width"], py["height"], py["frames"]), case
        assert js["seconds"] == pytest.approx(py["frames"] / geometry.FPS)


def test_keyframe_canvas_is_the_engines():
    """The one case the JS leaves open (fl2va, auto) is the keyframe's shape under the same rules."""
    plan = validate(Request("fl2va", "x", first_image=Image.new("RGB", (300, 400))), RELEASE_CANVAS)
    assert (plan.width, plan.height) == RELEASE_CANVAS.canvas(300, 400)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the JS is not run")
def test_a_linked_value_is_said_to_come_from_its_link():
    """A widget whose socket is linked (H3 VAE Encode's width and height into H3 Conditioning, as H3 Sampler's docs
    suggest) keeps an old value the frontend does not send: the line showed the default 1344x768 for the clip's
    canvas. Linked values reach resolveRequest as undefined; what they decide is said to come from the links."""
    cases = {  # JSON has no undefined: a missing key is one
        "linked size": dict(task="t2va", aspect_ratio="auto", duration=5.0),
        "one side linked": dict(task="t2va", aspect_ratio="auto", width=1344, duration=5.0),
        "linked ratio": dict(task="t2va", width=0, height=0, duration=5.0),
        "linked task, auto": dict(aspect_ratio="auto", width=0, height=0, duration=5.0),
        "linked task, named ratio": dict(aspect_ratio="1:1", width=0, height=0, duration=5.0),
        "linked duration": dict(task="t2va", aspect_ratio="auto", width=0, height=0),
        "size given, ratio linked": dict(task="t2va", width=256, height=128, duration=5.0),
        "nothing linked": dict(task="t2va", aspect_ratio="auto", width=0, height=0, duration=5.0),
    }
    described = _run_js("console.log(JSON.stringify(Object.fromEntries(Object.entries(input).map("
                        "([k, c]) => [k, g.describe(g.resolveRequest(c))]))));", cases)
    assert described == {
        "linked size": "canvas from the links, 124 frames = 5.167 s at 24 fps",
        "one side linked": "canvas from the links, 124 frames = 5.167 s at 24 fps",
        "linked ratio": "canvas from the links, 124 frames = 5.167 s at 24 fps",
        "linked task, auto": "canvas from the links, 124 frames = 5.167 s at 24 fps",
        "linked task, named ratio": "768x768, 124 frames = 5.167 s at 24 fps",
        "linked duration": "1344x768, frame count from the linked duration",
        "size given, ratio linked": "256x128, 124 frames = 5.167 s at 24 fps",
        "nothing linked": "1344x768, 124 frames = 5.167 s at 24 fps",
    }


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the JS is not run")
def test_a_linked_widget_is_read_as_unknown():
    """unlinkedValues (what web/h3_conditioning.js reads the node with) leaves a linked socket's widget out: its
    value is stale. A socket named by its widget (the frontend's converted widgets) or by its own name counts."""
    node = {"widgets": [{"name": n, "value": v} for n, v in (("task", "t2va"), ("aspect_ratio", "auto"), ("width", 1344),
                                                           ("height", 768), ("duration", 5.0))],
            "inputs": [{"name": "text_encoder", "link": 1}, {"name": "width", "widget": {"name": "width"}, "link": 7},
                       {"name": "height", "widget": {"name": "height"}, "link": None}, {"name": "duration", "link": 9}]}
    unknown, values, line = _run_js(
        "const v = g.unlinkedValues(input, ['task', 'aspect_ratio', 'width', 'height', 'duration']);"
        "console.log(JSON.stringify([Object.keys(v).filter(k => v[k] === undefined), v,"
        " g.describe(g.resolveRequest(v))]));", node)
    assert unknown == ["width", "duration"] and values == {"task": "t2va", "aspect_ratio": "auto", "height": 768}
    assert line == "canvas from the links, frame count from the linked duration"
    assert "unlinkedValues(node, " in (JS.parent / "h3_conditioning.js").read_text()  # what the resolved line reads


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the JS is not run")
def test_a_typed_folder_is_cleaned_as_the_nodes_clean_it():
    """A folder box holding only spaces (or empty quotes) is empty to the nodes, so tiny-random's canvas holds."""
    from nodes.model_folders import clean_path

    typed = ["", "   ", '""', "' '", '"C:\\models\\h3"', "  /a b/c  ", "'x", '"a"b"']
    assert _run_js("console.log(JSON.stringify(input.map(g.cleanPath)));", typed) == [clean_path(t) for t in typed]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the JS is not run")
def test_the_text_encoder_loader_is_found_through_reroutes():
    """The line's canvas rules come from the text encoder loader wired in (tiny-random's small canvas): through a
    Reroute node the origin was the Reroute, so release sizes showed for a tiny-random graph."""
    graph = {"nodes": {"1": {"type": "H3TextEncoderLoader", "inputs": []},
                       "2": {"type": "Reroute", "inputs": [{"link": 10}]},
                       "3": {"type": "Reroute", "inputs": [{"link": 11}]},
                       "4": {"type": "Reroute", "inputs": [{"link": None}]}},
             "links": {"10": {"origin_id": 1}, "11": {"origin_id": 2}, "12": {"origin_id": 3}, "13": {"origin_id": 4},
                       "14": {"origin_id": 99}}}
    found = _run_js("const graph = {links: input.links, getNodeById: (id) => input.nodes[id] ?? null};"
                    "const asMap = {links: new Map(Object.entries(input.links).map(([k, v]) => [Number(k), v])),"
                    " getNodeById: graph.getNodeById};"
                    "console.log(JSON.stringify([10, 12, 13, 14, null].map(id => g.linkOrigin(graph, id)?.type ?? null)"
                    ".concat([g.linkOrigin(asMap, 12)?.type ?? null])));", graph)
    assert found == ["H3TextEncoderLoader", "H3TextEncoderLoader", None, None, None,
                                      "H3TextEncoderLoader"]
    assert "linkOrigin(node.graph, input.link)" in (JS.parent / "h3_conditioning.js").read_text()


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the JS is not run")
def test_the_text_encoder_loader_is_found_through_subgraph_inputs():
    """H3 Conditioning inside a subgraph whose text_encoder comes in through the subgraph's input: the loader is
    found where the subgraph's node is fed (the frontend's shapes: links from the input node's id, -10, at the
    input's slot; `rootGraph`, its `subgraphs` Map, `isSubgraphNode()`), through nested subgraphs too; a subgraph
    placed by two nodes cannot say which loader it gets (the release canvas is shown, as before)."""
    body = """
    const graphOf = (nodes, links, extra = {}) => {
      const g = {nodes, links, getNodeById: (id) => nodes.find((n) => n.id === id) ?? null, ...extra};
      nodes.forEach((n) => { n.graph = g; });
      return g;
    };
    const holder = (id, subgraph, link) => ({id, type: "sub", isSubgraphNode: () => true, subgraph,
                                             inputs: [{name: "other", link: null}, {name: "text_encoder", link}]});
    const root = graphOf([{id: 1, type: "H3TextEncoderLoader", inputs: []}], new Map([[20, {origin_id: 1}]]));
    root.rootGraph = root;
    const io = {slots: [{name: "text_encoder"}]};
    const inner = graphOf([], {30: {origin_id: g.SUBGRAPH_INPUT_ID, origin_slot: 0}}, {rootGraph: root, inputNode: io});
    const outer = graphOf([], {40: {originIsIoNode: true, origin_slot: 0}, 41: {originIsIoNode: true, origin_slot: 0}},
                          {rootGraph: root, inputNode: io});
    outer.nodes.push(Object.assign(holder(7, inner, 41), {graph: outer}));
    root.nodes.push(Object.assign(holder(5, outer, 20), {graph: root}));
    root.subgraphs = new Map([["outer", outer], ["inner", inner]]);
    const found = [g.linkOrigin(inner, 30)?.type ?? null, g.linkOrigin(outer, 40)?.type ?? null];
    root.nodes.push(Object.assign(holder(6, outer, 20), {graph: root}));  // placed twice
    found.push(g.linkOrigin(outer, 40)?.type ?? null);
    console.log(JSON.stringify(found));
    """
    assert _run_js(body, None) == ["H3TextEncoderLoader", "H3TextEncoderLoader", None]
