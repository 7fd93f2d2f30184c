"""web/h3_conditioning.js: the line saying what canvas, frames and duration H3 Conditioning resolves to shows on
the classic canvas (drawn under the node) and under "Modern Node Design (Nodes 2.0)" (a node badge: its nodes are
HTML, above any canvas drawing). Run with node, against a stand-in for the frontend's app.js, where node is
installed."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

APP = """export const settings = { "Comfy.VueNodes.Enabled": false };
export const app = { extensions: [], extensionManager: { setting: { get: (name) => settings[name] } },
  registerExtension(e) { this.extensions.push(e); } };
"""
RUN = """
globalThis.window = { LGraphBadge: class { constructor(options) { Object.assign(this, options); } } };
import { app, settings } from "./scripts/app.js";
await import("./extensions/h3/h3_conditioning.js");
const [extension] = app.extensions;
function Node() {
  this.comfyClass = "H3Conditioning";
  this.size = [300, 200];
  this.inputs = [];
  this.badges = [() => ({ text: "#4" })];  // the frontend's own, first
  this.widgets = [["task", "t2va"], ["aspect_ratio", "auto"], ["width", 0], ["height", 0], ["duration", 7.3]]
    .map(([name, value]) => ({ name, value }));
}
await extension.beforeRegisterNodeDef(Node, { name: "H3Conditioning" });
const node = new Node();
extension.nodeCreated(node);
const out = {};
for (const nodes2 of [false, true]) {
  settings["Comfy.VueNodes.Enabled"] = nodes2;
  const drawn = [];
  const ctx = { save() {}, restore() {}, fillText: (text) => drawn.push(text) };
  node.onDrawForeground(ctx);
  out[nodes2 ? "nodes2" : "classic"] = { drawn, badges: node.badges.slice(1).map((badge) => badge().text) };
}
// wired to a tiny-random text encoder loader whose folder box holds only spaces: the demo's small canvas
const loader = { type: "H3TextEncoderLoader", widgets: [{ name: "text_encoder", value: "tiny-random" },
                                                         { name: "folder", value: "   " }] };
node.inputs = [{ name: "text_encoder", link: 1 }];
node.graph = { links: { 1: { origin_id: 5 } }, getNodeById: (id) => (id === 5 ? loader : null) };
out.tiny = node.badges[1]().text;
console.log(JSON.stringify(out));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the extension is not run")
def test_the_resolved_line_shows_on_the_classic_canvas_and_under_nodes_2(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(APP)
    (tmp_path / "extensions" / "h3").mkdir(parents=True)
    for name in ("h3_conditioning.js", "h3_geometry.js"):
        shutil.copy(ROOT / "web" / name, tmp_path / "extensions" / "h3")
    (tmp_path / "run.mjs").write_text(RUN)
    out = json.loads(subprocess.run(["node", str(tmp_path / "run.mjs")], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    line = "1344x768, 175 frames = 7.292 s at 24 fps"  # 7.3 s snaps to 17n + 5 frames on the release canvas
    assert out["classic"] == {"drawn": [line], "badges": [""]}  # an empty badge is not drawn
    assert out["nodes2"] == {"drawn": [], "badges": [line]}
    assert out["tiny"] == "224x128, 175 frames = 7.292 s at 24 fps"
