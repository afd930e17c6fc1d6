"""Make a provider by name, importing its module (and its cloud SDK) only then.

`import cloud.registry` loads no SDK: `make_provider("aws", region="eu-west-1")` imports boto3 and `cloud.aws`
at the call, so a machine without the aws extra can still use the local provider. A missing SDK is one clear
`UnsupportedError` that says which extra to install; options the provider does not take are an
`InvalidRequestError` that lists those it does.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Literal, get_args

from cloud.base import InvalidRequestError, Provider, UnsupportedError

ProviderName = Literal["local", "aws", "azure"]
PROVIDER_NAMES: tuple[str, ...] = get_args(ProviderName)


@dataclass(frozen=True, slots=True)
class _Entry:
    module: str
    cls: str
    sdk_modules: tuple[str, ...]  # imported before the provider module, so that a missing SDK is named clearly
    extra: str | None  # the pip extra that installs the SDK


_PROVIDERS: dict[str, _Entry] = {
    "local": _Entry("cloud.local", "LocalProvider", (), None),
    "aws": _Entry("cloud.aws", "AwsProvider", ("boto3", "botocore"), "aws"),
    "azure": _Entry("cloud.azure", "AzureProvider", ("azure.mgmt.compute", "azure.identity"), "azure"),
}
_SDK_ROOTS = ("boto3", "botocore", "azure")


def _missing_sdk(name: str, entry: _Entry, err: ImportError) -> UnsupportedError:
    return UnsupportedError(
        f"the {name} provider needs its cloud SDK ({err.name or err}), which is not installed: "
        f"pip install 'trainmover[{entry.extra}]'",
        provider=name,
        code="MissingSDK",
    )


def provider_class(name: str) -> type[Provider]:
    """The provider class registered as `name`, its SDK imported; raises the clear errors `make_provider` does."""
    entry = _PROVIDERS.get(name)
    if entry is None:
        raise InvalidRequestError(f"unknown provider {name!r}; choose one of {', '.join(PROVIDER_NAMES)}")
    try:
        for module in entry.sdk_modules:
            importlib.import_module(module)
        cls = getattr(importlib.import_module(entry.module), entry.cls)
    except ImportError as err:
        if entry.extra is not None and (err.name or "").split(".")[0] in _SDK_ROOTS:
            raise _missing_sdk(name, entry, err) from err
        raise
    if not (isinstance(cls, type) and issubclass(cls, Provider)):
        raise TypeError(f"{entry.module}.{entry.cls} is not a cloud.base.Provider")
    return cls


def make_provider(name: ProviderName, **options: Any) -> Provider:
    """Build the `name` provider with `options` (its constructor's keyword arguments, see docs/cloud.md)."""
    cls = provider_class(name)
    try:
        inspect.signature(cls).bind(**options)
    except TypeError as err:
        accepted = [p for p in inspect.signature(cls).parameters if p not in ("self", "args", "kwargs")]
        raise InvalidRequestError(
            f"the {name} provider does not take these options ({err}); it accepts: {', '.join(accepted)}",
            provider=name,
        ) from None
    entry = _PROVIDERS[name]
    try:
        return cls(**options)
    except ImportError as err:
        # A provider may import parts of its SDK only when built (e.g. azure.core pipeline policies).
        if entry.extra is not None and (err.name or "").split(".")[0] in _SDK_ROOTS:
            raise _missing_sdk(name, entry, err) from err
        raise


__all__ = ["PROVIDER_NAMES", "ProviderName", "make_provider", "provider_class"]
