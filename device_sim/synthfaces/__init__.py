"""SynthFaces: procedural face-like identities, rendered in batches by a vectorized torch renderer.

In the spirit of DigiFace-1M (Bae et al., WACV 2023), which renders each synthetic identity
with fixed geometry and texture under a few "looks" (hair style, accessories) and many
per-image nuisances. Here:

* **identity** ``(seed, identity)`` fixes face shape (superellipse width/height/exponent, jaw
  taper), skin tone, skin texture (a sum of identity-specific sinusoids), moles, cheek blush,
  hair colour and hairline, eye position/size/tilt/iris colour, brows, nose, mouth and lips,
  ears;
* **look** ``(seed, identity, look)``, one of ``looks_per_identity`` chosen per image: hair
  volume/length/fringe variation, beard/moustache, glasses;
* **image** ``(seed, identity, index)``: rotation, scale, translation, yaw and pitch (features
  shift with their depth and the face squashes horizontally), expression (smile, open mouth,
  brow raise, blink, gaze), hat, occluder, background, illumination gradient and colour cast,
  clothing, Gaussian blur, sensor noise, JPEG-like 8×8 DCT quantization.

Every random number comes from a counter-based hash (SplitMix64) of ``(seed, domain, identity,
look | index, parameter)`` computed in float64 numpy, so an image's parameters depend neither
on the other images in its batch nor on the device. All per-pixel work is elementwise torch on
a ``[N, 1, S, S]`` coordinate grid (signed-distance shapes with ~1-pixel soft edges, painter's
algorithm compositing), so a batch runs the same code on CPU and CUDA with no per-image loop,
and an image is bit-identical in any batch, chunking or thread count on a given device.

``difficulty`` scales every nuisance range and probability (0 = frontal, clean, neutral
images; 1 = the calibrated default, see ``docs/synthfaces.md`` for measured baselines).
``domain`` (:mod:`device_sim.synth_domains`) changes how the same identities are captured —
pose range, lighting, colour processing, face masks, blur, noise, texture — for cross-domain
scenarios; the default ``"none"`` renders the images above bit for bit.

Modules, one job each: :mod:`.hashing` (counter-based randomness, image keys),
:mod:`.params` (identity / look / image parameters), :mod:`.shapes` (signed distances, blur,
JPEG-like), :mod:`.painter` (one chunk of images), :mod:`.generator` (:class:`SynthFaces`:
settings, chunking, devices, uint8 output), :mod:`.folder` (``write_image_folder``).
"""
from __future__ import annotations

from .folder import write_image_folder
from .generator import SynthFaces
from .hashing import broadcast_pairs, hash_uniforms, index_array

__all__ = ["SynthFaces", "hash_uniforms", "write_image_folder", "broadcast_pairs", "index_array"]
