"""Helpers the tests share that are not fixtures: misbehaving donor sources, the reference denoising loop, a
random-weight Wan2.1 checkpoint on disk."""
