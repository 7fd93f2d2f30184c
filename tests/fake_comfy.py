"""The few ComfyUI surfaces our nodes touch, faked, so their execute paths and schemas run in CI without
ComfyUI: `comfy_api.latest` (io, ui), `comfy.model_management`, `comfy.model_patcher`, `comfy.utils`,
`comfy.cli_args`, `comfy.latent_formats`, `comfy.nested_tensor`, `folder_paths`. Every schema call is recorded as plain data
(`schema_of`), which the workflow checks read. `installed(tmp_path)` puts the fakes in sys.modules for a block."""

from __future__ import annotations

import contextlib
import enum
import os
import sys
import types
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Port:
    """One input or output of a schema: its socket type and options as given."""

    id: str | None
    type: str
    options: dict = field(default_factory=dict)

    @property
    def optional(self) -> bool:
        return bool(self.options.get("optional"))

    @property
    def min(self):  # a number widget's bounds, as ComfyUI's inputs hold them
        return self.options.get("min")

    @property
    def max(self):
        return self.options.get("max")

    def get_io_type(self) -> str:
        return self.type


class _Socket:
    """io.Int, io.Image, io.Custom("H3_MODEL"), ...: `.Input(id, **options)` and `.Output(**options)`."""

    def __init__(self, io_type: str):
        self.io_type = io_type

    def Input(self, id, **options):  # noqa: N802 (ComfyUI's spelling)
        return Port(id, self.io_type, options)

    def Output(self, id=None, **options):  # noqa: N802
        return Port(id, self.io_type, options)


class _MultiType:
    @staticmethod
    def Input(id, types, **options):  # noqa: N802
        return Port(id, ",".join(t.io_type for t in types), options)


class _Autogrow:
    class TemplatePrefix:
        def __init__(self, input, prefix, min=1, max=10):  # noqa: A002 (ComfyUI's names)
            self.input, self.prefix, self.min, self.max = input, prefix, min, max

    @staticmethod
    def Input(id, template, **options):  # noqa: N802
        return Port(id, "COMFY_AUTOGROW_V3", {**options, "template": template})


@dataclass
class Schema:
    node_id: str
    display_name: str = ""
    category: str = ""
    description: str = ""
    inputs: list = field(default_factory=list)
    outputs: list = field(default_factory=list)
    hidden: list = field(default_factory=list)
    is_output_node: bool = False


class NodeOutput:
    def __init__(self, *values, ui=None):
        self.values, self.ui = values, ui


class ComfyNode:
    hidden = None  # ComfyUI sets the hidden values (prompt, unique_id, ...) on the class while it executes


class Hidden(str, enum.Enum):
    prompt = "PROMPT"
    extra_pnginfo = "EXTRA_PNGINFO"
    unique_id = "UNIQUE_ID"


class FolderType(str, enum.Enum):
    input = "input"
    output = "output"
    temp = "temp"


def _io_module() -> types.ModuleType:
    io = types.ModuleType("comfy_api.latest.io")
    for name, io_type in (("Int", "INT"), ("Float", "FLOAT"), ("String", "STRING"), ("Boolean", "BOOLEAN"),
                          ("Combo", "COMBO"), ("Image", "IMAGE"), ("Audio", "AUDIO"), ("Video", "VIDEO"),
                          ("Latent", "LATENT"), ("Sigmas", "SIGMAS"), ("Mask", "MASK")):
        setattr(io, name, _Socket(io_type))
    io.Custom = _Socket
    io.MultiType = _MultiType
    io.Autogrow = _Autogrow
    io.Schema, io.NodeOutput, io.ComfyNode, io.FolderType = Schema, NodeOutput, ComfyNode, FolderType
    io.Hidden = Hidden
    return io


@dataclass
class SavedResult:
    filename: str
    subfolder: str
    type: Any


class Recorder:
    """What the nodes asked of ComfyUI during a test."""

    def __init__(self):
        self.loaded, self.freed, self.progress = [], [], []
        self.bars = 0  # progress bars made
        self.interrupt_after: int | None = None  # raise after this many progress updates
        self.free_bytes = 1 << 40  # what get_free_memory reports


class LoadedModel:
    """ComfyUI's registry entry: a weak reference to the patcher (the node output keeps it alive)."""

    def __init__(self, patcher):
        self._patcher = weakref.ref(patcher)

    @property
    def model(self):
        return self._patcher()


