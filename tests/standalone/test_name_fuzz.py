"""Property-based fuzzing of everything that becomes a path or an object key.

Run, experiment and checkpoint names, store keys and store URIs come from configs, CLI
flags, partition keys and files in the store itself. For any input: it is refused with
InvalidNameError/ConfigError, or it maps to a place inside the store (0 escapes), and two
distinct accepted inputs never map to the same place (0 collisions). Pointers and
manifests read from the store either parse into checked values or raise CheckpointError.
"""

from __future__ import annotations

import json
import os
import posixpath
import string
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from trainer.api.checkpointer import Checkpointer
from trainer.base.errors import CheckpointError, CheckpointNotFoundError, ConfigError
from trainer.checkpoints.manifest import (
    MANIFEST,
    Manifest,
    checkpoint_name,
    parse_checkpoint_name,
)
from trainer.checkpoints.pointer import Pointer
from trainer.checkpoints.repo import CheckpointRepo
from trainer.storage import open_store, split_uri, validate_key, validate_name
from trainer.storage.local import LocalStore
from trainer.storage.s3 import S3Store

# No example database: nothing is written into the working tree.
FUZZ = settings(max_examples=200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture])

NAME_CHARS = string.ascii_lowercase + string.digits + "._-"
SEGMENT_CHARS = string.ascii_letters + string.digits + "._-"

# Mostly near-miss text: the allowed alphabet plus separators, dots, case, unicode
# look-alikes and control characters, so that both outcomes are exercised.
tricky = st.text(
    alphabet=st.one_of(st.sampled_from(NAME_CHARS + "/\\.:%\n\r\t\x00 A~"),
                       st.sampled_from("\u0660\u2215\uff0e\u0131\u00e4"),
                       st.characters(codec="utf-8", exclude_categories=["Cs"])),
    max_size=80)
good_names = st.from_regex(r"[a-z0-9][a-z0-9._-]{0,63}", fullmatch=True).filter(
    lambda s: ".." not in s)
good_segments = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,40}", fullmatch=True).filter(
    lambda s: ".." not in s)


def _follows_the_name_rule(s: str) -> bool:
    """The documented rule, spelled out without a regex."""
    return (0 < len(s) <= 64 and s[0] in string.ascii_lowercase + string.digits
            and all(c in NAME_CHARS for c in s) and ".." not in s)


def _refused(fn, *args) -> bool:
    try:
        fn(*args)
    except ConfigError:  # InvalidNameError is one
        return True
    return False


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz") / "store"


# -- names ------------------------------------------------------------------------------

@FUZZ
@given(tricky)
def test_a_name_is_accepted_exactly_when_it_follows_the_documented_rule(s):
    assert (not _refused(validate_name, s)) == _follows_the_name_rule(s)


@FUZZ
@given(st.lists(st.one_of(good_segments, tricky), min_size=1, max_size=5))
def test_an_accepted_key_maps_inside_the_store_on_both_backends(root, segments):
    key = "/".join(segments)
    if _refused(validate_key, key):
        return
    local = LocalStore(root)._path(key)
    assert os.path.normpath(local) == str(local), "the key would be normalised"
    assert str(local).startswith(str(root) + os.sep)
    full = S3Store("bucket", "pre/fix", client=_NoClient())._full(key)
    assert full.startswith("pre/fix/") and posixpath.normpath(full) == full
    assert all(seg not in (".", "..") and seg.isascii() and seg.isprintable()
               for seg in key.split("/"))


@FUZZ
@given(st.lists(good_segments, min_size=1, max_size=4),
       st.lists(good_segments, min_size=1, max_size=4))
def test_distinct_accepted_keys_never_share_a_path_or_uri(root, a, b):
    ka, kb = "/".join(a), "/".join(b)
    assume(ka != kb)
    local = LocalStore(root)
    assert local._path(ka) != local._path(kb)
    assert local.uri_for(ka) != local.uri_for(kb)
    s3 = S3Store("bucket", "p", client=_NoClient())
    assert s3._full(ka) != s3._full(kb) and s3.uri_for(ka) != s3.uri_for(kb)


@FUZZ
@given(st.tuples(good_names, good_names), st.tuples(good_names, good_names))
def test_two_runs_never_share_a_key_and_neither_lies_inside_the_other(root, a, b):
    assume(a != b)
    store = LocalStore(root)
    ra, rb = CheckpointRepo(store, *a), CheckpointRepo(store, *b)
    assert ra.prefix != rb.prefix
    for x, y in ((ra, rb), (rb, ra)):
        for key in (x.pointer_key, x.key(checkpoint_name(1, 1), "state.pt"), x.ckpt_prefix):
            assert not key.startswith(y.prefix + "/") and key != y.prefix


