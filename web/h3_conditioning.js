// Shows with H3 Conditioning the canvas, frame count and real duration the request resolves to (frames snap
// up to 17n + 5), recomputed from the widgets as the user edits them, before queueing: drawn just under the
// node on the classic canvas, and as a badge on the node under "Modern Node Design (Nodes 2.0)", whose nodes
// are HTML that a canvas drawing would sit behind.
import { app } from "../../scripts/app.js";
import {
  cleanPath, describe, linkOrigin, resolveRequest, unlinkedValues, RELEASE_RULES, TINY_RULES,
} from "./h3_geometry.js";

function widgetValue(node, name) {
  return node.widgets?.find((w) => w.name === name)?.value;
}

// tiny-random encodes on its small demo canvas; read the text encoder loader wired to this node.
function rulesFor(node) {
  const input = node.inputs?.find((i) => i.name === "text_encoder");
  const loader = input?.link != null ? linkOrigin(node.graph, input.link) : null;
  const tiny = loader && widgetValue(loader, "text_encoder") === "tiny-random"
    && !cleanPath(widgetValue(loader, "folder"));
  return tiny ? TINY_RULES : RELEASE_RULES;
}

function resolvedLine(node) {
  const values = unlinkedValues(node, ["task", "aspect_ratio", "width", "height", "duration"]);
  const text = describe(resolveRequest(values, rulesFor(node)));
  node.h3Resolved = text; // read by tools/canvas.mjs
  return text;
}

function nodes2() {
  return !!app.extensionManager?.setting?.get("Comfy.VueNodes.Enabled");
}

app.registerExtension({
  name: "comfyui-h3.conditioning",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "H3Conditioning") return;
    const draw = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      draw?.apply(this, arguments);
      if (this.flags?.collapsed || nodes2()) return;
      const text = resolvedLine(this);
      ctx.save();
      ctx.font = "12px sans-serif";
      ctx.fillStyle = text.startsWith("H3:") ? "#f88" : "#8c8";
      ctx.fillText(text, 4, this.size[1] + 16); // just under the node, clear of its widgets
      ctx.restore();
    };
  },
  nodeCreated(node) {
    // after the frontend's own badges (the Nodes 2.0 header leaves out the first); empty, so not drawn, on the
    // classic canvas
    if (node.comfyClass !== "H3Conditioning" || !Array.isArray(node.badges) || !window.LGraphBadge) return;
    node.badges.push(() => {
      const text = nodes2() ? resolvedLine(node) : "";
      return new window.LGraphBadge({ text, fgColor: text.startsWith("H3:") ? "#f88" : "#8c8", bgColor: "#222" });
    });
  },
});
