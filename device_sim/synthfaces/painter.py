"""SynthFaces' painter: one chunk of images, drawn back to front on a ``[N, 1, S, S]`` grid.

The pixel grid is inverse-mapped to each image's face coordinates and ~30 layers (clothes,
hair, ears, face, fringe, beard, eyes, brows, nose, mouth, mask, glasses, hat, occluder) are
composited with in-place ``lerp_`` as soft signed-distance shapes; then illumination, blur,
sensor noise, the domain's colour processing and JPEG-like compression. No per-image Python
loop and no reduction across images: the same image comes out of any batch. Which optional
layers a chunk needs is decided from the numpy parameters, never from a device tensor, so
a CUDA chunk is launched without waiting for the GPU.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..synth_domains import STYLE_COLUMNS, apply_colour_style, apply_texture, draw_mask, style_params
from .hashing import DOMAIN_STYLE, hash_uniforms
from .params import MAX_BLUR, identity_params, image_params, look_params
from .shapes import circle, ellipse, ellipse_exact, jpeg_like, rotate, shift_sum, soft

if TYPE_CHECKING:
    from .generator import SynthFaces

__all__ = ["paint"]

_CONSTANTS: dict[tuple, torch.Tensor] = {}     # constant colours per device (no copy per chunk)


class _DeviceParams:
    """Every per-image parameter of a chunk on the device in one host→device copy.

    One copy instead of ~300: on CUDA each copy from pageable memory waits for the GPU, which
    would make rendering a chain of round trips. Each parameter keeps its own contiguous
    segment (row-major ``[N]`` or ``[N, 3]``), so every op sees the same layout as a tensor
    of its own and the pixels are unchanged.
    """

    def __init__(self, groups: tuple[dict[str, np.ndarray], ...], dev: torch.device) -> None:
        self.dev, self.where, arrays, off = dev, {}, [], 0
        for group in groups:
            for v in group.values():
                a = np.asarray(v, dtype=np.float32).reshape(-1)
                self.where[id(v)] = (off, a.size)
                arrays.append(a)
                off += a.size
        host = torch.from_numpy(np.concatenate(arrays))
        self.buf = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host

    def __call__(self, v: np.ndarray) -> torch.Tensor:
        hit = self.where.get(id(v))
        if hit is None:             # not one of the chunk's parameter arrays
            return torch.as_tensor(np.asarray(v, dtype=np.float32).reshape(-1), device=self.dev)
        off, n = hit
        return self.buf[off:off + n]


def paint(faces: "SynthFaces", ids: np.ndarray, idx: np.ndarray, dev: torch.device) -> torch.Tensor:
    """Render one chunk: float32 ``[N, 3, S, S]`` in (roughly) [0, 1], before quantization."""
    S, d, dom = faces.image_size, faces.difficulty, faces.domain
    ip = identity_params(faces.seed, ids)
    mp = image_params(faces.seed, ids, idx, d, faces.looks_per_identity, dom)
    sp = style_params(hash_uniforms([DOMAIN_STYLE, faces.seed, ids, idx], STYLE_COLUMNS), dom)
    lp = look_params(faces.seed, ids, mp["look"], ip["beardy"], ip["glassy"])
    n = ids.size
    P = _DeviceParams((ip, mp, sp, lp), dev)

    def T(a: np.ndarray) -> torch.Tensor:   # per-image scalar → [N,1,1,1]
        return P(a).view(-1, 1, 1, 1)

    def C(a: np.ndarray) -> torch.Tensor:   # per-image colour → [N,3,1,1]
        return P(a).view(-1, 3, 1, 1)

    def K(*rgb: float) -> torch.Tensor:     # constant colour → [1,3,1,1]
        key = (rgb, str(dev))
        if key not in _CONSTANTS:
            _CONSTANTS[key] = torch.tensor(rgb, dtype=torch.float32, device=dev).view(1, 3, 1, 1)
        return _CONSTANTS[key]

    lin = (torch.arange(S, device=dev, dtype=torch.float32) + 0.5) / S * 2 - 1
    X, Y = lin.view(1, 1, 1, S), lin.view(1, 1, S, 1)

    # --- background: two muted colours, a soft gradient and a low-frequency wave ------
    ang = T(mp["bg_ang"])
    g = torch.tanh(1.5 * (torch.cos(ang) * X + torch.sin(ang) * Y)).mul_(0.5).add_(0.5)
    img = C(mp["bg"]).expand(n, 3, S, S).clone()
    img.lerp_(C(mp["bg2"]), g)
    img.mul_(torch.sin(math.pi * (T(mp["bg_fx"]) * X + T(mp["bg_fy"]) * Y) + T(mp["bg_ph"])).mul_(0.05).add_(1))

    # --- pose: image → face coordinates (rotation, scale, translation) ---------------
    sc = 1.35 * T(mp["scale"])
    rot = T(mp["rot"])
    px, py = X - T(mp["tx"]), Y - (T(mp["ty"]) + 0.06)
    cr, sr = torch.cos(rot) / sc, torch.sin(rot) / sc
    u = cr * px + sr * py
    v = cr * py - sr * px
    aa = 1.7 / (S * sc)                                      # ~0.85 px soft edge in face units
    yaw, pitch = T(mp["yaw"]), T(mp["pitch"])
    cy_, sy_ = torch.cos(yaw), torch.sin(yaw)
    cyc = cy_.clamp(min=0.3)
    cp_, sp_ = torch.cos(pitch), torch.sin(pitch)

    def fx(cx: torch.Tensor | float, depth: float) -> torch.Tensor:
        """x-centre of a part at ``depth`` after yaw (nearer parts move further)."""
        return cx * cy_ + depth * sy_

    def fy(cy: torch.Tensor | float, depth: float) -> torch.Tensor:
        return cy * cp_ + depth * 0.6 * sp_

    def mirrored(half: torch.Tensor, depth: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Outward x-offset from a left/right pair of parts at ``±half`` and the side sign.

        Both parts of a pair are drawn at once in the mirrored frame (eyes, brows, ...).
        """
        du = u - depth * sy_
        return (du.abs() - half * cy_) / cyc, torch.sign(du)

    # --- identity / look geometry -----------------------------------------------------
    fa, fb = T(ip["face_a"]), T(ip["face_b"])
    skin, hair = C(ip["skin"]), C(ip["hair"])
    no_bald = 1 - T(ip["bald"])
    fcx = -0.05 * sy_
    face_w = fa * (0.78 + 0.22 * cy_)
    hair_vol = (T(ip["hair_vol"]) + T(lp["d_vol"])).clamp(0, 1.3) * no_bald
    hair_len = (T(ip["hair_len"]) + T(lp["d_len"])).clamp(0, 1.2) * no_bald
    has_hair = (hair_vol > 0.02).float()

    # --- clothes and neck -------------------------------------------------------------
    img.lerp_(C(mp["cloth"]), soft(ellipse(u - fcx * 0.5, v - (fb + 0.62), 1.05, 0.42), aa))
    neck = torch.maximum(torch.maximum((u - fcx * 0.3).abs() - fa * 0.52, fb * 0.4 - v), v - (fb + 0.35))
    img.lerp_(skin * 0.78, soft(neck, aa))

    # --- back hair ----------------------------------------------------------------------
    hcx = fcx - 0.04 * sy_
    du_h = u - hcx
    hb = ellipse(du_h, v + 0.06 + 0.05 * hair_vol, face_w * (1.05 + 0.22 * hair_vol), fb * (0.98 + 0.16 * hair_vol))
    long_ = torch.maximum(du_h.abs() - face_w * (1.02 + 0.2 * hair_vol),
                          torch.maximum(-0.05 - v, v - fb * (0.2 + 1.1 * hair_len)))
    long_ = long_ + (hair_len <= 0.15).float() * 10.0
    strands = torch.sin(T(ip["strand_freq"]) * du_h + 3 * torch.sin(7 * v)).mul_(0.1).add_(1)
    img.lerp_(hair * strands * 0.85, soft(torch.minimum(hb, long_), aa) * has_hair)

    # --- ears (mirrored pair) -----------------------------------------------------------
    es = T(ip["ear_size"])
    de = ellipse((u - fcx).abs() - face_w * 0.97, v - fy(T(ip["ear_y"]), -0.2), 0.065 * es * (0.6 + 0.4 * cy_), 0.12 * es)
    img.lerp_(skin * 0.9, soft(de, aa))

    # --- face: jaw-tapered superellipse with texture, shading, blush and moles --------
    du = (u - fcx) / face_w
    dv = v / fb
    dvc = dv.clamp(-1, 1)
    taper = torch.where(dv > 0, 1 - T(ip["jaw"]) * dvc * dvc, 1 - 0.12 * dvc * dvc)
    pe = T(ip["face_p"])
    r = ((du / taper).abs() ** pe + dv.abs() ** pe) ** (1 / pe)
    dface = (r - 1) * torch.minimum(face_w, fb)
    tex = sum(torch.sin(T(ip[f"tex_fx{k}"]) * u + T(ip[f"tex_fy{k}"]) * v + T(ip[f"tex_ph{k}"])) for k in range(3))
    shade = (tex * (T(ip["tex_amp"]) / 3) + 1) * (1 - 0.22 * r.clamp(max=1) ** 4)
    my = T(ip["mouth_y"])
    mb, _ = mirrored(fa * 0.55, 0.25)
    db = ellipse(mb * cyc, v - fy(my - 0.14, 0.25), 0.11, 0.08)
    skin_map = torch.lerp(skin * shade, K(0.85, 0.35, 0.35), torch.exp(-(db.clamp(min=0) * 20) ** 2) * (T(ip["blush"]) * 0.5))
    dm = None
    for k in range(3):
        dk = circle(u - fx(T(ip[f"mole_u{k}"]), 0.3), v - fy(T(ip[f"mole_v{k}"]), 0.3), T(ip[f"mole_r{k}"]))
        dk = dk + (1 - T(ip[f"mole{k}"])) * 10.0
        dm = dk if dm is None else torch.minimum(dm, dk)
    skin_map.lerp_(skin * 0.35, soft(dm, aa) * 0.85)
    img.lerp_(skin_map, soft(dface, aa))

    # --- front hair (fringe), inside a slightly dilated head --------------------------
    hl = (T(ip["hairline"]) + T(lp["d_hairline"])
          + T(ip["fringe_amp"]) * torch.sin(T(ip["fringe_freq"]) * du + T(ip["fringe_phase"]) + T(lp["d_fringe"]))
          + (T(ip["part"]) + T(lp["d_part"])) * du + 0.28 * du * du) * (fb / 0.62)
    front = torch.maximum(dface - 0.02 - 0.03 * hair_vol, v - fy(hl, 0.1))
    img.lerp_(hair * strands, soft(front, aa) * has_hair)

    # --- beard and moustache (look) ---------------------------------------------------
    mcx, mcy = fx(0.0, 0.42), fy(my, 0.4)
    mw = T(ip["mouth_w"]) * (0.55 + 0.45 * cy_)
    top = mcy - 0.03 + T(lp["beard_top"]) - 0.16 * du * du
    stub = (torch.sin(60 * u) * torch.sin(55 * v)).mul_(0.15).add_(1)
    img.lerp_(hair * 0.8 * stub, soft(torch.maximum(dface, top - v), aa) * (T(lp["beard"]) * T(lp["beard_density"])))
    mdu = (u - mcx) / mw
    must = torch.maximum((v - (mcy - 0.045 + 0.02 * mdu * mdu)).abs() - 0.022, (mdu.abs() - 1.05) * mw)
    img.lerp_(hair * 0.75, soft(must, aa) * (T(lp["moustache"]) * 0.85))

    # --- eyes and brows (mirrored pairs) ----------------------------------------------
    ew = T(ip["eye_w"])
    eh = ew * T(ip["eye_aspect"])
    ecy = fy(T(ip["eye_y"]), 0.35)
    ex = T(ip["eye_x"])
    mu, side = mirrored(ex, 0.35)
    edu, edv = rotate(mu, v - ecy, T(ip["eye_tilt"]))
    img.lerp_(skin * 0.72, soft(ellipse(edu, edv + 0.01, ew * 1.45, eh * 1.9), 0.04 + aa) * 0.35)
    # eye opening: a lens between two parabolic lids (stays a short arc when blinking)
    eho = eh * T(mp["blink"])
    prof = (1 - (edu / ew) ** 2).clamp(min=0)
    deye = torch.maximum(edv.abs() - eho * prof, edu.abs() - ew)
    eye_m = soft(deye, aa)
    img.lerp_(K(0.93, 0.91, 0.88), eye_m)
    ir = eh * T(ip["iris_r"])
    di = circle(edu - side * (T(mp["gaze_x"]) * ew * 0.35), edv - T(mp["gaze_y"]) * eh * 0.25, ir)
    img.lerp_(C(ip["iris"]), soft(di, aa) * eye_m)
    img.lerp_(K(0.03, 0.03, 0.03), soft(di + ir * 0.55, aa) * eye_m)
    lid = torch.maximum((edv + eho * prof).abs() - 0.012, edu.abs() - ew * 1.05)
    img.lerp_(skin * 0.3, soft(lid, aa) * 0.9)
    bmu, _ = mirrored(ex * 1.05, 0.33)
    bcy = ecy - T(ip["brow_gap"]) - eh - T(mp["brow_raise"])
    bdu, bdv = rotate(bmu, v - bcy, T(ip["brow_angle"]))
    bl = T(ip["brow_len"])
    t = (bdu / bl).clamp(-1, 1)
    dbrow = torch.maximum((bdv + T(ip["brow_arch"]) * (1 - t * t)).abs() - T(ip["brow_thick"]), bdu.abs() - bl)
    img.lerp_(hair * 0.6 + skin * 0.1, soft(dbrow, aa) * 0.9)

    # --- nose -------------------------------------------------------------------------
    nl, nw = T(ip["nose_len"]), T(ip["nose_w"])
    ny = ecy + nl
    light_side = torch.sign(torch.cos(T(mp["light_ang"])) + 1e-6)
    dbr = ellipse_exact(u - fx(-light_side * nw * 0.6, 0.55), v - (ecy + ny) / 2, nw * 0.35, nl * 0.5)
    img.lerp_(skin * 0.7, soft(dbr, 0.02 + aa) * 0.45)
    dtip = ellipse(u - fx(0.0, 0.65), v - (ny - 0.01), nw * 0.9, nw * 0.7)
    img.lerp_(skin * 0.82, soft(dtip.abs() - 0.006, aa) * 0.5)
    nmu, _ = mirrored(nw * 0.6, 0.55)
    img.lerp_(skin * 0.3, soft(ellipse(nmu * cyc, v - (ny + 0.012), nw * 0.32, nw * 0.2), aa) * 0.8)

    # --- mouth ------------------------------------------------------------------------
    t = ((u - mcx) / mw).clamp(-1, 1)
    prof = torch.sqrt((1 - t * t).clamp(min=0))
    line = mcy - (T(ip["smile0"]) + T(mp["smile"])) * 0.05 * (t * t - 0.3)
    op = T(mp["mouth_open"]) * 0.07
    in_x = (u - mcx).abs() - mw
    lipc = C(ip["lip"])
    inner = torch.maximum(torch.maximum(line - v, v - (line + op)), in_x)
    img.lerp_(K(0.25, 0.05, 0.06), soft(inner, aa) * (op > 0.005).float())
    up = torch.maximum(torch.maximum(line - T(ip["lip_u"]) * prof - v, v - line), in_x)
    img.lerp_(lipc, soft(up, aa))
    lo = torch.maximum(torch.maximum(line + op - v, v - (line + op + T(ip["lip_l"]) * prof)), in_x)
    img.lerp_(lipc * 1.08, soft(lo, aa))
    img.lerp_(lipc * 0.45, soft(torch.maximum((v - line).abs() - 0.004, in_x), aa) * 0.8)

    # --- face mask (domain, under glasses): nose, mouth and chin; top curves down sideways
    if sp["mask"].any():
        top = fy(T(ip["eye_y"]) + 0.55 * nl + T(sp["mask_top"]), 0.55) + 0.12 * du * du
        draw_mask(img, dface, v, top, aa, T(sp["mask"]), C(sp["mask_color"]), T(sp["pleat_ph"]))

    # --- glasses (look) ---------------------------------------------------------------
    gm = T(lp["glasses"])
    if np.any(lp["glasses"] > 0):
        gcol, gp = C(lp["glasses_color"]), T(lp["glasses_p"])
        gmu, _ = mirrored(ex, 0.45)
        rr = ((gmu / (ew * 1.55)).abs() ** gp + ((v - ecy) / (ew * 1.2)).abs() ** gp) ** (1 / gp)
        dr = (rr - 1) * ew * 1.2
        img.lerp_(K(0.08, 0.08, 0.1), soft(dr, aa) * (gm * T(lp["glasses_tint"]) * 0.8))
        img.lerp_(gcol, soft(dr.abs() - 0.012, aa) * gm)
        bridge = torch.maximum((v - (ecy - 0.01)).abs() - 0.01,
                               (u - fx(0.0, 0.5)).abs() - (ex - ew * 1.5).clamp(min=0.01) * cy_)
        img.lerp_(gcol, soft(bridge, aa) * gm)

    # --- hat (image) --------------------------------------------------------------------
    hat = T(mp["hat"])
    if np.any(mp["hat"] > 0):
        hat_v = fy(T(mp["hat_h"]), 0.1) * (fb / 0.62)
        dh = torch.maximum(ellipse(u - fcx, v + 0.05, face_w * 1.12, fb * 1.08), v - hat_v)
        img.lerp_(C(mp["hat_color"]), soft(dh, aa) * hat)
        brim = torch.maximum((v - hat_v).abs() - 0.025, (u - fcx).abs() - face_w * 1.2)
        img.lerp_(C(mp["hat_color"]) * 0.8, soft(brim, aa) * hat)

    # --- occluder (image coordinates) ---------------------------------------------------
    occ = T(mp["occ"])
    if np.any(mp["occ"] > 0):
        odu, odv = rotate(X - T(mp["occ_x"]), Y - T(mp["occ_y"]), T(mp["occ_ang"]))
        img.lerp_(C(mp["occ_color"]), soft(ellipse(odu, odv, T(mp["occ_rx"]), T(mp["occ_ry"])), 2.0 / S) * occ)

    # --- illumination: ambient × directional gradient × colour temperature -----------
    la = T(mp["light_ang"])
    light = (torch.cos(la) * X + torch.sin(la) * Y).mul_(T(mp["light_g"])).add_(1).mul_(T(mp["amb"]))
    temp = T(mp["temp"])
    img.mul_(light.clamp_(0.15, 2.0)).mul_(torch.cat([1 + temp, torch.ones_like(temp), 1 - temp], 1))

    # --- blur (per-image Gaussian, separable) -----------------------------------------
    # The kernel support depends only on (S, difficulty, domain blur), never on the chunk, so an image's
    # weights (normalized over that support) are the same in any batch.
    sig = T(mp["blur"]).view(-1) * (S / 112.0)
    rad = int(math.ceil(3 * MAX_BLUR * d * dom.blur * S / 112.0))
    if rad > 0 and np.any(mp["blur"] > 0):
        k = torch.arange(-rad, rad + 1, device=dev, dtype=torch.float32).view(1, -1)
        w = torch.exp(-0.5 * (k / sig.clamp(min=1e-3).view(-1, 1)) ** 2)
        w = w / w.sum(1, keepdim=True)
        img = shift_sum(shift_sum(img, w, 3), w, 2)

    # --- sensor noise: a per-image circular shift of one tile of a fixed bank ---------
    tile = faces.noise_bank(dev)[P(mp["noise_tile"]).long()]       # integers < 2¹⁶: exact in float32
    ar = torch.arange(S, device=dev).view(1, -1)
    rows = (ar + P(mp["noise_dy"]).long().view(-1, 1)) % S
    cols = (ar + P(mp["noise_dx"]).long().view(-1, 1)) % S
    tile = tile.gather(2, rows.view(n, 1, S, 1).expand(n, 3, S, S)).gather(3, cols.view(n, 1, 1, S).expand(n, 3, S, S))
    # σ is defined at 112×112; a smaller render is that image area-downsampled, which
    # divides i.i.d. noise by the downsampling factor (capped at 1 for larger renders).
    img.add_(tile.mul_(T(mp["noise"]) * min(1.0, S / 112.0)))

    # --- domain style: texture overlay, then the colour processing of the camera -------
    if dom.texture > 0:
        img = apply_texture(img, X, Y, dom.texture, T(sp["tex_px"]), T(sp["tex_py"]))
    img = apply_colour_style(img, dom)

    # --- JPEG-like compression --------------------------------------------------------
    # 8×8 blocks are defined at 112×112; at smaller sizes a block covers more of the face,
    # so the quantization strength shrinks with the size (as after downsampling a JPEG).
    jq = P(mp["jpeg"]) * min(1.0, S / 112.0)
    if np.any(mp["jpeg"] > 0):   # per-image select: the DCT round trip is not bit-exact
        img = torch.where(jq.view(-1, 1, 1, 1) > 0, jpeg_like(img.clamp(0, 1), jq), img)
    return img
