"""SynthFaces: determinism, API contract and identity separability."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from device_sim.synth_domains import DOMAINS, SynthDomain, get_domain
from device_sim.synthfaces import SynthFaces, hash_uniforms
from fedfs_sdk.errors import InputError
from fedfs_sdk.runtime.preprocess import preprocess


@pytest.fixture(scope="module")
def faces() -> SynthFaces:
    return SynthFaces(seed=3, image_size=32, difficulty=1.0, num_threads=1)


def test_shapes_dtype_and_range(faces: SynthFaces) -> None:
    x = faces.render([0, 1, 2], [0, 0, 5])
    assert x.shape == (3, 3, 32, 32) and x.dtype == torch.float32
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    # values are uint8 levels mapped by (x − 127.5)/127.5
    levels = x * 127.5 + 127.5
    assert torch.allclose(levels, levels.round(), atol=1e-4)
    u8 = faces.render_uint8([0, 1, 2], [0, 0, 5])
    assert u8.shape == (3, 32, 32, 3) and u8.dtype == np.uint8


def test_render_matches_preprocess_of_uint8(faces: SynthFaces) -> None:
    u8 = faces.render_uint8([4, 5], [1, 2])
    assert np.array_equal(preprocess(u8, 32), faces.render([4, 5], [1, 2]).numpy())


def _assert_batch_invariant(faces: SynthFaces, chunked: SynthFaces) -> None:
    """``faces`` renders each key identically alone, reordered, and as ``chunked`` (the same
    generator with another chunk size) does."""
    ids = np.array([7, 3, 7, 11, 3, 42, 7])
    idx = np.array([0, 5, 9, 1, 5, 2, 0])
    full = faces.render(ids, idx)
    # alone, reordered, and with a different chunking
    for j in range(len(ids)):
        assert torch.equal(faces.render(int(ids[j]), int(idx[j]))[0], full[j])
    perm = np.array([6, 2, 0, 5, 1, 4, 3])
    assert torch.equal(faces.render(ids[perm], idx[perm]), full[perm])
    assert torch.equal(chunked.render(ids, idx), full)
    # duplicates inside one batch are identical
    assert torch.equal(full[0], full[6]) and torch.equal(full[1], full[4])


def test_same_key_same_pixels_regardless_of_batch(faces: SynthFaces) -> None:
    _assert_batch_invariant(faces, SynthFaces(seed=3, image_size=32, difficulty=1.0, chunk_size=2))


def test_different_seed_index_identity_differ(faces: SynthFaces) -> None:
    a = faces.render(1, 0)
    assert not torch.equal(a, SynthFaces(seed=4, image_size=32).render(1, 0))
    assert not torch.equal(a, faces.render(1, 1))
    assert not torch.equal(a, faces.render(2, 0))


def test_scalar_broadcast_and_errors(faces: SynthFaces) -> None:
    assert faces.render(5, [0, 1, 2]).shape[0] == 3
    assert faces.render([5, 6], 0).shape[0] == 2
    assert faces.render([], []).shape == (0, 3, 32, 32)
    with pytest.raises(InputError, match="same length"):
        faces.render([1, 2], [1, 2, 3])
    with pytest.raises(InputError, match="≥ 0"):
        faces.render(-1, 0)
    with pytest.raises(InputError):
        SynthFaces(image_size=8)
    with pytest.raises(InputError):
        SynthFaces(difficulty=-1)


def test_hash_uniforms_rows_independent() -> None:
    u = hash_uniforms([1, 2, np.arange(10)], 5)
    v = hash_uniforms([1, 2, np.array([3])], 5)
    assert u.shape == (10, 5) and np.array_equal(u[3], v[0])
    assert 0.0 <= u.min() and u.max() < 1.0
    big = hash_uniforms([0, np.arange(20000)], 1).ravel()
    assert abs(big.mean() - 0.5) < 0.01 and abs(big.var() - 1 / 12) < 0.005


@pytest.mark.parametrize("size", [64, 112])
def test_other_sizes(size: int) -> None:
    f = SynthFaces(seed=0, image_size=size, num_threads=1)
    x = f.render([0, 1], [0, 0])
    assert x.shape == (2, 3, size, size)
    assert float(x.std()) > 0.1   # not blank


def test_difficulty_zero_is_clean_and_stable() -> None:
    """At difficulty 0 images of one identity vary only by look (hair/glasses/beard)."""
    f = SynthFaces(seed=1, image_size=32, difficulty=0.0, looks_per_identity=1)
    x = f.render(0, np.arange(6))
    # backgrounds/clothes still vary, the face centre must not
    centre = x[:, :, 8:24, 10:22]
    assert float((centre - centre[0:1]).abs().mean()) < 0.05


def test_identity_separability_pixels(faces: SynthFaces) -> None:
    """Same-identity face crops are closer than different-identity ones on average."""
    n_id, n_img = 12, 6
    ids = np.repeat(np.arange(n_id), n_img)
    idx = np.tile(np.arange(n_img), n_id)
    x = faces.render(ids, idx)[:, :, 6:28, 6:26].reshape(n_id * n_img, -1)
    x = x - x.mean(1, keepdim=True)
    x = x / x.norm(dim=1, keepdim=True)
    sim = (x @ x.T).numpy()
    same = ids[:, None] == ids[None, :]
    off = ~np.eye(len(ids), dtype=bool)
    assert sim[same & off].mean() > sim[~same].mean() + 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    f = SynthFaces(seed=2, image_size=32)
    ids, idx = np.arange(16), np.arange(16) % 5
    cpu = f.render(ids, idx)
    gpu = f.render(ids, idx, device="cuda").cpu()
    # transcendental functions differ in the last ulp between devices: rare ±1 level flips
    diff = (cpu - gpu).abs() * 127.5
    assert float(diff.max()) <= 2.01 and float((diff > 0.5).float().mean()) < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_large_batches_equal_small_chunks_and_cpu_at_112() -> None:
    """At the paper's 112 px: one CUDA call of 260 images (default chunks, ~198) equals chunks of
    7 and single images bit for bit, and the CPU within the renderer's device bound."""
    f = SynthFaces(seed=2, image_size=112)
    ids, idx = np.arange(260) % 37, np.arange(260)
    big = f.render_u8(ids, idx, "cuda")
    assert f.chunk_images("cuda") < 260 and big.is_cuda and big.dtype == torch.uint8
    assert torch.equal(big, SynthFaces(seed=2, image_size=112, chunk_size=7).render_u8(ids, idx, "cuda"))
    for j in (0, 131, 259):
        assert torch.equal(f.render_u8(int(ids[j]), int(idx[j]), "cuda")[0], big[j])
    diff = (big[:24].cpu().int() - f.render_u8(ids[:24], idx[:24]).int()).abs()
    assert int(diff.max()) <= 2 and float((diff > 0).float().mean()) < 0.01


