"""What installers read: requirements.txt (ComfyUI Manager, comfy-cli), pyproject.toml (pip, the Comfy
registry) and the license they name."""
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def requirement_lines() -> list[str]:
    lines = (line.strip() for line in (ROOT / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def test_requirements_txt_is_pyproject_dependencies_without_torch():
    dependencies = pyproject()["project"]["dependencies"]
    assert any(name.startswith("torch") for name in dependencies)
    assert requirement_lines() == [name for name in dependencies if not name.startswith("torch")]


def test_license_file_is_the_one_pyproject_names():
    """An SPDX expression: setuptools ends support for the {text = ...} table in 2027."""
    assert pyproject()["project"]["license"] == "Apache-2.0" and pyproject()["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_registry_includes_exist():
    comfy = pyproject()["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    for folder in comfy["includes"]:
        assert (ROOT / folder).is_dir(), f"[tool.comfy] includes {folder!r}, which is not a folder"


def test_torch_is_not_capped():
    """A cap below the torch already installed made `pip install -e` replace it (ComfyUI's CUDA build with another):
    the range admits what this pack is tested on (2.11 on the GPU machine, 2.13 in CI, 2.14 in ComfyUI) and later."""
    (torch,) = [name for name in pyproject()["project"]["dependencies"] if name.startswith("torch")]
    assert torch.split("#")[0].strip() == "torch>=2.11"


def test_comfyui_entry_names_another_copy_of_the_engine_it_would_use(tmp_path, monkeypatch, caplog):
    """An older pip-installed h3_core found before the pack's own made the nodes fail to import with a bare
    ImportError; the entry point now says which copy Python found and how to replace it."""
    import asyncio
    import importlib.util
    import sys

    import fake_comfy

    real_find_spec = importlib.util.find_spec
    elsewhere = tmp_path / "site-packages" / "h3_core"
    spec = importlib.util.spec_from_file_location("comfyui_h3_pack", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    with fake_comfy.installed(tmp_path):
        pack = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "comfyui_h3_pack", pack)
        spec.loader.exec_module(pack)
        with caplog.at_level("WARNING", logger="h3"):
            assert asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
            assert not caplog.records  # this checkout's own h3_core
            other = importlib.machinery.ModuleSpec("h3_core", None, is_package=True)
            other.submodule_search_locations[:] = [str(elsewhere), str(ROOT / "h3_core")]  # ours second
            monkeypatch.setattr(importlib.util, "find_spec",
                                lambda name, *a: other if name == "h3_core" else real_find_spec(name, *a))
            asyncio.run(asyncio.run(pack.comfy_entrypoint()).get_node_list())
        for name in [name for name in sys.modules if name.startswith("comfyui_h3_pack.")]:
            del sys.modules[name]
    (record,) = caplog.records
    assert f"another copy of the engine, {elsewhere}, before" in record.getMessage()
    assert f"pip install --no-deps -e {ROOT}" in record.getMessage()


def test_comfyui_entry_says_an_older_comfyui_is_too_old(tmp_path, monkeypatch):
    """ComfyUI before 0.33 has no io.Autogrow: the pack says what it needs (pyproject's requires-comfyui too)."""
    import asyncio
    import importlib.util
    import sys

    import fake_comfy

    assert pyproject()["tool"]["comfy"]["requires-comfyui"] == ">=0.33.0"
    spec = importlib.util.spec_from_file_location("comfyui_h3_old", ROOT / "__init__.py",
                                                  submodule_search_locations=[str(ROOT)])
    with fake_comfy.installed(tmp_path):
        monkeypatch.delattr(sys.modules["comfy_api.latest"].io, "Autogrow")
        pack = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(pack)
        with pytest.raises(RuntimeError, match=r"comfyui-h3 needs ComfyUI 0.33 or newer"):
            asyncio.run(pack.comfy_entrypoint())


def test_the_registry_archive_leaves_out_what_develops_the_pack():
    """`comfy node pack` archives git's files minus .comfyignore (plus [tool.comfy] includes): the tests, benchmarks,
    CI and tools are not what a user installs; nothing the nodes or the engine read at run time is left out."""
    ignored = [line.strip() for line in (ROOT / ".comfyignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    assert set(ignored) == {"tests/", "bench/", ".ci/", ".github/", "tools/"}
    kept = ("__init__.py", "nodes", "h3_core", *pyproject()["tool"]["comfy"]["includes"])
    assert not any(entry.rstrip("/") in kept for entry in ignored)


def test_no_line_the_registrys_publish_check_flags():
    """`comfy node validate` (run before a registry publish) flags exec, eval and two statements on one line
    (ruff S102, S307, E702) in every Python file of the folder, .comfyignore'd ones too; soon an error."""
    import ast
    import io
    import subprocess
    import tokenize

    files = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True)
    flagged = []
    for name in files.stdout.split():
        source = (ROOT / name).read_text()
        flagged += [f"{name}:{token.start[0]}: ';'" for token in tokenize.generate_tokens(io.StringIO(source).readline)
                    if token.type == tokenize.OP and token.string == ";"]
        flagged += [f"{name}:{node.lineno}: {node.func.id}()" for node in ast.walk(ast.parse(source))
                    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("exec", "eval")]
    assert len(files.stdout.split()) > 100 and flagged == []
