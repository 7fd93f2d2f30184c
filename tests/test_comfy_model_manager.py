"""Our ModelPatcher under the real ComfyUI model manager (COMFYUI_PATH; skipped without it), in a child process
started with --cpu so it imports ComfyUI's own model_management untouched by the other tests' fakes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

COMFYUI = os.environ.get("COMFYUI_PATH")
pytestmark = pytest.mark.skipif(not COMFYUI, reason="COMFYUI_PATH not set: ComfyUI's model manager is not here")

# A 48 GiB card (faked: free memory is 48 GiB less what the registered models hold) with a 3 GiB VAE on it, and a
# DiT of 62 GiB whose plan keeps 14 GiB there (a gpu_memory_gb budget): placing the DiT leaves the VAE loaded.
BUDGETED_DIT = r"""
import json, sys
import torch
sys.path[:0] = [sys.argv[1], sys.argv[2]]
import comfy.options
comfy.options.enable_args_parsing()
sys.argv = ["main.py", "--cpu"]
import comfy.model_management as mm
import importlib.util
spec = importlib.util.spec_from_file_location("h3nodes", sys.path[1] + "/nodes/__init__.py",
                                              submodule_search_locations=[sys.path[1] + "/nodes"])
package = importlib.util.module_from_spec(spec)
sys.modules["h3nodes"] = package
spec.loader.exec_module(package)
from h3nodes.memory import H3Patcher
from h3_core.placement import Placement

GIB, GPU, events = 2**30, torch.device("cuda", 0), []


class Planned(Placement):
    def __init__(self, name, size, planned):
        super().__init__(name, [], GPU, "cpu")
        self.size, self.planned = size, planned

    @property
    def planned_bytes(self):
        return self.planned

    @property
    def loaded_bytes(self):
        return self.planned if self.loaded else 0

    def _move(self, loaded):
        if self.loaded == loaded:
            return 0
        events.append(("load " if loaded else "unload ") + self.name)
        self.loaded = loaded
        return self.planned


def used():
    return sum(entry.model.loaded_size() for entry in mm.current_loaded_models)


mm.get_free_memory = lambda dev=None, torch_free_too=False: (48 * GIB - used(),) * 2 if torch_free_too else 48 * GIB - used()
mm.soft_empty_cache = lambda *args, **kwargs: None
vae, dit = H3Patcher(Planned("vae", 3 * GIB, 3 * GIB)), H3Patcher(Planned("dit", 62 * GIB, 14 * GIB))
mm.load_models_gpu([vae])
mm.load_models_gpu([dit], memory_required=2 * GIB)
print(json.dumps(events))
"""


def test_a_dit_placed_within_its_budget_leaves_the_models_that_fit_beside_it(tmp_path):
    """ComfyUI makes room for a model's size less what of it is loaded: told the whole DiT (62 GiB) when its plan
    keeps 14 GiB on the device, it unloaded the VAE (and text encoder) at every run however much room was left."""
    script = tmp_path / "budgeted_dit.py"
    script.write_text(BUDGETED_DIT)
    done = subprocess.run([sys.executable, str(script), COMFYUI, str(Path(__file__).resolve().parents[1])],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == ["load vae", "load dit"]
