"""`ckpt-assets` (also `python -m ckpt_assets`): register, launch, run, list, lineage, stop."""