FAKED = ("comfy", "comfy_api", "comfy_execution", "folder_paths", "nodes")  # top-level modules the fakes (and our nodes) fill


@contextlib.contextmanager
def installed(tmp_path: Path, **options):
    """`install` for the block, then every faked module and our node modules leave sys.modules again, and
    what was there before comes back (so the tests around see no fake)."""
    from h3_core import pinned

    saved = {name: module for name, module in sys.modules.items() if name.split(".")[0] in FAKED}
    for name in saved:  # a real ComfyUI imported by an earlier test must not mix with the fakes
        del sys.modules[name]
    host = pinned.host  # the nodes set it on import
    try:
        yield install(tmp_path, **options)
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] in FAKED]:
            del sys.modules[name]
        sys.modules.update(saved)
        pinned.host = host


def validate_node_input(received, wanted) -> bool:
    """ComfyUI 0.33's link-type rule, as its comfy_execution.validation states it: the same type; "*" or a
    MatchType on either side; a list of choices into a COMBO; else comma-joined unions that overlap."""
    if received == wanted or "COMFY_MATCHTYPE_V3" in (received, wanted):
        return True
    if isinstance(received, list):
        return wanted == "COMBO"
    sent, taken = ({t.strip() for t in str(kind).split(",")} for kind in (received, wanted))
    return "*" in sent | taken or bool(sent & taken)


