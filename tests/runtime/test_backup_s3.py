"""Backups in S3 (`--backup-dir s3://BUCKET/PREFIX`), against moto's server over HTTP: uploaded with the manifest
last, pruned manifest first, downloaded and read back bit for bit; and a job whose workers all die comes back from
the bucket."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from runtime.training.backup import (
    MANIFEST,
    BackupError,
    S3Mirror,
    find_backup,
    has_backup,
    step_dir,
)
from tests.cloud.aws_servers import moto_server
from tests.runtime.test_backup import backed_up_at_step_2, backups_round_trip, comes_back_from_the_store

BUCKET = "tm-backups"


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """moto's S3 on loopback with one bucket; boto3 (here and in every process a job starts) points at it."""
    with moto_server() as url:
        for name, value in (("AWS_ENDPOINT_URL_S3", url), ("AWS_ACCESS_KEY_ID", "testing"),
                            ("AWS_SECRET_ACCESS_KEY", "testing"), ("AWS_DEFAULT_REGION", "us-east-1")):
            monkeypatch.setenv(name, value)
        boto3.client("s3").create_bucket(Bucket=BUCKET)
        yield url


def _keys(prefix: str) -> list[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


def test_backups_go_to_the_bucket_the_newest_kept_and_come_back_bit_for_bit(s3: str) -> None:
    url = f"s3://{BUCKET}/jobs/a"
    backups_round_trip(url, _keys)
    assert S3Mirror(url).steps() == [6, 9]


def test_a_backup_without_its_manifest_is_not_there_and_a_missing_bucket_says_so(s3: str) -> None:
    url = f"s3://{BUCKET}/jobs/b"
    backed_up_at_step_2(url)
    boto3.client("s3").delete_object(Bucket=BUCKET, Key=f"jobs/b/{step_dir(2)}/{MANIFEST}")  # an upload cut short
    assert not has_backup(url)
    with pytest.raises(BackupError, match="no complete backup under"):
        find_backup(url)
    with pytest.raises(BackupError, match="S3 answered NoSuchBucket; check the bucket"):
        has_backup("s3://no-such-bucket/x")


@pytest.mark.untimed
def test_every_copy_lost_the_job_comes_back_from_the_bucket_bit_exact(s3: str, tmp_path: Path) -> None:
    url = f"s3://{BUCKET}/jobs/ema"
    comes_back_from_the_store(url)
