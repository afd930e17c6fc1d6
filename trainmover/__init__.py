"""The `trainmover` command: a thin dispatcher; each part owns its subcommands and is imported only then."""
