"""Accelerators per instance type (cloud.accelerators), read from each provider's own instance-type data: EC2's
DescribeInstanceTypes from moto's server (whose data is AWS's own), Azure's resource SKUs from the local ARM
server through the real SDK, and the local provider's configured counts. Each type is asked of the cloud once."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from cloud.accelerators import Accelerators, AcceleratorTable, from_azure_sku, from_ec2_instance_type, table_for
from cloud.aws import AwsProvider
from cloud.azure import AzureProvider
from cloud.base import InvalidRequestError
from cloud.local import LocalProvider
from tests.cloud.arm_server import ArmServer
from tests.cloud.aws_servers import FaultProxy, fault_proxy, moto_server
from tests.cloud.test_azure import FAST, LOCATION, RG, SUBSCRIPTION, FakeCredential

REGION = "us-east-1"


@pytest.fixture(scope="module")
def proxy() -> Iterator[FaultProxy]:
    """moto's server behind the recording proxy: what EC2 was asked is countable."""
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    with moto_server() as url, fault_proxy(url) as recording:
        yield recording


@pytest.fixture
def aws(proxy: FaultProxy) -> AwsProvider:
    import boto3

    session = boto3.Session(aws_access_key_id="testing", aws_secret_access_key="not-a-real-secret",
                            region_name=REGION)
    proxy.reset()
    return AwsProvider(REGION, session=session, endpoint_url=proxy.url, describe_budget=FAST)


@pytest.mark.parametrize(("instance_type", "expected"), [
    ("p5.48xlarge", Accelerators("p5.48xlarge", 8, "H100", 81920, efa=True, network_cards=32)),
    ("p4d.24xlarge", Accelerators("p4d.24xlarge", 8, "A100", 40960, efa=True, network_cards=4)),
    ("g5.48xlarge", Accelerators("g5.48xlarge", 8, "A10G", 22888, efa=True, network_cards=1)),
    ("g5.xlarge", Accelerators("g5.xlarge", 1, "A10G", 22888)),
    ("m5.large", Accelerators("m5.large", 0)),
])
def test_aws_reads_gpus_and_efa_from_describe_instance_types(
    aws: AwsProvider, proxy: FaultProxy, instance_type: str, expected: Accelerators
) -> None:
    found = aws.accelerators(instance_type)
    assert found == expected
    assert found.slots == max(1, expected.count), "a CPU type trains in one slot"
    assert found.fabric == ("efa" if expected.efa else "ethernet")
    assert aws.accelerators(instance_type) is found
    (asked,) = proxy.seen("DescribeInstanceTypes")
    assert asked.params["InstanceType.1"] == instance_type, "asked once, for this type only"


def test_aws_refuses_a_type_ec2_does_not_know(aws: AwsProvider, proxy: FaultProxy) -> None:
    with pytest.raises(InvalidRequestError, match=r"unknown instance type 'p5.48xlarg'.*p5\.48xlarge"):
        aws.accelerators("p5.48xlarg")
    with pytest.raises(InvalidRequestError):
        aws.accelerators("p5.48xlarg")
    assert len(proxy.seen("DescribeInstanceTypes")) == 2, "an unknown type is not remembered: asked again"


@pytest.fixture
def arm(tmp_path: Path) -> Iterator[ArmServer]:
    with ArmServer(
        tmp_path, subscription_id=SUBSCRIPTION, resource_groups=[RG],
        locations={LOCATION: ["Standard_ND96isr_H100_v5", "Standard_NC80adis_H100_v5", "Standard_NC24ads_A100_v4",
                              "Standard_ND96asr_v4", "Standard_D2s_v5"],
                   "westus3": ["Standard_D2s_v5"]},
    ) as server:
        yield server


@pytest.fixture
def azure(arm: ArmServer) -> AzureProvider:
    return AzureProvider(SUBSCRIPTION, RG, LOCATION, credential=FakeCredential(), base_url=arm.url,
                         client_kwargs={"connection_verify": str(arm.ca_path)}, describe_budget=FAST)


