"""`h3 generate`'s outputs: never one of the run's own input files, and their names checked with the option
named, before any model loads."""

import errno
import os
import re
import tempfile
from pathlib import Path

import pytest
import torch
from PIL import Image
from wav_files import write_wav

from h3_core import pipeline
from h3_core.cli import main
from h3_core.output import AVLatents


@pytest.fixture
def no_model_loads(monkeypatch):
    for name in ("load_text_encoder_for", "load_vaes", "load_sampling_dit"):
        monkeypatch.setattr(pipeline, name, lambda *a, **k: pytest.fail("a model was loaded"))


@pytest.fixture
def inputs(tmp_path):
    """Input files whose names an output could take: a sound and a picture named .mp4, a 5 s tiny clip's latents."""
    write_wav(tmp_path / "mine.mp4", 4.0)
    write_wav(tmp_path / "take_00001.mp4", 4.0)
    Image.new("RGB", (224, 128), "red").save(tmp_path / "still.mp4", format="PNG")
    AVLatents(torch.zeros(1, 24, 37, 8, 14), torch.zeros(2, 32, 207)).save(tmp_path / "src.safetensors")
    os.symlink(tmp_path / "mine.mp4", tmp_path / "link.mp4")
    os.link(tmp_path / "src.safetensors", tmp_path / "hard.safetensors")
    return tmp_path


@pytest.mark.parametrize("options, message", [
    (["--drive-audio", "{tmp}/mine.mp4", "--out", "{tmp}/mine.mp4"], r"--out \S*mine.mp4 would overwrite its --drive-audio"),
    (["--drive-audio", "{tmp}/mine.mp4", "--out", "{tmp}/link.mp4"], r"--out \S*link.mp4 would overwrite its --drive-audio"),
    (["--drive-audio", "{tmp}/take_00001.mp4", "--outputs", "2", "--out", "{tmp}/take.mp4"],
     r"--out \S*take_00001.mp4 would overwrite its --drive-audio"),
    (["--guide", "0:image={tmp}/still.mp4", "--out", "{tmp}/still.mp4"], "would overwrite its --guide"),
    (["--task", "fl2va", "--first-image", "{tmp}/still.mp4", "--out", "{tmp}/still.mp4"], "would overwrite its --first-image"),
    (["--task", "ref2va", "--ref", "image={tmp}/still.mp4", "--out", "{tmp}/still.mp4"], "would overwrite its --ref"),
    (["--long-video", "--continue-from", "{tmp}/src.safetensors", "--duration", "12", "--save-latents",
      "{tmp}/src.safetensors"], r"--save-latents \S*src.safetensors would overwrite its --continue-from"),
    (["--long-video", "--continue-from", "{tmp}/src.safetensors", "--duration", "12", "--save-latents",
      "{tmp}/hard.safetensors"], r"--save-latents \S*hard.safetensors would overwrite its --continue-from"),
    (["--keep", "audio", "--from", "{tmp}/src.safetensors", "--save-latents", "{tmp}/src.safetensors"],
     "would overwrite its --from"),
])
def test_an_output_never_overwrites_an_input(inputs, no_model_loads, capsys, options, message):
    before = {path.name: path.read_bytes() for path in inputs.iterdir()}
    assert main(["generate", "--prompt", "a fox", "--steps", "2", *(option.format(tmp=inputs) for option in options)]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error), error
    assert error.startswith("h3: error: ") and "an output may not be one of the run's input files" in error
    assert {path.name: path.read_bytes() for path in inputs.iterdir()} == before


def test_a_batch_never_overwrites_its_file_or_another_jobs_input(inputs, no_model_loads, capsys):
    jobs = inputs / "jobs.safetensors"  # a jobs file that a line's --save-latents names
    jobs.write_text(f"--prompt x --save-latents {jobs}\n")
    assert main(["generate", "--batch", str(jobs), "--steps", "2", "--duration", "4"]) == 2
    assert re.search(r"line 1: --save-latents \S*jobs.safetensors would overwrite its --batch", capsys.readouterr().err)
    jobs = inputs / "jobs.txt"
    jobs.write_text(f"--prompt x --drive-audio {inputs}/mine.mp4 --out {inputs}/a.mp4\n--prompt y --out {inputs}/mine.mp4\n")
    assert main(["generate", "--batch", str(jobs), "--steps", "2", "--duration", "4"]) == 2
    error = capsys.readouterr().err
    assert re.search(r"line 2: --out \S*mine.mp4 would overwrite --batch \S*jobs.txt, line 1's --drive-audio", error), error


