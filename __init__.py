"""ComfyUI entry point of the H3 node pack.

ComfyUI imports this file from custom_nodes/; the engine lives in `h3_core` (no ComfyUI imports) and
the nodes in `nodes/` (ComfyUI V3 schema). Node modules import ComfyUI, so they are imported only here,
when ComfyUI asks for the node list. The engine is imported as the top-level `h3_core` (its media modules
import it by that name), so there is one copy of it whether or not the pack was pip-installed.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension  # only importable inside ComfyUI

    class H3Extension(ComfyExtension):
        async def get_node_list(self):
            import importlib.util
            import os
            import sys

            if importlib.util.find_spec("h3_core") is None:  # the pack was not pip-installed: use its own copy
                sys.path.append(os.path.dirname(os.path.abspath(__file__)))
            from .nodes import node_list

            return node_list()

    return H3Extension()
