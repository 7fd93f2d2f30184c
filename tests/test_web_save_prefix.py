"""web/h3_save_prefix.js: the H3 save nodes' filename_prefix gets the frontend's %date:...% / %Node.widget%
expansion, as its core save nodes' does (the frontend lists only its own). Run with node, against stand-ins
for the frontend's app.js and utils.js, where node is installed."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WEB = ROOT / "web"

APP = "export const app = { rootGraph: {}, extensions: [], registerExtension(e) { this.extensions.push(e); } };\n"
RUN = """
globalThis.window = { comfyAPI: { utils: { applyTextReplacements(app, value) {
  return value.replace(/%date:[^%]+%/g, '2026-12-01').replace(/%H3Sampler\\.seed%/g, '7');
} } } };
import { app } from "./scripts/app.js";
const { SAVE_NODES } = await import("./extensions/h3/h3_save_prefix.js");
const [extension] = app.extensions;
const results = {};
for (const name of ["H3AVSave", "H3SaveMP4", "H3SaveLatent", "SaveImage"]) {
  function Node() { this.widgets = [{ name: "filename_prefix", value: "H3/%date:yyyy-MM-dd%/s%H3Sampler.seed%" }]; }
  Node.prototype.onNodeCreated = function () { this.created = true; };
  await extension.beforeRegisterNodeDef(Node, { name });
  const node = new Node();
  node.onNodeCreated();
  const widget = node.widgets[0];
  results[name] = { created: node.created, sent: widget.serializeValue ? widget.serializeValue() : widget.value };
}
console.log(JSON.stringify({ results, listed: [...SAVE_NODES] }));
"""


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed: the extension is not run")
def test_the_h3_save_nodes_expand_their_prefix_as_core_save_nodes_do(tmp_path):
    (tmp_path / "scripts").mkdir()
    (tmp_path / "scripts" / "app.js").write_text(APP)
    (tmp_path / "extensions" / "h3").mkdir(parents=True)
    shutil.copy(WEB / "h3_save_prefix.js", tmp_path / "extensions" / "h3")
    (tmp_path / "run.mjs").write_text(RUN)
    out = json.loads(subprocess.run(["node", str(tmp_path / "run.mjs")], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    expanded = {"created": True, "sent": "H3/2026-12-01/s7"}
    assert out["results"] == {"H3AVSave": expanded, "H3SaveMP4": expanded, "H3SaveLatent": expanded,
                              "SaveImage": {"created": True, "sent": "H3/%date:yyyy-MM-dd%/s%H3Sampler.seed%"}}
    assert "/scripts/utils.js\"" not in (WEB / "h3_save_prefix.js").read_text()  # internal: the frontend warns on it
    interface = json.loads((ROOT / "tools" / "node_interface.json").read_text())  # every node's inputs, kept current
    assert set(out["listed"]) == {node for node, spec in interface.items() if "filename_prefix" in spec["inputs"]}

    # a frontend without window.comfyAPI: the prefix goes as typed (the queueing must not fail on it)
    start, end = RUN.index("globalThis.window"), RUN.index("import { app }")
    (tmp_path / "run.mjs").write_text(RUN[:start] + "globalThis.window = {};\n" + RUN[end:])
    out = json.loads(subprocess.run(["node", str(tmp_path / "run.mjs")], capture_output=True, text=True, check=True,
                                    timeout=60).stdout)
    assert out["results"]["H3AVSave"] == {"created": True, "sent": "H3/%date:yyyy-MM-dd%/s%H3Sampler.seed%"}
