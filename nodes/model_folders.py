"""Where a loader reads from: the file chosen from ComfyUI's model folders, or a path typed into its folder box,
which must lie inside those folders unless the person running ComfyUI allows any path. ComfyUI's HTTP API queues
whatever a client sends: without the fence, anyone who can reach the server could have it read (and say what lies
at) any path on the machine."""

from __future__ import annotations

import os
from pathlib import Path

ANY_FOLDER_VARIABLE = "H3_ALLOW_ANY_FOLDER"
# the model kinds whose folders (models/..., or those extra_model_paths.yaml adds) a typed path may lie in
FENCED_KINDS = ("diffusion_models", "checkpoints", "text_encoders", "vae", "loras")


def clean_path(text: str) -> str:
    """A path typed or pasted into a text box: spaces around it and one pair of quotes around it dropped (Windows'
    "Copy as path" adds them)."""
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        text = text[1:-1].strip()
    return text


def any_folder_allowed(environ=os.environ) -> bool:
    """Whether ComfyUI was started with H3_ALLOW_ANY_FOLDER=1 (a machine only its user reaches)."""
    return environ.get(ANY_FOLDER_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def model_roots() -> list[str]:
    """ComfyUI's models folder and every folder registered for the fenced kinds, absolute."""
    import folder_paths

    roots = [folder_paths.models_dir]
    for kind in FENCED_KINDS:
        roots.extend(_folders_of(kind))
    return list(dict.fromkeys(os.path.normpath(os.path.abspath(root)) for root in roots))


def _folders_of(kind: str) -> list[str]:
    """ComfyUI's folders for a model kind (none for a kind this ComfyUI does not know)."""
    import folder_paths

    try:
        return list(folder_paths.get_folder_paths(kind))
    except KeyError:
        return []


def _inside(path: str, root: str) -> bool:
    try:
        return os.path.commonpath([os.path.normcase(path), os.path.normcase(root)]) == os.path.normcase(root)
    except ValueError:  # another drive (Windows)
        return False


def typed_path(text: str, kind: str) -> str:
    """The absolute path a folder box names ('' when empty). A relative one is looked for in ComfyUI's `kind`
    folders, then checkpoints, then the other model folders (a release folder kept once, in diffusion_models,
    is typed alike into all three loaders), else taken from the current folder, as before. Refused with what to
    do when it leads outside the model folders ('..' counts; a link placed inside them is followed, as ComfyUI
    does)."""
    import folder_paths

    typed = clean_path(text)
    path = os.path.expanduser(typed)
    if not path:
        return ""
    roots = model_roots()
    allowed = any_folder_allowed()
    fenced_in = lambda candidate: allowed or any(_inside(candidate, root) for root in roots)  # noqa: E731
    if not os.path.isabs(path):
        kinds = dict.fromkeys((kind, "checkpoints", *FENCED_KINDS))
        folders = [root for name in kinds for root in _folders_of(name)] + [folder_paths.models_dir]
        # only joins that stay inside the fence are looked at: '..' out of a model folder to a file that exists
        # there, and one that does not, are refused alike (the refusal told which, so what lay where)
        joins = [os.path.normpath(os.path.abspath(os.path.join(root, path))) for root in folders]
        found = next((joined for joined in joins if fenced_in(joined) and os.path.exists(joined)), None)
        if found is None and ".." not in Path(path).parts and not fenced_in(os.path.abspath(path)):
            # a name with no way out, in none of them (a typo): "outside" sent the user to move what is not there
            raise ValueError(f"{typed!r} is in none of ComfyUI's model folders (looked in "
                             f"{', '.join(dict.fromkeys(folders))}): check the name, or give its full path.")
        path = found or path
    path = os.path.normpath(os.path.abspath(path))
    if fenced_in(path):
        return path
    raise ValueError(f"{typed!r} is outside ComfyUI's model folders ({', '.join(roots)}). Move it (or a link to it) "
                     f"into one of them, or add its folder to extra_model_paths.yaml; on a ComfyUI only you can reach, "
                     f"start ComfyUI with {ANY_FOLDER_VARIABLE}=1 to let the H3 loaders read any path.")


def folder_problem(text, kind: str) -> str | None:
    """`typed_path`'s refusal for a loader's validate_inputs (None: fine, empty or linked)."""
    try:
        if isinstance(text, str):
            typed_path(text, kind)
    except ValueError as error:
        return str(error)
    return None


def model_path(kind: str, name: str, folder: str):
    """The path to load: a non-empty `folder` wins; else the chosen file of ComfyUI's `kind` folder."""
    import folder_paths

    return typed_path(folder or "", kind) or folder_paths.get_full_path_or_raise(kind, name)


def chosen_file(kind: str, name, folder) -> str | None:
    """`model_path` for a loader's `fingerprint_inputs`: None for tiny-random, a linked input (None there), a name
    ComfyUI cannot find or a folder outside the fence (execute says so)."""
    from h3_core.tiny import TINY_RANDOM

    if not isinstance(name, str) or not isinstance(folder, str) or (name == TINY_RANDOM and not clean_path(folder)):
        return None
    try:
        return model_path(kind, name, folder)
    except (OSError, KeyError, ValueError):  # not found, no such model folder, or fenced out
        return None
