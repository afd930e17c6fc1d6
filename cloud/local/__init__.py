"""This machine: slots behind the `cloud.base.Provider` interface, with failure injection (the demo's and the tests'
default; docs/cloud.md).

- `cloud.local.provider`: `LocalProvider` (and its prices, `LOCAL_PRICES_USD_PER_H`);
- `cloud.local.hosts`: hosts that bootstrapped instances boot into (`ProcessHosts`, `NamespaceHosts`);
- `cloud.local.secrets`: the job's secret in a file only its owner can read (`LocalFileStore`).
"""

from cloud.local.provider import LOCAL_DEFAULT_PRICE_USD_PER_H, LOCAL_SPOT_FACTOR, LocalProvider

__all__ = ["LOCAL_DEFAULT_PRICE_USD_PER_H", "LOCAL_SPOT_FACTOR", "LocalProvider"]
