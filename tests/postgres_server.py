"""A real PostgreSQL server on loopback for the team-instance tests, and the instance file
(deploy/postgres/dagster.yaml) that points Dagster at it.

The server is the distribution's PostgreSQL (`initdb`, `pg_ctl`, `postgres`; Debian's
`postgresql` package, installed by scripts/setup.sh when run as root), in a fresh cluster
under a temporary directory, listening on 127.0.0.1 only, with password authentication.
`initdb` refuses to run as root: as root the cluster is made and run by the unprivileged
`postgres` user.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import secrets
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import yaml

from tests.daemon_harness import ROOT

POSTGRES_INSTANCE_YAML = ROOT / "deploy" / "postgres" / "dagster.yaml"
SERVICE_USER = "postgres"  # the unprivileged owner of the cluster when the tests run as root
INSTALL_HINT = ("to run it: `sudo apt-get install -y postgresql` (Debian; "
                "`bash scripts/setup.sh` does it when run as root), or put a PostgreSQL "
                "installation's bin/ (initdb, pg_ctl, postgres) on the PATH")
TOOLS = ("initdb", "pg_ctl", "postgres")


def postgres_bindir() -> Path | None:
    """The directory holding initdb, pg_ctl and postgres: the PATH's first, else the newest
    of Debian's /usr/lib/postgresql/<major>/bin (which the package leaves off the PATH)."""
    found = shutil.which("initdb")
    candidates = [Path(found).resolve().parent] if found else []
    debian = Path("/usr/lib/postgresql")
    majors = sorted((p for p in debian.glob("*/bin") if p.parent.name.isdigit()),
                    key=lambda p: int(p.parent.name), reverse=True) if debian.is_dir() else []
    for bindir in [*candidates, *majors]:
        if all(os.access(bindir / tool, os.X_OK) for tool in TOOLS):
            return bindir
    return None


def missing_postgres() -> str | None:
    """Why a PostgreSQL server cannot be started here, or None when it can."""
    if postgres_bindir() is None:
        return f"no PostgreSQL server binaries ({', '.join(TOOLS)}) found; {INSTALL_HINT}"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam(SERVICE_USER)
        except KeyError:
            return (f"running as root, the cluster needs the unprivileged user "
                    f"`{SERVICE_USER}` (initdb refuses root), and there is none; {INSTALL_HINT}")
        if shutil.which("runuser") is None:
            return "running as root, `runuser` (util-linux) is needed to start PostgreSQL"
    return None


def postgres_required() -> bool:
    """In CI, or as root with apt (where scripts/setup.sh installs PostgreSQL), a missing
    server is a failure, not a skip."""
    return bool(os.environ.get("CI")) or (os.geteuid() == 0 and shutil.which("apt-get")
                                          is not None)


def instance_env_names(instance_yaml: Path = POSTGRES_INSTANCE_YAML) -> dict[str, str]:
    """`postgres_db` setting -> the environment variable the instance file reads it from.

    The names are defined once, in the instance file; the tests read them from there."""
    db = yaml.safe_load(instance_yaml.read_text())["storage"]["postgres"]["postgres_db"]
    return {key: value["env"] for key, value in db.items()
            if isinstance(value, dict) and "env" in value}


# The SQLAlchemy scheme the instance file names (MLflow's URI uses the same driver).
DRIVER_SCHEME = yaml.safe_load(POSTGRES_INSTANCE_YAML.read_text()
                               )["storage"]["postgres"]["postgres_db"]["scheme"]


@dataclass(frozen=True)
class PostgresServer:
    host: str
    port: int
    user: str
    password: str

    def url(self, database: str) -> str:
        """A SQLAlchemy URL (an MLflow tracking URI) for one database on the server, with
        the driver named: SQLAlchemy 2.1 reads a bare postgresql:// as psycopg 3."""
        return (f"{DRIVER_SCHEME}://{self.user}:{self.password}@{self.host}:{self.port}"
                f"/{database}")

    def create_database(self, name: str) -> None:
        import psycopg2

        if not re.fullmatch(r"[a-z_][a-z0-9_]*", name):
            raise ValueError(f"database name {name!r}: use lowercase letters, digits and _")
        conn = psycopg2.connect(host=self.host, port=self.port, user=self.user,
                                password=self.password, dbname="postgres")
        try:
            conn.autocommit = True  # CREATE DATABASE cannot run inside a transaction
            with conn.cursor() as cur:
                cur.execute(f"CREATE DATABASE {name}")
        finally:
            conn.close()

    def instance_env(self, database: str) -> dict[str, str]:
        """The environment that points deploy/postgres/dagster.yaml at `database` here."""
        values = {"username": self.user, "password": self.password, "hostname": self.host,
                  "port": str(self.port), "db_name": database}
        return {var: values[key] for key, var in instance_env_names().items()}


