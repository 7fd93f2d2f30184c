// Shows, under H3 Conditioning, the canvas, frame count and real duration the request resolves to
// (frames snap up to 17n + 5), recomputed from the widgets as the user edits them, before queueing.
import { app } from "../../scripts/app.js";
import { describe, linkOrigin, resolveRequest, unlinkedValues, RELEASE_RULES, TINY_RULES } from "./h3_geometry.js";

function widgetValue(node, name) {
  return node.widgets?.find((w) => w.name === name)?.value;
}

// tiny-random encodes on its small demo canvas; read the text encoder loader wired to this node.
function rulesFor(node) {
  const input = node.inputs?.find((i) => i.name === "text_encoder");
  const loader = input?.link != null ? linkOrigin(node.graph, input.link) : null;
  const tiny = loader && widgetValue(loader, "text_encoder") === "tiny-random" && !widgetValue(loader, "folder");
  return tiny ? TINY_RULES : RELEASE_RULES;
}

app.registerExtension({
  name: "comfyui-h3.conditioning",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "H3Conditioning") return;
    const draw = nodeType.prototype.onDrawForeground;
    nodeType.prototype.onDrawForeground = function (ctx) {
      draw?.apply(this, arguments);
      if (this.flags?.collapsed) return;
      const values = unlinkedValues(this, ["task", "aspect_ratio", "width", "height", "duration"]);
      const text = describe(resolveRequest(values, rulesFor(this)));
      ctx.save();
      ctx.font = "12px sans-serif";
      ctx.fillStyle = text.startsWith("H3:") ? "#f88" : "#8c8";
      ctx.fillText(text, 4, this.size[1] + 16); // just under the node, clear of its widgets
      ctx.restore();
      this.h3Resolved = text; // read by tools/canvas.mjs
    };
  },
});