def test_scoped_threads_same_pixels_and_restored() -> None:
    before = torch.get_num_threads()
    one = SynthFaces(seed=3, image_size=32, num_threads=1)
    default = SynthFaces(seed=3, image_size=32)          # the process's thread count
    assert torch.equal(one.render([1, 2, 3], [4, 5, 6]), default.render([1, 2, 3], [4, 5, 6]))
    assert torch.get_num_threads() == before


def test_jpeg_like_identity_at_zero_and_lossy_above() -> None:
    from device_sim.synthfaces.shapes import jpeg_like as _jpeg_like

    x = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert float((_jpeg_like(x, torch.zeros(2)) - x).abs().max()) < 1e-5     # orthonormal DCT round trip
    err = (_jpeg_like(x, torch.tensor([0.5, 2.0])) - x).abs().mean(dim=(1, 2, 3))
    assert 0 < float(err[0]) < float(err[1])


# ---------------------------------------------------------------------------------------------
# Domains
# ---------------------------------------------------------------------------------------------
_PRESETS = [n for n in DOMAINS if n != "none"]


def test_domain_none_is_bit_identical_to_default(faces: SynthFaces) -> None:
    ids, idx = np.arange(12), np.arange(12) * 7
    ref = faces.render(ids, idx)
    for dom in ("none", DOMAINS["none"], SynthDomain("plain")):
        f = SynthFaces(seed=3, image_size=32, difficulty=1.0, num_threads=1, domain=dom)
        assert torch.equal(f.render(ids, idx), ref)
        assert repr(f) == repr(faces) == \
            "SynthFaces(seed=3, image_size=32, difficulty=1.0, looks_per_identity=4)"


