"""Dagster layer of ckpt-assets: partitions, assets, IO manager, checks, lineage, CLI.

The code location is `ckpt_assets.definitions:defs`; the CLI is `python -m ckpt_assets`.
"""
