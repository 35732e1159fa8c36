"""Standalone, resumable PyTorch trainer with a crash-safe checkpoint store.

Never imports dagster: it runs on its own, under torchrun, or in a container.
"""
