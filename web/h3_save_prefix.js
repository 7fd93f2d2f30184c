// The frontend expands %date:yyyy-MM-dd% and %Node.widget% in a save node's filename_prefix when the prompt is
// queued, but only for the core save nodes it lists; the H3 save nodes get the same expansion here. The
// frontend's own expansion is taken from window.comfyAPI (importing scripts/utils.js logs that it is internal).
import { app } from "../../scripts/app.js";

// a frontend without it sends the prefix as typed rather than failing to queue
const applyTextReplacements = (app, value) => window.comfyAPI?.utils?.applyTextReplacements?.(app, value) ?? value;

export const SAVE_NODES = new Set(["H3AVSave", "H3SaveMP4", "H3SaveLatent"]);

app.registerExtension({
  name: "comfyui-h3.save-prefix",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!SAVE_NODES.has(nodeData.name)) return;
    const created = nodeType.prototype.onNodeCreated;
    nodeType.prototype.onNodeCreated = function () {
      const result = created?.apply(this, arguments);
      const prefix = this.widgets?.find((w) => w.name === "filename_prefix");
      if (prefix) prefix.serializeValue = () => applyTextReplacements(app, prefix.value);
      return result;
    };
  },
});
