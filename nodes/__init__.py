"""ComfyUI V3 nodes of the H3 pack, one family a file. Node modules import ComfyUI and are loaded only
by the pack's `comfy_entrypoint`; `convert` holds the ComfyUI-free adapters (tested without ComfyUI)."""
