"""runtime.training: what runs inside each training process (worker or standby).

The script API (`job`: `init()`, the heartbeat; `trainer`: the step loop and its recovery points; `sharded`: FSDP2,
HSDP and tensor-parallel meshes; `data`: the deterministic loader), the training state and its digest (`state`), the
process groups (`comm`), the state handoff and its transports (`handoff`, `tls_transport`) and buddy copies of
shards (`buddy`). Imports runtime.wire and the shared modules (runtime.config, runtime.faults), never
runtime.control or runtime.host.
"""
