"""The Dagster objects of the code location, one module per kind: assets, asset checks,
jobs, sensors, resources, the IO manager and the partitions definition. They are assembled
in `ckpt_assets.definitions`; the logic they call lives beside this package, in
`ckpt_assets/` (registration, attempts, the resume decision, run state, lineage, tracking).

Empty on purpose: importing one definition must not import them all.
"""