@pytest.mark.parametrize("name", _PRESETS)
def test_domain_presets_change_images(faces: SynthFaces, name: str) -> None:
    ids, idx = np.arange(16), np.arange(16)
    x = SynthFaces(seed=3, image_size=32, num_threads=1, domain=name).render(ids, idx)
    changed = (x != faces.render(ids, idx)).flatten(1).any(1)
    # "mask" only draws on the images it masks (p = 0.8); every other preset changes all
    assert float(changed.float().mean()) >= (0.5 if name == "mask" else 1.0)


@pytest.mark.parametrize("name", ["phone", "night", "mask"])
def test_domain_same_key_same_pixels_regardless_of_batch(name: str) -> None:
    faces = SynthFaces(seed=3, image_size=32, num_threads=1, domain=name)
    _assert_batch_invariant(faces, SynthFaces(seed=3, image_size=32, chunk_size=2, domain=name))
    again = SynthFaces(seed=3, image_size=32, num_threads=1, domain=get_domain(name))
    assert torch.equal(again.render([1, 2], [3, 4]), faces.render([1, 2], [3, 4]))


def test_domain_keeps_identities(faces: SynthFaces) -> None:
    """An image correlates more with the same identity in the default domain than with other
    identities (face crop, zero-mean unit-norm pixels): the domain changes the look, not who."""
    n_id, n_img = 16, 4
    ids, idx = np.repeat(np.arange(n_id), n_img), np.tile(np.arange(n_img), n_id)

    def unit(x: torch.Tensor) -> torch.Tensor:
        x = x[:, :, 6:28, 6:26].reshape(len(x), -1)
        x = x - x.mean(1, keepdim=True)
        return x / x.norm(dim=1, keepdim=True)

    base = unit(faces.render(ids, idx))
    same = ids[:, None] == ids[None, :]
    for name in _PRESETS:
        sim = (unit(SynthFaces(seed=3, image_size=32, num_threads=1, domain=name).render(ids, idx)) @ base.T).numpy()
        assert sim[same].mean() > sim[~same].mean() + 0.05, name


def test_domain_saturation_zero_is_greyscale() -> None:
    grey = SynthFaces(seed=3, image_size=32, num_threads=1, domain=SynthDomain("grey", saturation=0.0))
    u8 = grey.render_uint8(np.arange(8), np.arange(8)).astype(np.int16)
    # JPEG-like compression runs in float YCbCr after the desaturation: ±1 level at most
    assert np.abs(u8[..., 0] - u8[..., 1]).max() <= 1 and np.abs(u8[..., 1] - u8[..., 2]).max() <= 1
    colour = SynthFaces(seed=3, image_size=32, num_threads=1).render_uint8(np.arange(8), np.arange(8)).astype(np.int16)
    assert np.abs(colour[..., 0] - colour[..., 2]).max() > 20


@pytest.mark.parametrize("field,value", [("pose", -0.1), ("light", 9.0), ("saturation", float("nan")),
                                         ("gamma", 0.0), ("contrast", "1"), ("occlusion", 1.5),
                                         ("blur", True), ("noise", -1), ("texture", 2.0),
                                         ("tint", (1.0, 1.0)), ("tint", (1.0, -1.0, 1.0))])
def test_domain_bad_fields_raise(field: str, value: object) -> None:
    with pytest.raises(InputError, match=rf"SynthDomain\.{field} must be .*\["):
        SynthDomain("bad", **{field: value})


def test_domain_unknown_name_and_bad_name() -> None:
    with pytest.raises(InputError, match="known domains: none, studio, phone, night, mask"):
        SynthFaces(domain="sepia")
    with pytest.raises(InputError, match="SynthDomain.name"):
        SynthDomain("a b")


def test_domain_repr_differs_between_domains() -> None:
    reprs = {repr(SynthFaces(seed=3, domain=n)) for n in DOMAINS}
    reprs.add(repr(SynthFaces(seed=3, domain=SynthDomain("phone", occlusion=0.5))))   # same name, other values
    assert len(reprs) == len(DOMAINS) + 1
    assert repr(SynthFaces(seed=3, domain="mask")).endswith(", domain='mask:occlusion=0.8')")
    assert DOMAINS["phone"].key().startswith("phone:pose=1.6,light=2.0,saturation=0.35,tint=(1.15, 1.0, 0.8)")
