"""ComfyUI entry point of the H3 node pack.

ComfyUI imports this file from custom_nodes/; the engine lives in `h3_core` (no ComfyUI imports) and
the nodes in `nodes/` (ComfyUI V3 schema). Node modules import ComfyUI, so they are imported only here,
when ComfyUI asks for the node list. The engine is imported as the top-level `h3_core` (its media modules
import it by that name), so there is one copy of it whether or not the pack was pip-installed.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from comfy_api.latest import ComfyExtension, io  # only importable inside ComfyUI

    if not hasattr(io, "Autogrow"):  # said once at start-up, instead of a bare AttributeError from a node module
        raise RuntimeError("comfyui-h3 needs ComfyUI 0.33 or newer (its reference inputs grow as they are "
                           "connected: io.Autogrow); update ComfyUI.")

    class H3Extension(ComfyExtension):
        async def get_node_list(self):
            import importlib.util
            import logging
            import os
            import sys

            here = os.path.dirname(os.path.abspath(__file__))
            found = importlib.util.find_spec("h3_core")
            if found is None:  # the pack was not pip-installed: use its own copy
                sys.path.append(here)
            else:  # h3_core is a namespace package: its first folder on the path is the one modules come from
                first = (list(found.submodule_search_locations or ()) or [os.path.dirname(found.origin or "")])[0]
                if os.path.realpath(first) != os.path.realpath(os.path.join(here, "h3_core")):
                    logging.getLogger("h3").warning(
                        "comfyui-h3: Python finds another copy of the engine, %s, before this pack's own: the nodes "
                        "use it, and fail to load if it is older than they are. Remove it (pip uninstall "
                        "comfyui-h3) or install this one in its place (python -m pip install --no-deps -e %s).",
                        first, here)
            from .nodes import node_list

            return node_list()

    return H3Extension()