def test_azure_reads_gpus_and_infiniband_from_the_locations_resource_skus(azure: AzureProvider, arm: ArmServer) -> None:
    h100 = azure.accelerators("Standard_ND96isr_H100_v5")
    assert h100 == Accelerators("Standard_ND96isr_H100_v5", 8, "H100", infiniband=True)
    assert (h100.slots, h100.fabric) == (8, "infiniband")
    assert azure.accelerators("Standard_NC80adis_H100_v5") == Accelerators("Standard_NC80adis_H100_v5", 2, "H100")
    assert azure.accelerators("Standard_NC24ads_A100_v4").slots == 1
    # ARM names no GPU model, and this size's name does not either.
    assert azure.accelerators("Standard_ND96asr_v4") == Accelerators("Standard_ND96asr_v4", 8, None, infiniband=True)
    cpu = azure.accelerators("Standard_D2s_v5")
    assert (cpu.count, cpu.slots, cpu.kind, cpu.fabric) == (0, 1, None, "ethernet")
    (listed,) = arm.calls("GET", r"/providers/Microsoft\.Compute/skus$")
    assert listed.query["$filter"] == f"location eq '{LOCATION}'", "one list of the location, every size kept"


def test_azure_refuses_a_size_the_location_does_not_list(azure: AzureProvider, arm: ArmServer) -> None:
    with pytest.raises(InvalidRequestError, match=r"Standard_ND96isr_H200_v5.*not among the resource SKUs of 'eastus'"):
        azure.accelerators("Standard_ND96isr_H200_v5")
    assert azure.accelerators("Standard_D2s_v5").count == 0, "kept from the list the unknown size asked for"
    assert len(arm.calls("GET", r"/skus$")) == 1
    with pytest.raises(InvalidRequestError):
        azure.accelerators("Standard_ND96isr_H200_v5")
    assert len(arm.calls("GET", r"/skus$")) == 2, "an unknown size is not remembered: the location is listed again"


def test_the_local_provider_has_one_cpu_slot_per_instance_unless_told_a_count() -> None:
    cloud = LocalProvider(slots=4)
    assert cloud.accelerators("p5.48xlarge") == Accelerators("p5.48xlarge", 0)
    assert cloud.accelerators("p5.48xlarge").slots == 1
    cloud.accelerator_counts = {"p5.48xlarge": 8}
    assert cloud.accelerators("p5.48xlarge").slots == 8
    assert LocalProvider(slots=4).accelerators("p5.48xlarge").slots == 1, "the count is one provider's"


def test_the_translators_keep_what_the_providers_say_and_nothing_they_do_not() -> None:
    mixed = from_ec2_instance_type({
        "InstanceType": "x.mixed", "NetworkInfo": {"EfaSupported": False, "MaximumNetworkCards": 2},
        "GpuInfo": {"Gpus": [{"Count": 2, "Name": "T4", "MemoryInfo": {"SizeInMiB": 15360}},
                             {"Count": 1, "Name": "A10G", "MemoryInfo": {"SizeInMiB": 22888}}]},
    })
    assert (mixed.count, mixed.kind, mixed.memory_mib, mixed.network_cards) == (3, "A10G+T4", None, 2)
    trainium = from_ec2_instance_type({"InstanceType": "trn1.32xlarge", "NeuronInfo": {"NeuronDevices": [
        {"Count": 16, "Name": "Trainium"}]}, "NetworkInfo": {"EfaSupported": True, "MaximumNetworkCards": 8}})
    assert (trainium.count, trainium.slots, trainium.efa) == (0, 1, True), "Neuron devices are no GPU slots"
    assert from_azure_sku("Standard_NC4as_T4_v3", {"GPUs": "1"}).kind == "T4"
    assert from_azure_sku("Standard_ND96isr_MI300X_v5", {"GPUs": "8", "RdmaEnabled": "True"}).kind == "MI300X"
    assert from_azure_sku("Standard_D4s_v5", {"vCPUs": "4"}) == Accelerators("Standard_D4s_v5", 0)
    assert from_azure_sku("Standard_Odd", {"GPUs": "many"}).count == 0
    with pytest.raises(ValueError, match="count"):
        Accelerators("x", count=-1)


def test_a_table_asks_once_per_type_and_keeps_every_record_a_lookup_brings() -> None:
    asked: list[str] = []

    def load(name: str) -> list[Accelerators]:
        asked.append(name)
        return [Accelerators("a", 8), Accelerators("b", 2)]

    table = AcceleratorTable()
    assert table.lookup("a", load) == Accelerators("a", 8)
    assert table.lookup("b", load) == Accelerators("b", 2)
    assert table.lookup("c", load) is None
    assert asked == ["a", "c"] and len(table) == 2
    owner = LocalProvider(slots=1)
    assert table_for(owner) is table_for(owner) and table_for(owner) is not table_for(LocalProvider(slots=1))
