"""Certificate revocation for device identities: a list the operator CA signs (issue 30).

A stolen or retired device key stays certified until ``not_after``; the operator revokes it
by serial (``fedfs ca revoke``). The list is a canonical-JSON document signed with the CA key:

    {format: fedfs-revocations/1, ca: key id, number: n, issued_at: t, revoked: [serials…]}

* the **server cannot forge** it (the devices check the signature against the pinned CA) and
  cannot roll it back unseen: ``number`` only grows, and a device remembers the highest it
  accepted (:class:`~.round_log.RoundLog`, persisted) and refuses a smaller one;
* the server **cannot withhold** it silently: a device that once accepted a list refuses a
  round without one; a device with ``DevicePolicy.max_revocation_age_s`` also refuses a first
  round without one, or a list issued longer ago than that — so the operator re-signs it
  regularly (``fedfs ca revoke --ca DIR`` with no serial re-issues it);
* the server copies the operator's current list into its state (``STATE/secagg_revocations.json``)
  and puts it in every secure task (``task["secagg"]["revocations"]``), where it is part of
  the context every signature binds: all devices of a round check one list. It also refuses
  advertisements of revoked certificates, so an honest round does not fail on them.

A device refuses a roster holding a revoked certificate (:meth:`SecAggDevice.share_keys`).
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .errors import RefusedError
from .identity import CaPublicKey, IdentityError, _b64, _load, _unb64, canonical, verify, SIG_BYTES

FORMAT = "fedfs-revocations/1"
FILENAME = "revocations.json"
"""The CA folder's current list (``fedfs ca revoke``)."""
SERVER_FILENAME = "secagg_revocations.json"
"""Where the server reads the list it sends (its state directory)."""


@dataclass(frozen=True)
class RevocationList:
    ca_key_id: str
    number: int
    issued_at: int
    revoked: tuple[str, ...]
    signature: bytes

    def tbs(self) -> dict[str, Any]:
        return {"format": FORMAT, "ca": self.ca_key_id, "number": self.number, "issued_at": self.issued_at,
                "revoked": list(self.revoked)}

    def to_json(self) -> dict[str, Any]:
        return {**self.tbs(), "signature": _b64(self.signature)}

    @classmethod
    def from_json(cls, doc: Any) -> "RevocationList":
        """Parse (not verify); :class:`IdentityError` if malformed."""
        if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
            raise IdentityError(f"not a {FORMAT} revocation list")
        ca, num, at, rev = doc.get("ca"), doc.get("number"), doc.get("issued_at"), doc.get("revoked")
        if not isinstance(ca, str) or len(ca) != 64:
            raise IdentityError("revocation list 'ca' must be a CA key id")
        for name, v in (("number", num), ("issued_at", at)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise IdentityError(f"revocation list {name!r} must be an int ≥ 0")
        if not isinstance(rev, list) or not all(isinstance(s, str) and s for s in rev):
            raise IdentityError("revocation list 'revoked' must be a list of certificate serials")
        return cls(ca, num, at, tuple(rev), _unb64(doc.get("signature"), "revocation list signature", SIG_BYTES))

    def verify(self, ca: CaPublicKey) -> None:
        if self.ca_key_id != ca.key_id or not verify(ca.public_key, self.signature, canonical(self.tbs())):
            raise IdentityError("the revocation list is not signed by the pinned CA")

    def save(self, path: str | os.PathLike[str]) -> None:
        from ...fileio import atomic_write_bytes

        atomic_write_bytes(path, json.dumps(self.to_json(), indent=1).encode(), mode=0o644)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RevocationList":
        return _load(cls, path, "the revocation list", "a fedfs revocation list (fedfs ca revoke writes one)")


def issue(ca: Any, previous: RevocationList | None, add: Iterable[str] = (), now: float | None = None) -> RevocationList:
    """The next list of ``ca`` (a :class:`~.identity.CertificateAuthority`): ``previous``'s
    serials plus ``add``, ``number`` one higher, issued now, signed."""
    revoked = tuple(sorted(set(previous.revoked if previous is not None else ()) | {str(s) for s in add}))
    unsigned = RevocationList(ca.public.key_id, (previous.number + 1) if previous is not None else 1,
                              int(time.time() if now is None else now), revoked, b"\0" * SIG_BYTES)
    return RevocationList(unsigned.ca_key_id, unsigned.number, unsigned.issued_at, revoked,
                          ca.sign_bytes(canonical(unsigned.tbs())))


def check_task_list(doc: Any, ca: CaPublicKey | None, max_age_s: float | None, last_number: int,
                    where: str, now: float | None = None) -> RevocationList | None:
    """The device's check of ``task["secagg"]["revocations"]``: signed by the pinned CA, not
    older than ``max_age_s`` (if set; then also required), not rolled back below the highest
    number this device accepted. :class:`RefusedError` naming the problem."""
    if doc is None:
        if last_number > 0:          # this deployment uses revocation: a task without the list is withheld
            raise RefusedError(f"{where}: the round carries no revocation list, and this device already accepted "
                               f"list number {last_number}: the server withholds it")
        if max_age_s is not None:
            raise RefusedError(f"{where}: the round carries no revocation list and this device requires one (at "
                               f"most {max_age_s:g} s old): a server withholding it could include revoked devices")
        return None
    if ca is None:
        raise RefusedError(f"{where}: a revocation list without a pinned CA to check it against")
    try:
        crl = RevocationList.from_json(doc)
        crl.verify(ca)
    except IdentityError as e:
        raise RefusedError(f"{where}: {e}") from None
    t = time.time() if now is None else now
    if max_age_s is not None and t - crl.issued_at > max_age_s:
        raise RefusedError(f"{where}: the revocation list (number {crl.number}) was issued {t - crl.issued_at:.0f} s "
                           f"ago, this device accepts at most {max_age_s:g} s: the operator must re-issue it "
                           "(fedfs ca revoke --ca DIR)")
    if crl.number < last_number:
        raise RefusedError(f"{where}: the revocation list is number {crl.number}, this device already saw number "
                           f"{last_number}: an older list (rolled back)")
    return crl


__all__ = ["RevocationList", "issue", "check_task_list", "FORMAT", "FILENAME", "SERVER_FILENAME"]
