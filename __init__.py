"""ComfyUI entry point of the H3 node pack.

ComfyUI imports this file from custom_nodes/; the engine lives in `h3_core` (no ComfyUI imports) and
the nodes in `nodes/`. The node list is empty until the nodes land (see nodes/README.md), so the
pack loads cleanly in ComfyUI today and adds nothing to the canvas yet.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension  # only importable inside ComfyUI

    class H3Extension(ComfyExtension):
        async def get_node_list(self):
            return []

    return H3Extension()
