"""runtime.host: what runs on each host beside the training processes.

The per-host agent (`agent`: joins the coordinator, starts and fences this host's processes, reports the host's
notices) and its fork server (`zygote`: a process with torch already imported that forks standbys and workers).
Imports runtime.wire and runtime.config, never runtime.control or runtime.training.
"""
