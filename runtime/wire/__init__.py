"""runtime.wire: what crosses a process boundary, the same on every side.

The records of the job's store and of the agent link (`protocol`), the store's keys and its sealed reads and writes
(`store`), the job secret and what is derived from it (`auth`), the event records and the event log (`event_records`,
`events`), the control channel an orchestrator writes commands into (`control`), and which interface holds an address
(`netaddr`). Nothing here imports any other part of the runtime, and torch only for torch.distributed's TCPStore
(`store`, `control`): every side (coordinator, agent, training process, a supervisor outside the job) imports it.
"""
