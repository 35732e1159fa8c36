"""A code server builds a Dagster instance for every sensor evaluation; opening one must not
read Dagster's schema migration scripts again (`read_schema_migrations_once`), and a new
instance directory still gets its schema, stamped at the newest migration."""

from __future__ import annotations

import dagster as dg
from alembic.script import ScriptDirectory
from dagster._core.instance.ref import InstanceRef
from dagster._core.storage.runs.sqlite import sqlite_run_storage
from dagster._core.storage.sql import check_alembic_revision, get_alembic_config

import ckpt_assets.definitions  # noqa: F401  (loading the code location is what installs it)


def test_an_instance_opened_after_the_first_reads_no_migration_script(tmp_path, monkeypatch):
    for home in ("a", "b"):
        (tmp_path / home).mkdir()
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path / "a"))) as first:
        first.get_runs(limit=1)
    reads = []
    load = ScriptDirectory._load_revisions

    def counted(self):
        reads.append(self.dir)
        return load(self)

    monkeypatch.setattr(ScriptDirectory, "_load_revisions", counted)
    with dg.DagsterInstance.from_ref(InstanceRef.from_dir(str(tmp_path / "b"))) as second:
        assert second.get_runs(limit=1) == []
        with second.run_storage.connect() as conn:  # a new directory: created at the head
            db, head = check_alembic_revision(get_alembic_config(sqlite_run_storage.__file__),
                                              conn)
    assert reads == []
    assert db == head is not None
