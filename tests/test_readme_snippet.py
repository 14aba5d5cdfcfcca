"""The README's "Enroll and verify in an app" snippet runs as written (issue 12 #5): it is
extracted from README.md and executed in a folder holding the files it names."""
from __future__ import annotations

import re
from pathlib import Path

import cv2
import numpy as np
import torch

from device_sim.synthfaces import SynthFaces

README = Path(__file__).resolve().parents[1] / "README.md"


def app_snippet() -> str:
    text = README.read_text()
    section = text[text.index("## Enroll and verify in an app"):]
    m = re.search(r"```python\n(.*?)```", section, re.S)
    assert m is not None, "no python block in the README's app section"
    return m.group(1)


def test_readme_snippet_runs_as_written(tmp_path: Path, monkeypatch, capsys) -> None:
    from fedfs_sdk.nn.checkpoint import save_verifier
    from fedfs_sdk.nn.model import FaceNet, ModelConfig

    cfg = ModelConfig(backbone="tiny", width=4, embedding_dim=16, input_size=32)
    torch.manual_seed(0)
    save_verifier(tmp_path / "verifier.safetensors", FaceNet(cfg).backbone, cfg)
    faces = SynthFaces(seed=2, image_size=96)
    (tmp_path / "owner").mkdir()
    for k, im in enumerate(faces.render_uint8(7, np.arange(25))):
        path = tmp_path / ("probe.jpg" if k == 24 else f"owner/{k:02d}.jpg")
        assert cv2.imwrite(str(path), cv2.cvtColor(im, cv2.COLOR_RGB2BGR))
    monkeypatch.chdir(tmp_path)
    code = app_snippet()
    assert "..." not in code and "…" not in code          # nothing left for the reader to fill in
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    result = namespace["result"]
    assert isinstance(result.accepted, bool) and np.isfinite(result.score)
    assert (tmp_path / "owner.enr").is_file() and len(namespace["key"]) == 32
    assert str(result.accepted) in capsys.readouterr().out
