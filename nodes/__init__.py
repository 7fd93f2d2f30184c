"""ComfyUI V3 nodes of the H3 pack, one family a file. Node modules import ComfyUI and are loaded only
by the pack's `comfy_entrypoint`; `convert` holds the ComfyUI-free adapters (tested without ComfyUI)."""


def node_list() -> list:
    """Every node class of the pack, in menu order (imports ComfyUI: call it only inside ComfyUI)."""
    from . import conditioning, latent, latent_files, loaders, long_video, output, sampler

    return [*loaders.NODES, *conditioning.NODES, *latent.NODES, *sampler.NODES, *output.NODES, *long_video.NODES,
            *latent_files.NODES]
