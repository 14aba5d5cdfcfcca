"""Named simulation scenarios: where ξ is pre-trained and where the clients live.

Personalization only has room to help where the frozen model ξ is *not* already good on the
clients' images. FedFS's own experiments are cross-domain (ξ on MS-Celeb-1M real faces,
clients on DigiFace-1M synthetic faces and VGGFace); a simulation whose ξ is pre-trained on
the same generator as its clients has almost no headroom (docs/personalization.md measures
both). A scenario fixes the data arguments that make the difference:

========================  ==========================================  ==========================
scenario                  ξ pre-trained on                            clients
========================  ==========================================  ==========================
``in-domain``             SynthFaces, default look                    SynthFaces, default look
``cross-domain``          SynthFaces ``studio`` (frontal, soft light)  SynthFaces ``phone``
``cross-domain-night``    SynthFaces ``studio``                       SynthFaces ``night``
``synth-to-folder``       SynthFaces ``studio``                       ``--data PATH`` (a folder)
``folder-to-folder``      ``--pretrain-data PATH``                    ``--data PATH``
``real-phone``            ``--data``'s public identities (or          ``--data PATH`` as phones
                          ``--pretrained``), photos as they are       capture them: capture shift
                                                                      ``phone``
``real-night``            as ``real-phone``                           capture shift ``night``
========================  ==========================================  ==========================

The ``real-*`` scenarios put real photos under the SynthFaces domains' capture conditions
(:mod:`device_sim.capture_shifts`: low light, side light, colour style, greyscale, blur, noise,
low resolution, JPEG, masks) — on the clients' and new users' photos only: ξ's public
identities, and the public impostor set taken from them, stay as they are.

``phone`` changes how faces look, not only how hard they are: wider pose, harsh directional
light, a desaturated warm colour style with gamma and contrast changes, face masks on a third
of the images, stronger blur, sensor noise and a texture overlay
(:mod:`device_sim.synth_domains`). Identities keep their index across domains, so the
public / client / new-user split is one split of one universe and ξ never sees a client.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from fedfs_sdk.errors import InputError

if TYPE_CHECKING:
    from .experiment import DataConfig


@dataclass(frozen=True)
class Scenario:
    """Data settings a scenario fixes (``None``: left to the command line).

    Attributes:
        name: the ``--scenario`` value.
        summary: one line for ``--help`` and result tables.
        data: ``synth`` or ``None`` (the user's ``--data`` folder is required).
        pretrain_data: ``synth``, ``"same"`` (ξ on ``--data``'s public identities) or ``None``
            (the user's ``--pretrain-data`` folder is required).
        settings: other argument values (``domain``, ``pretrain_domain``, ``difficulty`` …).
    """

    name: str
    summary: str
    data: str | None = "synth"
    pretrain_data: str | None = "same"
    settings: dict[str, Any] = field(default_factory=dict)


SCENARIOS: dict[str, Scenario] = {s.name: s for s in (
    Scenario("in-domain", "ξ and clients from the same SynthFaces look (little headroom)",
             settings={"domain": "none", "pretrain_domain": "none"}),
    Scenario("cross-domain", "ξ on SynthFaces 'studio', clients on SynthFaces 'phone' (the main benchmark)",
             settings={"domain": "phone", "pretrain_domain": "studio"}),
    Scenario("cross-domain-night", "ξ on SynthFaces 'studio', clients on SynthFaces 'night'",
             settings={"domain": "night", "pretrain_domain": "studio"}),
    Scenario("synth-to-folder", "ξ on SynthFaces 'studio', clients from the --data folder",
             data=None, pretrain_data="synth", settings={"pretrain_domain": "studio", "public": 0}),
    Scenario("folder-to-folder", "ξ on the --pretrain-data folder, clients from the --data folder",
             data=None, pretrain_data=None, settings={"public": 0}),
    Scenario("real-phone", "the --data folder's photos as phones capture them (capture shift 'phone' on the "
             "clients' and new users' photos; ξ's public identities untouched)",
             data=None, settings={"capture_shift": "phone"}),
    Scenario("real-night", "the --data folder's photos captured at night (capture shift 'night' on the clients' "
             "and new users' photos)", data=None, settings={"capture_shift": "night"}),
)}


def apply_scenario(data: DataConfig) -> DataConfig:
    """``data`` with the settings of its ``scenario`` (unchanged without one); says what is missing."""
    name = data.scenario
    if not name:
        return data
    sc = SCENARIOS.get(name)
    if sc is None:
        raise InputError(f"unknown --scenario {name!r}; choose one of {sorted(SCENARIOS)}")
    changes: dict[str, Any] = {}
    if sc.data is None:
        if data.data == "synth":
            raise InputError(f"--scenario {name} needs the clients' images: pass --data PATH (an ImageFolder)")
    else:
        changes["data"] = sc.data
    if sc.pretrain_data is None:
        if not data.pretrain_data:
            raise InputError(f"--scenario {name} needs ξ's images: pass --pretrain-data PATH (an ImageFolder)")
    elif sc.pretrain_data == "synth":
        changes["pretrain_data"] = "synth"
    else:
        changes["pretrain_data"] = None
    return replace(data, **{**changes, **sc.settings})


def scenario_help() -> str:
    return "; ".join(f"{s.name}: {s.summary}" for s in SCENARIOS.values())


__all__ = ["Scenario", "SCENARIOS", "apply_scenario", "scenario_help"]
