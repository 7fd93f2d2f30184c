// Template thumbnails, step 1: screenshot each canvas workflow in a running ComfyUI (headless Chromium).
//   node tools/thumbnails.mjs URL example_workflows RAW_DIR      then   python tools/thumbnails.py RAW_DIR example_workflows
// For each example_workflows/NAME.json writes RAW_DIR/NAME.png (the whole graph at a readable zoom, the
// browser sized to it, ComfyUI's menus, toasts and minimap hidden) and RAW_DIR/NAME.json (its crop box).
// ComfyUI's template browser asks for example_workflows/NAME.jpg beside each workflow. Run the server with
// the pack in custom_nodes and empty files named as the workflows' models (else the loaders are outlined
// red as missing); Load Image / Video / Audio files are missing anyway, their red outline is cleared here.
// Needs playwright-core (PLAYWRIGHT_CORE = its path) and Chromium (CHROMIUM, default /usr/bin/chromium).
import fs from "node:fs";
import path from "node:path";
import { createRequire } from "node:module";

const require = createRequire(import.meta.url);
const { chromium } = require(process.env.PLAYWRIGHT_CORE || "playwright-core");
const [url, dir, rawDir] = process.argv.slice(2);
const SCALE = 0.85;      // canvas zoom: LiteGraph draws full text at this zoom
const PAD = 30;          // screen px around the graph
fs.mkdirSync(rawDir, { recursive: true });

const QUIET = {
  "Comfy.Minimap.Visible": false, "Comfy.Graph.CanvasInfo": false, "Comfy.Graph.CanvasMenu": false,
  "Comfy.Workflow.ShowMissingModelsWarning": false, "Comfy.Workflow.ShowMissingNodesWarning": false,
  "LiteGraph.Canvas.MinFontSizeForLOD": 0, "Comfy.VueNodes.Enabled": false,
};
let saved = null; // the server's settings before the first page changed them

// In the page: set `want`'s settings, returning the values they had (a setting this frontend lacks is skipped).
async function applySettings(want) {
  const s = window.app.extensionManager.setting;
  const had = {};
  for (const [k, v] of Object.entries(want)) {
    try { had[k] = s.get(k); await s.set(k, v); } catch (e) { delete had[k]; }
  }
  return had;
}

async function restoreSettings() {
  if (!saved) return;
  const page = await browser.newPage();
  await page.goto(url, { waitUntil: "networkidle" });
  await page.waitForFunction(() => window.app?.extensionManager?.setting, null, { timeout: 60000 });
  await page.evaluate(applySettings, saved);
  await page.close();
}

const browser = await chromium.launch({
  executablePath: process.env.CHROMIUM || "/usr/bin/chromium",
  args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update", "--no-first-run"],
});
try {
  for (const file of fs.readdirSync(dir).filter((f) => f.endsWith(".json")).sort()) {
    const name = file.replace(/\.json$/, "");
    const workflow = JSON.parse(fs.readFileSync(path.join(dir, file), "utf8"));
    const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
    const errors = [];
    page.on("pageerror", (e) => errors.push(e.message));
    await page.addInitScript(() => {
      localStorage.setItem("Comfy.TutorialCompleted", "true");
      localStorage.setItem("Comfy.Settings.Comfy.TutorialCompleted", "true");
    });
    await page.goto(url, { waitUntil: "networkidle" });
    await page.waitForFunction(() => window.app?.graph && window.LiteGraph, null, { timeout: 60000 });
    // quiet UI: no minimap, no canvas info / canvas menu, no missing-model/node dialogs, the classic canvas; the
    // server keeps settings, so the user's own are put back at the end
    const before = await page.evaluate(applySettings, QUIET);
    saved ??= before;
    // measure the graph (nodes with title bars, groups)
    const bounds = await page.evaluate(async (workflow) => {
      await window.app.loadGraphData(structuredClone(workflow));
      await new Promise((d) => setTimeout(d, 500));
      const g = window.app.graph;
      let x0 = Infinity, y0 = Infinity, x1 = -Infinity, y1 = -Infinity;
      const add = (x, y, w, h) => { x0 = Math.min(x0, x); y0 = Math.min(y0, y); x1 = Math.max(x1, x + w); y1 = Math.max(y1, y + h); };
      for (const n of g.nodes) { const b = n.boundingRect; add(b[0], b[1], b[2], b[3]); }
      for (const gr of g.groups ?? g._groups ?? []) { const b = gr._bounding ?? gr.boundingRect; add(b[0], b[1], b[2], b[3]); }
      return [x0, y0, x1, y1];
    }, workflow);
    const [bx0, by0, bx1, by1] = bounds;
    const width = Math.ceil((bx1 - bx0) * SCALE + 2 * PAD);
    const height = Math.ceil((by1 - by0) * SCALE + 2 * PAD);
    await page.setViewportSize({ width: Math.max(width, 800), height: Math.max(height, 500) });
    // hide menus/sidebars/toasts/dialogs; put the canvas over the whole page
    await page.addStyleTag({ content: `
      .comfyui-body-top, .comfyui-body-bottom, .comfyui-body-left, .comfyui-body-right, .comfy-menu,
      .p-toast, .p-dialog-mask, .p-dialog, .comfy-modal, .no-drag.fixed, .side-tool-bar-container,
      .graph-canvas-panel, .p-blockui, .node-tooltip,
      .graph-canvas-container > :not(canvas):not(.isolate) { display: none !important; }
      .graph-canvas-container { position: fixed !important; inset: 0 !important; }` });
    await page.keyboard.press("Escape");
    const info = await page.evaluate(async ({ bounds, SCALE, PAD }) => {
      await new Promise((d) => setTimeout(d, 300));
      const c = window.app.canvas;
      c.resize?.();
      c.deselectAll?.();
      c.ds.scale = SCALE;
      c.ds.offset = [PAD / SCALE - bounds[0], PAD / SCALE - bounds[1]];
      c.setDirty(true, true);
      await new Promise((d) => setTimeout(d, 1500));
      // red outlines mark files missing on this machine (input media), not a fault of the workflow
      const flagged = window.app.graph.nodes.filter((n) => n.has_errors).map((n) => n.type);
      for (const n of window.app.graph.nodes) n.has_errors = false;
      c.draw(true, true);
      await new Promise((d) => requestAnimationFrame(() => requestAnimationFrame(d)));
      const r = c.canvas.getBoundingClientRect();
      return { rect: [r.x, r.y, r.width, r.height], bg: c.clear_background_color,
               nodes: window.app.graph.nodes.length, flagged,
               still: window.app.graph.nodes.filter((n) => n.has_errors).map((n) => n.type) };
    }, { bounds, SCALE, PAD });
    const png = path.join(rawDir, `${name}.png`);
    await page.screenshot({ path: png });
    const crop = [info.rect[0], info.rect[1], info.rect[0] + width, info.rect[1] + height].map(Math.round);
    fs.writeFileSync(path.join(rawDir, `${name}.json`), JSON.stringify({ crop, bg: info.bg, bounds, errors }) + "\n");
    console.log(`${name}: ${info.nodes} nodes, graph ${Math.round(bx1 - bx0)}x${Math.round(by1 - by0)}, crop ${crop}, canvas ${info.rect}, error-flagged ${info.flagged} (after clearing: ${info.still})${errors.length ? ", page errors: " + errors.join(" | ") : ""}`);
    await page.close();
  }
} finally {
  await restoreSettings();
  await browser.close();
}