@pytest.mark.parametrize("out, message", [
    ("{tmp}/.mp4", "--out must name a file such as clip.mp4; got '.mp4'."),
    ("{tmp}/.MP4", "--out must name a file such as clip.mp4; got '.MP4'."),
    ("", "--out must name a file such as clip.mp4; got an empty name."),
    ("{tmp}/clip.mov", r"--out \S*clip.mov must end in .mp4 \(any case\)."),
    ("{tmp}/afolder", r"--out \S*afolder is a folder; give the output file's name."),
    ("{tmp}/afile/b.mp4", r"Cannot write --out \S*afile/b.mp4: \S*afile is a file, not a folder."),
    ("{tmp}/afile/deeper/b.mp4", r"Cannot write --out \S*afile/deeper/b.mp4: \S*afile is a file, not a folder."),
])
def test_a_bad_out_name_says_so_with_the_option(tmp_path, no_model_loads, capsys, out, message):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "afolder").mkdir()
    assert main(["generate", "--prompt", "a fox", "--steps", "2", "--out", out.format(tmp=tmp_path)]) == 2
    error = capsys.readouterr().err
    assert re.fullmatch(f"h3: error: {message}\n", error), error


@pytest.mark.parametrize("option, name", [("--out", "m.mp4"), ("--save-latents", "m.safetensors")])
def test_each_numbered_output_is_checked_before_the_run(tmp_path, no_model_loads, capsys, option, name):
    """--outputs 3 writes m_00000 .. m_00002: a folder in the way of the third was found once the first two were
    made (for latents as a raw errno naming a temporary file)."""
    third = tmp_path / name.replace(".", "_00002.")
    third.mkdir()
    assert main(["generate", "--prompt", "x", "--steps", "2", "--outputs", "3", option, str(tmp_path / name)]) == 2
    assert capsys.readouterr().err == (f"h3: error: {option} {third} is a folder; give the output file's name (the "
                                       "run writes 3 numbered files).\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == [third.name]


def test_a_refused_run_makes_no_output_folder(tmp_path, no_model_loads, capsys, monkeypatch):
    """The output's folders are made when it is written: a run refused after the output check (a missing guide, a
    missing sound to encode) leaves none behind; a folder that cannot be made is still said before the run."""
    for argv in (["generate", "--prompt", "x", "--steps", "2", "--out", str(tmp_path / "new" / "deeper" / "x.mp4"),
                  "--guide", f"0:image={tmp_path / 'missing.png'}"],
                 ["generate", "--prompt", "x", "--steps", "2", "--save-latents", str(tmp_path / "new" / "x.safetensors"),
                  "--lora", str(tmp_path / "missing.safetensors")],
                 ["encode", str(tmp_path / "missing.mp4"), "--out", str(tmp_path / "new" / "x.safetensors")]):
        assert main(argv) == 2, argv
        assert "missing" in capsys.readouterr().err
        assert not (tmp_path / "new").exists(), argv
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    if os.access(locked, os.W_OK):  # root writes anywhere: the refusal a user would meet, made for it
        made = tempfile.NamedTemporaryFile

        def refused(*args, dir=None, **kwargs):
            if Path(dir) == locked:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
            return made(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "NamedTemporaryFile", refused)
    assert main(["generate", "--prompt", "x", "--out", str(locked / "new" / "x.mp4")]) == 2
    assert re.search(r"Cannot write --out \S*locked/new/x.mp4: Permission denied", capsys.readouterr().err)


def test_an_upper_case_mp4_is_taken(tmp_path, monkeypatch, capsys):
    def stop(*args, **kwargs):
        raise ValueError("stopped before the text encoder")

    monkeypatch.setattr(pipeline, "load_text_encoder_for", stop)
    assert main(["generate", "--prompt", "a fox", "--steps", "2", "--out", str(tmp_path / "CLIP.MP4")]) == 2
    assert "h3: error: stopped before the text encoder" in capsys.readouterr().err


def test_a_one_line_batch_names_its_line(tmp_path, no_model_loads, capsys):
    jobs = tmp_path / "jobs.txt"
    for lines in (["--prompt x --duration 99 --out a.mp4"], ["--prompt x --out a.mp4", "--prompt y --duration 99 --out b.mp4"]):
        jobs.write_text("\n".join(lines) + "\n")
        assert main(["generate", "--batch", str(jobs)]) == 2
        error = capsys.readouterr().err
        assert f"h3: error: --batch {jobs}, line {len(lines)}: The duration must be between 4 and 15 seconds" in error


def test_output_into_a_closed_pipe_ends_quietly():
    """`h3 env | head` printed 'h3: error: [Errno 32] Broken pipe' (twice: once more at Python's exit flush)."""
    import subprocess
    import sys

    done = subprocess.Popen([sys.executable, "-m", "h3_core.cli", "env"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    done.stdout.close()  # the reader is gone before anything is written
    said = done.stderr.read().decode()
    assert done.wait(timeout=300) == 1 and said == ""


def test_the_mp4s_quality_is_the_users(tmp_path, no_model_loads, monkeypatch, capsys):
    """--crf sets x264's constant quality of the MP4 (it was fixed at 18); out of 0..51 it is refused at once."""
    assert main(["generate", "--prompt", "x", "--crf", "52", "--out", str(tmp_path / "x.mp4")]) == 2
    assert "h3: error: --crf must be an integer from 0 (lossless) to 51 (worst), got 52." in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--crf", "10", "--save-latents", str(tmp_path / "x.safetensors")]) == 2
    assert ("h3: error: --crf 10 sets the MP4's quality; this run writes no MP4 (no --out): drop it, or give --out "
            "FILE.mp4.") in capsys.readouterr().err  # it was taken and ignored
    monkeypatch.undo()
    written = []

    def write_mp4(path, *args, crf, **kwargs):
        written.append(crf)
        return Path(path)

    monkeypatch.setattr(pipeline, "write_mp4", write_mp4)
    assert main(["generate", "--prompt", "x", "--steps", "2", "--duration", "4", "--crf", "30",
                 "--out", str(tmp_path / "x.mp4")]) == 0
    assert written == [30]


def test_quiet_hides_the_progress_bars_and_keeps_the_result_line(tmp_path, capsys):
    """--quiet (-q) leaves a script's log with the result line and any warning, without bars."""
    for command, extra in (("generate", ["--prompt", "x", "--duration", "4"]), ("denoise", [])):
        argv = [command, *extra, "--steps", "2", "--save-latents", str(tmp_path / f"{command}.safetensors")]
        assert main(argv) == 0
        shown = capsys.readouterr()
        assert "%|" in shown.err and "safetensors" in shown.out  # a bar, unless told not to
        assert main(argv + ["-q"]) == 0
        shown = capsys.readouterr()
        assert "%|" not in shown.err and "safetensors" in shown.out
    clip = tmp_path / "clip.mp4"
    assert main(["generate", "--prompt", "x", "--duration", "4", "--steps", "2", "--quiet", "--out", str(clip)]) == 0
    capsys.readouterr()
    assert main(["encode", str(clip), "--out", str(tmp_path / "clip.safetensors"), "--quiet"]) == 0
    shown = capsys.readouterr()
    assert "%|" not in shown.err and "clip.safetensors" in shown.out


def test_quiet_is_the_whole_batchs(tmp_path, capsys):
    jobs = tmp_path / "jobs.txt"
    jobs.write_text(f"--prompt x --quiet --save-latents {tmp_path / 'a.safetensors'}\n")
    assert main(["generate", "--batch", str(jobs)]) == 2
    assert "--quiet applies to the whole batch" in capsys.readouterr().err
