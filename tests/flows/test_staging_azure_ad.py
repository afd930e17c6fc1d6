"""The job's files staged on Azure with Azure AD credentials only (no account key): the orchestrator gets a user
delegation key and signs the hosts' read-only SAS URLs with it (`flows.hosts.BlobStaging` without
AZURE_STORAGE_CONNECTION_STRING, `cloud.artifacts.BlobSigner`). Against Azurite's blob service over HTTPS with its
basic OAuth (tests/azurite.py), which checks a bearer token's audience, issuer and lifetime (not its signature) and
serves Get User Delegation Key; the SAS URLs it then verifies are user delegation SAS, as Azure Storage's."""

from __future__ import annotations

import base64
import datetime
import hashlib
import ipaddress
import json
import ssl
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from azure.core.credentials import AccessToken

from cloud.artifacts import AZ_CONNECTION_STRING, delete_blobs, sign_blobs, stage_blob
from cloud.base import CloudError
from flows.hosts import BlobStaging
from tests.azurite import DEV_ACCOUNT, azurite_service

pytestmark = pytest.mark.slow

CONTAINER = "tm-staging-ad"
TENANT = "72f988bf-86f1-41af-91ab-2d7cd011db47"


class AzureAdToken:
    """An azure-core TokenCredential whose tokens carry the claims Azure AD puts in a storage token (unsigned: the
    emulator checks the claims, and a real account never sees these). Counts the tokens it gave."""

    def __init__(self) -> None:
        self.issued = 0

    def get_token(self, *scopes: str, **_: Any) -> AccessToken:
        assert scopes == ("https://storage.azure.com/.default",), scopes
        now = int(time.time())
        claims = {"aud": "https://storage.azure.com", "iss": f"https://sts.windows.net/{TENANT}/", "iat": now - 60,
                  "nbf": now - 60, "exp": now + 3600, "oid": str(uuid.uuid4()), "tid": TENANT, "appid": "trainmover"}
        self.issued += 1
        return AccessToken(_jwt(claims), now + 3600)


def _b64(value: object) -> str:
    raw = value.encode() if isinstance(value, str) else json.dumps(value).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _jwt(claims: dict[str, Any]) -> str:
    return ".".join((_b64({"alg": "RS256", "typ": "JWT"}), _b64(claims), _b64("not-checked-by-the-emulator")))


def _certificate(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (and its key), which the clients here trust."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = directory / "azurite.pem", directory / "azurite-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return _certificate(tmp_path_factory.mktemp("azurite-tls"))


@pytest.fixture(scope="module")
def azurite(tls: tuple[Path, Path]) -> Iterator[str]:
    with azurite_service(CONTAINER, oauth_tls=tls) as connection_string:
        yield connection_string


@pytest.fixture
def staging(azurite: str, tls: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> BlobStaging:
    """The flows' staging of a job with Azure AD credentials only: no connection string in the environment."""
    monkeypatch.delenv(AZ_CONNECTION_STRING, raising=False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(tls[0]))  # the SDK's transport (requests) trusts the emulator
    port = urlsplit(azurite.split("BlobEndpoint=", 1)[1].rstrip(";")).port
    return BlobStaging(job_id=f"ad-{uuid.uuid4().hex[:6]}", container_url=f"https://127.0.0.1:{port}/{DEV_ACCOUNT}/"
                       f"{CONTAINER}", prefix="trainmover-jobs", workdir=tmp_path, credential=AzureAdToken())


def _get(url: str, cafile: Path) -> bytes:
    with urllib.request.urlopen(url, timeout=10, context=ssl.create_default_context(cafile=str(cafile))) as r:
        return bytes(r.read())


def _refused(url: str, cafile: Path) -> int:
    try:
        _get(url, cafile)
    except urllib.error.HTTPError as err:
        return err.code
    return 200


def test_files_staged_with_azure_ad_get_user_delegation_sas_urls_that_only_read_them(
    staging: BlobStaging, tls: tuple[Path, Path], tmp_path: Path
) -> None:
    files = [tmp_path / "trainmover-0.1.0-py3-none-any.whl", tmp_path / "train.py"]
    for i, f in enumerate(files):
        f.write_bytes(f"payload {i} ".encode() * 1000)
    signer = staging.signer()
    assert getattr(signer.container.credential, "account_key", None) is None, "signed without an account key"

    staged = stage_blob(files, job_id=staging.job_id, prefix=staging.prefix, signer=signer)

    for artifact, f in zip(staged, files, strict=True):
        assert artifact.sha256 == hashlib.sha256(f.read_bytes()).hexdigest()
        query = parse_qs(urlsplit(artifact.url).query)
        # A user delegation SAS: signed by the delegation key's object, read-only, no account key in sight.
        assert {"skoid", "sktid", "skt", "ske", "sks", "skv"} <= set(query) and query["sp"] == ["r"]
        assert query["sktid"] == [TENANT]
        assert _get(artifact.url, tls[0]) == f.read_bytes()  # no credentials: the URL alone
        assert _refused(artifact.url.replace("sp=r", "sp=rw"), tls[0]) == 403  # its permissions altered
        assert _refused(artifact.url.replace(artifact.name, "other.py"), tls[0]) == 403  # another blob

    # A later launch signs again (nothing uploaded again): those URLs read the same files.
    again = sign_blobs(staged, job_id=staging.job_id, prefix=staging.prefix, signer=signer)
    assert [_get(a.url, tls[0]) for a in again] == [f.read_bytes() for f in files]
    assert isinstance(staging.credential, AzureAdToken) and staging.credential.issued >= 1

    assert delete_blobs(job_id=staging.job_id, prefix=staging.prefix, container=signer.container) == 2
    assert _refused(staged[0].url, tls[0]) == 404


def test_an_expired_token_stops_the_staging_with_one_error_that_names_what_could_not_be_done(
    staging: BlobStaging,
) -> None:
    class Expired(AzureAdToken):
        def get_token(self, *scopes: str, **_: Any) -> AccessToken:
            now = int(time.time())
            claims = {"aud": "https://storage.azure.com", "iss": f"https://sts.windows.net/{TENANT}/",
                      "iat": now - 7200, "nbf": now - 7200, "exp": now - 3600, "tid": TENANT}
            return AccessToken(_jwt(claims), now + 3600)  # the client believes it; the service does not

    staging.credential = Expired()

    with pytest.raises(CloudError, match=r"could not delete the staged files in https://127\.0\.0\.1:\d+/"
                                         r"devstoreaccount1/tm-staging-ad/trainmover-jobs/ad-\w+/: "
                                         r".*run\.artifact_container must be a container these credentials may write"):
        staging.delete()