def install(tmp_path: Path, loras: list[str] = (), previews: bool = True) -> Recorder:
    """Fake ComfyUI modules into sys.modules (the test removes our node modules first)."""
    record = Recorder()
    output_dir, input_dir = tmp_path / "output", tmp_path / "input"
    output_dir.mkdir(exist_ok=True)
    input_dir.mkdir(exist_ok=True)
    loras_dir = tmp_path / "loras"
    loras_dir.mkdir(exist_ok=True)

    latest = types.ModuleType("comfy_api.latest")
    latest.io = _io_module()
    latest.ui = types.SimpleNamespace(PreviewVideo=lambda results: {"videos": results}, SavedResult=SavedResult)
    latest.InputImpl = types.SimpleNamespace(VideoFromFile=lambda path: ("video file", str(path)))
    latest.ComfyExtension = object
    api = types.ModuleType("comfy_api")
    api.latest = latest

    import torch

    class Interrupted(Exception):
        pass

    mm = types.ModuleType("comfy.model_management")
    mm.InterruptProcessingException = Interrupted
    mm.get_torch_device = lambda: torch.device("cpu")
    mm.vae_device = lambda: mm.get_torch_device()  # the CPU under --cpu-vae
    mm.unet_offload_device = mm.text_encoder_offload_device = mm.vae_offload_device = lambda: torch.device("cpu")

    def load_models_gpu(models, memory_required=0, **_):
        record.loaded.append(([m.model.name for m in models], memory_required))
        for m in models:
            if not any(entry.model is m for entry in mm.current_loaded_models):
                mm.current_loaded_models.insert(0, LoadedModel(m))
            m.partially_load(m.load_device, 1e32)

    def unload_all_models():
        """As /free's "unload models": every registered model detaches and leaves the registry."""
        for entry in list(mm.current_loaded_models):
            if entry.model is not None:
                entry.model.detach(True)
        mm.current_loaded_models.clear()

    mm.current_loaded_models = []
    mm.load_models_gpu = load_models_gpu
    mm.unload_all_models = unload_all_models
    mm.free_memory = lambda nbytes, device, **_: record.freed.append((nbytes, str(device)))
    mm.get_free_memory = lambda device=None, torch_free_too=False: record.free_bytes
    mm.extra_reserved_memory = lambda: 0

    def check_interrupt():
        if record.interrupt_after is not None and len(record.progress) >= record.interrupt_after:
            raise Interrupted("interrupted")

    mm.throw_exception_if_processing_interrupted = check_interrupt

    class ModelPatcher:
        def __init__(self, model, load_device, offload_device, size=0, weight_inplace_update=False):
            self.model, self.load_device, self.offload_device, self.size = model, load_device, offload_device, size

    patcher_module = types.ModuleType("comfy.model_patcher")
    patcher_module.ModelPatcher = ModelPatcher

    class ProgressBar:
        def __init__(self, total):
            self.total = total
            record.bars += 1

        def update_absolute(self, value, total=None, preview=None):
            record.progress.append((value, total, preview))

    utils = types.ModuleType("comfy.utils")
    utils.ProgressBar = ProgressBar

    class LatentPreviewMethod(enum.Enum):
        NoPreviews = "none"
        Auto = "auto"

    cli_args = types.ModuleType("comfy.cli_args")
    cli_args.LatentPreviewMethod = LatentPreviewMethod
    cli_args.args = types.SimpleNamespace(preview_method=LatentPreviewMethod.Auto if previews else
                                          LatentPreviewMethod.NoPreviews, preview_size=512, disable_metadata=False)
    latent_formats = types.ModuleType("comfy.latent_formats")  # no H3 format: h3_core's false colour

    class NestedTensor:
        """ComfyUI's joint AV latent: its tensors in order, flagged nested."""

        def __init__(self, tensors):
            self.tensors, self.is_nested = list(tensors), True

        def unbind(self):
            return self.tensors

    nested_tensor = types.ModuleType("comfy.nested_tensor")
    nested_tensor.NestedTensor = NestedTensor
    comfy = types.ModuleType("comfy")
    comfy.model_management, comfy.model_patcher, comfy.utils = mm, patcher_module, utils
    comfy.cli_args, comfy.latent_formats, comfy.nested_tensor = cli_args, latent_formats, nested_tensor

    folder_paths = types.ModuleType("folder_paths")
    folders = {"loras": loras_dir}
    folder_paths.get_filename_list = lambda kind: sorted(os.listdir(folders[kind])) if kind in folders else []
    folder_paths.get_folder_paths = lambda kind: [str(folders.get(kind, tmp_path / kind))]
    folder_paths.models_dir = str(tmp_path)  # the kinds' folders lie in it, as in ComfyUI's models/

    def recursive_search(folder, excluded_dir_names=None):  # the files, and each directory's mtime (as ComfyUI's)
        found = [str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()]
        folders = [Path(folder), *(p for p in Path(folder).rglob("*") if p.is_dir())] if Path(folder).is_dir() else []
        return found, {str(p): p.stat().st_mtime for p in folders}

    folder_paths.recursive_search = recursive_search
    folder_paths.filter_files_extensions = lambda files, suffixes: sorted(
        f for f in files if os.path.splitext(f)[1].lower() in suffixes)

    def full_path(kind, name):
        path = folders.get(kind, tmp_path / kind) / name
        if not path.is_file():
            raise FileNotFoundError(f"Model in folder '{kind}' with filename '{name}' not found.")
        return str(path)

    folder_paths.get_full_path_or_raise = full_path
    folder_paths.get_output_directory = lambda: str(output_dir)
    folder_paths.get_input_directory = lambda: str(input_dir)

    def save_path(prefix, output_dir, width=0, height=0):
        subfolder, name = os.path.split(prefix)
        folder = os.path.join(output_dir, subfolder)
        os.makedirs(folder, exist_ok=True)
        counter = len(os.listdir(folder)) + 1
        return folder, name, counter, subfolder, prefix

    folder_paths.get_save_image_path = save_path

    execution, validation = types.ModuleType("comfy_execution"), types.ModuleType("comfy_execution.validation")
    validation.validate_node_input = validate_node_input
    for name, module in (("comfy_api", api), ("comfy_api.latest", latest), ("comfy", comfy),
                         ("comfy_execution", execution), ("comfy_execution.validation", validation),
                         ("comfy.model_management", mm), ("comfy.model_patcher", patcher_module),
                         ("comfy.utils", utils), ("comfy.cli_args", cli_args),
                         ("comfy.latent_formats", latent_formats), ("comfy.nested_tensor", nested_tensor),
                         ("folder_paths", folder_paths)):
        sys.modules[name] = module
    for name in [n for n in sys.modules if n == "nodes" or n.startswith("nodes.")]:
        if name != "nodes.convert":
            del sys.modules[name]
    return record


def schema_of(node_class) -> dict:
    """A node class's schema as data: {"inputs": {id: Port}, "order": [ids], "outputs": [types], ...}."""
    schema = node_class.define_schema()
    return {"node_id": schema.node_id, "inputs": {p.id: p for p in schema.inputs}, "order": [p.id for p in schema.inputs],
            "outputs": [p.type for p in schema.outputs], "output_is_list": [bool(p.options.get("is_output_list"))
                                                                         for p in schema.outputs]}
