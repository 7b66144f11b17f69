"""Dynamic loss scaling: the loss scales, the optax transformation, its state and helpers.

How it works and how to extend it: README.md in this folder.
"""
