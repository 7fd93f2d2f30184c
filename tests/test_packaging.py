"""What installers read: requirements.txt (ComfyUI Manager, comfy-cli), pyproject.toml (pip, the Comfy
registry) and the license they name."""
import tomllib
from pathlib import Path

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
    assert pyproject()["project"]["license"] == {"text": "Apache-2.0"}
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text


def test_registry_includes_exist():
    comfy = pyproject()["tool"]["comfy"]
    assert comfy["PublisherId"] and comfy["DisplayName"]
    for folder in comfy["includes"]:
        assert (ROOT / folder).is_dir(), f"[tool.comfy] includes {folder!r}, which is not a folder"
