"""runtime.control: what runs in the coordinator process.

The coordinator's loop (`coordinator`), its pure decisions (`decisions`), the recoveries in flight (`recoveries`),
the standby pool (`standbys`), health and hang detection (`health`), generations (`membership`), the chaos monkey
(`chaos`) and the coordinator's side of the per-host agents (`hosts`). Imports runtime.wire and the shared modules
(runtime.config, runtime.faults), never runtime.host or runtime.training; of torch only torch.distributed's store.
"""