def _as_service_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", SERVICE_USER, "--", *cmd] if os.geteuid() == 0 else cmd


def _run(cmd: list[str], cwd: Path, what: str, log: Path | None = None) -> None:
    res = subprocess.run(_as_service_user(cmd), cwd=cwd, capture_output=True, text=True,
                         timeout=300)
    if res.returncode != 0:
        server_log = log.read_text() if log and log.exists() else ""
        raise RuntimeError(f"{what} failed (exit {res.returncode}): {' '.join(cmd)}\n"
                           f"{res.stdout}{res.stderr}{server_log}")


@contextlib.contextmanager
def running_postgres(port: int) -> Iterator[PostgresServer]:
    """A fresh cluster on 127.0.0.1:`port`, stopped and deleted on exit."""
    bindir = postgres_bindir()
    if bindir is None:
        raise RuntimeError(missing_postgres())
    # Under /tmp rather than pytest's tmp_path: as root, pytest's directories are closed to
    # the postgres user.
    work = Path(tempfile.mkdtemp(prefix="ckpt-pg-"))
    data, log = work / "data", work / "server.log"
    server = PostgresServer("127.0.0.1", port, "ckpt", secrets.token_hex(12))
    (work / "pwfile").write_text(server.password + "\n")
    if os.geteuid() == 0:
        owner = pwd.getpwnam(SERVICE_USER)
        for path in (work, work / "pwfile"):
            os.chown(path, owner.pw_uid, owner.pw_gid)
    started = False
    try:
        # --no-sync and fsync=off: a throwaway cluster on a busy disk; durability of the
        # test database is not what the tests are about.
        _run([str(bindir / "initdb"), "-D", str(data), "-U", server.user,
              f"--pwfile={work / 'pwfile'}", "--auth=scram-sha-256", "-E", "UTF8",
              "--no-locale", "--no-sync"], work, "initdb")
        options = f"-h {server.host} -p {port} -k {work} -c fsync=off"
        _run([str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-w", "-t", "180",
              "-o", options, "start"], work, "starting PostgreSQL", log)
        started = True
        yield server
    finally:
        if started:
            _run([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "-t", "120",
                  "stop"], work, "stopping PostgreSQL", log)
        shutil.rmtree(work, ignore_errors=True)


def require_postgres() -> None:
    """Skip the calling test when no server can be started here (fail where one must)."""
    import pytest

    why = missing_postgres()
    if why is None:
        return
    if postgres_required():
        pytest.fail(f"{why} (as root with apt, scripts/setup.sh installs it)")
    pytest.skip(why)


def team_instance(server: PostgresServer, workdir: Path) -> dict:
    """`Daemon.start` keyword arguments for a team instance on `server`: the Dagster
    instance in one database (deploy/postgres/dagster.yaml, connection from the
    environment), MLflow tracking in a second database on the same server."""
    from mlflow.tracking import MlflowClient

    from trainer.config import TrainConfig

    server.create_database("dagster")
    server.create_database("mlflow")
    tracking = server.url("mlflow")
    # MLflow's tables are created once, here, rather than by run workers racing to. With a
    # database tracking URI MLflow would put artifacts under ./mlruns of whichever process
    # creates the experiment; a team creates it with a shared artifact location first (S3),
    # as this does with a local directory.
    MlflowClient(tracking_uri=tracking).create_experiment(
        TrainConfig.model_fields["experiment"].default,
        artifact_location=(workdir / "mlartifacts").as_uri())
    return {"instance_yaml": POSTGRES_INSTANCE_YAML,
            "extra_env": {**server.instance_env("dagster"), "MLFLOW_TRACKING_URI": tracking}}
