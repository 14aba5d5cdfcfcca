"""Every method ``fedfs simulate --data DIR`` lists by default does no harm by default (issue 29
item 4): the trained ones run the do-no-harm selection (``select=auto``) — ``feduv`` too, which on
LFW with a real ξ lost 0.18 template AUROC without it — and their ``:paper`` presets keep the
papers' behaviour (no check) under a name the tables show."""
from __future__ import annotations

import argparse

from device_sim.cli_simulate import add_arguments
from device_sim.methods import parse_method


def default_methods() -> list[str]:
    p = argparse.ArgumentParser()
    add_arguments(p)
    return p.parse_args([]).method


def test_every_default_trained_method_selects_and_its_paper_preset_does_not():
    specs = default_methods()
    assert "feduv" in specs
    for spec in specs:
        m = parse_method(spec)
        if not hasattr(m, "select"):          # pretrained: ξ itself, nothing trained
            continue
        assert m.select == "auto", spec
        paper = parse_method(f"{spec}:paper")
        assert paper.select == "off" and "paper" in paper.label, paper.label
