"""The networks (``fedfs[train]``: torch): backbones, the FedFS/FedUV model, checkpoints,
the dual verifier, and importing a pre-trained face recognizer.
"""