@FUZZ
@given(st.one_of(tricky, st.builds(checkpoint_name, st.integers(0, 10**9 - 1),
                                   st.integers(0, 10**9 - 1))))
def test_a_checkpoint_name_parses_only_when_it_is_exactly_what_it_would_be_written_as(s):
    parsed = parse_checkpoint_name(s)
    assert parsed is None or checkpoint_name(*parsed) == s


# -- URIs -------------------------------------------------------------------------------

@FUZZ
@given(st.one_of(tricky, st.builds(lambda a, b: f"s3://{a}/{b}", tricky, tricky),
                 st.builds(lambda a: f"file://{a}", tricky)))
def test_a_store_uri_is_refused_or_names_a_store_with_a_safe_bucket_prefix_or_root(uri):
    try:
        store = _open_without_network(uri)
    except ConfigError:
        return
    if isinstance(store, S3Store):
        assert store.prefix == "" or validate_key(store.prefix) == store.prefix
        assert all(c in SEGMENT_CHARS for c in store.bucket)
    else:
        assert os.path.isabs(store.root) and os.path.normpath(store.root) == str(store.root)


@FUZZ
@given(st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"],
                                      exclude_characters="/\x00"), min_size=1, max_size=30),
       good_names, good_names, st.integers(0, 10**9 - 1), st.integers(1, 10**6))
def test_a_checkpoint_uri_round_trips_to_the_same_store_and_key(tmp_path_factory, dirname,
                                                                 experiment, run, step, attempt):
    assume(dirname not in (".", ".."))
    base = tmp_path_factory.getbasetemp()
    store = LocalStore(base / dirname)
    repo = CheckpointRepo(store, experiment, run)
    name = checkpoint_name(step, attempt)
    store_uri, key = split_uri(repo.uri(name))
    assert open_store(store_uri).uri == store.uri
    assert key == repo.key(name)


# -- what the store hands back --------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4)
    | st.dictionaries(st.text(max_size=12), children, max_size=4),
    max_leaves=20)


@FUZZ
@given(st.one_of(json_values, st.fixed_dictionaries(
    {"generation": json_values}, optional={k: json_values for k in (
        "checkpoint", "step", "attempt", "history", "best", "owner", "updated_at")})))
def test_a_pointer_parses_into_safe_names_or_is_a_checkpoint_error(raw):
    try:
        ptr = Pointer.from_json(json.dumps(raw).encode(), "latest.json")
    except CheckpointError:
        return
    assert all(validate_key(n) == n and "/" not in n for n in ptr.timeline)


@pytest.fixture(scope="module")
def committed(tmp_path_factory):
    store = open_store(str(tmp_path_factory.mktemp("fuzz-ck") / "store"))
    repo = CheckpointRepo(store, "exp", "r")
    attempt = repo.claim(None)
    Checkpointer(repo, {"m": torch.nn.Linear(2, 2)}, attempt, keep_last=1).save(10, {})
    name = repo.read_pointer().checkpoint
    path = Path(store.root) / repo.key(name, MANIFEST)
    return repo, name, path, json.loads(path.read_text())


MANIFEST_FIELDS = ["name", "step", "attempt", "files", "parent", "created_at", "meta",
                   "format_version", "experiment", "run"]
FILE_FIELDS = ["size", "sha256", "chunk_size", "chunks"]


@FUZZ
@given(st.sampled_from(MANIFEST_FIELDS + [f"files.state.pt.{f}" for f in FILE_FIELDS]),
       st.one_of(json_values, st.integers(-3, 3), st.just([]), st.just({})))
def test_a_manifest_with_any_field_changed_verifies_or_is_a_checkpoint_error(committed, field,
                                                                             value):
    repo, name, path, original = committed
    raw = json.loads(json.dumps(original))
    target, leaf = raw, field
    if field.startswith("files."):
        target, leaf = raw["files"]["state.pt"], field.rsplit(".", 1)[1]
    target[leaf] = value
    path.write_text(json.dumps(raw))
    try:
        m = repo.verify(name)
    except (CheckpointError, CheckpointNotFoundError):
        return
    finally:
        path.write_text(json.dumps(original))
    assert isinstance(m, Manifest) and m.name == name


class _NoClient:
    """Stands in for boto3 where only key arithmetic is exercised."""

    class meta:  # noqa: N801 - mimics botocore's attribute
        endpoint_url = "http://unused"


def _open_without_network(uri: str):
    from unittest import mock

    with mock.patch("trainer.storage.s3.default_client", return_value=_NoClient()):
        return open_store(uri)
